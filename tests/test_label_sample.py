"""The human sample: design from the model's confidence, Label Studio files, reading the coders' export back."""

import csv
import json
import xml.etree.ElementTree as ET

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import default_model_dir, run_snakemake, write_overlay

from vidlabel.analyze import aggregate, labelstudio, sample_design, sampling
from vidlabel.analyze.humans import HumanLabelError, load_human_labels
from vidlabel.analyze.label_sample import (
    FLOOR_SHARE_ACTIVE,
    FLOOR_SHARE_SECOND_PHASE,
    SampleError,
    collect,
    run,
)
from vidlabel.analyze.labelstudio import ExportError, read_export
from vidlabel.core.config import load

QUESTIONS = [{"id": "promotes_product", "text": "Does the post promote a product?"},
             {"id": "sales_interaction", "text": "Does the post suggest a sale & follow-up <now>?"}]
IDS = [q["id"] for q in QUESTIONS]
OUTPUTS = ("sample.csv", "design.parquet", "burn_in_labels.csv", "labelstudio_config.xml",
           "labelstudio_tasks.json")


def _config(tmp_path, **label_sample):
    media = tmp_path / "media"
    media.mkdir(exist_ok=True)
    overrides = {"classify": {"questions": QUESTIONS}, "label_sample": label_sample}
    config_path = tmp_path / "base.yaml"
    config_path.write_text(json.dumps({"posts": str(tmp_path), "media_root": str(media)}))
    return load(config_path, overrides)


def _results(tmp_path, n_ok=300, n_error=12, n_excluded=5, probabilities=True, seed=0, beta=(0.4, 0.6)):
    """labels.parquet (ok posts with answer_probs, failed and excluded posts) and two manifest shards.
    Returns (labels path, manifest paths, {post_id: (P(yes) per question or None)})."""
    rng = np.random.default_rng(seed)
    media = tmp_path / "media"
    media.mkdir(exist_ok=True)
    rows, truth = [], {}
    for i in range(n_ok + n_error + n_excluded):
        post_id = f"p{i:04d}"
        status = "ok" if i < n_ok else "error" if i < n_ok + n_error else "excluded"
        row = {"post_id": post_id, "status": status, "answer_probs": None}
        if status == "ok":
            p = rng.beta(*beta, size=len(IDS))
            row.update({qid: "yes" if p_q > 0.5 else "no" for qid, p_q in zip(IDS, p)})
            row["answer_probs"] = json.dumps({qid: {"yes": float(p_q), "no": float(1 - p_q)} for qid, p_q in zip(IDS, p)})
            truth[post_id] = p
        else:
            row.update({qid: None for qid in IDS})
            truth[post_id] = None
        rows.append(row)
    columns = ["post_id", "status", *IDS] + (["answer_probs"] if probabilities else [])
    labels = default_model_dir(tmp_path / "results") / "labels.parquet"
    labels.parent.mkdir(parents=True, exist_ok=True)
    table = {c: pa.array([r[c] for r in rows], pa.string()) for c in columns}
    # The rest of merge's columns, so that aggregate reads the same file.
    n, ok = len(rows), [r["status"] == "ok" for r in rows]
    table.update({"shard": pa.array([0] * n, pa.int64()),
                  "error_kind": pa.array([None if o else "timeout" for o in ok], pa.string()),
                  "error": pa.array([None] * n, pa.string()),
                  "prompt_tokens": pa.array([1000 if o else None for o in ok], pa.int64()),
                  "completion_tokens": pa.array([20 if o else None for o in ok], pa.int64()),
                  "latency_s": [1.0] * n, "started_at": [float(i) for i in range(n)],
                  "finished_at": [i + 1.0 for i in range(n)]})
    pq.write_table(pa.table(table), labels)
    classified = [r for r in rows if r["status"] != "excluded"]
    manifest = []
    for shard in range(2):
        part = classified[shard::2]
        path = tmp_path / "results" / "manifest" / "qwen2_5_vl" / f"shard-{shard}.parquet"  # the default model's plan
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({
            "request_id": [f"r-{r['post_id']}" for r in part],
            "post_id": [r["post_id"] for r in part],
            "video_path": [str(media / f"sub dir/{r['post_id']}.mp4") for r in part],
            "caption": [f"caption of {r['post_id']} ✓" for r in part],
            "transcript": [None if r["post_id"].endswith("3") else f"said in {r['post_id']}" for r in part],
        }), path)
        manifest.append(path)
    write_transcript_chunks(tmp_path / "results", {})
    return labels, manifest, truth


def write_transcript_chunks(results, texts: dict[str, str], chunks: int = 2) -> list:
    """The transcribe rule's chunks (the label_sample rule's input), holding ``texts`` by transcript id."""
    paths = []
    for chunk in range(chunks):
        ids = sorted(texts)[chunk::chunks]
        path = results / "transcripts" / f"chunk-{chunk}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"post_id": pa.array(ids, pa.string()), "transcript_id": pa.array(ids, pa.string()),
                                 "text": pa.array([texts[i] for i in ids], pa.string()),
                                 "status": pa.array(["ok"] * len(ids), pa.string())}), path)
        paths.append(path)
    return paths


def _outputs(tmp_path):
    out = tmp_path / "results" / "label_sample"
    keys = ("sample", "design", "burn_in", "ls_config", "ls_tasks")
    return {k: out / name for k, name in zip(keys, OUTPUTS)}


