"""The models that label the posts: ``classify.models``, or the one ``classify.model``.

Every model labels the same manifest (same posts, prompt and questions) into its own folder,
``results/models/<name>/`` (journal, label shards, labels.parquet, summary, estimate). A model's jobs
see ``model_config(config, name)``: the config whose ``classify`` section holds that model's entry
over the shared keys, without the list. Its stage fingerprints are therefore those of a one-model
config: adding or removing another model changes no fingerprint of this one, so Snakemake reruns
nothing of it, and its journal is its own.

Only serving keys may differ per model (``MODEL_KEYS``); what the prompt depends on (questions, prompt,
context length, answer budget) is shared, so that the models answer the same questions of the same posts
and their labels are comparable.

Each model has a family (vidlabel.families): ``planning.model_family`` (or the entry's own
``model_family``), ``auto`` by default: the ``model_type`` of the model's config.json (a local folder or its
Hugging Face cache snapshot), else what its hub name is known to be. The family decides how the posts are
planned (token rules, pixel bounds, which frames the server decodes), and ``classify.audio`` whether the
model hears the audio or reads its transcript: models that share both share one plan (``plans``), a
manifest of their own (``results/manifest/<plan>/``). A model's jobs, and a plan's, see the planning
settings resolved for its family (``resolve_planning``: unset bounds become the family's defaults).
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
from pathlib import Path
from typing import Any, Mapping

from vidlabel import families

# classify keys an entry of classify.models may set for its model alone (the schema lists the same).
MODEL_KEYS = ("model", "server_command", "server_args", "generation_config", "quantization", "api_server_count",
              "parallelism",
              "data_parallel_backend", "gpu_memory_gib", "gpu_memory_utilization", "max_num_seqs", "endpoints",
              "api_key_env", "concurrency", "startup_timeout_s", "top_logprobs", "audio")
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
    """The config a job of model ``name`` runs under: its entry's keys over classify's, no model list, and
    the planning settings of its family (``resolve_planning``)."""
    chosen = entry(config, name)
    out = copy.deepcopy(dict(config))
    classify = dict(out["classify"])
    classify.pop("models", None)
    classify.update({k: copy.deepcopy(v) for k, v in chosen.items() if k in MODEL_KEYS})
    out["classify"] = classify
    out["planning"] = resolve_planning(out["planning"], family(config, name))
    return out


# ------------------------------------------------------------------------------------ the model's files

def hub_cache() -> Path:
    return Path(os.environ.get("HF_HUB_CACHE") or Path(os.environ.get("HF_HOME") or "~/.cache/huggingface")
                / "hub").expanduser()


def hub_snapshot(name: str) -> Path | None:
    """The cached snapshot a hub name loads offline: the one ``refs/main`` names, else the newest one
    holding a config.json."""
    repo = hub_cache() / ("models--" + name.replace("/", "--"))
    ref = repo / "refs" / "main"
    if ref.is_file():
        chosen = repo / "snapshots" / ref.read_text().strip()
        if (chosen / "config.json").is_file():
            return chosen
    snapshots = repo / "snapshots"
    found = sorted(snapshots.glob("*/config.json"), key=lambda p: p.stat().st_mtime) if snapshots.is_dir() else []
    return found[-1].parent if found else None


def model_files(model: str) -> Path | None:
    """The directory holding the model's config.json: a local folder, or its Hugging Face cache snapshot."""
    local = Path(model).expanduser()
    if (local / "config.json").is_file():
        return local
    return hub_snapshot(model)


# ------------------------------------------------------------------------------------ families and plans

#: classify.audio: the model reads a transcript of the audio, hears it, or both.
AUDIO_MODES = ("transcript", "native", "both")
#: planning keys whose null means the family's own value (vidlabel.families.base.Family).
FAMILY_SAMPLING_KEYS = ("fps", "min_frames", "max_frames", "min_pixels", "max_pixels")
FAMILY_IMAGE_KEYS = {"image_min_pixels": "min_pixels", "image_max_pixels": "max_pixels"}


