"""End to end: `snakemake --profile profiles/local` on generated posts, only the GPU server stood in.

One workflow directory for the module: first `--until transcribe`, then the whole run, the report,
and a no-op rerun. Expected labels are recomputed here from the stand-in's documented rule
(`--yes-if QID=WORD`: yes iff WORD is in the caption or transcript block), not copied from outputs.
"""

from __future__ import annotations

import csv
import json
import re
import sys

import pyarrow.parquet as pq
import pytest
from conftest import manifest_dir, model_dir, run_snakemake, write_overlay
from standin import is_probe, read_request_log, standin_command

pytestmark = pytest.mark.slow

RULES = {"promotes_product": "buy", "sales_interaction": "link"}


def words(text: str | None) -> set[str]:
    return set(re.findall(r"[a-z']+", (text or "").lower()))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, demo_set):
    workdir = tmp_path_factory.mktemp("e2e")
    demo_root, info = demo_set
    yes_if = [arg for qid, word in RULES.items() for arg in ("--yes-if", f"{qid}={word}")]
    command = standin_command(sys.executable, workdir / "requests.jsonl", *yes_if, "--latency", "0.05")
    # Human labels for the good posts: the truth is what was spoken; one label disagrees on purpose.
    human = workdir / "human_labels.csv"
    with open(human, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["post_id", "question", "label"])
        for post_id, expected in sorted(info.items()):
            if expected["probe_ok"]:
                writer.writerow([post_id, "promotes_product", "yes" if expected["promotes_product"] else "no"])
        writer.writerow(["no-such-post", "promotes_product", "yes"])  # reported, not silently dropped
    write_overlay(workdir, demo_root, {"classify": {"server_command": command}, "human_labels": str(human),
                                       "planning": {"pilot_size": 6}})
    return workdir, info


@pytest.fixture(scope="module")
def transcribed(run_dir):
    workdir, info = run_dir
    run_snakemake(workdir, "--until", "transcribe")
    return workdir, info


@pytest.fixture(scope="module")
def finished(transcribed):
    workdir, info = transcribed
    run_snakemake(workdir)
    return workdir, info


def test_until_transcribe_stops_there_with_spoken_words(transcribed):
    workdir, info = transcribed
    results = workdir / "results"
    assert (results / "inventory.parquet").exists()
    assert not (results / "manifest").exists() and not (results / "models").exists()
    chunks = sorted((results / "transcripts").glob("chunk-*.parquet"))
    assert len(chunks) == 2
    rows = [r for c in chunks for r in pq.read_table(c).to_pylist()]
    by_post = {r["post_id"]: r for r in rows}
    good_probe = {p for p, e in info.items() if e["probe_ok"]}
    assert set(by_post) == good_probe  # posts that failed to probe are not transcribed
    for post_id, expected in info.items():
        if post_id not in by_post:
            continue
        row = by_post[post_id]
        if expected["text"] and expected["has_audio"]:
            assert row["status"] == "ok", row
            spoken = words(expected["text"])
            assert len(spoken & words(row["text"])) >= 0.6 * len(spoken), (expected["text"], row["text"])
        elif not expected["has_audio"]:
            assert row["status"] == "no_audio", row


def test_every_valid_post_labelled_by_the_rule(finished):
    workdir, info = finished
    results = workdir / "results"
    labels = {r["post_id"]: r for r in pq.read_table(model_dir(results) / "labels.parquet").to_pylist()}
    assert set(labels) == set(info)  # one row per post, none lost, none invented
    manifest = {r["post_id"]: r for s in sorted(manifest_dir(results).glob("shard-*.parquet"))
                for r in pq.read_table(s).to_pylist()}
    excluded = {r["post_id"]: r for r in pq.read_table(manifest_dir(results) / "excluded.parquet").to_pylist()}

    for post_id, expected in info.items():
        row = labels[post_id]
        if not expected["probe_ok"]:
            assert row["status"] == "excluded", row
            assert excluded[post_id]["reason"] == "probe_error" and excluded[post_id]["detail"]
            assert post_id not in manifest
            continue
        assert row["status"] == "ok", row
        request = manifest[post_id]
        visible = words(request["caption"]) | words(request["transcript"])
        for qid, word in RULES.items():
            assert row[qid] == ("yes" if word in visible else "no"), (post_id, qid, request["transcript"])
    answers = [labels[p]["promotes_product"] for p in info if info[p]["probe_ok"]]
    assert "yes" in answers and "no" in answers


def test_each_request_sent_once_with_file_urls_and_key(finished):
    workdir, _ = finished
    events = read_request_log(workdir / "requests.jsonl")
    completed = [e for e in events if e.get("event") == "completed" and e.get("status") == 200
                 and e.get("request_id")]
    manifest_ids = {r["request_id"] for s in sorted(manifest_dir(workdir / "results").glob("shard-*.parquet"))
                    for r in pq.read_table(s).to_pylist()}
    chat = [e["request_id"] for e in completed if e["request_id"] in manifest_ids]
    assert sorted(chat) == sorted(manifest_ids)  # every request answered exactly once
    assert not [e for e in events if e.get("status") == 401]  # the per-job key reached the client


