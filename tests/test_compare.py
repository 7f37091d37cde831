"""The model comparison stage on fabricated shard files: two (or three) models label the same posts,
each is merged and aggregated, then compared; every number is recomputed here with numpy."""

from __future__ import annotations

import csv
import json
import math
import zlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from vidlabel.analyze import aggregate, compare, merge
from vidlabel.core import config as vconfig
from vidlabel.serve.record import LABEL_SCHEMA

QUESTIONS = [{"id": "promotes_product", "text": "Product?"}, {"id": "shows_face", "text": "Face?"}]
QIDS = [q["id"] for q in QUESTIONS]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
N_POSTS = 320
N_EXCLUDED = 8
LAX, STRICT = "lax-7B", "Strict_72B.fp8"  # names with the characters a model name may hold


def _config(questions=QUESTIONS):
    return vconfig.validate({
        "posts": "posts.csv", "media_root": "/data", "classify": {"shards": 2, "questions": questions},
        "stats": {"confidence": 0.95, "bootstrap_samples": 400},
        "cost": {"gpu_hour_usd": 3.0, "gpus_per_job": 1}})


def _read_csv(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def _f(x):
    return float(x) if x not in ("", None) else math.nan


@pytest.fixture
def world(tmp_path):
    """Posts with a synthetic truth, an inventory (some posts excluded) and a human sample."""
    rng = np.random.default_rng(20)
    ids = [f"post{i:04d}" for i in range(N_POSTS)]
    order = rng.permutation(N_POSTS)
    pq.write_table(pa.table({"post_id": [ids[i] for i in order],
                             "video_path": [f"/data/{ids[i]}.mp4" for i in order]}), tmp_path / "inventory.parquet")
    excluded = ids[:N_EXCLUDED]
    pq.write_table(pa.table({"post_id": excluded, "video_path": [f"/data/{p}.mp4" for p in excluded],
                             "reason": ["probe_error"] * N_EXCLUDED, "detail": ["moov atom not found"] * N_EXCLUDED}),
                   tmp_path / "excluded.parquet")
    truth = rng.random(N_POSTS) < 0.45
    face = rng.random(N_POSTS) < 0.3
    return {"dir": tmp_path, "ids": ids, "truth": truth, "face": face, "rng": rng,
            "classified": list(range(N_EXCLUDED, N_POSTS))}


def _model(world, name, *, yes_if_true, yes_if_false, failed=(), probs=False, seconds=2.0, servers=("vLLM 0.26",),
           answer_all=None, config=None, drop_post=None):
    """Label shards for one model, merged and aggregated into world['dir']/name; returns the paths
    and the answers given (post index -> {question: answer} or None for a failed request)."""
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    d = world["dir"] / name
    d.mkdir()
    answers, p_yes_given, shards = {}, {}, {0: [], 1: []}
    for i in world["classified"]:
        if answer_all is not None:
            given = answer_all(i)
        elif i in failed:
            given = None
        else:
            p = yes_if_true if world["truth"][i] else yes_if_false
            face = world["face"][i] if rng.random() < 0.95 else not world["face"][i]
            given = {"promotes_product": "yes" if rng.random() < p else "no", "shows_face": "yes" if face else "no"}
        answers[i] = given
        shard = i % 2
        start = 1_000.0 + (i // 2) * seconds
        row = {"request_id": f"{name}-r{i}", "post_id": world["ids"][i], "shard": shard,
               "status": "ok" if given else "error", "error_kind": None if given else "timeout",
               "error": None if given else "no answer in time", "attempts": 1, "latency_s": seconds,
               "started_at": start, "finished_at": start + seconds,
               "prompt_tokens": int(rng.integers(2_000, 9_000)) if given else None,
               "completion_tokens": int(rng.integers(20, 60)) if given else None,
               "answers": json.dumps(given) if given else None,
               "model": f"Qwen/{name}", "server": servers[shard % len(servers)],
               "settings_fingerprint": f"settings-{servers[shard % len(servers)]}", "prompt_hash": "prompt-1"}
        if probs and given:
            p_yes = float(rng.uniform(0.5, 1.0) if given["promotes_product"] == "yes" else rng.uniform(0, 0.5))
            row["answer_probs"] = json.dumps({"promotes_product": {"yes": p_yes, "no": 1 - p_yes}})
            p_yes_given[i] = p_yes
        shards[shard].append(row)
    paths = []
    for shard, rows in shards.items():
        if drop_post is not None:
            rows = [r for r in rows if r["post_id"] != drop_post]
        paths.append(d / f"shard-{shard}.parquet")
        pq.write_table(pa.table({c: [r.get(c) for r in rows] for c in LABEL_SCHEMA.names}, schema=LABEL_SCHEMA),
                       paths[-1])
    labels = d / "labels.parquet"
    cfg = config or _config()
    excluded = world["dir"] / "excluded.parquet"
    inventory = world["dir"] / "inventory.parquet"
    if drop_post is not None:  # this model was merged from an inventory without the post
        inv = pq.read_table(inventory).to_pylist()
        inventory = d / "inventory.parquet"
        pq.write_table(pa.Table.from_pylist([r for r in inv if r["post_id"] != drop_post]), inventory)
    merge.merge(cfg, inventory, excluded, paths, labels)
    return {"name": name, "labels": labels, "summary": d / "summary", "answers": answers, "p_yes": p_yes_given,
            "config": cfg}


def _aggregate(model, human):
    aggregate.run(model["config"], model["labels"], human, model["summary"])
    return model


def _human(world, extra_posts=()):
    """150 uniformly drawn classified posts labelled with the truth, plus ``extra_posts``."""
    chosen = list(world["rng"].choice(world["classified"], 150, replace=False))
    chosen += [i for i in extra_posts if i not in chosen]
    path = world["dir"] / "human.csv"
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["post_id", "question", "label"])
        for i in chosen:
            w.writerow([world["ids"][i], "promotes_product", "yes" if world["truth"][i] else "no"])
    return path, {int(i): float(world["truth"][i]) for i in chosen}


def _compare(world, models, human, cfg=None):
    out = world["dir"] / "compare"
    compare.run(cfg or _config(), [(m["name"], str(m["labels"]), str(m["summary"])) for m in models],
                str(world["dir"] / "inventory.parquet"), str(human) if human else None, str(out))
    return out


def _confusion(model, human, question="promotes_product"):
    """tp, fp, fn, tn of a model's answers against the human labels, on every labelled post: a post the
    model gave no answer for is its wrong answer."""
    pairs = np.array([(y, model["answers"][i][question] == "yes" if model["answers"].get(i) else 1 - y)
                      for i, y in human.items()], dtype=float)
    y, m = pairs[:, 0], pairs[:, 1]
    return [int(np.sum(a * b)) for a, b in ((y, m), (1 - y, m), (y, 1 - m), (1 - y, 1 - m))]


def _kappa(tp, fp, fn, tn):
    n = tp + fp + fn + tn
    po = (tp + tn) / n
    pe = ((tp + fp) * (tp + fn) + (fn + tn) * (fp + tn)) / n**2
    return (po - pe) / (1 - pe)


def test_compare_two_models_every_file_checked(world):
    failed_lax = {i for i in world["classified"] if i % 37 == 0}
    failed_strict = {i for i in world["classified"] if i % 41 == 0}
    human, labels = _human(world, extra_posts=sorted(failed_lax)[:3] + sorted(failed_strict)[:3])
    lax = _aggregate(_model(world, LAX, yes_if_true=0.95, yes_if_false=0.35, failed=failed_lax, probs=True), human)
    strict = _aggregate(_model(world, STRICT, yes_if_true=0.6, yes_if_false=0.08, failed=failed_strict, seconds=9.0,
                               servers=("vLLM 0.26 on node a", "vLLM 0.26 on node b")), human)
    out = _compare(world, [lax, strict], human)

    # models.csv: metrics against the humans recomputed from the answers and the human labels
    rows = {(r["model"], r["question"]): r for r in _read_csv(out / "models.csv")}
    assert list(rows) == [(m, q) for m in (LAX, STRICT) for q in QIDS]
    metrics = {}
    for model in (lax, strict):
        tp, fp, fn, tn = _confusion(model, labels)
        r = rows[(model["name"], "promotes_product")]
        assert [int(r["agreement_n"])] == [tp + fp + fn + tn] == [len(labels)]  # the same posts for every model
        failed = sum(1 for i in labels if not model["answers"][i])
        assert failed > 0 and int(r["agreement_no_answer"]) == failed and r["agreement_design"] == "uniform"
        expected = {"precision": tp / (tp + fp), "recall": tp / (tp + fn), "f1": 2 * tp / (2 * tp + fp + fn),
                    "kappa": _kappa(tp, fp, fn, tn)}
        for key, value in expected.items():
            assert _f(r[key]) == pytest.approx(value, abs=1e-12), (model["name"], key)
            assert _f(r[key + "_lo"]) <= _f(r[key]) <= _f(r[key + "_hi"]) and _f(r[key + "_lo"]) < _f(r[key + "_hi"])
        metrics[model["name"]] = expected
        answered = [a["promotes_product"] for a in model["answers"].values() if a]
        assert int(r["answered"]) == len(answered) and _f(r["model_share"]) == pytest.approx(
            answered.count("yes") / len(answered))
        assert r["model_id"] == f"Qwen/{model['name']}"
        # the per-model numbers are the aggregate's, character for character
        prevalence = {p["question"]: p for p in _read_csv(model["summary"] / "prevalence.csv")}["promotes_product"]
        for key in ("model_share", "human_share", "human_lo", "corrected", "corrected_lo", "corrected_hi",
                    "corrected_method"):
            assert r[key] == prevalence[key] != ""
        overall = next(t for t in _read_csv(model["summary"] / "throughput.csv") if t["shard"] == "all")
        for key in ("gpu_hours", "cost_usd", "busy_s", "input_tokens", "output_tokens"):
            assert r[key] == overall[key] != ""
        assert rows[(model["name"], "shows_face")]["gpu_hours"] == overall["gpu_hours"]
    assert metrics[LAX]["recall"] > metrics[STRICT]["recall"]
    assert metrics[LAX]["precision"] < metrics[STRICT]["precision"]
    assert _f(rows[(STRICT, "promotes_product")]["gpu_hours"]) > 3 * _f(rows[(LAX, "promotes_product")]["gpu_hours"])
    assert rows[(STRICT, "shows_face")]["human_n"] == "0" and rows[(STRICT, "shows_face")]["f1"] == ""
    assert "mixed provenance" in rows[(STRICT, "promotes_product")]["note"]
    assert rows[(STRICT, "promotes_product")]["provenances"] == "2"

    # model_agreement.csv: counts and kappa on the posts both answered
    pairs = {r["question"]: r for r in _read_csv(out / "model_agreement.csv")}
    assert list(pairs) == QIDS
    for qid, p in pairs.items():
        assert (p["model_a"], p["model_b"]) == (LAX, STRICT)
        both = [i for i in world["classified"] if lax["answers"][i] and strict["answers"][i]]
        a = np.array([lax["answers"][i][qid] == "yes" for i in both], dtype=float)
        b = np.array([strict["answers"][i][qid] == "yes" for i in both], dtype=float)
        counts = [int(np.sum(x * y)) for x, y in ((a, b), (a, 1 - b), (1 - a, b), (1 - a, 1 - b))]
        assert [int(p[k]) for k in ("both_answered", "both_yes", "only_a_yes", "only_b_yes", "both_no")] == [
            len(both), *counts]
        assert int(p["only_a_answered"]) == sum(1 for i in world["classified"]
                                                if lax["answers"][i] and not strict["answers"][i])
        assert int(p["only_b_answered"]) == len(failed_lax - failed_strict)
        assert _f(p["agreement"]) == pytest.approx(np.mean(a == b))
        assert _f(p["kappa"]) == pytest.approx(_kappa(*counts), abs=1e-12)
        assert _f(p["kappa_lo"]) < _f(p["kappa"]) < _f(p["kappa_hi"])
        assert _f(p["agreement_lo"]) < _f(p["agreement"]) < _f(p["agreement_hi"])
        assert _f(p["yes_share_difference"]) == pytest.approx(a.mean() - b.mean())
    assert _f(pairs["promotes_product"]["yes_share_difference"]) > 0.1  # the lax model says yes more often

    # disagreements.csv: exactly the (post, question) pairs where the answers differ or some failed
    dis = _read_csv(out / "disagreements.csv")
    expected = {}
    for i in world["classified"]:
        for qid in QIDS:
            given = [m["answers"][i][qid] for m in (lax, strict) if m["answers"][i]]
            if len(set(given)) > 1:
                expected[(world["ids"][i], qid)] = "answers differ"
            elif given and len(given) < 2:
                expected[(world["ids"][i], qid)] = "some gave no answer"
    assert {(r["post_id"], r["question"]): r["kind"] for r in dis} == expected
    assert len(dis) == len(expected)
    assert list(dis[0]) == ["post_id", "video_path", "question", "kind", "answered", "no_answer_from",
                            f"answer_{LAX}", f"p_yes_{LAX}", f"answer_{STRICT}", f"p_yes_{STRICT}", "human_label"]
    by_index = {world["ids"][i]: i for i in world["classified"]}
    for r in dis:
        i = by_index[r["post_id"]]
        assert r["video_path"] == f"/data/{r['post_id']}.mp4"
        for m in (lax, strict):
            given = m["answers"][i]
            assert r[f"answer_{m['name']}"] == (given[r["question"]] if given else "")
        # P(yes) where the server gave one (the lax model's, for promotes_product only)
        if r["question"] == "promotes_product" and i in lax["p_yes"]:
            assert _f(r[f"p_yes_{LAX}"]) == pytest.approx(lax["p_yes"][i])
        else:
            assert r[f"p_yes_{LAX}"] == ""
        assert r[f"p_yes_{STRICT}"] == ""
        label = labels.get(i) if r["question"] == "promotes_product" else None
        assert r["human_label"] == ("" if label is None else "yes" if label else "no")
        if r["kind"] == "some gave no answer":
            assert r["no_answer_from"] == (LAX if i in failed_lax else STRICT)
    # posts with a human label first, then by post id
    keys = [(r["human_label"] == "", r["post_id"], QIDS.index(r["question"])) for r in dis]
    assert keys == sorted(keys) and keys[0][0] is False and keys[-1][0] is True
    # human labels on posts a model failed are among them
    assert any(r["kind"] == "some gave no answer" and r["human_label"] for r in dis)

    # compare.md: both models, their F1 with intervals, cost, the verdict rule, the disagreements
    md = (out / "compare.md").read_text()
    for name in (LAX, STRICT):
        r = rows[(name, "promotes_product")]
        assert f"F1 {_f(r['f1']):.2f} [{_f(r['f1_lo']):.2f}, {_f(r['f1_hi']):.2f}]" in md
        assert f"**{name}**" in md
    # the paired comparison: both F1s on the same labelled posts, the verdict from the difference's interval
    paired = {p["question"]: p for p in _read_csv(out / "model_agreement.csv")}["promotes_product"]
    for name, side in ((LAX, "a"), (STRICT, "b")):
        assert _f(paired[f"f1_{side}"]) == pytest.approx(_f(rows[(name, "promotes_product")]["f1"]), abs=1e-12)
    assert int(paired["paired_n"]) == len(labels) and paired["paired_design"] == "uniform"
    lo, hi = _f(paired["f1_difference_lo"]), _f(paired["f1_difference_hi"])
    assert _f(paired["f1_difference"]) == pytest.approx(_f(paired["f1_a"]) - _f(paired["f1_b"]))
    assert lo <= _f(paired["f1_difference"]) <= hi
    assert paired["f1_verdict"] == ("a_better" if lo > 0 else "b_better" if hi < 0 else "cannot_tell")
    assert (f"{LAX} - {STRICT} of {_f(paired['f1_difference']):+.3f} [{lo:+.3f}, {hi:+.3f}]" in md
            or f"{LAX} - {STRICT} is {_f(paired['f1_difference']):+.3f} [{lo:+.3f}, {hi:+.3f}]" in md)
    assert ("agrees better with the human labels" in md) == (paired["f1_verdict"] != "cannot_tell")
    ratio = _f(rows[(STRICT, "promotes_product")]["cost_usd"]) / _f(rows[(LAX, "promotes_product")]["cost_usd"])
    assert f"{ratio:.1f} x the cost" in md
    assert f"WARNING: {STRICT}'s answers come from 2 different servers or settings" in md
    assert f"lists all {len(dis):,} (post, question) pairs" in md and f"The first 20 of {len(dis):,}" in md
    assert dis[0]["post_id"] in md and "No human labels" not in md

    png = (out / "plots" / "prevalence_by_model.png").read_bytes()
    assert png[:8] == PNG_MAGIC and len(png) > 10_000
    import matplotlib.image
    assert matplotlib.image.imread(out / "plots" / "prevalence_by_model.png").shape[0] > 200


def test_compare_without_human_labels(world):
    lax = _aggregate(_model(world, LAX, yes_if_true=0.95, yes_if_false=0.3), None)
    strict = _aggregate(_model(world, STRICT, yes_if_true=0.6, yes_if_false=0.05), None)
    out = _compare(world, [lax, strict], None)
    rows = _read_csv(out / "models.csv")
    assert len(rows) == 4 and all(r["f1"] == "" and r["corrected"] == "" and r["human_n"] == "" for r in rows)
    assert all(r["model_share"] != "" for r in rows)
    pairs = _read_csv(out / "model_agreement.csv")
    assert len(pairs) == 2 and all(_f(p["kappa"]) > 0 for p in pairs)
    dis = _read_csv(out / "disagreements.csv")
    assert dis and all(r["human_label"] == "" for r in dis)
    md = (out / "compare.md").read_text()
    assert "No human labels are configured" in md and "F1" not in md.split("## How")[0]
    assert (out / "plots" / "prevalence_by_model.png").read_bytes()[:8] == PNG_MAGIC


def test_compare_one_model(world):
    human, _ = _human(world)
    only = _aggregate(_model(world, LAX, yes_if_true=0.9, yes_if_false=0.2), human)
    out = _compare(world, [only], human)
    assert len(_read_csv(out / "models.csv")) == 2
    assert (out / "model_agreement.csv").read_text().strip() == ",".join(compare.MODEL_AGREEMENT_COLUMNS)
    assert _read_csv(out / "disagreements.csv") == []
    md = (out / "compare.md").read_text()
    assert "Only one model is configured" in md and "One model: nothing to disagree on." in md
    assert (out / "plots" / "prevalence_by_model.png").read_bytes()[:8] == PNG_MAGIC


def test_compare_a_model_whose_every_post_failed_and_a_question_without_disagreements(world):
    """A third model failed on every post; the other two answer shows_face alike on every post."""
    human, labels = _human(world)
    face = {i: {"shows_face": "yes" if world["face"][i] else "no"} for i in world["classified"]}
    lax = _aggregate(_model(world, LAX, yes_if_true=0.95, yes_if_false=0.3,
                            answer_all=lambda i: {**face[i], "promotes_product": "yes" if i % 3 else "no"}), human)
    strict = _aggregate(_model(world, STRICT, yes_if_true=0.6, yes_if_false=0.05,
                               answer_all=lambda i: {**face[i], "promotes_product": "yes" if i % 4 else "no"}), human)
    dead = _aggregate(_model(world, "dead", yes_if_true=0, yes_if_false=0, answer_all=lambda i: None), human)
    out = _compare(world, [lax, strict, dead], human)
    rows = {(r["model"], r["question"]): r for r in _read_csv(out / "models.csv")}
    assert rows[("dead", "promotes_product")]["answered"] == "0"
    # every labelled post is a wrong answer of the dead model: F1 0, never left out of the comparison
    assert _f(rows[("dead", "promotes_product")]["f1"]) == 0
    assert int(rows[("dead", "promotes_product")]["agreement_n"]) == len(labels)
    assert rows[("dead", "promotes_product")]["gpu_hours"] != ""  # its failed requests still took time
    pairs = {(p["question"], p["model_a"], p["model_b"]): p for p in _read_csv(out / "model_agreement.csv")}
    assert len(pairs) == 6
    p = pairs[("promotes_product", LAX, "dead")]
    assert p["both_answered"] == "0" and p["kappa"] == "" and p["note"] == "no post answered by both models"
    assert int(p["only_a_answered"]) == len(world["classified"])
    face_pair = pairs[("shows_face", LAX, STRICT)]
    assert _f(face_pair["agreement"]) == 1.0 and _f(face_pair["kappa"]) == pytest.approx(1.0)
    dis = _read_csv(out / "disagreements.csv")
    # every classified post: one or two rows per question (the dead model gave no answer anywhere)
    kinds = {(r["post_id"], r["question"]): r["kind"] for r in dis}
    assert len(kinds) == len(dis) == 2 * len(world["classified"])
    assert all(k == "some gave no answer" for (_, q), k in kinds.items() if q == "shows_face")
    assert all(r["no_answer_from"] == "dead" for r in dis)
    differ = {world["ids"][i] for i in world["classified"] if (i % 3 == 0) != (i % 4 == 0)}
    assert {pid for (pid, q), k in kinds.items() if k == "answers differ"} == differ
    md = (out / "compare.md").read_text()
    assert "**dead**: answered none of the" in md
    assert f"{LAX} and dead never both answered a post." in md
    assert "0 post(s) where the answers differ" in md  # shows_face


def test_compare_two_models_agreeing_everywhere(world):
    same = lambda i: {"promotes_product": "yes" if world["truth"][i] else "no", "shows_face": "no"}  # noqa: E731
    a = _aggregate(_model(world, LAX, yes_if_true=0, yes_if_false=0, answer_all=same), None)
    b = _aggregate(_model(world, STRICT, yes_if_true=0, yes_if_false=0, answer_all=same), None)
    out = _compare(world, [a, b], None)
    assert _read_csv(out / "disagreements.csv") == []
    assert (out / "disagreements.csv").read_text().startswith("post_id,video_path,question,kind")
    pairs = {p["question"]: p for p in _read_csv(out / "model_agreement.csv")}
    assert "every post both answered" in pairs["shows_face"]["note"] and pairs["shows_face"]["kappa_lo"] == ""
    md = (out / "compare.md").read_text()
    assert md.count("The models gave the same answer on every post") == 2
    assert "None: on every post and question the models that answered gave the same answer" in md


def test_compare_refuses_inputs_that_do_not_fit(world):
    a = _aggregate(_model(world, LAX, yes_if_true=0.9, yes_if_false=0.2), None)
    # labels of another question set
    three = QUESTIONS + [{"id": "has_music", "text": "Music?"}]
    other = _aggregate(_model(world, "other", yes_if_true=0.9, yes_if_false=0.2, config=_config(three)), None)
    with pytest.raises(compare.CompareError, match=r"other/labels.parquet \(model other\) holds question column\(s\) "
                                                   r"\['has_music'\]"):
        _compare(world, [a, other], None)
    with pytest.raises(ValueError, match=r"labels.parquet lacks column\(s\) \['has_music'\]"):
        _compare(world, [a, other], None, cfg=_config(three))
    # a model merged from an inventory without one post
    short = _aggregate(_model(world, "short", yes_if_true=0.9, yes_if_false=0.2, drop_post=world["ids"][50]), None)
    with pytest.raises(compare.CompareError, match=r"short/labels.parquet \(model short\) does not hold the posts of "
                                                   r".*inventory posts missing from the labels: 1 post\(s\), e\.g\. "
                                                   "post0050"):
        _compare(world, [a, short], None)
    # a summary made from other labels
    b = _model(world, STRICT, yes_if_true=0.6, yes_if_false=0.05)
    aggregate.run(_config(), a["labels"], None, b["summary"])
    with pytest.raises(compare.CompareError, match=r"prevalence.csv \(model Strict_72B.fp8\) does not match .*"
                                                   r"rerun the model's aggregate"):
        _compare(world, [a, b], None)
    # a summary made without the human labels the comparison is given, or at another confidence
    b = _aggregate(_model(world, "unlabelled", yes_if_true=0.6, yes_if_false=0.05), None)
    human, labels = _human(world)
    _aggregate(a, human)
    with pytest.raises(compare.CompareError, match=r"unlabelled/summary/prevalence.csv \(model unlabelled\) was made "
                                                   r"with other human labels: question promotes_product: human_n 0 "
                                                   rf"in the summary, {len(labels)} labelled posts in .*human.csv"):
        _compare(world, [a, b], human)
    cfg = _config()
    cfg["stats"]["confidence"] = 0.9
    with pytest.raises(compare.CompareError, match=r"intervals at confidence \['0.95'\], not stats.confidence 0.9"):
        _compare(world, [a], human, cfg=cfg)
    with pytest.raises(compare.CompareError, match="given more than once"):
        _compare(world, [a, a], None)
    assert not (world["dir"] / "compare" / "models.csv").exists()


def test_compare_never_calls_a_model_better_when_the_paired_difference_holds_0(world):
    """Two models with the same error rates: the paired F1 difference's interval holds 0, compare.md says the
    labels cannot tell them apart and how large a difference they could detect; "as good as" only with an
    equivalence margin the interval lies inside."""
    human, labels = _human(world)
    a = _aggregate(_model(world, LAX, yes_if_true=0.85, yes_if_false=0.15), human)
    b = _aggregate(_model(world, STRICT, yes_if_true=0.85, yes_if_false=0.15, seconds=6.0), human)
    out = _compare(world, [a, b], human)
    rows = {r["model"]: r for r in _read_csv(out / "models.csv") if r["question"] == "promotes_product"}
    for model in (a, b):  # the F1 in models.csv is this model's, recomputed
        tp, fp, fn, tn = _confusion(model, labels)
        assert _f(rows[model["name"]]["f1"]) == pytest.approx(2 * tp / (2 * tp + fp + fn))
    paired = {p["question"]: p for p in _read_csv(out / "model_agreement.csv")}["promotes_product"]
    lo, hi, reach = (_f(paired[k]) for k in ("f1_difference_lo", "f1_difference_hi", "f1_detectable"))
    assert lo < 0 < hi and paired["f1_verdict"] == "cannot_tell" and int(paired["paired_discordant"]) > 10
    # the smallest detectable difference: (1.96 + 0.84) bootstrap SDs, about half the interval's width again
    assert 0.5 * (hi - lo) < reach < 2 * (hi - lo)
    md = (out / "compare.md").read_text()
    assert (f"{LAX} and {STRICT}: these labels cannot tell the two apart on this question" in md
            and f"would detect a difference of about ±{reach:.3f}" in md
            and "no equivalence margin is set (compare.equivalence_margin)" in md)
    assert "agrees better" not in md and "as good as each other on F1" not in md
    ratio = _f(rows[STRICT]["cost_usd"]) / _f(rows[LAX]["cost_usd"])
    assert ratio == pytest.approx(3.0, rel=0.05)
    # an equivalence margin the interval lies inside: as good as each other; a narrower one: still cannot tell
    wide, narrow = max(-lo, hi) * 1.01, max(-lo, hi) * 0.5
    for margin, said in ((wide, True), (narrow, False)):
        cfg = vconfig.validate({**_config(), "compare": {"equivalence_margin": margin}})
        md = (_compare(world, [a, b], human, cfg) / "compare.md").read_text()
        assert (f"as good as each other on F1 within the equivalence margin ±{margin:g}" in md) == said
        assert (f"reaches beyond the equivalence margin ±{margin:g}" in md) == (not said)


def test_compare_draws_a_placeholder_when_nothing_can_be_drawn(world, monkeypatch):
    from vidlabel.analyze import plots

    calls = []
    real = plots.placeholder
    monkeypatch.setattr(plots, "placeholder", lambda path, title, message: calls.append(message) or real(
        path, title, message))
    a = _aggregate(_model(world, LAX, yes_if_true=0, yes_if_false=0, answer_all=lambda i: None), None)
    b = _aggregate(_model(world, STRICT, yes_if_true=0, yes_if_false=0, answer_all=lambda i: None), None)
    calls.clear()  # the aggregates drew their own placeholders
    out = _compare(world, [a, b], None)
    assert calls == ["No model answered any post and no human label is usable:\nnothing to draw."]
    assert (out / "plots" / "prevalence_by_model.png").read_bytes()[:8] == PNG_MAGIC
    assert _read_csv(out / "disagreements.csv") == []  # nobody answered: nothing to compare
    md = (out / "compare.md").read_text()
    assert md.count("answered none of the") == 4 and "never both answered a post" in md


def test_a_model_that_fails_on_the_posts_it_would_get_wrong_is_not_flattered(world):
    """B answers as A does, but its requests fail exactly where A is wrong: counted as wrong answers, B's
    figures equal A's (scored only on the posts it answered, as before, B's F1 was 1)."""
    human, labels = _human(world)

    def a_answers(i):
        wrong = i % 4 == 0
        return {"promotes_product": "yes" if bool(world["truth"][i]) != wrong else "no", "shows_face": "no"}

    a = _aggregate(_model(world, LAX, yes_if_true=0, yes_if_false=0, answer_all=a_answers), human)
    b = _aggregate(_model(world, STRICT, yes_if_true=0, yes_if_false=0,
                          answer_all=lambda i: None if i % 4 == 0 else a_answers(i)), human)
    out = _compare(world, [a, b], human)
    rows = {r["model"]: r for r in _read_csv(out / "models.csv") if r["question"] == "promotes_product"}
    wrong_labelled = sum(1 for i in labels if i % 4 == 0)
    assert wrong_labelled > 10 and int(rows[STRICT]["agreement_no_answer"]) == wrong_labelled
    # A's wrong answer and B's failure fall in the same cell (fn for a human "yes", fp for a "no")
    for metric in ("accuracy", "precision", "recall", "f1", "kappa"):
        assert _f(rows[STRICT][metric]) == pytest.approx(_f(rows[LAX][metric])), metric
    assert _f(rows[STRICT]["f1"]) < 0.9
    md = (out / "compare.md").read_text()
    assert f"the {wrong_labelled:,} it gave no answer for counted as wrong answers" in md
    assert "agrees better" not in md
    assert f"{LAX} and {STRICT} fall in the same cell of the human comparison on each of the" in md
