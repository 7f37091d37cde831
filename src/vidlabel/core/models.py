"""The models that label the posts: ``classify.models``, or the one ``classify.model``.

Every model labels the same manifest (same posts, prompt and questions) into its own folder,
``results/models/<name>/`` (journal, label shards, labels.parquet, summary, estimate). A model's jobs
see ``model_config(config, name)``: the config whose ``classify`` section holds that model's entry
over the shared keys, without the list. Its stage fingerprints are therefore those of a one-model
config: adding or removing another model changes no fingerprint of this one, so Snakemake reruns
nothing of it, and its journal is its own.

Only serving keys may differ per model (``MODEL_KEYS``); what the plan and the prompt depend on
(questions, prompt, context length, answer budget, sampling) is shared, so that the models answer
the very same requests and their labels are comparable.
"""

from __future__ import annotations

import copy
import re
from typing import Any, Mapping

# classify keys an entry of classify.models may set for its model alone (the schema lists the same).
MODEL_KEYS = ("model", "server_command", "server_args", "generation_config", "quantization", "api_server_count",
              "parallelism",
              "data_parallel_backend", "gpu_memory_gib", "gpu_memory_utilization", "max_num_seqs", "endpoints",
              "api_key_env", "concurrency", "startup_timeout_s", "top_logprobs")
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class ModelsError(ValueError):
    """classify.models cannot be resolved; the message names the entry."""


def default_name(model: str) -> str:
    """The folder name of a model: the last part of its name or path, with other characters as '-'
    (``Qwen/Qwen2.5-VL-7B-Instruct`` -> ``Qwen2.5-VL-7B-Instruct``)."""
    last = str(model).rstrip("/").rsplit("/", 1)[-1]
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", last).strip("-.")
    return name or "model"


def resolve(classify: dict[str, Any]) -> list[dict[str, Any]]:
    """The entries of ``classify.models`` (or of the one ``classify.model``) as dicts with ``name`` and
    ``model``; raises ModelsError on a repeated name."""
    raw = classify.get("models") or [classify["model"]]
    entries = []
    for i, item in enumerate(raw):
        entry = {"model": item} if isinstance(item, str) else dict(item)
        entry.setdefault("name", default_name(entry["model"]))
        if not NAME_PATTERN.match(entry["name"]):
            raise ModelsError(f"config key 'classify.models.{i}.name': {entry['name']!r} is not a folder name "
                              "(letters, digits, '.', '-', '_')")
        entries.append(entry)
    names = [e["name"] for e in entries]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ModelsError(f"config key 'classify.models.{i}': the name {name!r} is taken by entry "
                              f"{names.index(name)}; give each model its own `name`")
    return entries


def names(config: Mapping) -> list[str]:
    """The model names, in the config's order (classify.models is resolved by vidlabel.core.config.validate)."""
    return [e["name"] for e in config["classify"]["models"]]


def entry(config: Mapping, name: str) -> Mapping:
    for e in config["classify"]["models"]:
        if e["name"] == name:
            return e
    raise ModelsError(f"no model named {name!r} in classify.models (models: {names(config)})")


def model_config(config: Mapping, name: str) -> dict[str, Any]:
    """The config a job of model ``name`` runs under: its entry's keys over classify's, no model list."""
    chosen = entry(config, name)
    out = copy.deepcopy(dict(config))
    classify = dict(out["classify"])
    classify.pop("models", None)
    classify.update({k: copy.deepcopy(v) for k, v in chosen.items() if k in MODEL_KEYS})
    out["classify"] = classify
    return out


def own_servers(config: Mapping) -> bool:
    """Whether some model's jobs start their own server (rather than using classify.endpoints)."""
    return any(not model_config(config, n)["classify"]["endpoints"] for n in names(config))