def _read_csv(path):
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def test_design_follows_the_model_uncertainty_and_covers_failed_posts(tmp_path):
    config = _config(tmp_path, budget=60, floor_share=0.2, seed=7, design="active")
    labels, manifest, truth = _results(tmp_path)
    outputs = _outputs(tmp_path)
    run(config, labels, manifest, None, outputs)

    design = pq.read_table(outputs["design"]).to_pylist()
    _, metadata = sample_design.read_design(outputs["design"])
    assert metadata["design"] == "active" and metadata["frame_posts"] == 312 and metadata["seed"] == 7
    assert metadata["labels_sha256"] == sample_design.file_digest(labels) and metadata["labels_path"] == str(labels)
    assert metadata["created_at"].startswith("20") and {r["phase"] for r in design} == {None}
    population = [p for p, t in truth.items() if t is not None or p < "p0312"]
    assert [r["post_id"] for r in design] == population  # ok and error posts, labels.parquet's order
    p_yes = np.array([truth[p] if truth[p] is not None else [np.nan] * len(IDS) for p in population])
    expected_pi = sampling.inclusion_probabilities(sampling.post_uncertainty(p_yes), 60, 0.2)
    pi = np.array([r["pi"] for r in design])
    np.testing.assert_allclose(pi, expected_pi)
    assert pi.sum() == pytest.approx(60)
    failed = np.array([r["status"] == "error" for r in design])
    assert failed.sum() == 12 and np.all(pi[failed] >= pi[~failed].max() - 1e-12)
    assert {r["design"] for r in design} == {"active"}
    drawn = np.array([r["drawn"] for r in design])
    np.testing.assert_array_equal(drawn, sampling.draw(expected_pi, 7))

    sample = _read_csv(outputs["sample"])
    assert list(sample[0]) == ["post_id", "video_path", "media", "caption", "transcript", "questions", "pi", "seed",
                              "design"]
    by_post = {r["post_id"]: r for r in design}
    assert sorted(r["post_id"] for r in sample) == sorted(p for p, d in zip(population, drawn) if d)
    for row in sample:
        assert float(row["pi"]) == pytest.approx(by_post[row["post_id"]]["pi"])
        assert row["seed"] == "7" and row["design"] == "active" and row["questions"] == ";".join(IDS)
        assert row["caption"] == f"caption of {row['post_id']} ✓"
        assert row["video_path"].endswith(f"sub dir/{row['post_id']}.mp4")
    assert _read_csv(outputs["burn_in"]) == []


def test_label_studio_files_show_every_question_and_point_at_the_videos(tmp_path):
    config = _config(tmp_path, budget=40)
    labels, manifest, _ = _results(tmp_path)
    outputs = _outputs(tmp_path)
    run(config, labels, manifest, None, outputs)

    view = ET.fromstring(outputs["ls_config"].read_text())
    assert view.find("Repeater[@on='$videos']/Video").get("value") == "$videos[{{idx}}].url"
    choices = view.findall("Choices")
    assert [c.get("name") for c in choices] == IDS
    assert all(c.get("toName") == "caption" and [x.get("value") for x in c] == ["yes", "no"] for c in choices)
    headers = [h.get("value") for h in view.findall("Header")]
    assert all(q["text"] in headers for q in QUESTIONS)  # "&" and "<" survive XML escaping

    tasks = json.loads(outputs["ls_tasks"].read_text())
    sample = _read_csv(outputs["sample"])
    assert [t["data"]["post_id"] for t in tasks] == [r["post_id"] for r in sample]
    for task, row in zip(tasks, sample):
        (video,) = task["data"]["videos"]
        assert video["url"] == f"/data/local-files/?d=media/sub%20dir/{row['post_id']}.mp4"
        assert task["data"]["pi"] == pytest.approx(float(row["pi"]))
        assert task["data"]["transcript"] == row["transcript"]
        assert not set(task["data"]) & set(IDS)  # the model's answers are not shown to coders


def test_same_seed_same_sample_other_seed_other_sample(tmp_path):
    labels, manifest, _ = _results(tmp_path)
    samples = []
    for seed in (3, 3, 4):
        outputs = _outputs(tmp_path)
        run(_config(tmp_path, budget=50, seed=seed), labels, manifest, None, outputs)
        samples.append([r["post_id"] for r in _read_csv(outputs["sample"])])
    assert samples[0] == samples[1]
    assert samples[0] != samples[2]


def test_floor_share_one_draws_a_uniform_sample(tmp_path):
    labels, manifest, _ = _results(tmp_path)
    outputs = _outputs(tmp_path)
    run(_config(tmp_path, budget=31.2, design="uniform"), labels, manifest, None, outputs)
    design = pq.read_table(outputs["design"]).to_pylist()
    assert {r["design"] for r in design} == {"uniform"}
    np.testing.assert_allclose([r["pi"] for r in design], 31.2 / len(design))
    assert {r["design"] for r in _read_csv(outputs["sample"])} == {"uniform"}


def test_without_answer_probs_answered_posts_share_one_uncertainty(tmp_path):
    labels, manifest, _ = _results(tmp_path, probabilities=False)
    outputs = _outputs(tmp_path)
    run(_config(tmp_path, budget=50, design="active"), labels, manifest, None, outputs)
    design = pq.read_table(outputs["design"]).to_pylist()
    ok = [r for r in design if r["status"] == "ok"]
    failed = [r for r in design if r["status"] == "error"]
    assert len({round(r["pi"], 12) for r in ok}) == 1
    # The fallback P(yes) is the question's model share, so u = mean over questions of share(1 - share).
    answers = pq.read_table(labels).to_pylist()
    shares = [np.mean([r[q] == "yes" for r in answers if r["status"] == "ok"]) for q in IDS]
    assert ok[0]["uncertainty"] == pytest.approx(np.mean([s * (1 - s) for s in shares]))
    assert failed[0]["uncertainty"] == pytest.approx(sampling.MAX_UNCERTAINTY)