def test_summary_numbers_recomputed(finished):
    workdir, info = finished
    results = workdir / "results"
    labels = pq.read_table(model_dir(results) / "labels.parquet").to_pylist()

    with open(model_dir(results) / "summary" / "prevalence.csv") as fh:
        prevalence = {r["question"]: r for r in csv.DictReader(fh)}
    for qid in RULES:
        answered = [r[qid] for r in labels if r["status"] == "ok" and r[qid] is not None]
        row = prevalence[qid]
        assert int(row["answered"]) == len(answered)
        assert int(row["yes"]) == answered.count("yes")
        assert float(row["model_share"]) == pytest.approx(answered.count("yes") / len(answered))

    with open(model_dir(results) / "summary" / "tokens.csv") as fh:
        tokens = {r["direction"]: r for r in csv.DictReader(fh)}
    prompt = [r["prompt_tokens"] for r in labels if r["status"] == "ok"]
    assert float(tokens["input"]["mean"]) == pytest.approx(sum(prompt) / len(prompt))
    assert float(tokens["input"]["max"]) == max(prompt)

    with open(model_dir(results) / "summary" / "errors.csv") as fh:
        errors = list(csv.DictReader(fh))
    probe_errors = sum(int(r["count"]) for r in errors if r["reason"] == "probe_error")
    assert probe_errors == sum(1 for e in info.values() if not e["probe_ok"])
    assert (model_dir(results) / "summary" / "summary.md").read_text().strip()


def test_report_renders_every_figure(finished):
    workdir, _ = finished
    run_snakemake(workdir, "--report", "results/report.html")
    report = workdir / "results" / "report.html"
    assert report.exists() and report.stat().st_size > 10_000
    html = report.read_text(errors="replace")
    for name in ("input_tokens.png", "input_tokens_by_kind.png", "output_tokens.png", "prevalence.png",
                 "throughput.png", "errors.png", "prevalence_by_type.csv", "post_types.csv"):
        assert name in html, name


def test_same_command_again_does_nothing(finished):
    workdir, _ = finished
    before = len(read_request_log(workdir / "requests.jsonl"))
    proc = run_snakemake(workdir)
    assert "Nothing to be done" in proc.stdout + proc.stderr
    assert len(read_request_log(workdir / "requests.jsonl")) == before


def test_journal_has_one_record_per_request(finished):
    workdir, _ = finished
    for journal in sorted((model_dir(workdir / "results") / "journal").glob("shard-*.jsonl")):
        ids = [json.loads(line)["request_id"] for line in journal.read_text().splitlines()]
        assert len(ids) == len(set(ids)), journal


def read_csv(path):
    with open(path) as fh:
        return list(csv.DictReader(fh))


def test_agreement_and_corrected_prevalence_with_human_labels(finished):
    workdir, info = finished
    summary = model_dir(workdir / "results") / "summary"
    labels = {r["post_id"]: r for r in pq.read_table(model_dir(workdir / "results") / "labels.parquet").to_pylist()}
    human = {p: ("yes" if e["promotes_product"] else "no") for p, e in info.items() if e["probe_ok"]}
    pairs = [(human[p], labels[p]["promotes_product"]) for p in human]
    tp = sum(h == "yes" and m == "yes" for h, m in pairs)
    fp = sum(h == "no" and m == "yes" for h, m in pairs)
    fn = sum(h == "yes" and m == "no" for h, m in pairs)
    tn = sum(h == "no" and m == "no" for h, m in pairs)
    agreement = {r["question"]: r for r in read_csv(summary / "agreement.csv")}
    row = agreement["promotes_product"]
    assert (int(row["n"]), int(row["tp"]), int(row["fp"]), int(row["fn"]), int(row["tn"])) == (len(pairs), tp, fp, fn, tn)
    assert float(row["accuracy"]) == pytest.approx((tp + tn) / len(pairs))
    assert float(row["accuracy_lo"]) <= float(row["accuracy"]) <= float(row["accuracy_hi"])

    prevalence = {r["question"]: r for r in read_csv(summary / "prevalence.csv")}["promotes_product"]
    assert int(prevalence["human_n"]) == len(human)
    assert float(prevalence["human_share"]) == pytest.approx(sum(h == "yes" for h, _ in pairs) / len(pairs))
    lo, est, hi = (float(prevalence[k]) for k in ("corrected_lo", "corrected", "corrected_hi"))
    assert 0 <= lo <= est <= hi <= 1 and hi > lo
    # The label for an unknown post is reported, not silently dropped.
    issues = [r for r in read_csv(summary / "errors.csv") if r["stage"] == "human_labels"]
    assert sum(int(r["count"]) for r in issues) == 1
    assert "no-such-post" in (summary / "summary.md").read_text()


def test_estimate_target_projects_from_a_pilot(finished):
    workdir, _ = finished
    before = len(read_request_log(workdir / "requests.jsonl"))
    run_snakemake(workdir, "estimate")
    estimate = json.loads((model_dir(workdir / "results") / "estimate.json").read_text())
    received = [e for e in read_request_log(workdir / "requests.jsonl")[before:] if e["event"] == "received"]
    pilot_requests = [e for e in received if not is_probe(e["request_id"])]
    assert 0 < len(pilot_requests) <= 6  # the pilot sample; besides it the readiness and calibration requests
    assert len(received) - len(pilot_requests) == 1 + 3
    flat = json.dumps(estimate)
    assert "wall" in flat and "gpu_hours" in flat and "cost" in flat
    assert (model_dir(workdir / "results") / "estimate.md").read_text().strip()
    # The models side by side (one here): results/estimate.md names the model and its projection.
    side_by_side = (workdir / "results" / "estimate.md").read_text()
    assert model_dir(workdir / "results").name in side_by_side and "GPU-hours" in side_by_side
