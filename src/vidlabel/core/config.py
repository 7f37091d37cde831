"""Configuration: JSON-schema validation with defaults and messages that name the bad key."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from vidlabel.core import models
from vidlabel.core.prompt import answer_max_tokens
from vidlabel.core.decode import resolve_choice

REPO_SCHEMA = Path(__file__).resolve().parents[3] / "workflow" / "schemas" / "config.schema.yaml"


class ConfigError(ValueError):
    """A configuration value is missing or invalid; the message names the key."""


# Keys that were renamed: the old dotted key -> what to write instead (an old config then gets this
# rather than "Additional properties are not allowed").
RENAMED_KEYS = {
    "classify.tensor_parallel_size": ("classify.parallelism: {tensor: N, data: 1} for N GPUs per server "
                                      "copy, or auto (the default) to fit the model to the job's GPUs"),
}


def renamed_keys(config: dict[str, Any]) -> list[str]:
    """One message per renamed key present in ``config``."""
    found = []
    for old, instead in RENAMED_KEYS.items():
        *parents, leaf = old.split(".")
        node: Any = config
        for parent in parents:
            node = node.get(parent) if isinstance(node, dict) else None
        if isinstance(node, dict) and leaf in node:
            found.append(f"config key '{old}' was renamed; write {instead}")
    return found


def _extend_with_defaults(validator_class):
    """A validator that fills in schema defaults before checking (objects recursively)."""
    validate_properties = validator_class.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for name, sub in properties.items():
                if "default" in sub and name not in instance:
                    instance[name] = copy.deepcopy(sub["default"])
        yield from validate_properties(validator, properties, instance, schema)

    return jsonschema.validators.extend(validator_class, {"properties": set_defaults})


_DefaultFillingValidator = _extend_with_defaults(jsonschema.Draft202012Validator)


def _coerce_scalar(value: str, types: list[str]):
    """A string that reads as one of ``types``, or the string itself."""
    text = value.strip()
    for type_ in types:
        if type_ == "boolean" and text.lower() in ("true", "false"):
            return text.lower() == "true"
        if type_ == "null" and text.lower() in ("null", "none", "~"):
            return None
        if type_ in ("integer", "number"):
            try:
                number = int(text) if type_ == "integer" else float(text)
            except ValueError:
                continue
            return number
    return value


def coerce_strings(instance: Any, schema: dict) -> Any:
    """Turn strings into the booleans and numbers the schema asks for.

    Snakemake parses nested `--config` values (and a profile's `config:`) with YAML's BaseLoader,
    which leaves every scalar a string: `--config planning='{transcode: {enabled: true}}'` must
    still mean True.
    """
    if isinstance(instance, dict):
        props = schema.get("properties", {})
        for key, value in instance.items():
            if key in props:
                instance[key] = coerce_strings(value, props[key])
        return instance
    if isinstance(instance, list) and isinstance(schema.get("items"), dict):
        return [coerce_strings(item, schema["items"]) for item in instance]
    if isinstance(instance, str):
        types = schema.get("type", [])
        types = [types] if isinstance(types, str) else list(types)
        if "string" not in types and "enum" not in schema:
            return _coerce_scalar(instance, types)
    return instance


def _key_path(error: jsonschema.ValidationError) -> str:
    parts = [str(p) for p in error.absolute_path]
    if error.validator == "additionalProperties":
        # jsonschema reports the parent; name the unknown key itself.
        extra = sorted(set(error.instance) - set(error.schema.get("properties", {})))
        parts.append(",".join(extra))
    if error.validator == "required":
        missing = [r for r in error.validator_value if r not in error.instance]
        parts.append(",".join(missing))
    return ".".join(parts) or "<top level>"


def load_schema(schema_path: str | Path | None = None) -> dict:
    with open(schema_path or REPO_SCHEMA) as fh:
        return yaml.safe_load(fh)


def validate(config: dict[str, Any], schema_path: str | Path | None = None) -> dict[str, Any]:
    """Fill defaults into ``config`` (in place) and validate it; raise ConfigError naming each bad key."""
    if not isinstance(config, dict):
        raise ConfigError("config must be a mapping of keys to values")
    renamed = renamed_keys(config)
    if renamed:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(renamed))
    schema = load_schema(schema_path)
    coerce_strings(config, schema)
    validator = _DefaultFillingValidator(schema)
    errors = sorted(validator.iter_errors(config), key=lambda e: list(map(str, e.absolute_path)))
    if errors:
        lines = [f"config key '{_key_path(e)}': {e.message}" for e in errors]
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(lines))
    adaptive = config["classify"]["adaptive_concurrency"]
    if adaptive["ceiling"] is not None and adaptive["floor"] > adaptive["ceiling"]:
        raise ConfigError("config key 'classify.adaptive_concurrency.floor': must not exceed ceiling")
    qids = [q["id"] for q in config["classify"]["questions"]]
    if len(set(qids)) != len(qids):
        raise ConfigError(f"config key 'classify.questions': duplicate question ids {sorted(qids)}")
    try:
        resolve_derived(config)
    except models.ModelsError as exc:
        raise ConfigError(f"invalid configuration:\n  {exc}") from None
    return config


def resolve_derived(config: dict[str, Any]) -> None:
    """Fill the keys whose default (null) is derived from other keys, so every step reads one value."""
    c = config["classify"]
    if c["max_tokens"] is None:
        c["max_tokens"] = answer_max_tokens(c["questions"])
    if c["max_num_batched_tokens"] is None:
        c["max_num_batched_tokens"] = c["max_model_len"]
    # `auto` is the measured choice: resolved here, so that fingerprints name the decoder itself.
    config["planning"]["decode"] = resolve_choice(config["planning"]["decode"])
    listed = bool(c.get("models"))
    c["models"] = models.resolve(c)
    models.resolve_families(config, listed)
    chosen = config["label_sample"]["model"]
    if chosen is not None and chosen not in models.names(config):
        raise models.ModelsError(f"config key 'label_sample.model': {chosen!r} is not a model name "
                                 f"(classify.models: {models.names(config)})")


def load(path: str | Path, overrides: dict | None = None, schema_path: str | Path | None = None) -> dict:
    """Read a YAML config file, apply ``overrides`` (deep merge) and validate."""
    with open(path) as fh:
        config = yaml.safe_load(fh) or {}
    if overrides:
        deep_merge(config, overrides)
    return validate(config, schema_path)


def deep_merge(base: dict, update: dict) -> dict:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            deep_merge(base[key], value)
        else:
            base[key] = value
    return base