def test_a_question_without_probabilities_takes_the_model_share(tmp_path):
    labels, manifest, truth = _results(tmp_path, n_ok=40, n_error=0, n_excluded=0)
    table = pq.read_table(labels).to_pylist()
    probs = json.loads(table[0]["answer_probs"])
    del probs["sales_interaction"]  # left out by vidlabel.serve.confidence
    table[0]["answer_probs"] = json.dumps(probs)
    pq.write_table(pa.Table.from_pylist(table, schema=pq.read_schema(labels)), labels)
    outputs = _outputs(tmp_path)
    run(_config(tmp_path, budget=10), labels, manifest, None, outputs)
    share = np.mean([r["sales_interaction"] == "yes" for r in table])
    p0 = truth["p0000"][0]
    first = pq.read_table(outputs["design"]).to_pylist()[0]
    assert first["uncertainty"] == pytest.approx((p0 * (1 - p0) + share * (1 - share)) / 2)


def test_unreadable_answer_probs_stop_the_draw(tmp_path):
    labels, manifest, _ = _results(tmp_path, n_ok=30, n_error=0, n_excluded=0)
    table = pq.read_table(labels).to_pylist()
    table[4]["answer_probs"] = "{'promotes_product': {'yes': 0.5}}"  # a Python repr, not JSON
    pq.write_table(pa.Table.from_pylist(table, schema=pq.read_schema(labels)), labels)
    with pytest.raises(SampleError, match=r"answer_probs of 1 post\(s\) is not a JSON object.*p0004"):
        run(_config(tmp_path, budget=5), labels, manifest, None, _outputs(tmp_path))


def _burn_in_file(path, coded, extra=()):
    """A uniform burn-in in human-label format: every post of ``coded`` labelled on both questions by
    one coder, then ``extra`` rows (second coders, adjudications, ...). Returns the path."""
    rng = np.random.default_rng(11)
    rows = [{"post_id": post_id, "question": qid, "label": ["yes", "no", "1", "0"][rng.integers(4)],
             "adjudication": ""} for post_id in coded for qid in IDS]
    rows += [{"adjudication": "", **r} for r in extra]
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=["post_id", "question", "label", "adjudication"])
        writer.writeheader()
        writer.writerows(rows)
    return path


def _resolved(path, post_ids):
    """Resolved labels of a human-label file by the rule aggregate states (docs/statistics.md),
    computed here from the rows: adjudication if any, else the majority, 0.5 for a tie."""
    votes = {}
    for r in _read_csv(path):
        if r["post_id"] in post_ids:
            votes.setdefault((r["post_id"], r["question"]), []).append(r)
    out = {}
    for key, rows in votes.items():
        adjudicated = [r["adjudication"] in ("yes", "1") for r in rows if r["adjudication"]]
        vote = np.mean(adjudicated) if adjudicated else np.mean([r["label"] in ("yes", "1") for r in rows])
        out[key] = 1.0 if vote > 0.5 else 0.0 if vote < 0.5 else 0.5
    return out


def _model_p_yes(truth, post_ids):
    return np.array([truth[p] if truth[p] is not None else [np.nan] * len(IDS) for p in post_ids])


def test_second_draw_after_a_burn_in_follows_the_two_phase_design_on_resolved_labels(tmp_path):
    labels, manifest, truth = _results(tmp_path)
    coded = [f"p{i:04d}" for i in range(0, 312, 8)] + ["p0301"]  # 40 posts, one failed post among them
    tie, adjudicated = coded[1], coded[2]
    first = {(r["post_id"], r["question"]): r["label"] for r in _read_csv(_burn_in_file(tmp_path / "b.csv", coded))}
    flip = {"yes": "no", "1": "no", "no": "yes", "0": "yes"}
    burn_in = _burn_in_file(tmp_path / "uniform.csv", coded, extra=[
        # a second coder who disagrees: a tie, 0.5
        {"post_id": tie, "question": "promotes_product", "label": flip[first[(tie, "promotes_product")]]},
        # two coders disagree, the adjudication decides
        {"post_id": adjudicated, "question": "sales_interaction",
         "label": flip[first[(adjudicated, "sales_interaction")]]},
        {"post_id": adjudicated, "question": "sales_interaction", "label": "",
         "adjudication": flip[first[(adjudicated, "sales_interaction")]]},
        {"post_id": "nobody", "question": "promotes_product", "label": "yes"}])  # unknown post: not used
    outputs = _outputs(tmp_path)
    config = _config(tmp_path, budget=85, seed=4, burn_in=str(burn_in))
    assert config["label_sample"]["floor_share"] is None and config["label_sample"]["design"] == "two_phase"
    run(config, labels, manifest, burn_in, outputs)

    design = pq.read_table(outputs["design"]).to_pylist()
    post_ids = [r["post_id"] for r in design]
    mask = np.array([p in coded for p in post_ids])
    resolved = _resolved(burn_in, set(post_ids))
    assert resolved[(tie, "promotes_product")] == 0.5
    assert resolved[(adjudicated, "sales_interaction")] == (1.0 if flip[first[(adjudicated, "sales_interaction")]]
                                                             == "yes" else 0.0)
    y = np.array([[resolved[(p, q)] for q in IDS] for p in post_ids if p in coded])
    expected = sampling.two_phase_design(_model_p_yes(truth, post_ids), mask, y, 85, FLOOR_SHARE_SECOND_PHASE,
                                         sampling.fold_of(post_ids))
    pi = np.array([r["pi"] for r in design])
    np.testing.assert_allclose(pi, np.where(mask, len(coded) / len(post_ids), expected.pi))
    assert expected.pi[~mask].sum() == pytest.approx(85 - len(coded)) and np.all(expected.pi[mask] == 0)
    # The tie enters the calibration as 0.5: leaving it out gives another design.
    y_without_tie = y.copy()
    y_without_tie[list(np.flatnonzero(mask)).index(post_ids.index(tie)), 0] = np.nan
    other = sampling.two_phase_design(_model_p_yes(truth, post_ids), mask, y_without_tie, 85, FLOOR_SHARE_SECOND_PHASE)
    assert other.combination != expected.combination or not np.allclose(other.pi, expected.pi)
    drawn = np.array([r["drawn"] for r in design])
    np.testing.assert_array_equal(drawn, mask | sampling.draw(expected.pi, 4))
    assert [r["design"] for r in design] == ["burn_in" if m else "second_phase" for m in mask]
    assert [r["phase"] for r in design] == [1 if m else 2 for m in mask]
    _, metadata = sample_design.read_design(outputs["design"])
    assert metadata["phase"] == 2 and metadata["burn_in_posts"] == len(coded) and metadata["burn_in_path"] == str(burn_in)
    assert metadata["combination"] == pytest.approx(dict(zip(IDS, expected.combination)))
    # the weights chosen without each fold's labels (the burn-in cut by a hash of the post id)
    for qid, weights in zip(IDS, expected.fold_combination):
        assert metadata["fold_combination"][qid] == pytest.approx(list(weights))
    assert all(len(w) == sampling.FOLDS and all(0 < a < 1 for a in w) for w in metadata["fold_combination"].values())
    assert metadata["pi_burn_in"] == pytest.approx(len(coded) / len(post_ids))
    assert metadata["mixture"] == expected.mixture

    sample = _read_csv(outputs["sample"])
    assert sorted(r["post_id"] for r in sample) == sorted(p for p, d, m in zip(post_ids, drawn, mask) if d and not m)
    by_post = {r["post_id"]: r for r in design}
    assert all(float(r["pi"]) == pytest.approx(by_post[r["post_id"]]["pi"]) and r["design"] == "second_phase"
               for r in sample)

    # Every usable burn-in row, coder by coder, with the burn-in's probability n0/N and phase 1; aggregate
    # resolves them again.
    burn_rows = _read_csv(outputs["burn_in"])
    source = [r for r in _read_csv(burn_in) if r["post_id"] != "nobody"]
    assert [(r["post_id"], r["question"], r["adjudication"]) for r in burn_rows] == [
        (r["post_id"], r["question"], r["adjudication"]) for r in source]
    assert [r["label"] for r in burn_rows] == [{"1": "yes", "0": "no"}.get(r["label"], r["label"]) for r in source]
    assert all(float(r["sampling_probability"]) == pytest.approx(len(coded) / len(post_ids)) and r["phase"] == "1"
               for r in burn_rows)
    assert _resolved(outputs["burn_in"], set(post_ids)) == resolved


