"""The classify stage's settings, typed and frozen, resolved once from a model's config at the stage's
edge (``classify.run_shard``, the estimate pilot): no module below them reads the config dict.

Which config keys the stage reads, and their fingerprint, stay declared in vidlabel.core.stage_settings
(STAGES); this module only gives them types and groups them by who uses them: the server command
(``ServerSettings``), the layout over the job's GPUs (``LayoutSettings``), the client
(``ClientSettings``) and the plan the requests were made for (``PlanSettings``).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from vidlabel import families
from vidlabel.core import stage_settings
from vidlabel.families import Family, ImageBounds, Sampling
from vidlabel.prepare import planning
from vidlabel.core import decode
from vidlabel.serve.items import MediaLimits


def _thaw(value: Any) -> Any:
    """Plain dicts and lists of a frozen config value (JSON-able, hashable by digest)."""
    if isinstance(value, Mapping):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_thaw(v) for v in value]
    return value


@dataclass(frozen=True)
class ClientSettings:
    """What the client is run with; every field but the last comes from the config (its schema holds the
    defaults)."""
    model: str
    questions: tuple[dict[str, Any], ...]
    concurrency: int
    in_flight_from_kv_cache: bool  # fewer in flight where the KV cache holds fewer (concurrency.fit_in_flight)
    max_tokens: int
    temperature: float
    top_logprobs: int
    request_timeout_s: float
    adaptive_deadline: bool
    deadline_floor_s: float
    max_attempts: int
    backoff_initial_s: float
    backoff_max_s: float
    health_interval_s: float
    media_root: str | None  # the one directory the server may read (planning.allowed_media_path)
    adaptive: bool
    adaptive_floor: int
    adaptive_ceiling: int
    adaptive_interval_s: float = 2.0  # how often adaptive concurrency looks at the servers' load

    def for_copies(self, copies: int) -> "ClientSettings":
        """These settings for ``copies`` servers: classify.concurrency and the adaptive floor and ceiling are
        per server copy (or endpoint), the client's limits are the job's."""
        return replace(self, concurrency=self.concurrency * copies, adaptive_floor=self.adaptive_floor * copies,
                       adaptive_ceiling=self.adaptive_ceiling * copies)


@dataclass(frozen=True)
class ServerSettings:
    """What the job's own server is started with (``classify.server_command`` and its fields)."""
    model: str
    command: str  # the str.format template
    args: str  # classify.server_args, shell syntax
    generation_config: str
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    api_server_count: int | None
    startup_timeout_s: float
    shutdown_grace_s: float
    family: Family  # its pixel-bounds form (--mm-processor-kwargs)
    sampling: Sampling
    image_bounds: ImageBounds
    allowed_media_path: str  # the one directory the server may read (planning.allowed_media_path)
    decode_backend: str  # vLLM's video codec backend for planning.decode (vidlabel.core.decode)
    quantization: str | None  # classify.quantization (vidlabel.serve.quantization)
    # What the job's data need the server to accept (vidlabel.serve.items.job_limits); set per job.
    media_limits: MediaLimits = field(default_factory=MediaLimits)

    @property
    def words(self) -> list[str]:
        """The command template and server_args as words (for flags such as --quantization); [] when
        the quoting is bad (starting the server reports it with its key)."""
        try:
            return shlex.split(self.command) + shlex.split(self.args)
        except ValueError:
            return []


@dataclass(frozen=True)
class LayoutSettings:
    """How a job lays its servers out over the GPUs it was granted (vidlabel.serve.parallelism)."""
    parallelism: tuple[int, int] | None  # (tensor, data), or None for auto
    data_parallel_backend: str
    gpu_memory_gib: float | None
    gpu_memory_utilization: float


@dataclass(frozen=True)
class PlanSettings:
    """What the manifest planned the requests for: the model family (its rules) and how the model takes
    the audio, how the server samples videos and resizes images, and its limits."""
    family: Family
    audio: str  # classify.audio
    sampling: Sampling
    image_bounds: ImageBounds
    max_model_len: int
    max_tokens: int
    max_num_batched_tokens: int

    def identity(self) -> dict[str, Any]:
        s, i = self.sampling, self.image_bounds
        return {**self.family.identity(), "audio": self.audio, "fps": s.fps, "min_frames": s.min_frames,
                "max_frames": s.max_frames, "min_pixels": s.min_pixels, "max_pixels": s.max_pixels,
                "image_min_pixels": i.min_pixels, "image_max_pixels": i.max_pixels,
                "max_model_len": self.max_model_len, "max_num_batched_tokens": self.max_num_batched_tokens}


