"""classify.models: several models label the same posts side by side (the user's story with the real
workflow; only the GPU servers are stood in). A "yes"-leaning and a "no"-leaning model against the
same human labels; then a third model is added (only it is sent requests) and one removed (nothing
else is touched). Each model's metrics are recomputed here from its labels and the human labels."""

from __future__ import annotations

import csv
import math
import re
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import run_snakemake, write_overlay
from standin import read_request_log, standin_command

from vidlabel.core import config as vconfig
from vidlabel.core import models
from vidlabel.core import stage_settings as settings

QUESTIONS = [{"id": "promotes_product", "text": "Does the post promote a product?"}]
# The stand-in says "yes" when one of these words is in the caption or transcript. The lax model's
# words include the strict model's, so its "yes" answers are a superset of the strict model's.
LAX_WORDS = ["buy", "my", "shoes", "cookbook"]
STRICT_WORDS = ["shoes", "cookbook"]
THIRD_WORDS = ["buy"]


# ---- the config ------------------------------------------------------------------------------

def _validate(classify: dict, **extra) -> dict:
    # The models here are made up: they are planned as Qwen2.5-VL (a real one's family is read: test_families.py).
    return vconfig.validate({"posts": "p.csv", "media_root": "/m", "classify": classify,
                             "planning": {"model_family": "qwen2_5_vl"}, **extra})


def test_one_model_form_and_list_form_are_the_same_model():
    one = _validate({"model": "Qwen/Qwen2.5-VL-7B-Instruct"})
    listed = _validate({"models": ["Qwen/Qwen2.5-VL-7B-Instruct",
                                   {"model": "Qwen/Qwen2.5-VL-72B-Instruct", "name": "72b-fp8",
                                    "server_args": "--quantization fp8"}]})
    assert models.names(one) == ["Qwen2.5-VL-7B-Instruct"]
    assert models.names(listed) == ["Qwen2.5-VL-7B-Instruct", "72b-fp8"]
    # Same folder, same fingerprints: switching to the list form reruns nothing of the first model.
    for stage in ("classify", "merge", "aggregate", "estimate"):
        assert settings.fingerprint(one, stage, "Qwen2.5-VL-7B-Instruct") == \
            settings.fingerprint(listed, stage, "Qwen2.5-VL-7B-Instruct"), stage
    big = models.model_config(listed, "72b-fp8")["classify"]
    assert big["model"] == "Qwen/Qwen2.5-VL-72B-Instruct" and big["server_args"] == "--quantization fp8"
    assert "models" not in big
    # The shared keys stay shared; an entry changes only its own model's fingerprint.
    assert big["questions"] == listed["classify"]["questions"]
    edited = _validate({"models": ["Qwen/Qwen2.5-VL-7B-Instruct",
                                   {"model": "Qwen/Qwen2.5-VL-72B-Instruct", "name": "72b-fp8",
                                    "server_args": "--quantization fp8 --enforce-eager"}]})
    assert settings.fingerprint(edited, "classify", "Qwen2.5-VL-7B-Instruct") == \
        settings.fingerprint(listed, "classify", "Qwen2.5-VL-7B-Instruct")
    assert settings.fingerprint(edited, "classify", "72b-fp8") != settings.fingerprint(listed, "classify", "72b-fp8")
    # The manifest is the same for every model: it does not depend on the model at all.
    assert settings.fingerprint(one, "manifest") == settings.fingerprint(listed, "manifest")


@pytest.mark.parametrize("classify, extra, message", [
    ({"models": [{"model": "a/x"}, {"model": "b/x"}]}, {}, "classify.models.1': the name 'x' is taken"),
    ({"models": [{"model": "a", "sever_args": "x"}]}, {}, "classify.models.0.sever_args"),
    ({"models": [{"model": "a", "name": "a b"}]}, {}, "classify.models.0.name"),
    ({"models": [{"model": "a", "questions": []}]}, {}, "classify.models.0.questions"),  # shared, not per model
    ({"models": []}, {}, "classify.models"),
    ({"models": ["a"]}, {"label_sample": {"model": "b"}}, "label_sample.model': 'b' is not a model name"),
])
def test_bad_model_lists_name_the_key(classify, extra, message):
    with pytest.raises(vconfig.ConfigError, match=re.escape(message)):
        _validate(classify, **extra)