def test_two_phase_design_draws_the_burn_in_first_then_the_rest(tmp_path):
    """The default design in two runs: a uniform burn-in, coded and collected; then, with its labels as
    label_sample.burn_in, the second draw; aggregate with the design file gives the two-phase estimate."""
    labels, manifest, truth = _results(tmp_path, n_ok=600, n_error=10, n_excluded=5, seed=3)
    outputs = _outputs(tmp_path)
    config = _config(tmp_path, budget=120, seed=5)
    run(config, labels, manifest, None, outputs)
    design = pq.read_table(outputs["design"]).to_pylist()
    _, metadata = sample_design.read_design(outputs["design"])
    n_burn = sampling.burn_in_size(_model_p_yes(truth, [r["post_id"] for r in design]), 120, 0.1)
    assert metadata["design"] == "two_phase" and metadata["phase"] == 1 and metadata["burn_in_posts"] == n_burn
    assert sum(r["drawn"] for r in design) == n_burn and {r["phase"] for r in design} == {1}
    assert all(r["pi"] == pytest.approx(n_burn / len(design)) for r in design)
    sample = _read_csv(outputs["sample"])
    assert len(sample) == n_burn and {r["design"] for r in sample} == {"burn_in"}

    def coded(rows, seed):
        rng = np.random.default_rng(seed)
        return {r["post_id"]: [_annotation(i, 1, {q: "yes" if rng.random() < 0.4 else "no" for q in IDS})]
                for i, r in enumerate(rows)}

    export = tmp_path / "burn_in_export.json"
    export.write_text(json.dumps(_export(outputs["ls_tasks"], coded(sample, 1))))
    burn_in = tmp_path / "burn_in_labels_collected.csv"
    rows = collect(outputs["design"].parent, export, burn_in)
    assert {r["phase"] for r in rows} == {1} and len(rows) == 2 * n_burn

    config = _config(tmp_path, budget=120, seed=5, burn_in=str(burn_in))
    run(config, labels, manifest, burn_in, outputs)
    _, metadata = sample_design.read_design(outputs["design"])
    assert metadata["phase"] == 2 and metadata["burn_in_posts"] == n_burn
    second = _read_csv(outputs["sample"])
    assert second and {r["design"] for r in second} == {"second_phase"}
    assert not {r["post_id"] for r in second} & {r["post_id"] for r in sample}
    export.write_text(json.dumps(_export(outputs["ls_tasks"], coded(second, 2))))
    human = tmp_path / "human_labels.csv"
    collected = collect(outputs["design"].parent, export, human)
    assert sorted({r["phase"] for r in collected}, key=str) == ["1", 2]  # burn-in rows read back from CSV

    with pytest.raises(HumanLabelError, match="set config key human_design"):
        aggregate.run(config, labels, human, tmp_path / "summary")
    aggregate.run(config, labels, human, tmp_path / "summary", outputs["design"])
    prevalence = {r["question"]: r for r in _read_csv(tmp_path / "summary" / "prevalence.csv")}
    agreement = {r["question"]: r for r in _read_csv(tmp_path / "summary" / "agreement.csv")}
    for qid in IDS:
        assert prevalence[qid]["design"] == "two_phase" and prevalence[qid]["corrected_method"].startswith("two-phase")
        assert int(prevalence[qid]["human_n"]) == n_burn + len(second)
        assert float(prevalence[qid]["corrected_lo"]) < float(prevalence[qid]["corrected"]) < float(
            prevalence[qid]["corrected_hi"])
        assert agreement[qid]["design"] == "two_phase" and agreement[qid]["f1"] != ""
        assert prevalence[qid]["outside_frame"] == "0"
    md = (tmp_path / "summary" / "summary.md").read_text()
    assert "two-phase design (a uniform burn-in of" in md and "Design: two phases" in md