@dataclass(frozen=True)
class ServeSettings:
    """Every setting of one model's classify job."""
    model: str
    server: ServerSettings
    layout: LayoutSettings
    client: ClientSettings
    plan: PlanSettings
    endpoints: tuple[str, ...]
    api_key_env: str
    journal_fsync: str
    progress_interval_s: float
    media_identity: str  # stat | content (vidlabel.core.identity)
    results: str
    settings_fingerprint: str  # the stage fingerprint (vidlabel.core.stage_settings), for provenance
    prompt_hash: str

    @property
    def own_servers(self) -> bool:
        return not self.endpoints

    def with_media_limits(self, limits: MediaLimits) -> "ServeSettings":
        """These settings for a job whose data need ``limits`` (the server command's and the breaker's)."""
        return replace(self, server=replace(self.server, media_limits=limits))

    @classmethod
    def from_config(cls, config: Mapping) -> "ServeSettings":
        c = config["classify"]
        parallelism = c["parallelism"]
        allowed = planning.allowed_media_path(config)
        ad = c["adaptive_concurrency"]
        ceiling = c["concurrency"] if ad["ceiling"] is None else ad["ceiling"]
        questions = tuple(_thaw(q) for q in c["questions"])
        client = ClientSettings(
            model=c["model"], questions=questions, concurrency=c["concurrency"],
            in_flight_from_kv_cache=c["in_flight_from_kv_cache"], max_tokens=c["max_tokens"],
            temperature=c["temperature"], top_logprobs=c["top_logprobs"], request_timeout_s=c["request_timeout_s"],
            adaptive_deadline=c["adaptive_deadline"], deadline_floor_s=c["deadline_floor_s"],
            max_attempts=c["max_attempts"], backoff_initial_s=c["backoff_initial_s"],
            backoff_max_s=c["backoff_max_s"], health_interval_s=c["health_interval_s"], media_root=allowed,
            adaptive=ad["enabled"], adaptive_floor=min(ad["floor"], ceiling), adaptive_ceiling=ceiling)
        family, sampling, images = families.of_config(config), planning.sampling(config), planning.image_bounds(config)
        server = ServerSettings(
            model=c["model"], command=c["server_command"], args=c["server_args"],
            generation_config=c["generation_config"], max_model_len=c["max_model_len"],
            max_num_batched_tokens=c["max_num_batched_tokens"], max_num_seqs=c["max_num_seqs"],
            api_server_count=c["api_server_count"], startup_timeout_s=float(c["startup_timeout_s"]),
            shutdown_grace_s=float(c["shutdown_grace_s"]), family=family, sampling=sampling, image_bounds=images,
            allowed_media_path=allowed, decode_backend=decode.backend(config),
            quantization=c.get("quantization"))
        layout = LayoutSettings(
            parallelism=(int(parallelism["tensor"]), int(parallelism.get("data", 1)))
            if isinstance(parallelism, Mapping) else None,
            data_parallel_backend=c["data_parallel_backend"], gpu_memory_gib=c["gpu_memory_gib"],
            gpu_memory_utilization=float(c["gpu_memory_utilization"]))
        plan = PlanSettings(family=family, audio=c.get("audio", "transcript"), sampling=sampling, image_bounds=images,
                            max_model_len=c["max_model_len"], max_tokens=c["max_tokens"],
                            max_num_batched_tokens=c["max_num_batched_tokens"])
        return cls(model=c["model"], server=server, layout=layout, client=client, plan=plan,
                   endpoints=tuple(u.rstrip("/") for u in c["endpoints"]), api_key_env=c["api_key_env"],
                   journal_fsync=c["journal_fsync"], progress_interval_s=float(c["progress_interval_s"]),
                   media_identity=c["media_identity"], results=str(config["results"]),
                   settings_fingerprint=stage_settings.fingerprint(config, "classify"),
                   prompt_hash=stage_settings.digest([c["prompt_template"], _thaw(c["questions"])]))