def test_a_model_served_elsewhere_comes_in_through_its_own_endpoints():
    cfg = _validate({"models": ["Qwen/Qwen2.5-VL-7B-Instruct",
                                {"model": "gpt-4o-video", "endpoints": ["http://lab-server:8000/v1"],
                                 "api_key_env": "LAB_KEY"}]})
    remote = models.model_config(cfg, "gpt-4o-video")["classify"]
    local = models.model_config(cfg, "Qwen2.5-VL-7B-Instruct")["classify"]
    assert remote["endpoints"] == ["http://lab-server:8000/v1"] and remote["api_key_env"] == "LAB_KEY"
    assert local["endpoints"] == [] and local["api_key_env"] == "VIDLABEL_API_KEY"
    assert models.own_servers(cfg)  # the 7B still starts its own server: the media path is checked
    assert not models.own_servers(_validate({"models": [{"model": "m", "endpoints": ["http://h:1/v1"]}]}))


def test_default_names_are_folder_names():
    assert models.default_name("Qwen/Qwen2.5-VL-72B-Instruct") == "Qwen2.5-VL-72B-Instruct"
    assert models.default_name("/models/my model (v2)/") == "my-model-v2"


# ---- the workflow ----------------------------------------------------------------------------

def _entry(workdir: Path, name: str, words: list[str]) -> dict:
    yes_if = [arg for word in words for arg in ("--yes-if", f"promotes_product={word}")]
    # Each model has its own stand-in and request log, so the test sees which model was asked what.
    return {"model": name, "server_command": standin_command(sys.executable, workdir / f"requests-{name}.jsonl",
                                                             *yes_if, "--latency", "0.02")}


def _overlay(workdir: Path, demo_root: Path, human: Path, names: list[str]) -> None:
    words = {"lax": LAX_WORDS, "strict": STRICT_WORDS, "third": THIRD_WORDS}
    write_overlay(workdir, demo_root, {
        "classify": {"questions": QUESTIONS, "models": [_entry(workdir, n, words[n]) for n in names]},
        "human_labels": str(human), "cost": {"gpus_per_job": 2, "gpu_hour_usd": 3.0}})


def _received(workdir: Path, name: str) -> list[str]:
    return [e["request_id"] for e in read_request_log(workdir / f"requests-{name}.jsonl")
            if e["event"] == "received" and len(e.get("request_id") or "") == 24]


def _files(workdir: Path, name: str) -> dict[str, tuple[int, bytes]]:
    """Every file of a model's folder, with its modification time and bytes."""
    folder = workdir / "results" / "models" / name
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def _planned(workdir: Path) -> dict[str, int]:
    out = run_snakemake(workdir, "-n", "--quiet", "rules").stdout
    return {m.group(1): int(m.group(2)) for m in (re.fullmatch(r"\s*([a-z_]+)\s+(\d+)\s*", line)
                                                    for line in out.splitlines()) if m and m.group(1) != "total"}


@pytest.fixture(scope="module")
def study(tmp_path_factory, demo_set):
    """Two models labelled; human labels are what each good post says (one label flipped)."""
    workdir = tmp_path_factory.mktemp("models")
    demo_root, info = demo_set
    human = workdir / "human_labels.csv"
    rows = [(p, "yes" if e["promotes_product"] else "no") for p, e in sorted(info.items()) if e["probe_ok"]]
    rows[0] = (rows[0][0], "no" if rows[0][1] == "yes" else "yes")
    human.write_text("post_id,question,label\n" + "".join(f"{p},promotes_product,{label}\n" for p, label in rows))
    _overlay(workdir, demo_root, human, ["lax", "strict"])
    run_snakemake(workdir)
    return workdir, demo_root, human, dict(rows)


def _direct_metrics(labels_path: Path, human: dict[str, str]) -> dict[str, float]:
    """Precision, recall, F1 and Cohen's kappa of a model's answers against the human labels."""
    answers = {r["post_id"]: r["promotes_product"] for r in pq.read_table(labels_path).to_pylist()}
    pairs = [(answers[p] == "yes", label == "yes") for p, label in human.items() if answers.get(p) in ("yes", "no")]
    tp = sum(m and h for m, h in pairs)
    fp = sum(m and not h for m, h in pairs)
    fn = sum(h and not m for m, h in pairs)
    tn = sum(not m and not h for m, h in pairs)
    n = tp + fp + fn + tn
    precision = tp / (tp + fp) if tp + fp else math.nan
    recall = tp / (tp + fn) if tp + fn else math.nan
    f1 = 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else math.nan
    observed = (tp + tn) / n
    expected = ((tp + fp) * (tp + fn) + (fn + tn) * (fp + tn)) / n / n
    kappa = (observed - expected) / (1 - expected) if expected < 1 else math.nan
    return {"n": n, "precision": precision, "recall": recall, "f1": f1, "kappa": kappa}


def _close(value: str, expected: float) -> bool:
    return (value in ("", "nan") and math.isnan(expected)) or float(value) == pytest.approx(expected)


