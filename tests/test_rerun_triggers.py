"""Editing a setting reruns exactly what it touches, and no label survives the settings it was made
under (the user's story: run, edit, run the same command again). Only the GPU server is stood in.

`snakemake -n` names the jobs a change would run; the real runs count the requests the stand-in got.
"""

from __future__ import annotations

import csv
import json
import re
import sys

import pyarrow.parquet as pq
import pytest
import yaml
from conftest import REPO, manifest_dir, model_dir, run_snakemake, write_overlay
from standin import read_request_log, standin_command

from vidlabel.core import stage_settings
from vidlabel.core.config import load

pytestmark = pytest.mark.slow

RULES = {"promotes_product": "buy", "sales_interaction": "link"}
QUESTIONS = [{"id": "promotes_product", "text": "Does the post promote a product?"},
             {"id": "sales_interaction", "text": "Does the post suggest a sales interaction?"}]


def overlay(workdir, demo_root, **changes) -> None:
    yes_if = [arg for qid, word in RULES.items() for arg in ("--yes-if", f"{qid}={word}")]
    classify = {"server_command": standin_command(sys.executable, workdir / "requests.jsonl", *yes_if,
                                                  "--latency", "0.02"),
                "questions": QUESTIONS, "shards": 3}
    classify.update(changes.pop("classify", {}))
    write_overlay(workdir, demo_root, {"classify": classify, **changes})


def planned_jobs(workdir) -> dict[str, int]:
    """Rule -> jobs that `snakemake -n` would run ('Nothing to be done' -> {})."""
    out = run_snakemake(workdir, "-n", "--quiet", "rules").stdout
    jobs = {}
    for line in out.splitlines():
        m = re.fullmatch(r"\s*([a-z_]+)\s+(\d+)\s*", line)
        if m and m.group(1) != "total":
            jobs[m.group(1)] = int(m.group(2))
    return jobs


def reasons(workdir) -> str:
    proc = run_snakemake(workdir, "-n")
    return proc.stdout + proc.stderr


def sent(workdir) -> list[str]:
    """Request ids of the chat requests the stand-in received, in order (smoke requests left out)."""
    return [e["request_id"] for e in read_request_log(workdir / "requests.jsonl")
            if e["event"] == "received" and len(e.get("request_id") or "") == 24]


@pytest.fixture(scope="module")
def study(tmp_path_factory, demo_set):
    """A finished run; each test edits the overlay and puts it back."""
    workdir = tmp_path_factory.mktemp("rerun")
    demo_root, _ = demo_set
    overlay(workdir, demo_root)
    run_snakemake(workdir)
    return workdir, demo_root


def labels(workdir) -> list[dict]:
    return pq.read_table(model_dir(workdir / "results") / "labels.parquet").to_pylist()


# From classify on, every stage after an edit that reaches the requests (3 shards).
FROM_CLASSIFY = {"classify": 3, "merge": 1, "aggregate": 1, "all": 1}
EDITED_QUESTIONS = [dict(QUESTIONS[0], text="Is a product advertised?"), QUESTIONS[1]]


@pytest.mark.parametrize("edit, expected", [
    ({}, {}),
    # Operational settings change how a stage runs, never what it writes.
    ({"classify": {"concurrency": 7, "request_timeout_s": 99}, "inventory": {"threads": 3},
      "transcribe": {"threads": 2}}, {}),
    # transcode too: which videos must be re-planned to fit the context depends on the prompt's length.
    ({"classify": {"questions": EDITED_QUESTIONS}}, {"transcode": 1, "manifest": 1, **FROM_CLASSIFY}),
    # Another model labels the same manifest into its own folder (results/models/<name>).
    ({"classify": {"model": "Qwen/Qwen2.5-VL-7B-Instruct"}}, FROM_CLASSIFY),
    ({"planning": {"fps": 1, "transcode": {"chunks": 1}}}, {"transcode": 1, "manifest": 1, **FROM_CLASSIFY}),
    # transcode too: it plans with the transcripts (its files are reused where the plan is the same).
    ({"transcribe": {"beam_size": 2}}, {"transcribe": 2, "transcode": 1, "manifest": 1, **FROM_CLASSIFY}),
    ({"classify": {"server_args": "--enforce-eager"}}, FROM_CLASSIFY),
    ({"stats": {"confidence": 0.9}}, {"aggregate": 1, "all": 1}),
    # The shard count re-deals the posts: the manifest writes other shards (lowered, the old files would
    # stay); each classify job then sends only what no journal answered (test_resume_shards.py).
    ({"classify": {"shards": 2}}, {"manifest": 1, "classify": 2, "merge": 1, "aggregate": 1, "all": 1}),
], ids=["nothing", "operational", "question-text", "model", "planning", "transcription", "server-args",
        "aggregate-only", "fewer-shards"])