@functools.lru_cache(maxsize=256)
def family_of(choice: str, model: str) -> tuple[families.Family, str]:
    """The family of ``model`` under ``planning.model_family: choice``, and how it was told (for the log)."""
    if choice != families.AUTO:
        return families.by_name(choice), f"planning.model_family {choice}"
    folder = model_files(model)
    if folder is not None:
        try:
            model_type = json.loads((folder / "config.json").read_text()).get("model_type")
        except (OSError, ValueError) as exc:
            raise families.FamilyError(f"model {model!r}: cannot read {folder / 'config.json'} ({exc}) to tell "
                                       "its family; set planning.model_family") from None
        found = families.of_model_type(model_type)
        if found is None:
            raise families.FamilyError(
                f"model {model!r}: config.json's model_type {model_type!r} ({folder}) is not a family vidlabel "
                f"plans for; known: {families.known()}. If the server treats it like one of them, set "
                "planning.model_family (or the entry's model_family) to that family")
        return found, f"model_type {model_type} in {folder / 'config.json'}"
    found = families.of_name(model)
    if found is None:
        raise families.FamilyError(
            f"model {model!r}: no config.json here (a local folder or the Hugging Face cache) and its name is not a "
            f"known family's, so its family cannot be told; known: {families.known()}. Download the model, or "
            "set planning.model_family (or the entry's model_family)")
    return found, f"its name (no config.json here; {found.name} by the name {model!r})"


def family(config: Mapping, name: str) -> families.Family:
    """The family of model ``name`` (``family_of`` with the entry's or planning's choice)."""
    chosen = entry(config, name)
    return family_of(chosen.get("model_family") or config["planning"]["model_family"], chosen["model"])[0]


def audio_mode(config: Mapping, name: str) -> str:
    return entry(config, name).get("audio") or config["classify"]["audio"]


def plan_name(family_: families.Family, audio: str) -> str:
    """The plan of a family and audio mode: the family's name, with the mode where it is not transcript."""
    return family_.name if audio == "transcript" else f"{family_.name}-{audio}"


def plan_of(config: Mapping, name: str) -> str:
    return plan_name(family(config, name), audio_mode(config, name))


def plans(config: Mapping) -> dict[str, list[str]]:
    """Each plan and the models that share it, in the config's order."""
    out: dict[str, list[str]] = {}
    for name in names(config):
        out.setdefault(plan_of(config, name), []).append(name)
    return out


def plan_config(config: Mapping, plan: str) -> dict[str, Any]:
    """The config the plan's stages (transcode, manifest) run under: its first model's, which every model
    of the plan shares in what the plan depends on (family, audio mode, planning settings)."""
    try:
        first = plans(config)[plan][0]
    except KeyError:
        raise ModelsError(f"no plan {plan!r}; plans: {sorted(plans(config))}") from None
    return model_config(config, first)


def uses_transcripts(config: Mapping, plan: str) -> bool:
    """Whether the plan's prompts carry transcripts (``classify.audio`` transcript or both)."""
    return plan_config(config, plan)["classify"]["audio"] != "native"


def resolve_planning(planning: Mapping[str, Any], family_: families.Family, version: bool = True) -> dict[str, Any]:
    """``planning`` with the family's name, its defaults for the keys left null and (``version``) its rule
    version."""
    out = copy.deepcopy(dict(planning))
    out["model_family"] = family_.name
    if version:
        out["rule_version"] = family_.rule_version
    for key in FAMILY_SAMPLING_KEYS:
        if out.get(key) is None:
            out[key] = getattr(family_.default_sampling, key)
    for key, attribute in FAMILY_IMAGE_KEYS.items():
        if out.get(key) is None:
            out[key] = getattr(family_.default_image_bounds, attribute)
    return out


def resolve_families(config: dict[str, Any], listed: bool) -> None:
    """Check that every model's family can be told and can do what its entry asks (ModelsError naming the
    key; ``listed``: the models came from classify.models), and where every model is of one family, resolve ``planning`` for it in place (its name and
    defaults), so that the run's config plans as any of its models' does."""
    found = {}
    for i, name in enumerate(names(config)):
        where = f"classify.models.{i}" if listed else "classify.model"
        try:
            found[name] = family(config, name)
        except families.FamilyError as exc:
            raise ModelsError(f"config key '{where}': {exc}") from None
        audio = audio_mode(config, name)
        key = f"classify.models.{i}.audio" if "audio" in entry(config, name) else "classify.audio"
        if audio != "transcript" and not found[name].hears_audio:
            raise ModelsError(f"config key '{key}': model {name!r} is of the {found[name].name} family, "
                              f"which does not hear audio; `audio: {audio}` needs a family that does "
                              f"({', '.join(n for n, f in families.FAMILIES.items() if f.hears_audio) or 'none'})")
    if len({f.name for f in found.values()}) == 1:
        config["planning"] = resolve_planning(config["planning"], next(iter(found.values())), version=False)


def own_servers(config: Mapping) -> bool:
    """Whether some model's jobs start their own server (rather than using classify.endpoints)."""
    return any(not model_config(config, n)["classify"]["endpoints"] for n in names(config))
