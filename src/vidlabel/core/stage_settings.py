"""The settings each stage uses, resolved once from the validated config, and their fingerprints.

Every stage declares here the config keys it reads, in two groups:

- ``results``: keys that can change what the stage writes (a question's text, the model, the fps).
  Their fingerprint is the rule's Snakemake ``params``, so editing one reruns that stage, and every
  stage downstream through its inputs; ``snakemake -n`` names the reason ("params changed").
- ``operational``: keys that change how fast or how robustly the stage runs, never what it writes
  (threads, timeouts, concurrency). Editing one reruns nothing finished.

A stage is handed only ``stage_config(config, stage)``: a frozen copy holding just its declared
keys. Reading any other key raises ``UndeclaredSetting``, so a setting a stage uses but does not
fingerprint cannot exist; the test suite runs every stage and would fail on one.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from vidlabel.core.models import model_config, plan_config

log = logging.getLogger(__name__)

FINGERPRINT_CHARS = 16


@dataclass(frozen=True)
class StageKeys:
    results: tuple[str, ...]
    operational: tuple[str, ...] = ()


# The plan: the model family (resolved per model: vidlabel.core.models.resolve_planning) and its rule version,
# how the audio is taken, and the sampling and limits the requests are planned for.
_PLANNING = ("planning.model_family", "planning.rule_version", "classify.audio", "planning.fps",
             "planning.min_frames", "planning.max_frames",
             "planning.min_pixels", "planning.max_pixels", "planning.image_min_pixels", "planning.image_max_pixels",
             "planning.tokenizer", "planning.over_limit",
             "planning.max_duration_s", "planning.decode", "planning.transcode.enabled",
             "planning.transcode.media_dir", "planning.transcode.crf", "results")
# What every model is asked, and under which limits the plan must fit (shared by all models).
_PROMPT = ("classify.prompt_template", "classify.questions", "classify.max_model_len",
           "classify.max_num_batched_tokens", "classify.max_tokens")
# What decides the answers besides the request body: the model, its server and generation settings.
_SERVER = ("classify.model", "classify.server_command", "classify.server_args", "classify.quantization",
           "classify.generation_config", "classify.temperature", "classify.top_logprobs", "classify.media_identity",
           "media_root")
_CLIENT = ("classify.concurrency", "classify.in_flight_from_kv_cache", "classify.request_timeout_s",
           "classify.adaptive_deadline", "classify.deadline_floor_s", "classify.max_attempts",
           "classify.backoff_initial_s", "classify.backoff_max_s", "classify.health_interval_s",
           "classify.adaptive_concurrency")
# How a job lays out its servers on the GPUs it was granted: chosen per job, never part of an answer.
_LAYOUT = ("classify.parallelism", "classify.data_parallel_backend", "classify.gpu_memory_gib",
           "classify.gpu_memory_utilization", "classify.max_num_seqs", "classify.api_server_count",
           "classify.endpoints", "classify.api_key_env", "classify.startup_timeout_s",
           "classify.shutdown_grace_s", "classify.progress_interval_s", "classify.journal_fsync")

STAGES: dict[str, StageKeys] = {
    "inventory": StageKeys(results=("posts", "media_root"), operational=("inventory.threads",)),
    "transcribe": StageKeys(
        results=("transcribe.backend", "transcribe.model", "transcribe.device", "transcribe.compute_type",
                 "transcribe.beam_size", "transcribe.vad", "transcribe.language", "classify.media_identity"),
        operational=("transcribe.chunks", "transcribe.threads")),
    "transcode": StageKeys(results=_PLANNING + _PROMPT + ("media_root",),
                           operational=("planning.transcode.chunks",)),
    # The shard count decides which files the manifest writes (lowering it must rewrite them).
    "manifest": StageKeys(results=_PLANNING + _PROMPT + ("media_root", "transcribe.on_error", "classify.shards"),
                          operational=("classify.concurrency", "planning.concurrent_jobs")),
    "classify": StageKeys(results=_PLANNING + _PROMPT + _SERVER, operational=_CLIENT + _LAYOUT),
    "estimate": StageKeys(results=_PLANNING + _PROMPT + _SERVER + ("planning.pilot_size", "cost"),
                          operational=_CLIENT + _LAYOUT + ("planning.concurrent_jobs",)),
    "merge": StageKeys(results=("classify.questions",)),
    "aggregate": StageKeys(results=("classify.questions", "stats", "cost", "human_labels", "human_design")),
    "compare": StageKeys(results=("classify.questions", "stats", "cost", "human_labels", "human_design",
                                  "compare.equivalence_margin")),
    "label_sample": StageKeys(results=("classify.questions", "label_sample", "media_root")),
}


class UndeclaredSetting(LookupError):
    """A stage read a config key it does not declare in ``vidlabel.core.stage_settings.STAGES``."""


def _get(config: Mapping, path: str) -> tuple[bool, Any]:
    node: Any = config
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return FrozenSettings({k: _freeze(v) for k, v in value.items()}, frozenset(), "")
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


class FrozenSettings(dict):
    """A read-only mapping of one stage's settings; reading a key the stage did not declare raises.

    A dict subclass so that json, ``==`` and ``isinstance(x, dict)`` work as on the plain config.
    """

    def __init__(self, data: dict, undeclared: frozenset[str], prefix: str):
        super().__init__(data)
        self._undeclared = undeclared  # keys the full config has here but the stage did not declare
        self._prefix = prefix

    def _missing(self, key: str) -> UndeclaredSetting:
        return UndeclaredSetting(
            f"config key '{self._prefix}{key}' is read but not declared for this stage in "
            "vidlabel.core.stage_settings.STAGES: declare it (results or operational) so that its fingerprint is right")

    def __getitem__(self, key):
        try:
            return super().__getitem__(key)
        except KeyError:
            if key in self._undeclared:
                raise self._missing(key) from None
            raise

    def get(self, key, default=None):
        if key in self._undeclared:
            raise self._missing(key)
        return super().get(key, default)

    def _readonly(self, *args, **kwargs):
        raise TypeError("stage settings are read-only")

    __setitem__ = __delitem__ = setdefault = pop = popitem = clear = update = _readonly  # type: ignore[assignment]

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return (_rebuild, (dict(self), self._undeclared, self._prefix))


def _rebuild(data: dict, undeclared: frozenset[str], prefix: str) -> FrozenSettings:
    return FrozenSettings(data, undeclared, prefix)


def _build(config: Mapping, paths: Iterable[str], prefix: str = "") -> FrozenSettings:
    """The nested subset of ``config`` holding ``paths`` (dotted, relative to ``prefix``)."""
    here: dict[str, Any] = {}
    nested: dict[str, list[str]] = {}
    for path in paths:
        head, _, rest = path.partition(".")
        if rest:
            nested.setdefault(head, []).append(rest)
        elif head in config:
            here[head] = _freeze(config[head])
    for head, rests in nested.items():
        if head in here or not isinstance(config.get(head), Mapping):
            continue
        here[head] = _build(config[head], rests, f"{prefix}{head}.")
    undeclared = frozenset(k for k in config if k not in here)
    return FrozenSettings(here, undeclared, prefix)


def keys(stage: str) -> StageKeys:
    try:
        return STAGES[stage]
    except KeyError:
        raise ValueError(f"unknown stage {stage!r}; stages: {sorted(STAGES)}") from None


def stage_config(config: Mapping, stage: str) -> FrozenSettings:
    """The frozen settings of ``stage``: its declared keys of the validated ``config``, nothing else."""
    k = keys(stage)
    return _build(config, k.results + k.operational)


def result_settings(config: Mapping, stage: str) -> dict[str, Any]:
    """The settings that can change what ``stage`` writes, by dotted key (absent keys left out)."""
    out = {}
    for path in sorted(keys(stage).results):
        found, value = _get(config, path)
        if found:
            out[path] = value
    return out


def digest(value: Any) -> str:
    """A short, stable hash of a JSON-able value (key order does not matter)."""
    text = json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:FINGERPRINT_CHARS]


def scoped(config: Mapping, model: str | None = None, plan: str | None = None) -> Mapping:
    """The config a per-model stage (``model``) or a per-plan stage (``plan``) runs under
    (vidlabel.core.models.model_config, plan_config)."""
    if model is not None:
        return model_config(config, model)
    if plan is not None:
        return plan_config(config, plan)
    return config


def fingerprint(config: Mapping, stage: str, model: str | None = None, plan: str | None = None) -> str:
    """The fingerprint of what ``stage`` writes: its result settings (the rule's ``params``); for a
    per-model or per-plan stage, those of its config (``scoped``)."""
    return digest([stage, result_settings(scoped(config, model, plan), stage)])


def for_job(config: Mapping, stage: str, model: str | None = None, plan: str | None = None) -> FrozenSettings:
    """What a job's adapter hands its stage: the frozen settings (of its model's or plan's config,
    ``scoped``), logged in full with their fingerprint."""
    config = scoped(config, model, plan)
    scope = f" (model {model})" if model else f" (plan {plan})" if plan else ""
    log.info("%s settings %s%s: %s", stage, fingerprint(config, stage), scope,
             json.dumps(result_settings(config, stage), sort_keys=True, ensure_ascii=False, default=str))
    return stage_config(config, stage)