def test_an_edit_reruns_exactly_the_stages_it_touches(study, edit, expected):
    workdir, demo_root = study
    overlay(workdir, demo_root, **edit)
    try:
        assert planned_jobs(workdir) == expected
        if expected:
            because = reasons(workdir)
            assert ("Missing output files" if "model" in edit.get("classify", {}) else "Params have changed") \
                in because
    finally:
        overlay(workdir, demo_root)


def test_every_stage_declares_what_it_reads():
    """Reading an undeclared key fails loudly (the e2e runs above go through these views)."""
    cfg = {"classify": {"model": "m", "concurrency": 3}, "stats": {"confidence": 0.9}}
    view = stage_settings._build(cfg, ["classify.model"])
    assert view["classify"]["model"] == "m"
    with pytest.raises(stage_settings.UndeclaredSetting, match="classify.concurrency"):
        view["classify"]["concurrency"]
    with pytest.raises(stage_settings.UndeclaredSetting, match="'stats'"):
        view.get("stats")
    with pytest.raises(TypeError):
        view["classify"]["model"] = "other"


def test_user_story_edit_a_question_then_drop_dummy_weights(tmp_path, demo_set):
    """A trial run with --load-format dummy; edit a question's text and run again: every request is
    sent again and every label carries the new prompt. Then drop the dummy weights: every request is
    sent again (random weights' answers are never reused for real weights)."""
    demo_root, _ = demo_set
    workdir = tmp_path
    dummy = {"server_args": "--load-format dummy"}
    overlay(workdir, demo_root, classify=dummy)
    run_snakemake(workdir)
    first = sent(workdir)
    first_labels = labels(workdir)
    assert len(set(first)) == len(first) > 0
    assert {r["prompt_hash"] for r in first_labels if r["status"] == "ok"} == {prompt_hash(workdir)}

    edited = [dict(QUESTIONS[0], text="Is a product advertised?"), QUESTIONS[1]]
    overlay(workdir, demo_root, classify={"questions": edited, **dummy})
    run_snakemake(workdir)
    second = sent(workdir)[len(first):]
    assert sorted(second) != sorted(first) and len(second) == len(first)  # new request ids, each once
    hashes = {r["prompt_hash"] for r in labels(workdir) if r["status"] == "ok"}
    assert hashes == {prompt_hash(workdir)} and hashes != {r["prompt_hash"] for r in first_labels}

    overlay(workdir, demo_root, classify={"questions": edited})
    run_snakemake(workdir)
    real = sent(workdir)[len(first) + len(second):]
    assert sorted(real) == sorted(second)  # other server settings: every request again
    fingerprints = {r["request_fingerprint"] for r in labels(workdir) if r["status"] == "ok"}
    assert len(fingerprints) == len(real)


def test_more_shards_send_nothing_twice_and_keep_the_gpu_hours(tmp_path, demo_set):
    """classify.shards from 3 to 4: the re-dealt posts find their answers in the other journals, and
    the busy time of the jobs that made them (shard jobs run side by side: --resources gpu=3)."""
    demo_root, _ = demo_set
    overlay(tmp_path, demo_root)
    run_snakemake(tmp_path, "--resources", "gpu=3")
    before, hours = sent(tmp_path), gpu_hours(tmp_path)
    overlay(tmp_path, demo_root, classify={"shards": 4})
    run_snakemake(tmp_path, "--resources", "gpu=3")
    assert sent(tmp_path) == before  # nothing sent twice
    rows = labels(tmp_path)
    assert {r["shard"] for r in rows if r["shard"] is not None} == {0, 1, 2, 3}
    assert all(r["status"] != "ok" or r["promotes_product"] in ("yes", "no") for r in rows)
    assert gpu_hours(tmp_path) == pytest.approx(hours, rel=0.05)
    assert len({r["job_id"] for r in rows if r["status"] == "ok"}) == 3  # the first run's three jobs


def gpu_hours(workdir) -> float:
    summary = model_dir(workdir / "results") / "summary" / "throughput.csv"
    return float(next(r for r in csv.DictReader(summary.open()) if r["shard"] == "all")["gpu_hours"])


