"""The server command of a job: which server processes it starts (one per model copy, or one vLLM
data-parallel server), their CPUs and environment, and their argv from ``classify.server_command``.

``placeholder_command`` is the command with the fields each job chooses for the GPUs and CPUs it was
granted and for the data it sends (``PER_JOB_FIELDS``) left as placeholders: what an answer depends on
(vidlabel.core.identity), so that a shard resumed on another node, or after posts with more photos
joined the data, reuses its answers.

The fields for the data (``vidlabel.serve.items.MediaLimits``, docs/serving.md): ``limit_mm_per_prompt``
(the most images, videos and audio items a post sends) and ``max_num_batched_tokens`` (at least the largest
item: vLLM sizes its encoder cache from it). ``mm_processor_kwargs`` carries the pixel bounds of videos
(``planning.min_pixels``/``max_pixels``) and of images (``planning.image_min_pixels``/``image_max_pixels``)
in the model family's form (``mm_processor_kwargs``); they decide answers, so they stay in it.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
from dataclasses import dataclass
from pathlib import Path

from vidlabel.core import decode
from vidlabel.serve import quantization
from vidlabel.serve.parallelism import Layout, choose_layout, granted_gpus
from vidlabel.serve.settings import ServerSettings, ServeSettings


class CommandError(ValueError):
    """``classify.server_command`` or ``classify.server_args`` cannot be made an argv; the message names the key."""


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now (the server binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# How a server copy's CPUs are shared when classify.api_server_count is null. Each API server process
# decodes videos in its own thread pool and runs the multimodal processor (resize and normalisation
# of every frame, the chat template, request parsing) in its own interpreter: the per-request CPU
# work that decides whether the GPU waits. Measured on one H200 with 16 cores, camera-like H.264,
# 32 requests in flight (vLLM 0.26, docs/serving.md): 8 API servers x 2 media threads 18.5k prompt
# tok/s at 1.4 req/s with the GPU near 100 % busy; 4 x 3 (with 2 CPUs kept aside) 12.9k at 1.0 req/s
# with the GPU idle a third of the time. So no CPUs are kept aside (the engine and the client
# share them with decoding) and every 2 CPUs get an API server.
RESERVED_CPUS = 0
CPUS_PER_API_SERVER = 2
MAX_API_SERVERS = 8  # the most measured


def granted_cpus(environ=os.environ) -> int | None:
    """CPUs SLURM granted this job: --cpus-per-task, else --cpus-per-gpu x the GPUs granted, else
    the job's CPUs on this node (the only one left inside the Snakemake plugin's job step, which
    clears the allocation's SLURM_* variables before its srun)."""
    per_task = environ.get("SLURM_CPUS_PER_TASK", "").strip()
    if per_task.isdigit():
        return int(per_task)
    per_gpu = environ.get("SLURM_CPUS_PER_GPU", "").strip()
    visible = [d for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if per_gpu.isdigit() and visible:
        return int(per_gpu) * len(visible)
    on_node = environ.get("SLURM_CPUS_ON_NODE", "").strip()
    return int(on_node) if on_node.isdigit() else None


def job_cpus(environ=os.environ) -> tuple[int, str]:
    """CPUs this job may use: what SLURM granted, else this process's CPU affinity."""
    granted = granted_cpus(environ)
    if granted:
        return granted, "SLURM"
    return len(os.sched_getaffinity(0)), "CPU affinity"


@dataclass(frozen=True)
class ServerCopy:
    """One server process of a job: its GPUs, its parallel sizes and its share of the job's CPUs."""

    index: int
    gpus: tuple[str, ...]  # CUDA_VISIBLE_DEVICES for it; empty: leave the variable alone
    tensor: int
    data: int  # --data-parallel-size: >1 only when vLLM serves the copies itself
    cpus: int
    api_servers: int
    log_path: Path

    @property
    def media_threads(self) -> int:
        """Video-decoding threads per API server process (vLLM's pool is per process)."""
        return max(1, (self.cpus - RESERVED_CPUS) // self.api_servers)


def api_server_count(server: ServerSettings, cpus: int) -> int:
    """``--api-server-count`` for a server copy with ``cpus`` CPUs: ``classify.api_server_count``, or
    one per ``CPUS_PER_API_SERVER`` CPUs between 1 and ``MAX_API_SERVERS`` (16 CPUs: 8 API servers,
    each with 2 media threads, ``ServerCopy.media_threads``)."""
    configured = server.api_server_count
    if configured:
        return int(configured)
    return max(1, min(MAX_API_SERVERS, (cpus - RESERVED_CPUS) // CPUS_PER_API_SERVER))


def copy_log_path(log_path: str | Path, index: int, copies: int) -> Path:
    """``server-3.log`` for a lone copy; ``server-3.copy-1.log`` for the second of several."""
    path = Path(log_path)
    return path if copies == 1 else path.with_name(f"{path.stem}.copy-{index}{path.suffix}")


def server_copies(settings: ServeSettings, layout: Layout, log_path: str | Path,
                  environ=os.environ) -> list[ServerCopy]:
    """The server processes that serve ``layout``: one per copy, or one vLLM data-parallel server."""
    cpus, _ = job_cpus(environ)
    pin = bool(granted_gpus(environ)[0])  # fake or unknown GPUs: nothing to pin
    if layout.data > 1 and settings.layout.data_parallel_backend == "servers":
        per_copy = max(1, cpus // layout.data)
        return [ServerCopy(i, group if pin else (), layout.tensor, 1, per_copy,
                           api_server_count(settings.server, per_copy), copy_log_path(log_path, i, layout.data))
                for i, group in enumerate(layout.groups())]
    return [ServerCopy(0, layout.gpus if pin else (), layout.tensor, layout.data, cpus,
                       api_server_count(settings.server, cpus), Path(log_path))]


def server_environment(api_key: str, copy: ServerCopy, environ=os.environ) -> dict[str, str]:
    """The server's environment: the per-job key, its GPUs, media decoding sized to its CPUs, and no cap
    on a request's decoded media.

    vLLM decodes videos in a thread pool of VLLM_MEDIA_LOADING_THREAD_COUNT (default 8) per API
    server process whatever the job was granted; on a shared node that oversubscribes a small
    allocation or idles a large one. vLLM 0.33 refuses a request whose decoded media (every sampled
    frame at the file's size, 3 bytes a pixel) exceed VLLM_MAX_MEDIA_REQUEST_DECODE_BYTES (715,827,880:
    ~58 s of 1080p at 2 frames a second); the plan bounds each request by its tokens (the context gate,
    the transcodes), as vLLM 0.26, which has no such cap, was measured, so the cap is lifted (0). A value
    the user set is kept.
    """
    env = {**environ, "VLLM_API_KEY": api_key}
    if copy.gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(copy.gpus)
    if "VLLM_MEDIA_LOADING_THREAD_COUNT" not in environ:
        env["VLLM_MEDIA_LOADING_THREAD_COUNT"] = str(copy.media_threads)
    env.setdefault("VLLM_MAX_MEDIA_REQUEST_DECODE_BYTES", "0")
    return env


def single_copy(settings: ServeSettings, log_path: str | Path, environ=os.environ) -> ServerCopy:
    """The one server of a job whose layout is not known yet (its largest request unknown)."""
    return server_copies(settings, choose_layout(settings, settings.server.max_model_len, environ),
                         log_path, environ)[0]


# Fields of the server command that each job chooses for the GPUs and CPUs it was granted, and for the
# items its posts send. They do not decide an answer (the server accepts more, or batches otherwise; the
# planned limits are in the plan's identity), so the command a record is tied to (``placeholder_command``)
# leaves them out: a resumed shard on another node, or one whose data set grew a larger post, reuses
# its answers.
PER_JOB_FIELDS = ("port", "tensor_parallel_size", "data_parallel_size", "api_server_count", "max_num_seqs",
                  "limit_mm_per_prompt", "max_num_batched_tokens")

# --mm-processor-kwargs carries the plan's pixel bounds in the family's own form (vidlabel.families:
# Family.mm_processor_kwargs). Qwen2.5-VL's was measured on vLLM 0.26 (docs/serving.md, "Photos and video
# frames": per-modality dicts with min/max_pixels; a flat pair would bound photos like video frames, which
# the calibration images catch); the Qwen3 families take the processors' ``size`` form. The job's
# calibration checks every server against the plan before its traffic (vidlabel.serve.probe).


def mm_processor_kwargs(server: ServerSettings) -> str:
    """``--mm-processor-kwargs``' JSON for the plan's pixel bounds, in the family's form."""
    return json.dumps(server.family.mm_processor_kwargs(server.sampling, server.image_bounds), separators=(",", ":"))


def batched_tokens(server: ServerSettings) -> int:
    """``--max-num-batched-tokens``: ``classify.max_num_batched_tokens``, raised to the data's largest item
    so that vLLM's encoder cache holds it (vLLM: max of this and its profiler's largest item)."""
    return max(int(server.max_num_batched_tokens), int(server.media_limits.largest_item_tokens))


def build_command(server: ServerSettings, port: int, copy: ServerCopy) -> list[str]:
    """The server argv from ``classify.server_command`` (values shell-quoted, then split), followed
    by ``classify.server_args``."""
    return _fill_command(server, {"port": port, "tensor_parallel_size": copy.tensor,
                                  "data_parallel_size": copy.data, "api_server_count": copy.api_servers,
                                  "max_num_seqs": server.max_num_seqs,
                                  "limit_mm_per_prompt": server.media_limits.flag,
                                  "max_num_batched_tokens": batched_tokens(server)})


def placeholder_command(server: ServerSettings) -> list[str]:
    """The job's command with the per-job fields left as placeholders (the module docstring)."""
    return _fill_command(server, {f: f"<{f}>" for f in PER_JOB_FIELDS})


def _fill_command(server: ServerSettings, per_job: dict) -> list[str]:
    fields = {
        "model": server.model, "media_root": server.allowed_media_path, "max_model_len": server.max_model_len,
        "min_pixels": server.sampling.min_pixels, "max_pixels": server.sampling.max_pixels,
        "image_min_pixels": server.image_bounds.min_pixels, "image_max_pixels": server.image_bounds.max_pixels,
        "mm_processor_kwargs": mm_processor_kwargs(server), "fps": server.sampling.fps,
        "generation_config": server.generation_config, **per_job,
    }
    quoted = {k: shlex.quote(str(v)) for k, v in fields.items()}
    try:
        text = server.command.format(**quoted)
    except (KeyError, IndexError, ValueError) as exc:
        raise CommandError(f"config key 'classify.server_command': cannot fill in {exc!r}; fields are "
                           f"{sorted(fields)} and literal braces must be doubled") from None
    try:
        extra = shlex.split(server.args)
    except ValueError as exc:
        raise CommandError(f"config key 'classify.server_args': {exc}") from None
    # planning.decode and classify.quantization (vidlabel.core.decode, vidlabel.serve.quantization).
    try:
        argv = decode.with_backend(shlex.split(text) + extra, server.decode_backend)
        return quantization.with_flag(argv, server.quantization)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
