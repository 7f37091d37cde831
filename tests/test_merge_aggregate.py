"""Merge and aggregate on fabricated shard files (docs/outputs.md), every number recomputed here."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from vidlabel import aggregate, config as vconfig, merge
from vidlabel.classify import LABEL_SCHEMA

QUESTIONS = [{"id": "promotes_product", "text": "Product?"}, {"id": "shows_face", "text": "Face?"}]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SHARD_COLUMNS = LABEL_SCHEMA.names  # what a classify job writes


def _config(**extra):
    cfg = {"posts": "posts.csv", "media_root": "/data",
           "classify": {"shards": 3, "questions": QUESTIONS},
           "stats": {"confidence": 0.95, "bootstrap_samples": 500},
           "cost": {"gpu_hour_usd": 2.5, "gpus_per_job": 4}}
    cfg.update(extra)
    return vconfig.validate(cfg)


def _write_shard(path, rows):
    table = pa.table({c: [r.get(c) for r in rows] for c in SHARD_COLUMNS}, schema=LABEL_SCHEMA)
    pq.write_table(table, path)


@pytest.fixture
def fabricated(tmp_path):
    """600 posts: 10 excluded, 3 shards; shard 2 holds only failed requests (answers all null)."""
    rng = np.random.default_rng(3)
    n = 600
    ids = [f"post{i:04d}" for i in range(n)]
    order = rng.permutation(n)  # inventory order is not sorted
    inv = pa.table({"post_id": [ids[i] for i in order], "video_path": [f"/data/{ids[i]}.mp4" for i in order],
                    "extra": list(range(n))})
    pq.write_table(inv, tmp_path / "inventory.parquet")
    excluded = ids[:10]
    pq.write_table(pa.table({"post_id": excluded, "video_path": [f"/data/{p}.mp4" for p in excluded],
                             "reason": ["probe_error"] * 7 + ["too_long"] * 3,
                             "detail": ["moov atom not found"] * 7 + ["estimate 40000 > 32768"] * 3}),
                   tmp_path / "excluded.parquet")
    truth = rng.random(n) < 0.45
    shards = {0: [], 1: [], 2: []}
    for i in range(10, n):
        s = 2 if i >= 580 else i % 2
        failed = s == 2 or i % 50 == 0
        says_yes = bool(truth[i] and rng.random() < 0.7 or (not truth[i] and rng.random() < 0.1))
        start = 1_000.0 + 100 * s + (i // 2) * 1.5 + (5_000.0 if (s == 1 and i > 400) else 0.0)  # resumed run
        shards[s].append({
            "request_id": f"r{i}", "post_id": ids[i], "shard": s, "status": "error" if failed else "ok",
            "error_kind": ("timeout" if s == 2 else "bad_media") if failed else None,
            "error": "failed" if failed else None, "attempts": 1, "latency_s": 2.0,
            "started_at": start, "finished_at": start + 2.0 + (i % 3),
            "prompt_tokens": None if s == 2 else int(rng.integers(2_000, 40_000)),
            "completion_tokens": None if s == 2 else int(rng.integers(20, 400)),
            "answers": None if failed else json.dumps({"promotes_product": "yes" if says_yes else "no",
                                                       "shows_face": "yes" if i % 3 == 0 else "no"}),
        })
    paths = []
    for s, rows in shards.items():
        paths.append(tmp_path / f"shard-{s}.parquet")
        _write_shard(paths[-1], rows)
    return {"dir": tmp_path, "ids": ids, "truth": truth, "excluded": excluded, "shards": paths,
            "records": {r["post_id"]: r for rows in shards.values() for r in rows}, "order": [ids[i] for i in order]}


def _merge(f, cfg=None):
    out = f["dir"] / "labels.parquet"
    merge.merge(cfg or _config(), f["dir"] / "inventory.parquet", f["dir"] / "excluded.parquet", f["shards"], out)
    return out


def _read_csv(path):
    with open(path) as fh:
        return list(csv.DictReader(fh))


def _f(x):
    return float(x) if x not in ("", None) else math.nan


# ------------------------------------------------------------------------------------------
# merge

def test_merge_one_row_per_post(fabricated):
    f = fabricated
    table = pq.read_table(_merge(f))
    assert table.column_names == ["post_id", "shard", "status", "error_kind", "error", "promotes_product",
                                  "shows_face", "prompt_tokens", "completion_tokens", "latency_s", "started_at",
                                  "finished_at", "answer_probs", "model", "server", "settings_fingerprint",
                                  "prompt_hash", "request_fingerprint"]
    rows = table.to_pylist()
    assert [r["post_id"] for r in rows] == f["order"]  # inventory order kept
    by_id = {r["post_id"]: r for r in rows}
    for pid in f["excluded"]:
        r = by_id[pid]
        assert r["status"] == "excluded" and r["shard"] is None and r["promotes_product"] is None
    assert by_id["post0000"]["error_kind"] == "probe_error" and by_id["post0000"]["error"] == "moov atom not found"
    assert by_id["post0009"]["error_kind"] == "too_long"
    for pid, rec in f["records"].items():
        r = by_id[pid]
        assert (r["status"], r["shard"], r["error_kind"]) == (rec["status"], rec["shard"], rec["error_kind"])
        answers = json.loads(rec["answers"]) if rec["answers"] else {}
        assert r["promotes_product"] == answers.get("promotes_product")
        assert r["shows_face"] == answers.get("shows_face")
        assert r["prompt_tokens"] == rec["prompt_tokens"] and r["started_at"] == rec["started_at"]
    assert sum(r["status"] == "error" for r in rows) == sum(r["status"] == "error" for r in f["records"].values())


def test_merge_refuses_missing_and_duplicate_posts(fabricated):
    f = fabricated
    shard0 = pq.read_table(f["shards"][0]).to_pylist()
    # a post of shard 0 lost
    _write_shard(f["shards"][0], shard0[1:])
    with pytest.raises(merge.MergeError, match=rf"missing from every label shard.*1 post\(s\), e\.g\. {shard0[0]['post_id']}"):
        _merge(f)
    # the same post in two shards, and a post both labelled and excluded, and an unknown post
    dup = dict(shard0[1], shard=1)
    _write_shard(f["shards"][0], shard0 + [dict(shard0[2], post_id=f["excluded"][0]), dict(shard0[3], post_id="ghost")])
    _write_shard(f["shards"][1], pq.read_table(f["shards"][1]).to_pylist() + [dup])
    with pytest.raises(merge.MergeError) as err:
        _merge(f)
    msg = str(err.value)
    assert "duplicate post_id in the label shards (shards 0, 1): 1 post(s)" in msg and shard0[1]["post_id"] in msg
    assert "post both classified and excluded: 1 post(s), e.g. post0000" in msg
    assert "labelled post not in the inventory (stale shard?): 1 post(s), e.g. ghost" in msg
    assert not (f["dir"] / "labels.parquet").exists()


def test_merge_refuses_question_id_shadowing_a_column(fabricated):
    cfg = _config()
    cfg["classify"]["questions"] = [{"id": "status", "text": "?"}]
    with pytest.raises(merge.MergeError, match="clash"):
        _merge(fabricated, cfg)


# ------------------------------------------------------------------------------------------
# aggregate

def _human_labels(f, path, weighted=False):
    """Human labels on 120 classified posts (truth), plus rows that must be reported."""
    rng = np.random.default_rng(5)
    pool = [int(p[4:]) for p in f["records"]]
    chosen = rng.choice(pool, 120, replace=False)
    rows = [{"post_id": f["ids"][i], "question": "promotes_product",
             "label": ["yes", "1", "TRUE"][i % 3] if f["truth"][i] else ["no", "0", "false"][i % 3]}
            for i in chosen]
    if weighted:
        for r in rows:
            r["sampling_probability"] = 0.5 if r["label"].lower() in ("yes", "1", "true") else 0.2
    bad = [{"post_id": "nobody", "question": "promotes_product", "label": "yes"},
           {"post_id": f["ids"][20], "question": "unknown_q", "label": "no"},
           {"post_id": f["ids"][21], "question": "promotes_product", "label": "perhaps"},
           {"post_id": f["excluded"][0], "question": "promotes_product", "label": "no"},
           dict(rows[0], label="no" if rows[0]["label"].lower() in ("yes", "1", "true") else "yes")]  # conflict
    if weighted:
        for r in bad:
            r.setdefault("sampling_probability", 0.3)
    all_rows = rows + bad
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(all_rows), path)
    else:
        with open(path, "w", newline="") as fh:
            w = csv.DictWriter(fh, list(all_rows[0]))
            w.writeheader()
            w.writerows(all_rows)
    usable = rows[1:]  # rows[0] conflicts with its duplicate
    return usable


def _is_yes(label):
    return label.lower() in ("yes", "1", "true")


def test_aggregate_every_file_checked(fabricated):
    f = fabricated
    labels = _merge(f)
    human_path = f["dir"] / "human.csv"
    usable = _human_labels(f, human_path)
    summary = f["dir"] / "summary"
    aggregate.run(_config(), labels, human_path, summary)
    rows = pq.read_table(labels).to_pylist()
    classified = [r for r in rows if r["status"] in ("ok", "error")]

    # prevalence: model share recomputed
    prev = {r["question"]: r for r in _read_csv(summary / "prevalence.csv")}
    assert list(prev) == ["promotes_product", "shows_face"]
    for qid in prev:
        answered = [r[qid] for r in classified if r[qid] is not None]
        p = prev[qid]
        assert int(p["posts"]) == len(classified) == 590
        assert int(p["answered"]) == len(answered) and int(p["no_answer"]) == len(classified) - len(answered)
        assert int(p["yes"]) == answered.count("yes")
        assert _f(p["model_share"]) == pytest.approx(answered.count("yes") / len(answered))
        assert _f(p["model_lo"]) < _f(p["model_share"]) < _f(p["model_hi"])
    # human-only share and corrected estimate against ppi_py on arrays built here
    p = prev["promotes_product"]
    y = np.array([1.0 if _is_yes(h["label"]) else 0.0 for h in usable])
    assert int(p["human_n"]) == len(usable) and _f(p["human_share"]) == pytest.approx(y.mean())
    assert p["human_ci_method"] == "Wilson"
    by_id = {r["post_id"]: r for r in classified}
    share = _f(p["model_share"])

    def pred(r):  # a failed request is predicted as the model share (documented choice)
        v = r["promotes_product"]
        return share if v is None else float(v == "yes")

    yhat = np.array([pred(by_id[h["post_id"]]) for h in usable])
    yhat_all = np.array([pred(r) for r in classified])
    import ppi_py
    est = float(np.ravel(ppi_py.ppi_mean_pointestimate(y, yhat, yhat_all))[0])
    lo, hi = (float(np.ravel(v)[0]) for v in ppi_py.ppi_mean_ci(y, yhat, yhat_all, alpha=0.05))
    assert abs(_f(p["corrected"]) - est) < 1e-9
    assert abs(_f(p["corrected_lo"]) - max(lo, 0)) < 1e-9 and abs(_f(p["corrected_hi"]) - min(hi, 1)) < 1e-9
    assert 0 <= _f(p["lambda"]) <= 1 and int(p["ppi_population"]) == 590 and int(p["ppi_labelled"]) == len(usable)
    assert prev["shows_face"]["human_n"] == "0" and prev["shows_face"]["corrected"] == ""

    # agreement: confusion counts recomputed
    agree = {r["question"]: r for r in _read_csv(summary / "agreement.csv")}
    a = agree["promotes_product"]
    pairs = [(_is_yes(h["label"]), by_id[h["post_id"]]["promotes_product"]) for h in usable]
    compared = [(t, m == "yes") for t, m in pairs if m is not None]
    tp = sum(t and m for t, m in compared)
    fp = sum((not t) and m for t, m in compared)
    fn = sum(t and not m for t, m in compared)
    tn = sum((not t) and not m for t, m in compared)
    assert [int(a[k]) for k in ("tp", "fp", "fn", "tn")] == [tp, fp, fn, tn]
    assert int(a["no_model_answer"]) == len(pairs) - len(compared)
    assert _f(a["precision"]) == pytest.approx(tp / (tp + fp))
    assert _f(a["recall"]) == pytest.approx(tp / (tp + fn))
    po = (tp + tn) / len(compared)
    pe = ((tp + fp) * (tp + fn) + (fn + tn) * (fp + tn)) / len(compared) ** 2
    assert _f(a["kappa"]) == pytest.approx((po - pe) / (1 - pe))
    assert _f(a["kappa_lo"]) < _f(a["kappa"]) < _f(a["kappa_hi"])
    assert "Wilson" in a["ci_method"] and "bootstrap" in a["ci_method"]
    assert agree["shows_face"]["n"] == "0"

    # tokens: numpy percentiles (linear interpolation)
    tok = {r["direction"]: r for r in _read_csv(summary / "tokens.csv")}
    pt = np.array([r["prompt_tokens"] for r in classified if r["prompt_tokens"] is not None], float)
    ct = np.array([r["completion_tokens"] for r in classified if r["completion_tokens"] is not None], float)
    for d, v in (("input", pt), ("output", ct)):
        t = tok[d]
        assert int(t["requests"]) == v.size and int(t["total"]) == v.sum() and int(t["max"]) == v.max()
        for q in (50, 90, 99):
            assert _f(t[f"p{q}"]) == pytest.approx(np.percentile(v, q))
        assert _f(t["mean"]) == pytest.approx(v.mean())
        assert _f(t["prefill_decode_ratio"]) == pytest.approx(pt.sum() / ct.sum())

    # throughput: busy time is the union of request intervals (the resumed shard 1 has a gap)
    thr = {r["shard"]: r for r in _read_csv(summary / "throughput.csv")}
    assert list(thr) == ["0", "1", "2", "all"]
    total_busy = 0.0
    for s in ("0", "1", "2"):
        iv = sorted((r["started_at"], r["finished_at"]) for r in classified if r["shard"] == int(s))
        busy, cur_s, cur_e = 0.0, *iv[0]
        for a_s, a_e in iv[1:]:
            if a_s > cur_e:
                busy, cur_s, cur_e = busy + cur_e - cur_s, a_s, a_e
            else:
                cur_e = max(cur_e, a_e)
        busy += cur_e - cur_s
        total_busy += busy
        t = thr[s]
        assert int(t["requests"]) == len(iv)
        assert _f(t["busy_s"]) == pytest.approx(busy)
        assert _f(t["span_s"]) == pytest.approx(max(e for _, e in iv) - iv[0][0])
        assert _f(t["requests_per_s"]) == pytest.approx(len(iv) / busy)
        assert _f(t["gpu_hours"]) == pytest.approx(busy * 4 / 3600)
        assert _f(t["cost_usd"]) == pytest.approx(busy * 4 / 3600 * 2.5)
    assert _f(thr["1"]["busy_s"]) < _f(thr["1"]["span_s"]) - 4_000  # the gap between runs is not work
    assert _f(thr["all"]["busy_s"]) == pytest.approx(total_busy)
    assert int(thr["all"]["requests"]) == 590
    assert _f(thr["all"]["tokens_per_s"]) == pytest.approx((pt.sum() + ct.sum()) / total_busy)

    # errors: by stage and reason
    errs = {(r["stage"], r["reason"]): int(r["count"]) for r in _read_csv(summary / "errors.csv")}
    n_timeout = sum(r["error_kind"] == "timeout" for r in classified)
    n_bad = sum(r["error_kind"] == "bad_media" for r in classified)
    assert errs[("manifest", "probe_error")] == 7 and errs[("manifest", "too_long")] == 3
    assert errs[("classify", "timeout")] == n_timeout == 20 and errs[("classify", "bad_media")] == n_bad
    assert errs[("human_labels", "unknown post_id")] == 1
    assert errs[("human_labels", "unknown question")] == 1
    assert errs[("human_labels", "invalid label")] == 1
    assert errs[("human_labels", "post excluded before classification")] == 1
    assert errs[("human_labels", "conflicting duplicate labels")] == 2

    # summary.md: headline sentences and the reported human-label problems
    md = (summary / "summary.md").read_text()
    assert f"{_f(p['corrected']) * 100:.1f}%" in md and "PPI++" in md
    assert "unknown post_id" in md and "'nobody'" in md and "unknown question" in md and "'unknown_q'" in md
    assert "590" in md

    # plots: valid PNGs
    for name in aggregate.PLOTS:
        png = summary / "plots" / f"{name}.png"
        data = png.read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5_000, name
        import matplotlib.image
        assert matplotlib.image.imread(png).shape[0] > 100


def test_aggregate_weighted_human_labels_parquet(fabricated):
    f = fabricated
    labels = _merge(f)
    human_path = f["dir"] / "human.parquet"
    usable = _human_labels(f, human_path, weighted=True)
    aggregate.run(_config(), labels, human_path, f["dir"] / "summary")
    p = {r["question"]: r for r in _read_csv(f["dir"] / "summary" / "prevalence.csv")}["promotes_product"]
    y = np.array([1.0 if _is_yes(h["label"]) else 0.0 for h in usable])
    w = np.array([1 / h["sampling_probability"] for h in usable])
    assert p["weighted"] == "true" and "weighted" in p["human_ci_method"]
    assert _f(p["human_share"]) == pytest.approx((w * y).sum() / w.sum())
    assert _f(p["human_share"]) < y.mean()  # yes-labels were oversampled, weights pull the share down
    assert _f(p["human_lo"]) < _f(p["human_share"]) < _f(p["human_hi"])
    assert _f(p["corrected_lo"]) < _f(p["corrected"]) < _f(p["corrected_hi"])
    assert p["note"] == ""  # in particular, no SQL / ppi_py disagreement


def test_aggregate_without_human_labels_and_without_data(tmp_path):
    """Every post excluded: aggregate still writes every declared file, plots are placeholders."""
    ids = ["a", "b"]
    pq.write_table(pa.table({"post_id": ids, "video_path": ["/x/a", "/x/b"]}), tmp_path / "inventory.parquet")
    pq.write_table(pa.table({"post_id": ids, "video_path": ["/x/a", "/x/b"], "reason": ["probe_error"] * 2,
                             "detail": ["empty file", "moov atom not found"]}), tmp_path / "excluded.parquet")
    _write_shard(tmp_path / "shard-0.parquet", [])
    labels = tmp_path / "labels.parquet"
    merge.merge(_config(), tmp_path / "inventory.parquet", tmp_path / "excluded.parquet",
                [tmp_path / "shard-0.parquet"], labels)
    assert [r["status"] for r in pq.read_table(labels).to_pylist()] == ["excluded", "excluded"]
    summary = tmp_path / "summary"
    aggregate.run(_config(), labels, None, summary)
    assert (summary / "agreement.csv").read_text().strip() == ",".join(aggregate.AGREEMENT_COLUMNS)
    prev = _read_csv(summary / "prevalence.csv")
    assert [(r["question"], r["posts"], r["answered"], r["model_share"]) for r in prev] == [
        ("promotes_product", "0", "0", ""), ("shows_face", "0", "0", "")]
    assert _read_csv(summary / "throughput.csv") == []
    assert [(r["stage"], r["reason"], r["count"]) for r in _read_csv(summary / "errors.csv")] == [
        ("manifest", "probe_error", "2")]
    tok = {r["direction"]: r for r in _read_csv(summary / "tokens.csv")}
    assert tok["input"]["requests"] == "0"
    md = (summary / "summary.md").read_text()
    assert "2 posts were excluded" in md and "No human labels are configured" in md
    for name in aggregate.PLOTS:
        assert (summary / "plots" / f"{name}.png").read_bytes()[:8] == PNG_MAGIC


def test_aggregate_rejects_unreadable_human_labels(fabricated):
    f = fabricated
    labels = _merge(f)
    bad = f["dir"] / "bad.csv"
    bad.write_text("post,answer\nx,yes\n")
    with pytest.raises(aggregate.HumanLabelError, match=r"lack column\(s\) \['post_id', 'question', 'label'\]"):
        aggregate.run(_config(), labels, bad, f["dir"] / "summary")
    with pytest.raises(aggregate.HumanLabelError, match="does not exist"):
        aggregate.run(_config(), labels, f["dir"] / "missing.csv", f["dir"] / "summary")