def test_a_weighted_or_unlabelled_burn_in_is_refused(tmp_path):
    labels, manifest, _ = _results(tmp_path, n_ok=60, n_error=0, n_excluded=0)
    weighted = tmp_path / "weighted.csv"
    weighted.write_text("post_id,question,label,sampling_probability\n"
                        "p0001,promotes_product,yes,0.5\np0002,promotes_product,no,0.1\n")
    with pytest.raises(SampleError, match="label_sample.burn_in.*varying sampling_probability.*uniform sample"):
        run(_config(tmp_path, budget=10), labels, manifest, weighted, _outputs(tmp_path))
    other_question = tmp_path / "other.csv"
    other_question.write_text("post_id,question,label\np0001,sales_interaction,yes\n")
    with pytest.raises(SampleError, match=r"label_sample.burn_in.*question 0.*\['promotes_product'\]"):
        run(_config(tmp_path, budget=10, questions=["promotes_product"]), labels, manifest, other_question,
            _outputs(tmp_path))


def test_floor_share_null_takes_the_floor_of_the_design(tmp_path):
    labels, manifest, truth = _results(tmp_path)
    outputs = _outputs(tmp_path)
    run(_config(tmp_path, budget=50, design="active"), labels, manifest, None, outputs)
    design = pq.read_table(outputs["design"]).to_pylist()
    u = sampling.post_uncertainty(_model_p_yes(truth, [r["post_id"] for r in design]))
    np.testing.assert_allclose([r["pi"] for r in design], sampling.inclusion_probabilities(u, 50, FLOOR_SHARE_ACTIVE))
    assert FLOOR_SHARE_ACTIVE == 0.4 and FLOOR_SHARE_SECOND_PHASE == 0.2  # docs/human_labels.md's figures


def test_budget_larger_than_the_population_is_refused(tmp_path):
    labels, manifest, _ = _results(tmp_path, n_ok=20, n_error=0, n_excluded=3)
    with pytest.raises(SampleError, match="label_sample.budget.*20 posts"):
        run(_config(tmp_path, budget=21, design="active"), labels, manifest, None, _outputs(tmp_path))


def test_unknown_sample_question_is_named(tmp_path):
    labels, manifest, _ = _results(tmp_path, n_ok=20)
    with pytest.raises(SampleError, match="label_sample.questions.*'nope'"):
        run(_config(tmp_path, budget=5, questions=["nope"]), labels, manifest, None, _outputs(tmp_path))
    config = _config(tmp_path, budget=5)
    config["classify"]["questions"].append({"id": "pi", "text": "Is it about maths?", "type": "yes/no"})
    with pytest.raises(SampleError, match=r"\['pi'\] are names the Label Studio files use"):
        run(config, labels, manifest, None, _outputs(tmp_path))


# --------------------------------------------------------------------------------------------
# Reading the export back

def _annotation(annotation_id, completed_by, labels, cancelled=False, extra=()):
    result = [{"value": {"choices": [label]}, "id": f"r{annotation_id}{qid}", "from_name": qid, "to_name": "video",
               "type": "choices", "origin": "manual"} for qid, label in labels.items()]
    result += list(extra)
    return {"id": annotation_id, "completed_by": completed_by, "result": result, "was_cancelled": cancelled,
            "ground_truth": False, "created_at": "2026-11-30T10:00:00.000000Z",
            "updated_at": "2026-11-30T10:01:00.000000Z", "draft_created_at": None, "lead_time": 61.2,
            "prediction": {}, "result_count": 0, "unique_id": f"u{annotation_id}", "import_id": None,
            "last_action": None, "task": 0, "project": 3, "updated_by": 1, "parent_prediction": None,
            "parent_annotation": None, "last_created_by": None}


def _export(tasks_file, annotations_by_post):
    """A Label Studio JSON export of the imported tasks, as Label Studio writes it."""
    export = []
    for inner_id, task in enumerate(json.loads(tasks_file.read_text()), start=1):
        annotations = annotations_by_post.get(task["data"]["post_id"], [])
        export.append({"id": 100 + inner_id, "annotations": annotations, "file_upload": "labelstudio_tasks.json",
                       "drafts": [], "predictions": [], "data": task["data"], "meta": {},
                       "created_at": "2026-11-30T09:00:00.000000Z", "updated_at": "2026-11-30T10:01:00.000000Z",
                       "inner_id": inner_id, "total_annotations": len(annotations), "cancelled_annotations": 0,
                       "total_predictions": 0, "comment_count": 0, "unresolved_comment_count": 0,
                       "last_comment_updated_at": None, "project": 3, "updated_by": 1, "comment_authors": []})
    return export


@pytest.fixture
def drawn_sample(tmp_path):
    labels, manifest, _ = _results(tmp_path)
    outputs = _outputs(tmp_path)
    run(_config(tmp_path, budget=30, seed=2, design="active"), labels, manifest, None, outputs)
    return labels, outputs, _read_csv(outputs["sample"])