def test_user_story_a_video_replaced_at_the_same_path(tmp_path):
    """A post's video downloaded again (another clip at the same path): the same command makes a new
    transcript and a new answer for it, and sends that post alone again."""
    from vidlabel.demo import make_demo_set

    demo_root = tmp_path / "demo"
    expected = make_demo_set(demo_root, n=2)
    first, second = (demo_root / expected[p]["video_path"] for p in ("good-01", "good-02"))
    assert expected["good-01"]["promotes_product"] and not expected["good-02"]["promotes_product"]
    workdir = tmp_path / "work"
    workdir.mkdir()
    overlay(workdir, demo_root, classify={"shards": 2})
    run_snakemake(workdir)
    before = sent(workdir)
    answer = {r["post_id"]: r for r in labels(workdir)}
    assert answer["good-01"]["promotes_product"] == "yes"

    first.write_bytes(second.read_bytes())  # the same path, another video
    assert planned_jobs(workdir).get("inventory") == 1  # the media's state is the inventory's params
    run_snakemake(workdir)
    again = sent(workdir)[len(before):]
    rows = {r["post_id"]: r for r in labels(workdir)}
    assert again == [rid(workdir, "good-01")]  # that post alone, once
    assert rows["good-01"]["promotes_product"] == "no"
    assert rows["good-01"]["request_fingerprint"] != answer["good-01"]["request_fingerprint"]
    assert all(rows[p] == answer[p] for p in rows if p != "good-01")
    transcripts = {r["post_id"]: r for path in sorted((workdir / "results" / "transcripts").glob("chunk-*.parquet"))
                   for r in pq.read_table(path).to_pylist()}
    assert "pasta" in transcripts["good-01"]["text"].lower() and "buy" not in transcripts["good-01"]["text"].lower()


def rid(workdir, post_id: str) -> str:
    """The request id of a post in the run's manifest."""
    for path in manifest_dir(workdir / "results").glob("shard-*.parquet"):
        for row in pq.read_table(path, columns=["post_id", "request_id"]).to_pylist():
            if row["post_id"] == post_id:
                return row["request_id"]
    raise KeyError(post_id)


def prompt_hash(workdir) -> str:
    """The hash of the template and the questions (with their schema defaults) the run's config has."""
    with open(workdir / "test-config.yaml") as fh:
        cfg = load(REPO / "config" / "config.yaml", yaml.safe_load(fh))
    c = cfg["classify"]
    return stage_settings.digest([c["prompt_template"], c["questions"]])


def test_user_story_a_checkpoint_overwritten_in_place_then_a_chat_template_edited(tmp_path, demo_set):
    """classify.model is a local folder and server_args name a chat template: overwriting the folder
    with a new fine-tune, then editing the template, each rerun classify through the same command and
    send every request again, and the labels say which model files answered."""
    demo_root, _ = demo_set
    folder, template = tmp_path / "checkpoint", tmp_path / "chat.jinja"
    folder.mkdir()
    qwen = json.loads((REPO / "tests" / "data" / "qwen2_5_vl_7b" / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**qwen, "fine_tune": 1}))
    (folder / "model.safetensors").write_bytes(b"\0" * 1024)
    template.write_text("{{ messages }}")
    classify = {"model": str(folder), "server_args": f"--chat-template {template}"}
    overlay(tmp_path, demo_root, classify=classify)
    run_snakemake(tmp_path)
    first = sent(tmp_path)
    revisions = [{r["model_revision"] for r in labels(tmp_path) if r["status"] == "ok"}]
    assert planned_jobs(tmp_path) == {}

    (folder / "config.json").write_text(json.dumps({**qwen, "fine_tune": 2}))
    assert planned_jobs(tmp_path) == FROM_CLASSIFY
    run_snakemake(tmp_path)
    second = sent(tmp_path)[len(first):]
    assert sorted(second) == sorted(first)  # every request again
    revisions.append({r["model_revision"] for r in labels(tmp_path) if r["status"] == "ok"})

    template.write_text("{{ messages }} ")
    assert planned_jobs(tmp_path) == FROM_CLASSIFY
    run_snakemake(tmp_path)
    assert sorted(sent(tmp_path)[len(first) + len(second):]) == sorted(first)
    assert [len(r) for r in revisions] == [1, 1] and revisions[0] != revisions[1]
