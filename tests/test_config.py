"""Config validation: defaults filled, every bad key named in the message."""

import copy

import pytest
import yaml
from conftest import REPO

from vidlabel.core import config as vconfig


def base():
    return {"posts": "posts.csv", "media_root": "media"}


def test_defaults_filled_recursively():
    cfg = vconfig.validate(base())
    assert cfg["classify"]["concurrency"] == 64
    assert cfg["classify"]["adaptive_concurrency"] == {"enabled": True, "floor": 4, "ceiling": None}
    assert cfg["planning"]["transcode"]["chunks"] == 4
    assert cfg["stats"]["confidence"] == 0.95
    assert cfg["classify"]["questions"][0]["type"] == "yes/no"


def test_shipped_config_is_valid():
    cfg = vconfig.load(REPO / "config" / "config.yaml")
    assert cfg["classify"]["shards"] >= 1
    assert {q["id"] for q in cfg["classify"]["questions"]} >= {"promotes_product"}


@pytest.mark.parametrize(
    "patch, key",
    [
        ({"classify": {"concurrency": 0}}, "classify.concurrency"),
        ({"classify": {"concurrenccy": 4}}, "classify.concurrenccy"),
        ({"transcribe": {"backend": "whisperx"}}, "transcribe.backend"),
        ({"planning": {"transcode": {"crf": 80}}}, "planning.transcode.crf"),
        ({"classify": {"questions": [{"id": "Bad Id", "text": "x"}]}}, "classify.questions.0.id"),
        ({"stats": {"confidence": 1.5}}, "stats.confidence"),
        ({"typo_top": 1}, "typo_top"),
        ({"classify": {"adaptive_concurrency": {"floor": 8, "ceiling": 4}}}, "classify.adaptive_concurrency.floor"),
        ({"classify": {"adaptive_concurrency": {"ceiling": 0}}}, "classify.adaptive_concurrency.ceiling"),
    ],
)
def test_bad_key_is_named(patch, key):
    cfg = vconfig.deep_merge(base(), copy.deepcopy(patch))
    with pytest.raises(vconfig.ConfigError) as err:
        vconfig.validate(cfg)
    assert f"'{key}'" in str(err.value)


def test_missing_required_key_is_named():
    with pytest.raises(vconfig.ConfigError, match="'media_root'"):
        vconfig.validate({"posts": "p.csv"})


def test_duplicate_question_ids_rejected():
    cfg = base()
    cfg["classify"] = {"questions": [{"id": "a", "text": "x"}, {"id": "a", "text": "y"}]}
    with pytest.raises(vconfig.ConfigError, match="duplicate question ids"):
        vconfig.validate(cfg)


def test_schema_documents_every_key():
    """Every property has a description and (unless required) a default, as users read the schema."""
    schema = yaml.safe_load((REPO / "workflow/schemas/config.schema.yaml").read_text())
    missing = []

    def walk(node, path):
        for name, sub in node.get("properties", {}).items():
            here = f"{path}.{name}" if path else name
            if "description" not in sub:
                missing.append(f"{here}: description")
            if "default" not in sub and name not in node.get("required", []):
                missing.append(f"{here}: default")
            if sub.get("type") == "object":
                walk(sub, here)
            if sub.get("type") == "array" and sub.get("items", {}).get("type") == "object":
                walk(sub["items"], here + "[]")

    walk(schema, "")
    assert missing == []


def test_strings_from_snakemake_config_flag_are_coerced():
    """Nested `--config` values reach the workflow as strings (YAML BaseLoader)."""
    cfg = vconfig.deep_merge(base(), {"planning": {"transcode": {"enabled": "true", "chunks": "8"}, "fps": "1.5",
                                                   "model_family": "qwen2_5_vl"},
                                      "classify": {"shards": "3", "model": "123"}})
    vconfig.validate(cfg)
    assert cfg["planning"]["transcode"] == {"enabled": True, "chunks": 8, "crf": 23, "media_dir": None}
    assert cfg["planning"]["fps"] == 1.5
    assert cfg["classify"]["shards"] == 3 and cfg["classify"]["model"] == "123"  # strings stay strings


def test_uncoercible_string_is_still_named():
    cfg = vconfig.deep_merge(base(), {"classify": {"shards": "many"}})
    with pytest.raises(vconfig.ConfigError, match="'classify.shards'"):
        vconfig.validate(cfg)


def test_slurm_profile_turns_pre_transcoding_on():
    """The SLURM profile's `config:` entries, parsed the way Snakemake parses them, then validated."""
    from snakemake.cli import parse_config

    profile = yaml.safe_load((REPO / "profiles" / "slurm" / "config.yaml").read_text())
    cfg = vconfig.load(REPO / "config" / "config.yaml", parse_config(profile["config"]))
    assert cfg["planning"]["transcode"]["enabled"] is True
    assert cfg["planning"]["transcode"]["chunks"] == 2  # the rest of the section is kept (deep merge)
    local = yaml.safe_load((REPO / "profiles" / "local" / "config.yaml").read_text())
    assert "config" not in local