def test_json_export_gives_one_row_per_annotation_and_question(tmp_path, drawn_sample):
    _, outputs, sample = drawn_sample
    first, second, third = (r["post_id"] for r in sample[:3])
    comment = {"value": {"text": ["blurry"]}, "from_name": "note", "to_name": "video", "type": "textarea"}
    annotations = {
        first: [_annotation(1, 1, {"promotes_product": "yes", "sales_interaction": "no"}, extra=[comment]),
                _annotation(2, {"id": 2, "email": "coder2@example.org"},
                            {"promotes_product": "no", "sales_interaction": "no"})],
        second: [_annotation(3, 1, {}, cancelled=True)],
        third: [_annotation(4, 2, {"promotes_product": "yes"})],
    }
    path = tmp_path / "project-3-at-2026-11-30.json"
    path.write_text(json.dumps(_export(outputs["ls_tasks"], annotations)))
    table = read_export(path)
    assert table.column_names == list(labelstudio.EXPORT_COLUMNS)
    rows = sorted(tuple(r.values()) for r in table.to_pylist())
    pi = {r["post_id"]: float(r["pi"]) for r in sample}
    assert rows == sorted([  # no annotation is set as ground truth: no adjudication
        (first, "promotes_product", "yes", pi[first], "1", None),
        (first, "sales_interaction", "no", pi[first], "1", None),
        (first, "promotes_product", "no", pi[first], "coder2@example.org", None),
        (first, "sales_interaction", "no", pi[first], "coder2@example.org", None),
        (third, "promotes_product", "yes", pi[third], "2", None)])


def test_flat_exports_csv_and_json_min_read_the_same(tmp_path, drawn_sample):
    _, _, sample = drawn_sample
    a, b = sample[0], sample[1]
    flat = [{"id": 7, "post_id": a["post_id"], "pi": a["pi"], "questions": a["questions"], "video": "x",
             "promotes_product": "yes", "sales_interaction": "no", "annotator": "c1@example.org",
             "annotation_id": 1, "lead_time": 3.2},
            {"id": 8, "post_id": b["post_id"], "pi": b["pi"], "questions": b["questions"], "video": "x",
             "promotes_product": "no", "sales_interaction": "", "annotator": "c2@example.org",
             "annotation_id": 2, "lead_time": 4.0}]
    json_min = tmp_path / "export-min.json"
    json_min.write_text(json.dumps(flat))
    csv_path = tmp_path / "export.csv"
    with open(csv_path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(flat[0]))
        writer.writeheader()
        writer.writerows(flat)
    expected = sorted([(a["post_id"], "promotes_product", "yes", float(a["pi"]), "c1@example.org", None),
                       (a["post_id"], "sales_interaction", "no", float(a["pi"]), "c1@example.org", None),
                       (b["post_id"], "promotes_product", "no", float(b["pi"]), "c2@example.org", None)])
    for path in (json_min, csv_path):
        assert sorted(tuple(r.values()) for r in read_export(path).to_pylist()) == expected


def test_bad_exports_are_named(tmp_path, drawn_sample):
    _, outputs, sample = drawn_sample
    export = _export(outputs["ls_tasks"], {sample[0]["post_id"]: [_annotation(1, 1, {"promotes_product": "yes"})]})
    broken = json.loads(json.dumps(export))
    del broken[1]["data"]["post_id"]
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(broken))
    with pytest.raises(ExportError, match=r"task 102 \(item 1\) has no post_id"):
        read_export(path)
    two = json.loads(json.dumps(export))
    two[0]["annotations"][0]["result"][0]["value"]["choices"] = ["yes", "no"]
    path.write_text(json.dumps(two))
    with pytest.raises(ExportError, match="promotes_product.*expected one choice"):
        read_export(path)
    path.write_text("{not json")
    with pytest.raises(ExportError, match="not JSON"):
        read_export(path)


def test_collected_labels_carry_pi_and_read_as_weighted_human_labels(tmp_path, drawn_sample):
    labels, outputs, sample = drawn_sample
    annotations = {r["post_id"]: [_annotation(i, 1, {"promotes_product": "yes", "sales_interaction": "no"})]
                   for i, r in enumerate(sample)}
    export = tmp_path / "export.json"
    export.write_text(json.dumps(_export(outputs["ls_tasks"], annotations)))
    human = tmp_path / "human_labels.csv"
    collect(outputs["design"].parent, export, human)
    rows = _read_csv(human)
    assert len(rows) == 2 * len(sample)
    design = {r["post_id"]: r["pi"] for r in pq.read_table(outputs["design"]).to_pylist()}
    assert all(float(r["sampling_probability"]) == pytest.approx(design[r["post_id"]]) for r in rows)

    con = duckdb.connect()
    con.read_parquet(str(labels)).create_view("labels")
    con.register("q", pa.table({"question": IDS, "position": [0, 1]}))
    con.execute("CREATE TABLE questions AS SELECT * FROM q")
    described = load_human_labels(con, human)
    assert described["weighted"] and described["usable"] == len(rows)

    # A label on a post that was not drawn is outside the design.
    not_drawn = next(r["post_id"] for r in pq.read_table(outputs["design"]).to_pylist() if not r["drawn"])
    tampered = json.loads(export.read_text())
    tampered[0]["data"]["post_id"] = not_drawn
    export.write_text(json.dumps(tampered))
    with pytest.raises(SampleError, match=f"not drawn.*{not_drawn}"):
        collect(outputs["design"].parent, export, tmp_path / "again.csv")
    # Tasks from an earlier draw of the same posts.
    tampered = json.loads(json.dumps(_export(outputs["ls_tasks"], annotations)))
    tampered[1]["data"]["pi"] = tampered[1]["data"]["pi"] / 2
    export.write_text(json.dumps(tampered))
    with pytest.raises(SampleError, match=f"pi of 1 task.*{tampered[1]['data']['post_id']}"):
        collect(outputs["design"].parent, export, tmp_path / "again.csv")
    assert not (tmp_path / "again.csv").exists()


