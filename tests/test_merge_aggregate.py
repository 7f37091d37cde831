"""Merge and aggregate on fabricated shard files (docs/outputs.md), every number recomputed here."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from stats_helpers import crossfit_ppi

from vidlabel.analyze import aggregate, agreement, humans, merge, stats
from vidlabel.core import config as vconfig
from vidlabel.serve.record import LABEL_SCHEMA

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
            # Shard 0's job recorded the one GPU it held; the others used endpoints (cost.gpus_per_job).
            "gpus": 1 if s == 0 else None,
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
                                  "shows_face", "error_item", "latency_s", "started_at", "finished_at", "prompt_tokens",
                                  "completion_tokens", "answer_probs", "transcript_status", "model",
                                  "model_revision", "server", "server_fingerprint", "settings_fingerprint",
                                  "prompt_hash", "request_fingerprint", "gpus", "job_id", *merge.POST_COLUMNS]
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
           dict(rows[0], label="no" if rows[0]["label"].lower() in ("yes", "1", "true") else "yes")]  # a tie
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
    # rows[0] and its contradicting copy tie: the post stays, with label 0.5 (half the coders said yes)
    usable = [dict(rows[0], y=0.5)] + [dict(r, y=1.0 if _is_yes(r["label"]) else 0.0) for r in rows[1:]]
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
    y = np.array([h["y"] for h in usable])
    assert int(p["human_n"]) == len(usable) and _f(p["human_share"]) == pytest.approx(y.mean())
    assert _f(p["human_yes"]) == y.sum() == int(y.sum()) + 0.5
    assert p["human_ci_method"] == "Wilson" and p["design"] == "uniform" and p["corrected_method"].startswith("PPI++")
    by_id = {r["post_id"]: r for r in classified}
    share = _f(p["model_share"])

    def pred(r):  # a failed request is predicted as the model share (documented choice)
        v = r["promotes_product"]
        return share if v is None else float(v == "yes")

    yhat = np.array([pred(by_id[h["post_id"]]) for h in usable])
    yhat_all = np.array([pred(r) for r in classified])
    # the SQL's PPI++ moments agree with ppi_py's (the cross-check adds a note when they do not)
    assert "ppi_py disagree" not in p["note"]
    # the reported estimate: PPI++ with lambda cross-fitted, each label corrected with the lambda of the others
    est, se = crossfit_ppi(y, yhat, yhat_all)
    assert abs(_f(p["corrected"]) - est) < 1e-9
    # the reported interval: that standard error with a t quantile on the events (fewest of
    # labelled yes, labelled no, disagreement mass), here well above stats.MIN_EVENTS
    from scipy.stats import t as student_t
    events = min(y.sum(), len(y) - y.sum(), np.abs(y - yhat).sum())
    assert _f(p["events"]) == pytest.approx(events) and events >= 10
    q = student_t.ppf(0.975, events - 1)
    assert _f(p["corrected_se"]) == pytest.approx(se, rel=1e-9)
    assert abs(_f(p["corrected_lo"]) - max(est - q * se, 0)) < 1e-9
    assert abs(_f(p["corrected_hi"]) - min(est + q * se, 1)) < 1e-9
    assert 0 <= _f(p["lambda"]) <= 1 and int(p["ppi_population"]) == 590 and int(p["ppi_labelled"]) == len(usable)
    assert prev["shows_face"]["human_n"] == "0" and prev["shows_face"]["corrected"] == ""

    # agreement: confusion counts recomputed
    agree = {r["question"]: r for r in _read_csv(summary / "agreement.csv")}
    a = agree["promotes_product"]
    pairs = [(_is_yes(h["label"]), by_id[h["post_id"]]["promotes_product"]) for h in usable if h["y"] != 0.5]
    # a post without a model answer is a wrong answer: fn for a human "yes", fp for a "no"
    compared = [(t, (m == "yes") if m is not None else not t) for t, m in pairs]
    tp = sum(t and m for t, m in compared)
    fp = sum((not t) and m for t, m in compared)
    fn = sum(t and not m for t, m in compared)
    tn = sum((not t) and not m for t, m in compared)
    failed = sum(m is None for _, m in pairs)
    assert failed > 0 and int(a["n"]) == len(pairs)
    assert [int(a[k]) for k in ("tp", "fp", "fn", "tn")] == [tp, fp, fn, tn]
    assert int(a["no_model_answer"]) == failed and "counted as wrong answers" in a["note"]
    assert int(a["tied_labels"]) == 1 and a["design"] == "uniform"
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
    total_busy = total_gpu_hours = 0.0
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
        gpus = 1 if s == "0" else 4
        assert int(t["gpus"]) == gpus
        assert _f(t["gpu_hours"]) == pytest.approx(busy * gpus / 3600)
        assert _f(t["cost_usd"]) == pytest.approx(busy * gpus / 3600 * 2.5)
        total_gpu_hours += busy * gpus / 3600
    assert _f(thr["1"]["busy_s"]) < _f(thr["1"]["span_s"]) - 4_000  # the gap between runs is not work
    assert _f(thr["all"]["busy_s"]) == pytest.approx(total_busy)
    assert _f(thr["all"]["gpu_hours"]) == pytest.approx(total_gpu_hours)
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
    assert not any(stage == "human_labels" and "duplicate" in reason for stage, reason in errs)

    # summary.md: headline sentences and the reported human-label problems
    md = (summary / "summary.md").read_text()
    assert f"{_f(p['corrected']) * 100:.1f}%" in md and "PPI++" in md
    assert "unknown post_id" in md and "'nobody'" in md and "unknown question" in md and "'unknown_q'" in md
    assert "590" in md
    assert f"tie counted as 0.5: 1 post-question(s), e.g. post '{usable[0]['post_id']}'" in md

    # plots: valid PNGs
    for name in aggregate.PLOTS:
        png = summary / "plots" / f"{name}.png"
        data = png.read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5_000, name
        import matplotlib.image
        assert matplotlib.image.imread(png).shape[0] > 100


def test_aggregate_weighted_human_labels_parquet(fabricated):
    """Varying sampling probabilities: Hajek human-only share and the active (Horvitz-Thompson)
    estimator, both recomputed here from their formulas over every classified post."""
    f = fabricated
    labels = _merge(f)
    human_path = f["dir"] / "human.parquet"
    usable = _human_labels(f, human_path, weighted=True)
    aggregate.run(_config(), labels, human_path, f["dir"] / "summary")
    p = {r["question"]: r for r in _read_csv(f["dir"] / "summary" / "prevalence.csv")}["promotes_product"]
    y = np.array([h["y"] for h in usable])
    prob = np.array([h["sampling_probability"] for h in usable])
    w = 1 / prob
    assert p["weighted"] == "true" and p["design"] == "weighted" and p["human_ci_method"].startswith("Hajek")
    hajek = (w * y).sum() / w.sum()
    assert _f(p["human_share"]) == pytest.approx(hajek)
    assert _f(p["human_share"]) < y.mean()  # yes-labels were oversampled, weights pull the share down
    assert _f(p["human_lo"]) < _f(p["human_share"]) < _f(p["human_hi"])
    # the active estimator by its definition over all N posts: z_i = g_i + (Y_i - g_i) xi_i / pi_i,
    # g_i = lam f_i + mu, (lam, mu) the least-squares fit that minimises the variance of z
    rows = [r for r in pq.read_table(labels).to_pylist() if r["status"] in ("ok", "error")]
    answered = [r["promotes_product"] for r in rows if r["promotes_product"] is not None]
    share = answered.count("yes") / len(answered)
    fhat = np.array([share if r["promotes_product"] is None else float(r["promotes_product"] == "yes") for r in rows])
    by_post = {h["post_id"]: (h["y"], h["sampling_probability"]) for h in usable}
    xi = np.array([r["post_id"] in by_post for r in rows])
    yy = np.array([by_post.get(r["post_id"], (0.0, 1.0))[0] for r in rows])
    pi = np.array([by_post.get(r["post_id"], (0.0, 1.0))[1] for r in rows])
    a, b1, b0 = yy * xi / pi, fhat * (1 - xi / pi), 1 - xi / pi
    design = np.c_[np.ones(len(a)), b1, b0]
    _, lam, mu = np.linalg.lstsq(design, -a, rcond=None)[0]
    assert 0 < lam < 1
    assert _f(p["lambda"]) == pytest.approx(lam, abs=1e-9)  # the full fit is the one quoted
    # cross-fitted: post i's z takes the (lambda, mu) fitted on every other post
    z = np.empty(len(a))
    for i in range(len(a)):
        others = np.arange(len(a)) != i
        _, lam_i, mu_i = np.linalg.lstsq(design[others], -a[others], rcond=None)[0]
        assert 0 < lam_i < 1
        z[i] = lam_i * fhat[i] + mu_i + (yy[i] - lam_i * fhat[i] - mu_i) * xi[i] / pi[i]
    assert _f(p["corrected"]) == pytest.approx(z.mean(), abs=1e-12)
    assert _f(p["corrected_se"]) == pytest.approx(z.std(ddof=1) / np.sqrt(len(z)), rel=1e-9)
    # these labels stand for sum 1/pi = about 400 posts of the 590 classified, with no design file
    assert "WARNING: the human labels stand for about" in p["note"] and "human_design" in p["note"]
    assert int(p["ppi_population"]) == 590 and int(p["ppi_labelled"]) == len(usable)
    assert _f(p["corrected_lo"]) < _f(p["corrected"]) < _f(p["corrected_hi"])
    assert _f(p["uniform_halfwidth"]) > 0
    # agreement: confusion totals weighted by 1/pi (a failed post counted as a wrong answer)
    agree = {r["question"]: r for r in _read_csv(f["dir"] / "summary" / "agreement.csv")}["promotes_product"]
    by_id = {r["post_id"]: r["promotes_product"] for r in rows}
    totals = np.zeros(4)
    for h in usable:
        if h["y"] == 0.5:
            continue
        answer = by_id[h["post_id"]]
        says_yes = answer == "yes" if answer is not None else h["y"] == 0
        totals[(0 if says_yes else 2) if h["y"] == 1 else (1 if says_yes else 3)] += 1 / h["sampling_probability"]
    tp, fp, fn, tn = totals
    assert agree["design"] == "weighted" and "weighted by the design (1/sampling_probability" in agree["ci_method"]
    assert _f(agree["precision"]) == pytest.approx(tp / (tp + fp))
    assert _f(agree["recall"]) == pytest.approx(tp / (tp + fn))
    assert _f(agree["f1"]) == pytest.approx(2 * tp / (2 * tp + fp + fn))
    assert _f(agree["accuracy"]) == pytest.approx((tp + tn) / totals.sum())
    for metric in stats.AGREEMENT_METRICS:
        assert _f(agree[metric + "_lo"]) < _f(agree[metric]) < _f(agree[metric + "_hi"]), metric
    unweighted_precision = int(agree["tp"]) / (int(agree["tp"]) + int(agree["fp"]))
    assert abs(unweighted_precision - _f(agree["precision"])) > 0.02  # the weights matter here
    md = (f["dir"] / "summary" / "summary.md").read_text()
    assert "A uniform random sample of as many posts would have given about" in md
    assert "Design: known, varying sampling probabilities" in md


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
    assert (summary / "agreement.csv").read_text().strip() == ",".join(agreement.AGREEMENT_COLUMNS)
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
    with pytest.raises(humans.HumanLabelError, match=r"lack column\(s\) \['post_id', 'question', 'label'\]"):
        aggregate.run(_config(), labels, bad, f["dir"] / "summary")
    with pytest.raises(humans.HumanLabelError, match="does not exist"):
        aggregate.run(_config(), labels, f["dir"] / "missing.csv", f["dir"] / "summary")


# ------------------------------------------------------------------------------------------
# aggregate: degenerate inputs, duplicates, populations (issue: intervals you can publish)

def _labels_file(path, answers, status=None, probs=None):
    """A labels.parquet as merge writes it: ``answers`` per post (dict question -> yes/no/None)."""
    n = len(answers)
    status = status or ["ok" if any(a.values()) else "error" for a in answers]
    table = {"post_id": [f"p{i:05d}" for i in range(n)], "shard": [0] * n, "status": status,
             "error_kind": [None if s == "ok" else "timeout" for s in status], "error": [None] * n}
    for q in ("promotes_product", "shows_face"):
        table[q] = [a.get(q) for a in answers]
    for c in ("prompt_tokens", "completion_tokens"):
        table[c] = pa.array([1000 if s == "ok" else None for s in status], pa.int64())
    table["latency_s"] = [1.0] * n
    table["started_at"] = [float(i) for i in range(n)]
    table["finished_at"] = [float(i) + 1 for i in range(n)]
    if probs is not None:
        table["answer_probs"] = [None if p is None else json.dumps(p) for p in probs]
    pq.write_table(pa.table(table), path)
    return path


def _write_human(path, rows):
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


def _run(tmp_path, answers, human_rows, status=None, probs=None):
    labels = _labels_file(tmp_path / "labels.parquet", answers, status, probs)
    human = _write_human(tmp_path / "human.csv", human_rows) if human_rows else None
    summary = tmp_path / "summary"
    aggregate.run(_config(), labels, human, summary)
    prev = {r["question"]: r for r in _read_csv(summary / "prevalence.csv")}
    for name in aggregate.PLOTS:
        assert (summary / "plots" / f"{name}.png").read_bytes()[:8] == PNG_MAGIC
    return prev, (summary / "summary.md").read_text(), summary


@pytest.mark.parametrize("case", ["all_no", "all_yes", "one_label", "two_labels", "constant_model",
                                  "every_post_failed"])
def test_aggregate_degenerate_inputs_give_honest_intervals(tmp_path, case):
    rng = np.random.default_rng(9)
    n_posts = 400
    rare = rng.random(n_posts) < 0.02
    answers = [{"promotes_product": "yes" if r else "no", "shows_face": "no"} for r in rare]
    status = None
    if case == "constant_model":
        answers = [{"promotes_product": "yes", "shows_face": "yes"} for _ in range(n_posts)]
    if case == "every_post_failed":
        answers = [{} for _ in range(n_posts)]
        status = ["error"] * n_posts
    n_labels = {"one_label": 1, "two_labels": 2}.get(case, 150)
    label = "yes" if case == "all_yes" else "no"
    human = [{"post_id": f"p{i:05d}", "question": "promotes_product", "label": label} for i in range(n_labels)]
    if case == "constant_model":
        human = [dict(h, label="yes" if i % 3 == 0 else "no") for i, h in enumerate(human)]
    prev, md, summary = _run(tmp_path, answers, human, status)
    p = prev["promotes_product"]
    k, n = sum(h["label"] == "yes" for h in human), len(human)
    share, lo, hi = _f(p["human_share"]), _f(p["human_lo"]), _f(p["human_hi"])
    assert (lo, hi) == pytest.approx(_wilson(k, n))
    assert lo <= share <= hi and hi - lo > 0
    c, c_lo, c_hi = _f(p["corrected"]), _f(p["corrected_lo"]), _f(p["corrected_hi"])
    assert 0 <= c_lo <= c <= c_hi <= 1 and c_hi - c_lo > 0
    if k == 0:
        assert lo == 0.0 and 'every human label is "no"' in p["note"]
    if k == n:
        assert hi == 1.0 and 'every human label is "yes"' in p["note"]
    if case in ("all_no", "all_yes", "one_label", "two_labels"):
        # too few events for a normal interval: the corrected one contains the human-only one
        assert c_lo <= lo and c_hi >= hi and "widened to contain the human-only interval" in p["note"]
    assert ("Wilson's coverage dips" in p["note"]) == (n < 50)
    if case == "constant_model":
        assert _f(p["lambda"]) == 0 and "the same for every post" in p["note"]
    if case == "every_post_failed":
        assert p["answered"] == "0" and p["model_share"] == "" and "answered no post" in p["note"]
        assert "the model answered none of the 400 classified posts" in md
    assert "Note:" in md and f"for all {n_posts} classified posts" in md
    # no question-level crash either for the unlabelled question
    assert prev["shows_face"]["human_n"] == "0" and "no usable human label" in prev["shows_face"]["note"]


def _wilson(k, n):
    return stats.wilson_interval(k, n, 0.95)


def test_aggregate_names_populations_and_warns_on_skipped_failed_posts(tmp_path):
    """20 % failed posts; the coders labelled answered posts only (unplayable media skipped)."""
    rng = np.random.default_rng(12)
    n_posts = 1000
    failed = rng.random(n_posts) < 0.2
    answers = [{} if bad else {"promotes_product": "yes" if rng.random() < 0.4 else "no", "shows_face": "no"}
               for bad in failed]
    status = ["error" if bad else "ok" for bad in failed]
    chosen = [i for i in rng.permutation(n_posts) if not failed[i]][:150]
    human = [{"post_id": f"p{i:05d}", "question": "promotes_product",
              "label": answers[i]["promotes_product"]} for i in chosen]
    prev, md, _ = _run(tmp_path, answers, human, status)
    p = prev["promotes_product"]
    assert _f(p["human_no_answer_share"]) == 0 and _f(p["run_no_answer_share"]) == pytest.approx(failed.mean())
    assert "WARNING" in p["note"] and "skipped" in p["note"]
    answered = n_posts - failed.sum()
    assert f"of the {answered:,} posts it answered" in md
    assert f"the share among all {n_posts:,} classified posts, answered or not" in md
    assert "Corrected for the model's errors" not in md
    # a uniform sample of all classified posts raises no such warning
    human = [{"post_id": f"p{i:05d}", "question": "promotes_product", "label": "yes" if rng.random() < 0.4 else "no"}
             for i in rng.permutation(n_posts)[:150]]
    prev, md, _ = _run(tmp_path, answers, human, status)
    assert "WARNING" not in prev["promotes_product"]["note"]


def test_aggregate_resolves_duplicates_by_majority_and_adjudication(tmp_path):
    answers = [{"promotes_product": "yes" if i % 2 else "no", "shows_face": "no"} for i in range(60)]
    human = []
    for i in range(40):  # one coder each on 40 posts, numeric labels as spreadsheets write them
        human.append({"post_id": f"p{i:05d}", "question": "promotes_product",
                      "label": ["1.00", "0.0", "1", "0"][i % 4], "adjudication": ""})
    human += [  # p00040: 2 of 3 coders say yes; p00041: a tie; p00042: a tie settled by adjudication
        {"post_id": "p00040", "question": "promotes_product", "label": "yes", "adjudication": ""},
        {"post_id": "p00040", "question": "promotes_product", "label": "yes", "adjudication": ""},
        {"post_id": "p00040", "question": "promotes_product", "label": "no", "adjudication": ""},
        {"post_id": "p00041", "question": "promotes_product", "label": "yes", "adjudication": ""},
        {"post_id": "p00041", "question": "promotes_product", "label": "no", "adjudication": ""},
        {"post_id": "p00042", "question": "promotes_product", "label": "yes", "adjudication": ""},
        {"post_id": "p00042", "question": "promotes_product", "label": "no", "adjudication": "no"},
    ]
    prev, md, summary = _run(tmp_path, answers, human)
    p = prev["promotes_product"]
    # 40 single labels (1, 0, 1, 0, ...: 20 yes) + majority yes + tie 0.5 + adjudicated no
    assert int(p["human_n"]) == 43 and _f(p["human_yes"]) == 20 + 1 + 0.5
    assert _f(p["human_share"]) == pytest.approx(21.5 / 43)
    assert not [r for r in _read_csv(summary / "errors.csv") if r["stage"] == "human_labels"]
    assert "majority of conflicting labels: 1 post-question(s), e.g. post 'p00040'" in md
    assert "tie counted as 0.5: 1 post-question(s), e.g. post 'p00041'" in md
    assert "adjudicated: 1 post-question(s), e.g. post 'p00042'" in md
    agree = {r["question"]: r for r in _read_csv(summary / "agreement.csv")}["promotes_product"]
    assert int(agree["n"]) == 42 and int(agree["tied_labels"]) == 1


def test_aggregate_uses_answer_probs_as_prediction(tmp_path):
    rng = np.random.default_rng(14)
    n_posts = 800
    p_yes = rng.beta(0.5, 0.8, n_posts)
    truth = rng.random(n_posts) < p_yes
    answers = [{"promotes_product": "yes" if p > 0.5 else "no", "shows_face": "no"} for p in p_yes]
    probs = [{"promotes_product": {"yes": 0.9 * p, "no": 0.9 * (1 - p)}, "shows_face": {"yes": 0.1, "no": 0.9}}
             for p in p_yes]
    probs[0] = None  # the server gave no log-probabilities for this post: its hard answer is used
    probs[1] = {"promotes_product": {"yes": "x", "no": 0.2}}  # unreadable: the hard answer again
    labelled = rng.permutation(n_posts)[:200]
    human = [{"post_id": f"p{i:05d}", "question": "promotes_product", "label": "yes" if truth[i] else "no"}
             for i in labelled]
    prev, md, _ = _run(tmp_path, answers, human, probs=probs)
    fhat = p_yes.copy()  # renormalised over yes + no
    fhat[:2] = [float(answers[i]["promotes_product"] == "yes") for i in range(2)]
    y = truth[labelled].astype(float)
    est, _ = crossfit_ppi(y, fhat[labelled], fhat)
    assert _f(prev["promotes_product"]["corrected"]) == pytest.approx(est, abs=1e-9)
    assert prev["promotes_product"]["note"] == ""  # SQL and ppi_py agree on the soft predictions too


def test_aggregate_reads_a_label_studio_export(tmp_path, monkeypatch):
    """A .json human-label file goes through vidlabel.analyze.labelstudio.read_export (stood in here)."""
    import sys
    import types

    answers = [{"promotes_product": "yes" if i % 3 == 0 else "no", "shows_face": "no"} for i in range(90)]
    export = pa.table({"post_id": [f"p{i:05d}" for i in range(30)] * 2,
                       "question": ["promotes_product"] * 60,
                       "label": ["yes" if i % 3 == 0 else "no" for i in range(30)] * 2,
                       "sampling_probability": [30 / 90] * 60,
                       "annotator": ["ann1"] * 30 + ["ann2"] * 30})
    calls = []
    fake = types.ModuleType("vidlabel.analyze.labelstudio")
    fake.read_export = lambda path: calls.append(path) or export
    monkeypatch.setitem(sys.modules, "vidlabel.analyze.labelstudio", fake)
    (tmp_path / "export.json").write_text("[]")
    labels = _labels_file(tmp_path / "labels.parquet", answers)
    aggregate.run(_config(), labels, tmp_path / "export.json", tmp_path / "summary")
    assert calls == [tmp_path / "export.json"]
    p = {r["question"]: r for r in _read_csv(tmp_path / "summary" / "prevalence.csv")}["promotes_product"]
    # two annotators who agree: 30 posts, equal probabilities: a uniform design
    assert p["human_n"] == "30" and p["design"] == "uniform" and _f(p["human_share"]) == pytest.approx(10 / 30)


def test_load_human_labels_leaves_the_connection_usable(tmp_path):
    """label_sample reads a burn-in through load_human_labels and goes on with the connection."""
    from vidlabel.core import duck

    labels = _labels_file(tmp_path / "labels.parquet", [{"promotes_product": "yes"}, {"promotes_product": "no"}])
    human = _write_human(tmp_path / "human.csv", [{"post_id": "p00000", "question": "promotes_product", "label": "yes"},
                                                   {"post_id": "p00001", "question": "promotes_product", "label": "0"}])
    con = duck.connect()
    duck.parquet_view(con, "labels", labels)
    con.register("questions_arrow", pa.table({"question": ["promotes_product"], "position": [0]}))
    con.execute("CREATE TABLE questions AS SELECT * FROM questions_arrow")
    described = humans.load_human_labels(con, human)
    assert described["usable"] == 2 and described["posts"] == 2 and described["design"] == "uniform"
    rows = con.sql("SELECT post_id, y FROM human_resolved ORDER BY post_id").fetchall()
    assert rows == [("p00000", 1.0), ("p00001", 0.0)]


def test_records_re_dealt_to_other_shards_keep_the_busy_time_of_the_jobs_that_made_them(tmp_path):
    """Three shard jobs ran at the same time; then classify.shards went to 4 and every record was copied
    into the new shards' journals (stamped with the new shard, keeping its job). Busy time and GPU-hours
    are the three jobs', not the union of each new shard's mixture of them."""
    cfg = _config()
    pq.write_table(pa.table({"post_id": [f"p{i}" for i in range(120)]}), tmp_path / "inventory.parquet")
    pq.write_table(pa.table({"post_id": pa.array([], pa.string()), "video_path": pa.array([], pa.string()),
                             "reason": pa.array([], pa.string()), "detail": pa.array([], pa.string())}),
                   tmp_path / "excluded.parquet")

    def record(i: int, shard: int) -> dict:
        job = i % 3  # the job that answered it: jobs 0, 1 and 2 ran side by side, 40 requests each
        start = 1_000.0 + (i // 3) * 2.0
        return {"request_id": f"r{i}", "post_id": f"p{i}", "shard": shard, "status": "ok", "attempts": 1,
                "sends": 1, "answers": json.dumps({"promotes_product": "no", "shows_face": "no"}),
                "prompt_tokens": 100, "completion_tokens": 9, "started_at": start, "finished_at": start + 2.0,
                "latency_s": 2.0, "model": "m", "server": "s", "settings_fingerprint": "f", "prompt_hash": "h",
                "request_fingerprint": f"x{i}", "gpus": 4, "job_id": f"shard-{job}/20250101T000000Z/00000{job}"}

    def gpu_hours(records_by_shard: dict[int, list[dict]]) -> dict[str, dict]:
        paths = []
        for shard, rows in records_by_shard.items():
            _write_shard(tmp_path / f"s{shard}.parquet", rows)
            paths.append(tmp_path / f"s{shard}.parquet")
        out = tmp_path / "labels.parquet"
        merge.merge(cfg, tmp_path / "inventory.parquet", tmp_path / "excluded.parquet", paths, out)
        aggregate.run(cfg, out, None, tmp_path / "summary")
        for p in paths:
            p.unlink()
        rows = _read_csv(tmp_path / "summary" / "throughput.csv")
        return {r["shard"] if r["shard"] == "all" else r["job"]: r for r in rows}

    three = gpu_hours({s: [record(i, s) for i in range(120) if i % 3 == s] for s in range(3)})
    four = gpu_hours({s: [record(i, s) for i in range(120) if i % 4 == s] for s in range(4)})
    assert _f(three["all"]["busy_s"]) == pytest.approx(3 * (39 * 2.0 + 2.0))  # each job: 40 back-to-back requests
    assert _f(four["all"]["gpu_hours"]) == pytest.approx(_f(three["all"]["gpu_hours"]))
    assert sorted(k for k in four if k != "all") == sorted(k for k in three if k != "all")  # the same three jobs
    assert {four[k]["shard"] for k in four if k != "all"} == {"0", "1", "2"}  # each job's own shard


def test_aggregate_refuses_a_census_of_the_labelled_posts_only(tmp_path):
    """Every labelled post drawn with probability 1 while the other classified posts were not labelled:
    each label stands for itself only (a zero-width Hajek "census"), so no share is claimed for all posts."""
    rng = np.random.default_rng(3)
    answers = [{"promotes_product": "yes" if rng.random() < 0.3 else "no", "shows_face": "no"} for _ in range(300)]
    human = [{"post_id": f"p{i:05d}", "question": "promotes_product", "label": "yes" if i % 3 == 0 else "no",
              "sampling_probability": 1} for i in range(60)]
    prev, md, _ = _run(tmp_path, answers, human)
    p = prev["promotes_product"]
    assert p["human_share"] == "" and p["corrected"] == "" and int(p["human_n"]) == 60
    assert "every one of the 60 labelled post(s) was drawn with sampling probability 1" in p["note"]
    assert "240 classified post(s) were not labelled" in p["note"] and "WARNING" in md
    # the same labels as a uniform sample of 60 of the 300 (probability 0.2) give both shares, and no warning
    uniform = [dict(h, sampling_probability=0.2) for h in human]
    (tmp_path / "uniform").mkdir()
    prev, _, _ = _run(tmp_path / "uniform", answers, uniform)
    assert _f(prev["promotes_product"]["corrected"]) > 0 and "WARNING" not in prev["promotes_product"]["note"]


def test_aggregate_warns_when_posts_were_classified_after_the_draw_without_the_design(tmp_path):
    """A uniform sample of 100 of the first 500 posts (probability 0.2), 900 posts classified now and no
    human_design: the labels stand for about 500 posts, the shares would speak for all 900."""
    rng = np.random.default_rng(4)
    answers = [{"promotes_product": "yes" if rng.random() < 0.3 else "no", "shows_face": "no"} for _ in range(900)]
    human = [{"post_id": f"p{i:05d}", "question": "promotes_product", "label": "yes" if i % 4 == 0 else "no",
              "sampling_probability": 0.2} for i in rng.choice(500, 100, replace=False)]
    prev, md, _ = _run(tmp_path, answers, human)
    note = prev["promotes_product"]["note"]
    assert "WARNING: the human labels stand for about 500 posts" in note and "900 posts are classified" in note
    assert "human_design" in note and "WARNING: the human labels stand for about 500 posts" in md
    # the same sample when nothing was classified since: no warning
    (tmp_path / "same").mkdir()
    prev, _, _ = _run(tmp_path / "same", answers[:500], human)
    assert "stand for about" not in prev["promotes_product"]["note"]