@pytest.mark.slow
def test_two_models_side_by_side_match_a_direct_computation(study):
    workdir, _, _, human = study
    results = workdir / "results"
    lax_labels = pq.read_table(results / "models" / "lax" / "labels.parquet").to_pylist()
    strict_labels = pq.read_table(results / "models" / "strict" / "labels.parquet").to_pylist()
    # Both models labelled the same posts, each row says which model answered.
    assert [r["post_id"] for r in lax_labels] == [r["post_id"] for r in strict_labels]
    assert {r["model"] for r in lax_labels if r["status"] == "ok"} == {"lax"}
    assert {r["model"] for r in strict_labels if r["status"] == "ok"} == {"strict"}
    lax_yes = {r["post_id"] for r in lax_labels if r["promotes_product"] == "yes"}
    strict_yes = {r["post_id"] for r in strict_labels if r["promotes_product"] == "yes"}
    assert strict_yes < lax_yes  # the lax model leans to "yes", the strict one to "no"
    # Same requests: the manifest is shared, and each model was sent each request once.
    assert sorted(_received(workdir, "lax")) == sorted(_received(workdir, "strict"))
    assert len(set(_received(workdir, "lax"))) == len(_received(workdir, "lax")) > 0

    rows = {r["model"]: r for r in _read_csv(results / "compare" / "models.csv")}
    assert list(rows) == ["lax", "strict"]
    for name in ("lax", "strict"):
        direct = _direct_metrics(results / "models" / name / "labels.parquet", human)
        row = rows[name]
        assert int(row["agreement_n"]) == direct["n"]
        for metric in ("precision", "recall", "f1", "kappa"):
            assert _close(row[metric], direct[metric]), (name, metric, row[metric], direct[metric])
        # GPU-hours: busy time x cost.gpus_per_job (a stand-in job holds no GPU it could record).
        throughput = {r["shard"]: r for r in _read_csv(results / "models" / name / "summary" / "throughput.csv")}
        assert float(row["gpu_hours"]) == pytest.approx(float(throughput["all"]["busy_s"]) * 2 / 3600)
    assert float(rows["lax"]["recall"]) >= float(rows["strict"]["recall"])
    assert float(rows["lax"]["model_share"]) > float(rows["strict"]["model_share"])

    # Agreement between the two models and the posts they disagree on, computed here.
    pair = _read_csv(results / "compare" / "model_agreement.csv")[0]
    both = [(a["promotes_product"], b["promotes_product"]) for a, b in zip(lax_labels, strict_labels)
            if a["promotes_product"] in ("yes", "no") and b["promotes_product"] in ("yes", "no")]
    assert int(pair["both_answered"]) == len(both)
    assert int(pair["only_a_yes"]) == sum(a == "yes" and b == "no" for a, b in both) == len(lax_yes - strict_yes)
    assert int(pair["only_b_yes"]) == 0
    differ = {r["post_id"] for r in _read_csv(results / "compare" / "disagreements.csv")
              if r["kind"] == "answers differ"}
    assert differ == lax_yes - strict_yes
    summary = (results / "compare" / "compare.md").read_text()
    assert "lax" in summary and "strict" in summary and "GPU-hours" in summary
    assert (results / "compare" / "plots" / "prevalence_by_model.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_adding_a_model_runs_that_model_only_and_removing_one_touches_nothing(study):
    workdir, demo_root, human, _ = study
    sent = {name: _received(workdir, name) for name in ("lax", "strict")}
    before = {name: _files(workdir, name) for name in ("lax", "strict")}

    _overlay(workdir, demo_root, human, ["lax", "strict", "third"])
    assert _planned(workdir) == {"classify": 2, "merge": 1, "aggregate": 1, "compare": 1, "all": 1}  # 2 shards
    run_snakemake(workdir)
    assert {name: _received(workdir, name) for name in ("lax", "strict")} == sent  # not one request more
    assert sorted(_received(workdir, "third")) == sorted(sent["lax"])  # the new model: every request once
    assert {name: _files(workdir, name) for name in ("lax", "strict")} == before
    assert [r["model"] for r in _read_csv(workdir / "results" / "compare" / "models.csv")] == \
        ["lax", "strict", "third"]

    # Remove the strict model: only the comparison is redone; its folder stays as it was.
    third = _files(workdir, "third")
    _overlay(workdir, demo_root, human, ["lax", "third"])
    assert _planned(workdir) == {"compare": 1, "all": 1}
    run_snakemake(workdir)
    assert {name: _received(workdir, name) for name in ("lax", "strict")} == sent
    assert _files(workdir, "lax") == before["lax"] and _files(workdir, "strict") == before["strict"]
    assert _files(workdir, "third") == third
    assert [r["model"] for r in _read_csv(workdir / "results" / "compare" / "models.csv")] == ["lax", "third"]