@pytest.mark.parametrize("kind, burn_in, design, method", [
    ("active", False, "weighted", "active estimator"),   # one active draw, floor 0.4
    ("uniform", False, "uniform", "PPI++"),              # a uniform sample
    ("two_phase", False, "uniform", "PPI++"),            # the burn-in of a two-phase design, alone
    ("two_phase", True, "two_phase", "two-phase"),       # a burn-in, then the second draw
])
def test_collected_labels_are_read_by_aggregate_as_the_drawn_design(tmp_path, kind, burn_in, design, method):
    labels, manifest, _ = _results(tmp_path)
    coded = [f"p{i:04d}" for i in range(3, 300, 12)]
    burn_in_path = _burn_in_file(tmp_path / "uniform.csv", coded) if burn_in else None
    outputs = _outputs(tmp_path)
    config = _config(tmp_path, budget=40 + (len(coded) if burn_in else 0), seed=9, design=kind,
                     burn_in=str(burn_in_path) if burn_in else None)
    run(config, labels, manifest, burn_in_path, outputs)
    sample = _read_csv(outputs["sample"])
    rng = np.random.default_rng(3)
    annotations = {r["post_id"]: [_annotation(i, 1, {q: ["yes", "no"][rng.integers(2)] for q in IDS})]
                   for i, r in enumerate(sample)}
    export = tmp_path / "export.json"
    export.write_text(json.dumps(_export(outputs["ls_tasks"], annotations)))
    human = tmp_path / "human_labels.csv"
    collected = collect(outputs["design"].parent, export, human)
    assert len(collected) == 2 * (len(sample) + (len(coded) if burn_in else 0))

    aggregate.run(config, labels, human, tmp_path / "summary", outputs["design"])
    prevalence = {r["question"]: r for r in _read_csv(tmp_path / "summary" / "prevalence.csv")}
    pi = {r["post_id"]: r["pi"] for r in pq.read_table(outputs["design"]).to_pylist()}
    for qid in IDS:
        row = prevalence[qid]
        assert row["design"] == design and row["corrected_method"].startswith(method)
        labelled = [(float(r["label"] == "yes"), pi[r["post_id"]]) for r in _read_csv(human) if r["question"] == qid]
        assert int(row["human_n"]) == len(labelled)
        if design != "two_phase":
            y, p = np.array(labelled).T
            # Hajek with the design's pi (the plain mean when pi is constant): the estimator saw these probabilities
            assert float(row["human_share"]) == pytest.approx((y / p).sum() / (1 / p).sum())


def test_collect_refuses_burn_in_labels_of_another_draw(tmp_path):
    labels, manifest, _ = _results(tmp_path)
    burn_in = _burn_in_file(tmp_path / "uniform.csv", [f"p{i:04d}" for i in range(0, 300, 10)])
    outputs = _outputs(tmp_path)
    run(_config(tmp_path, budget=60, burn_in=str(burn_in)), labels, manifest, burn_in, outputs)
    export = tmp_path / "export.json"
    export.write_text(json.dumps(_export(outputs["ls_tasks"], {})))
    rows = _read_csv(outputs["burn_in"])
    rows[0]["post_id"] = "p0001"  # not a burn-in post of design.parquet
    with open(outputs["burn_in"], "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    with pytest.raises(SampleError, match=r"burn_in_labels.csv: 1 post\(s\) are not burn-in posts.*p0001"):
        collect(outputs["design"].parent, export, tmp_path / "human.csv")
    assert not (tmp_path / "human.csv").exists()


# --------------------------------------------------------------------------------------------
# The rule

def test_snakemake_label_sample_writes_the_sample(tmp_path):
    """`snakemake label_sample` on a results folder whose labels.parquet and manifest already exist."""
    media = tmp_path / "media"
    media.mkdir()
    (media / "a.mp4").write_bytes(b"x")
    (tmp_path / "posts.csv").write_text(f"post_id,video_path,caption\na,{media / 'a.mp4'},\n")
    _, _, truth = _results(tmp_path, n_ok=80, n_error=4, n_excluded=2)
    pq.write_table(pa.table({"post_id": list(truth), "fps": [30.0] * len(truth)}),  # frame rates for the tasks
                   tmp_path / "results" / "inventory.parquet")
    write_overlay(tmp_path, tmp_path, {"classify": {"questions": QUESTIONS},
                                       "label_sample": {"budget": 20, "seed": 5, "design": "active"}})
    proc = run_snakemake(tmp_path, "label_sample", "--allowed-rules", "label_sample", "--cores", "1", timeout=300)
    out = tmp_path / "results" / "label_sample"
    for name in OUTPUTS:
        assert (out / name).is_file(), proc.stdout + proc.stderr
    sample = _read_csv(out / "sample.csv")
    design = pq.read_table(out / "design.parquet").to_pylist()
    assert sum(r["pi"] for r in design) == pytest.approx(20)
    assert sorted(r["post_id"] for r in sample) == sorted(r["post_id"] for r in design if r["drawn"])
    assert {r["seed"] for r in sample} == {"5"}
    assert "drawn for coding" in (tmp_path / "logs" / "label_sample.log").read_text()
    assert {v["fps"] for t in json.loads((out / "labelstudio_tasks.json").read_text()) for v in t["data"]["videos"]} == {
        30.0}


def test_posts_classified_after_the_draw_are_estimated_apart(tmp_path):
    """The design records its frame; aggregate estimates over the frame's posts, reports the posts
    added since from the model alone, and refuses labels from outside the frame."""
    labels, manifest, _ = _results(tmp_path, n_ok=300, n_error=12, n_excluded=5)
    outputs = _outputs(tmp_path)
    config = _config(tmp_path, budget=60, seed=3, design="active")
    run(config, labels, manifest, None, outputs)
    sample = _read_csv(outputs["sample"])
    rng = np.random.default_rng(8)
    annotations = {r["post_id"]: [_annotation(i, 1, {q: ["yes", "no"][rng.integers(2)] for q in IDS})]
                   for i, r in enumerate(sample)}
    export = tmp_path / "export.json"
    export.write_text(json.dumps(_export(outputs["ls_tasks"], annotations)))
    human = tmp_path / "human_labels.csv"
    collect(outputs["design"].parent, export, human)

    # After the draw: 40 new posts are classified (all answered "yes"), one framed post is now excluded.
    table = pq.read_table(labels).to_pylist()
    added = [dict(table[0], post_id=f"new{i:03d}", promotes_product="yes", sales_interaction="yes",
                  answer_probs=json.dumps({q: {"yes": 0.9, "no": 0.1} for q in IDS})) for i in range(40)]
    gone = next(r for r in table if r["status"] == "ok" and r["post_id"] not in annotations)
    gone.update(status="excluded", promotes_product=None, sales_interaction=None, answer_probs=None)
    pq.write_table(pa.Table.from_pylist(table + added, schema=pq.read_schema(labels)), labels)
    first = _read_csv(human)[0]
    with open(human, "a", newline="") as fh:
        fh.write("new000,promotes_product,yes,0.5,,,\n")  # a label on a post outside the frame
        fh.write(f"{first['post_id']},sales_interaction,no,0.999,,,\n")  # another draw's probability

    aggregate.run(config, labels, human, tmp_path / "summary", outputs["design"])
    prevalence = {r["question"]: r for r in _read_csv(tmp_path / "summary" / "prevalence.csv")}
    row = prevalence["promotes_product"]
    assert int(row["posts"]) == 312 - 1 + 40  # every classified post today
    assert int(row["ppi_population"]) == 312 - 1  # the frame's posts that are still classified
    assert int(row["outside_frame"]) == 40 and int(row["outside_answered"]) == 40
    assert float(row["outside_model_share"]) == 1.0 and float(row["outside_model_lo"]) < 1.0
    assert "40 classified post(s) are outside the frame" in row["note"]
    assert int(row["human_n"]) == len(sample)  # the outside label is not used
    errors = {(r["stage"], r["reason"]): int(r["count"]) for r in _read_csv(tmp_path / "summary" / "errors.csv")}
    assert errors[("human_labels", "post outside the sampling frame (human_design)")] == 1
    assert errors[("human_labels", "sampling_probability differs from human_design (another draw?)")] == 1
    md = (tmp_path / "summary" / "summary.md").read_text()
    assert "40 classified post(s) are not in its frame" in md and "1 post(s) of its frame are no longer" in md
    assert "labels.parquet is not the file the sample was drawn from" in md
    assert "classified posts of the sample's frame" in md

    # A file that is not label_sample's design is refused with a message naming it.
    with pytest.raises(HumanLabelError, match="is not a design file written by label_sample"):
        aggregate.run(config, labels, human, tmp_path / "summary", labels)
    # Without the design file the same labels claim every classified post: the shares cover all 351.
    aggregate.run(config, labels, human, tmp_path / "plain")
    plain = {r["question"]: r for r in _read_csv(tmp_path / "plain" / "prevalence.csv")}["promotes_product"]
    assert int(plain["ppi_population"]) == 351 and plain["outside_frame"] == ""


def test_active_design_is_switched_to_uniform_where_its_coverage_cannot_be_promised(tmp_path, caplog):
    """A rare question (the model's mean P(yes) about 0.03): a uniform sample of 60 labels expects about 2
    positives, where an active draw on unchecked probabilities covered as little as 0.75. label_sample draws a
    uniform sample instead and says why, in the log and in design.parquet's description."""
    labels, manifest, truth = _results(tmp_path, beta=(0.05, 1.5))
    outputs = _outputs(tmp_path)
    with caplog.at_level("WARNING"):
        run(_config(tmp_path, budget=60, design="active"), labels, manifest, None, outputs)
    _, metadata = sample_design.read_design(outputs["design"])
    assert metadata["design"] == "uniform" and metadata["requested_design"] == "active"
    assert "promotes_product" in metadata["switched_because"] and "fewer than 10 positives" in metadata["switched_because"]
    assert "label_sample.design active switched to a uniform draw" in caplog.text
    # summary.md's description of the design says so
    assert "label_sample.design active was asked for and switched to this draw" in sample_design.describe(metadata)
    pi = [r["pi"] for r in pq.read_table(outputs["design"]).to_pylist()]
    assert np.ptp(pi) < 1e-12 and pi[0] == pytest.approx(60 / len(pi))
    # where the budget expects enough positives the active design is drawn as asked
    assert sampling.active_design_refusal(np.full((1000, 1), 0.03), 400) is None
    assert sampling.active_design_refusal(np.full((1000, 1), 0.97), 300) is not None  # rare "no" counts too


def test_floor_share_zero_is_refused_and_a_low_one_warned_about(tmp_path, caplog):
    from vidlabel.core.config import ConfigError

    with pytest.raises(ConfigError, match="label_sample.floor_share"):
        _config(tmp_path, floor_share=0)
    labels, manifest, _ = _results(tmp_path)
    outputs = _outputs(tmp_path)
    with caplog.at_level("WARNING"):
        run(_config(tmp_path, budget=50, design="active", floor_share=0.1), labels, manifest, None, outputs)
    assert "label_sample.floor_share' 0.1 is below the 0.4" in caplog.text
    _, metadata = sample_design.read_design(outputs["design"])
    warning = sample_design.floor_warning(metadata)
    assert warning.startswith("WARNING: the human sample was drawn with label_sample.floor_share 0.1, below the 0.4")
    assert sample_design.floor_warning({**metadata, "floor_share": 0.4}) is None
    assert sample_design.floor_warning({"design": "two_phase", "floor_share": 0.1}) is not None
