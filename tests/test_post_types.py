"""Posts of several media items through merge and aggregate (issue 26, docs/outputs.md): an inventory,
manifest shards and label shards in the prepare side's contract, with videos, photos, slideshows,
carousels, audio posts and posts with no usable item; every number recomputed here from the fixture."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from scipy.stats import norm
from scipy.stats import t as student_t
from standin.mixed import ITEM_TYPE  # the manifest's item struct, as the classify side reads it
from stats_helpers import crossfit_ppi

from vidlabel.analyze import aggregate, merge
from vidlabel.core import config as vconfig
from vidlabel.prepare.post_plan import post_type
from vidlabel.serve.record import LABEL_SCHEMA

QUESTIONS = [{"id": "promotes_product", "text": "Product?"}, {"id": "shows_face", "text": "Face?"}]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
POST_COLUMNS = ["post_type", "n_items", "n_videos", "n_images", "n_audio", "items_dropped", "est_video_tokens",
                "est_image_tokens", "est_audio_tokens", "est_text_tokens", "est_prompt_tokens"]
# The inventory's item struct (the contract's fields).
INVENTORY_ITEM = pa.struct([("index", pa.int64()), ("kind", pa.string()), ("path", pa.string()),
                            ("fps", pa.float64()), ("width", pa.int64()), ("height", pa.int64()),
                            ("duration_s", pa.float64()), ("probe_error", pa.string())])
INVENTORY_SCHEMA = pa.schema([
    ("post_id", pa.string()), ("source_path", pa.string()), ("video_path", pa.string()), ("caption", pa.string()),
    ("duration_s", pa.float64()), ("fps", pa.float64()), ("width", pa.int64()), ("height", pa.int64()),
    ("probe_error", pa.string()), ("post_type", pa.string()), ("n_items", pa.int64()),
    ("items_dropped", pa.string()), ("items", pa.list_(INVENTORY_ITEM)),
])
MANIFEST_SCHEMA = pa.schema([
    ("request_id", pa.string()), ("post_id", pa.string()), ("video_path", pa.string()), ("media_path", pa.string()),
    ("caption", pa.string()), ("transcript", pa.string()), ("transcript_status", pa.string()),
    ("transcript_id", pa.string()), ("prompt", pa.string()), ("est_visual_tokens", pa.int64()),
    ("est_text_tokens", pa.int64()), ("est_prompt_tokens", pa.int64()), ("plan", pa.string()),
    ("items", pa.list_(ITEM_TYPE)), ("post_type", pa.string()), ("n_videos", pa.int64()), ("n_images", pa.int64()),
    ("n_audio", pa.int64()), ("est_video_tokens", pa.int64()), ("est_image_tokens", pa.int64()),
    ("est_audio_tokens", pa.int64()), ("items_dropped", pa.string()),
])
EXCLUDED_SCHEMA = pa.schema([("post_id", pa.string()), ("video_path", pa.string()), ("reason", pa.string()),
                             ("detail", pa.string())])
# The model's "yes" rate by post type: different enough that a by-type share is not the overall one.
YES_RATE = {"video": 0.25, "photo": 0.7, "slideshow": 0.5, "carousel": 0.15, "audio": 0.4}
SHARDS = 3


def _config():
    return vconfig.validate({"posts": "posts.csv", "media_root": "/data",
                             "classify": {"shards": SHARDS, "questions": QUESTIONS},
                             "stats": {"confidence": 0.95, "bootstrap_samples": 200},
                             "cost": {"gpu_hour_usd": 2.0, "gpus_per_job": 1}})


def _read_csv(path):
    with open(path) as fh:
        return list(csv.DictReader(fh))


def _f(x):
    return float(x) if x not in ("", None) else math.nan


def _item(index, kind, path, rng, error=None):
    visual = kind in ("video", "image") and error is None
    return {"index": index, "kind": None if error else kind, "path": path,
            "fps": 30.0 if kind == "video" and not error else None,
            "width": 1080 if visual else None, "height": 1920 if visual else None,
            "duration_s": float(rng.uniform(3, 60)) if kind in ("video", "audio") and not error else None,
            "probe_error": error}


def _plan_post(i, rng):
    """The items of post i: its intended shape (cycling through the types), some items unreadable."""
    shape = ["video", "photo", "slideshow", "carousel", "video", "slideshow", "photo", "carousel"][i % 8]
    if i % 97 == 5:
        shape = "audio"
    if i % 41 == 7:
        shape = "unusable"
    d = f"/data/p{i:04d}"
    if shape == "video":
        kinds = ["video"]
    elif shape == "photo":
        kinds = ["image"]
    elif shape == "slideshow":
        kinds = ["image"] * int(rng.integers(2, 9)) + ["audio"]
    elif shape == "carousel":
        kinds = list(rng.choice(["image", "video"], int(rng.integers(2, 6))))
    elif shape == "audio":
        kinds = ["audio"]
    else:
        kinds = ["video", "image"][: int(rng.integers(1, 3))]
    items = [_item(j, k, f"{d}/{j}.{'mp4' if k == 'video' else 'jpg' if k == 'image' else 'm4a'}", rng)
             for j, k in enumerate(kinds)]
    if shape == "unusable":
        items = [_item(j, it["kind"], it["path"], rng, error="moov atom not found") for j, it in enumerate(items)]
    elif shape == "carousel" and i % 3 == 0:  # one more item that cannot be read: dropped, the post stays
        items.append(_item(len(items), "image", f"{d}/{len(items)}.heic", rng, error="cannot identify image file"))
    return items


def _dropped(items):
    bad = [f"{it['index']}: {it['path']}: {it['probe_error']}" for it in items if it["probe_error"]]
    return "; ".join(bad) or None


@pytest.fixture
def mixed(tmp_path):
    """800 posts of every type; 3 slideshows too long to send, the posts with no usable item excluded,
    one carousel whose only image the manifest could not convert (sent as a video post)."""
    rng = np.random.default_rng(26)
    heard = np.random.default_rng(35)  # audio tokens on their own stream: the other draws stay as they were
    n = 800
    posts = {}
    for i in range(n):
        pid = f"p{i:04d}"
        items = _plan_post(i, rng)
        usable = [it for it in items if not it["probe_error"]]
        ptype = post_type([it["kind"] for it in usable])
        first_video = next((it["path"] for it in usable if it["kind"] == "video"), None)
        posts[pid] = {"post_id": pid, "source_path": f"p{i:04d}", "video_path": first_video,
                      "caption": f"caption {i}", "duration_s": None, "fps": None, "width": None, "height": None,
                      "probe_error": None if usable else "no usable item: " + _dropped(items),
                      "post_type": ptype, "n_items": len(items), "items": items,
                      "items_dropped": _dropped(items) if usable else None}
    order = list(rng.permutation(list(posts)))  # inventory order is not sorted
    pq.write_table(pa.Table.from_pylist([posts[p] for p in order], schema=INVENTORY_SCHEMA),
                   tmp_path / "inventory.parquet")

    unusable = [p for p, r in posts.items() if r["post_type"] is None]
    too_long = [p for p, r in posts.items() if r["post_type"] == "slideshow"][:3]
    excluded = {**{p: "no_usable_item" for p in unusable}, **{p: "too_long" for p in too_long}}
    pq.write_table(pa.Table.from_pylist([{"post_id": p, "video_path": posts[p]["video_path"], "reason": reason,
                                          "detail": posts[p]["probe_error"] or "estimate 140000 > 128000"}
                                         for p, reason in excluded.items()], schema=EXCLUDED_SCHEMA),
                   tmp_path / "excluded.parquet")

    # A carousel of one video and one image whose image the manifest could not convert: it is sent
    # as a video post, and labels.parquet says what was sent.
    converted = next(p for p, r in posts.items() if r["post_type"] == "carousel" and len(r["items"]) == 2
                     and sorted(it["kind"] for it in r["items"]) == ["image", "video"])
    manifest, truth, sent = {}, {}, {}
    for pid, r in posts.items():
        if pid in excluded:
            continue
        items = [it for it in r["items"] if not it["probe_error"]]
        dropped = r["items_dropped"]
        if pid == converted:
            lost = next(it for it in items if it["kind"] == "image")
            items = [it for it in items if it is not lost]
            dropped = f"{lost['index']}: {lost['path']}: cannot convert image"
        kinds = [it["kind"] for it in items]
        # Audio items are heard (classify.audio native): tokens of their own.
        est = [int(rng.integers(2_000, 30_000)) if k == "video" else int(rng.integers(300, 3_000)) if k == "image"
               else int(heard.integers(100, 1_500)) for k in kinds]
        sent_items = [{"index": it["index"], "kind": it["kind"], "path": it["path"],
                       "media_path": None if it["kind"] == "audio" else it["path"], "label": f"item {it['index']}",
                       "est_tokens": e, "transcript_id": None} for it, e in zip(items, est)]
        video = sum(e for k, e in zip(kinds, est) if k == "video")
        image = sum(e for k, e in zip(kinds, est) if k == "image")
        audio = sum(e for k, e in zip(kinds, est) if k == "audio")
        text = int(rng.integers(150, 900))
        first_video = next((it["path"] for it in items if it["kind"] == "video"), None)
        manifest[pid] = {"request_id": f"r-{pid}", "post_id": pid, "video_path": first_video,
                         "media_path": first_video, "caption": r["caption"], "transcript": "",
                         "transcript_status": "no_audio", "transcript_id": None, "prompt": "Q?",
                         "est_visual_tokens": video + image, "est_text_tokens": text,
                         "est_prompt_tokens": video + image + audio + text, "plan": "as-is", "items": sent_items,
                         "post_type": post_type(kinds), "n_videos": kinds.count("video"),
                         "n_images": kinds.count("image"), "n_audio": kinds.count("audio"),
                         "est_video_tokens": video, "est_image_tokens": image, "est_audio_tokens": audio,
                         "items_dropped": dropped}
        truth[pid] = bool(rng.random() < YES_RATE[post_type(kinds)])
        sent[pid] = post_type(kinds)
    ids = list(manifest)
    shard_of = {pid: k % SHARDS for k, pid in enumerate(ids)}
    for s in range(SHARDS):
        pq.write_table(pa.Table.from_pylist([manifest[p] for p in ids if shard_of[p] == s], schema=MANIFEST_SCHEMA),
                       tmp_path / f"manifest-{s}.parquet")

    records = {}
    for k, pid in enumerate(ids):
        m = manifest[pid]
        failed = k % 23 == 0
        says_yes = truth[pid] if rng.random() < 0.85 else not truth[pid]
        start = 100.0 + 2.0 * k
        records[pid] = {
            "request_id": m["request_id"], "post_id": pid, "shard": shard_of[pid],
            "status": "error" if failed else "ok", "error_kind": "bad_media" if failed else None,
            "error": "cannot decode item" if failed else None, "error_item": 0 if failed else None,
            "attempts": 1, "latency_s": 2.0, "started_at": start, "finished_at": start + 2.0,
            "prompt_tokens": None if failed else m["est_prompt_tokens"] + int(rng.integers(-50, 50)),
            "completion_tokens": None if failed else int(rng.integers(20, 200)),
            "answers": None if failed else json.dumps({"promotes_product": "yes" if says_yes else "no",
                                                       "shows_face": "yes" if k % 4 == 0 else "no"}),
            "model": "m", "server": "s", "settings_fingerprint": "f", "prompt_hash": "h"}
    label_paths = []
    for s in range(SHARDS):
        rows = [r for r in records.values() if r["shard"] == s]
        label_paths.append(tmp_path / f"labels-{s}.parquet")
        pq.write_table(pa.table({c: [r.get(c) for r in rows] for c in LABEL_SCHEMA.names}, schema=LABEL_SCHEMA),
                       label_paths[-1])
    return {"dir": tmp_path, "posts": posts, "order": order, "excluded": excluded, "manifest": manifest,
            "records": records, "truth": truth, "sent": sent, "converted": converted, "label_paths": label_paths,
            "manifest_paths": [tmp_path / f"manifest-{s}.parquet" for s in range(SHARDS)]}


def _merge(f, manifest=True):
    out = f["dir"] / "labels.parquet"
    merge.merge(_config(), f["dir"] / "inventory.parquet", f["dir"] / "excluded.parquet", f["label_paths"], out,
                manifest_paths=f["manifest_paths"] if manifest else None)
    return out


def _status(f, pid):
    return "excluded" if pid in f["excluded"] else f["records"][pid]["status"]


# ------------------------------------------------------------------------------------------
# merge

def test_merge_gives_every_post_its_type_items_and_token_estimates(mixed):
    f = mixed
    table = pq.read_table(_merge(f))
    assert table.column_names[-len(POST_COLUMNS):] == POST_COLUMNS
    assert {c: str(table.schema.field(c).type) for c in POST_COLUMNS} == {
        c: "string" if c in ("post_type", "items_dropped") else "int64" for c in POST_COLUMNS}
    rows = table.to_pylist()
    assert [r["post_id"] for r in rows] == f["order"]
    seen_types = set()
    for r in rows:
        pid, post = r["post_id"], f["posts"][r["post_id"]]
        usable = [it["kind"] for it in post["items"] if not it["probe_error"]]
        assert r["status"] == _status(f, pid)
        assert r["n_items"] == len(post["items"])
        m = f["manifest"].get(pid)
        if m is None:  # excluded: what the inventory found, no estimates
            assert r["post_type"] == post["post_type"]
            assert (r["n_videos"], r["n_images"], r["n_audio"]) == tuple(usable.count(k) for k in
                                                                         ("video", "image", "audio"))
            assert r["items_dropped"] == post["items_dropped"]
            assert [r[c] for c in POST_COLUMNS[6:]] == [None] * 5
        else:  # what was sent
            kinds = [it["kind"] for it in m["items"]]
            assert r["post_type"] == post_type(kinds)
            assert (r["n_videos"], r["n_images"], r["n_audio"]) == tuple(kinds.count(k) for k in
                                                                         ("video", "image", "audio"))
            assert r["items_dropped"] == m["items_dropped"]
            assert (r["est_video_tokens"], r["est_image_tokens"], r["est_audio_tokens"]) == tuple(
                sum(it["est_tokens"] for it in m["items"] if it["kind"] == kind)
                for kind in ("video", "image", "audio"))
            assert (r["est_text_tokens"], r["est_prompt_tokens"]) == (m["est_text_tokens"], m["est_prompt_tokens"])
            assert r["est_prompt_tokens"] == (r["est_video_tokens"] + r["est_image_tokens"] + r["est_audio_tokens"]
                                              + r["est_text_tokens"])
        seen_types.add(r["post_type"])
    assert seen_types == {"video", "photo", "slideshow", "carousel", "audio", None}
    by_id = {r["post_id"]: r for r in rows}
    # the post with no usable item: no type, its items listed, none usable
    gone = next(p for p, reason in f["excluded"].items() if reason == "no_usable_item")
    assert by_id[gone]["post_type"] is None and by_id[gone]["error_kind"] == "no_usable_item"
    assert by_id[gone]["n_items"] >= 1 and by_id[gone]["n_videos"] == by_id[gone]["n_images"] == 0
    # a slideshow too long to send keeps its type and items from the inventory
    long = next(p for p, reason in f["excluded"].items() if reason == "too_long")
    assert by_id[long]["post_type"] == "slideshow" and by_id[long]["n_audio"] == 1
    assert by_id[long]["n_images"] == by_id[long]["n_items"] - 1 and by_id[long]["est_prompt_tokens"] is None
    # a carousel with an unreadable item keeps the others and says which was dropped
    dropping = next(r for r in rows if r["post_type"] == "carousel" and r["items_dropped"])
    assert ": cannot identify image file" in dropping["items_dropped"]
    assert dropping["n_videos"] + dropping["n_images"] == dropping["n_items"] - 1
    # the carousel whose image the manifest could not convert was sent, and is labelled, as a video post
    c = by_id[f["converted"]]
    assert f["posts"][f["converted"]]["post_type"] == "carousel"
    assert (c["post_type"], c["n_items"], c["n_videos"], c["n_images"]) == ("video", 2, 1, 0)
    assert c["items_dropped"].endswith("cannot convert image") and c["est_image_tokens"] == 0
    # the label shards' error_item is carried
    failed = next(r for r in rows if r["status"] == "error")
    assert failed["error_item"] == 0


def test_merge_without_the_manifest_leaves_the_estimates_null(mixed):
    rows = pq.read_table(_merge(mixed, manifest=False)).to_pylist()
    assert all(r[c] is None for r in rows for c in POST_COLUMNS[6:])
    # the type then comes from the inventory alone (the converted carousel stays a carousel)
    by_id = {r["post_id"]: r for r in rows}
    assert by_id[mixed["converted"]]["post_type"] == "carousel"
    assert all(by_id[p]["post_type"] == mixed["posts"][p]["post_type"] for p in by_id)


def test_merge_refuses_a_manifest_that_does_not_fit_the_labels(mixed):
    f = mixed
    shard0 = pq.read_table(f["manifest_paths"][0]).to_pylist()
    pq.write_table(pa.Table.from_pylist(shard0[1:] + [shard0[2]], schema=MANIFEST_SCHEMA), f["manifest_paths"][0])
    with pytest.raises(merge.MergeError) as err:
        _merge(f)
    msg = str(err.value)
    assert f"duplicate post_id in the manifest shards: 1 post(s), e.g. {shard0[2]['post_id']}" in msg
    assert ("labelled post not in the manifest shards (stale label shard?): 1 post(s), "
            f"e.g. {shard0[0]['post_id']}") in msg
    assert not (f["dir"] / "labels.parquet").exists()


# ------------------------------------------------------------------------------------------
# aggregate

def _wilson(k, n, confidence=0.95):
    z = norm.ppf(1 - (1 - confidence) / 2)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return centre - half, centre + half


def _human_labels(f, path):
    """Uniform labels on 400 classified posts of every type but audio (whose rows must say why they
    have no corrected share): the truth of the fixture."""
    rng = np.random.default_rng(7)
    pool = sorted(p for p in f["records"] if f["sent"][p] != "audio")
    chosen = rng.choice(pool, 400, replace=False)
    rows = [{"post_id": p, "question": "promotes_product", "label": "yes" if f["truth"][p] else "no"} for p in chosen]
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, ["post_id", "question", "label"])
        w.writeheader()
        w.writerows(rows)
    return {r["post_id"]: 1.0 if r["label"] == "yes" else 0.0 for r in rows}


def test_aggregate_by_post_type(mixed):
    f = mixed
    labels = _merge(f)
    human = _human_labels(f, f["dir"] / "human.csv")
    summary = f["dir"] / "summary"
    aggregate.run(_config(), labels, f["dir"] / "human.csv", summary)
    classified = [p for p in f["records"]]
    answer = {p: (json.loads(r["answers"]) if r["answers"] else {}) for p, r in f["records"].items()}

    # prevalence_by_type.csv: per type and question, recomputed from the fixture
    by_type = _read_csv(summary / "prevalence_by_type.csv")
    types = ["video", "photo", "slideshow", "carousel", "audio"]
    assert [(r["post_type"], r["question"]) for r in by_type] == [(t, q["id"]) for t in types for q in QUESTIONS]
    overall = {r["question"]: r for r in _read_csv(summary / "prevalence.csv")}
    branches = set()
    for qid in ("promotes_product", "shows_face"):
        rows = [r for r in by_type if r["question"] == qid]
        assert sum(int(r["posts"]) for r in rows) == int(overall[qid]["posts"]) == len(classified)
        assert sum(int(r["yes"]) for r in rows) == int(overall[qid]["yes"])
    for r in by_type:
        posts = [p for p in classified if f["sent"][p] == r["post_type"]]
        answers = [answer[p].get(r["question"]) for p in posts]
        answered = [a for a in answers if a is not None]
        k = answered.count("yes")
        assert (int(r["posts"]), int(r["answered"]), int(r["yes"]), int(r["no_answer"])) == (
            len(posts), len(answered), k, len(posts) - len(answered))
        assert _f(r["model_share"]) == pytest.approx(k / len(answered))
        assert (_f(r["model_lo"]), _f(r["model_hi"])) == pytest.approx(_wilson(k, len(answered)))
        if r["question"] == "shows_face" or r["post_type"] == "audio":
            assert r["human_n"] == "0" and r["corrected"] == ""
            assert f"no usable human label for this question among the {r['post_type']} posts" in r["note"]
            continue
        # the corrected share over the type's classified posts: cross-fitted PPI++ on the labels that fall on it,
        # a failed post predicted as the type's model share
        share = k / len(answered)
        yhat_all = np.array([share if a is None else float(a == "yes") for a in answers])
        labelled = [j for j, p in enumerate(posts) if p in human]
        y = np.array([human[posts[j]] for j in labelled])
        yhat = yhat_all[labelled]
        est, se = crossfit_ppi(y, yhat, yhat_all)  # the reported estimate: lambda cross-fitted
        # the SQL's PPI++ moments themselves agree with ppi_py (the cross-check notes a disagreement)
        assert "ppi_py disagree" not in r["note"]
        assert int(r["human_n"]) == len(y) >= 20 and int(r["ppi_population"]) == len(posts)
        assert _f(r["human_share"]) == pytest.approx(y.mean())
        assert (_f(r["human_lo"]), _f(r["human_hi"])) == pytest.approx(_wilson(y.sum(), len(y)))
        assert _f(r["corrected"]) == pytest.approx(est, abs=1e-9) and r["corrected_method"].startswith("PPI++")
        events = min(y.sum(), len(y) - y.sum(), np.abs(y - yhat).sum())
        assert _f(r["corrected_se"]) == pytest.approx(se, rel=1e-9)
        branches.add(events >= 10)
        if events >= 10:
            q = student_t.ppf(0.975, events - 1)
            assert _f(r["corrected_lo"]) == pytest.approx(max(est - q * se, 0), abs=1e-9)
            assert _f(r["corrected_hi"]) == pytest.approx(min(est + q * se, 1), abs=1e-9)
        else:  # too few events: widened to contain the human-only interval
            assert _f(r["corrected_lo"]) <= _f(r["human_lo"]) and _f(r["corrected_hi"]) >= _f(r["human_hi"])
    assert branches == {True, False}  # both the t interval and the widened one are checked
    photo = next(r for r in by_type if r["post_type"] == "photo" and r["question"] == "promotes_product")
    carousel = next(r for r in by_type if r["post_type"] == "carousel" and r["question"] == "promotes_product")
    assert _f(photo["corrected"]) - _f(carousel["corrected"]) > 0.3  # the types differ, as made

    # post_types.csv: posts, statuses, items and tokens per type (the type of what was sent)
    type_of = {p: f["sent"].get(p, f["posts"][p]["post_type"]) for p in f["posts"]}
    rows = _read_csv(summary / "post_types.csv")
    assert [r["post_type"] for r in rows] == types + [""]
    for r in rows:
        mine = [p for p in f["posts"] if type_of[p] == (r["post_type"] or None)]
        ran = [p for p in mine if p in f["manifest"]]
        assert int(r["posts"]) == len(mine) and int(r["classified"]) == len(ran)
        assert [int(r[s]) for s in ("ok", "error", "excluded")] == [
            sum(_status(f, p) == s for p in mine) for s in ("ok", "error", "excluded")]
        n_items = [f["posts"][p]["n_items"] for p in mine]
        assert _f(r["items_mean"]) == pytest.approx(np.mean(n_items)) and int(r["items_max"]) == max(n_items)
        kinds = {p: [it["kind"] for it in f["manifest"][p]["items"]] if p in f["manifest"] else
                 [it["kind"] for it in f["posts"][p]["items"] if not it["probe_error"]] for p in mine}
        for column, kind in (("videos", "video"), ("images", "image"), ("audio", "audio")):
            assert int(r[column]) == sum(k.count(kind) for k in kinds.values()), (r["post_type"], column)
        dropped = [p for p in mine if (f["manifest"][p]["items_dropped"] if p in f["manifest"]
                                       else f["posts"][p]["items_dropped"])]
        assert int(r["posts_with_items_dropped"]) == len(dropped)
        for kind in ("video", "image", "audio", "text"):
            expected = np.mean([f["manifest"][p][f"est_{kind}_tokens"] for p in ran]) if ran else math.nan
            assert _f(r[f"est_{kind}_tokens_mean"]) == pytest.approx(expected, nan_ok=True)
        reported = [f["records"][p]["prompt_tokens"] for p in ran if f["records"][p]["prompt_tokens"] is not None]
        assert _f(r["input_tokens_mean"]) == pytest.approx(np.mean(reported) if reported else math.nan, nan_ok=True)
    no_type = rows[-1]
    unusable = sum(reason == "no_usable_item" for reason in f["excluded"].values())
    assert int(no_type["excluded"]) == int(no_type["posts"]) == unusable

    # tokens.csv: the manifest's estimates by kind over the requests that send that kind
    tok = {r["direction"]: r for r in _read_csv(summary / "tokens.csv")}
    assert list(tok) == ["input", "output", "input_video", "input_image", "input_audio", "input_text"]
    assert tok["input"]["source"] == "server usage" and tok["input_video"]["source"] == "manifest estimate"
    for kind in ("video", "image", "text"):
        v = np.array([f["manifest"][p][f"est_{kind}_tokens"] for p in classified], float)
        v = v[v > 0]
        t = tok[f"input_{kind}"]
        assert int(t["requests"]) == v.size and int(t["total"]) == v.sum() and int(t["max"]) == v.max()
        assert _f(t["mean"]) == pytest.approx(v.mean())
        for q in (50, 90, 99):
            assert _f(t[f"p{q}"]) == pytest.approx(np.percentile(v, q))
        assert t["prefill_decode_ratio"] == ""
    assert int(tok["input_image"]["requests"]) == sum(f["manifest"][p]["n_images"] > 0 for p in classified)

    # summary.md: the By post type section with each type's numbers
    md = (summary / "summary.md").read_text()
    section = md.split("## By post type", 1)[1].split("\n## ", 1)[0]
    for r in rows:
        name = r["post_type"] or "no type"
        assert (f"| {name} | {int(r['posts']):,} | {int(r['ok']):,} | {int(r['error']):,} | "
                f"{int(r['excluded']):,} | {_f(r['items_mean']):,.2f} ({int(r['items_max']):,}) |") in section, name
    for r in by_type:
        cells = f"| {r['post_type']} | {r['question']} | {int(r['answered']):,} of {int(r['posts']):,} | " \
                f"{100 * _f(r['model_share']):.1f}% ({100 * _f(r['model_lo']):.1f}%–{100 * _f(r['model_hi']):.1f}%) |"
        assert cells in section
        if r["corrected"]:
            assert (f"{100 * _f(r['corrected']):.1f}% ({100 * _f(r['corrected_lo']):.1f}%–"
                    f"{100 * _f(r['corrected_hi']):.1f}%) |") in section
    assert "- audio, promotes_product: no usable human label for this question among the audio posts" in section
    video_total = sum(f["manifest"][p]["est_video_tokens"] for p in classified)
    assert f"video {video_total:,}" in md

    # the histogram by kind: a PNG, one panel per kind
    png = summary / "plots" / "input_tokens_by_kind.png"
    assert png.read_bytes()[:8] == PNG_MAGIC
    import matplotlib.image
    height, width = matplotlib.image.imread(png).shape[:2]
    assert width > 2 * height  # three panels side by side



def test_two_phase_labels_by_post_type(mixed):
    """A two-phase sample (a uniform burn-in, then a draw with its own probabilities): each type's
    shares are the two-phase estimator's over the type's posts; the audio posts, which the burn-in
    missed, get no corrected share and say why."""
    from vidlabel.analyze import estimators
    from vidlabel.analyze.sample_design import file_digest, write_design

    f = mixed
    labels = _merge(f)
    rng = np.random.default_rng(11)
    frame = sorted(f["records"])
    pi0, weight = 0.15, 0.4
    burn_in = set(rng.choice([p for p in frame if f["sent"][p] != "audio"], int(pi0 * len(frame)), replace=False))
    answer = {p: (json.loads(r["answers"]) if r["answers"] else {}) for p, r in f["records"].items()}
    p_yes = {p: 0.8 if answer[p].get("promotes_product") == "yes" else 0.2 for p in frame}
    pi = {p: pi0 if p in burn_in else (0.9 if f["sent"][p] == "audio" else 0.1 + 0.3 * p_yes[p]) for p in frame}
    drawn = {p: p in burn_in or f["sent"][p] == "audio" or bool(rng.random() < pi[p]) for p in frame}
    design = f["dir"] / "design.parquet"
    write_design(design, {"post_id": frame, "status": [f["records"][p]["status"] for p in frame],
                          "uncertainty": [0.5] * len(frame), "pi": [pi[p] for p in frame],
                          "drawn": [drawn[p] for p in frame], "phase": [1 if p in burn_in else 2 for p in frame],
                          "design": ["burn_in" if p in burn_in else "second_phase" for p in frame],
                          "calibrated": [[p_yes[p], 0.3] for p in frame]},
                 {"design": "two_phase", "phase": 2, "pi_burn_in": pi0, "burn_in_posts": len(burn_in),
                  "combination": {"promotes_product": weight, "shows_face": weight},
                  "questions": ["promotes_product", "shows_face"], "frame_posts": len(frame),
                  "created_at": "2025-01-01T00:00:00Z", "labels_path": str(labels),
                  "labels_sha256": file_digest(labels), "seed": 1, "budget": 0, "mixture": 0.5})
    coded = [p for p in frame if drawn[p]]
    with open(f["dir"] / "human.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, ["post_id", "question", "label"])
        w.writeheader()
        w.writerows({"post_id": p, "question": "promotes_product", "label": "yes" if f["truth"][p] else "no"}
                    for p in coded)
    summary = f["dir"] / "summary"
    aggregate.run(_config(), labels, f["dir"] / "human.csv", summary, design)

    rows = {r["post_type"]: r for r in _read_csv(summary / "prevalence_by_type.csv")
            if r["question"] == "promotes_product"}
    audio = rows.pop("audio")
    assert int(audio["human_n"]) == sum(f["sent"][p] == "audio" for p in coded) > 0 and audio["corrected"] == ""
    assert "all come from the second draw of the two-phase sample, none from its uniform burn-in" in audio["note"]
    assert set(rows) == {"video", "photo", "slideshow", "carousel"}
    for ptype, r in rows.items():
        posts = [p for p in frame if f["sent"][p] == ptype]  # in post_id order, as the estimators see them
        answers = [answer[p].get("promotes_product") for p in posts]
        share = [a for a in answers if a is not None].count("yes") / sum(a is not None for a in answers)
        fhat = np.array([share if a is None else float(a == "yes") for a in answers])
        y = np.array([float(f["truth"][p]) if drawn[p] else np.nan for p in posts])
        first = np.array([p in burn_in for p in posts])
        second = np.array([drawn[p] and p not in burn_in for p in posts])
        prob = np.array([pi[p] if drawn[p] else 1.0 for p in posts])
        calibrated = np.array([p_yes[p] for p in posts])
        est = estimators.two_phase_mean(fhat, y, first, second, pi0, prob, weight, calibrated, 0.95)
        human = estimators.two_phase_share(y, first, second, pi0, prob, weight, 0.95)
        assert r["design"] == "two_phase" and r["corrected_method"].startswith("two-phase estimator"), ptype
        assert int(r["human_n"]) == int(first.sum() + second.sum()) and int(r["ppi_population"]) == len(posts)
        assert _f(r["corrected"]) == pytest.approx(min(1.0, max(0.0, float(est["estimate"]))), abs=1e-12), ptype
        assert _f(r["corrected_se"]) == pytest.approx(float(est["se"]), rel=1e-9), ptype
        assert _f(r["human_share"]) == pytest.approx(float(human["estimate"]), abs=1e-12), ptype


# ------------------------------------------------------------------------------------------
# inventories, manifests and labels from before posts had several items

def test_old_inventory_and_manifest_still_merge_and_aggregate(tmp_path):
    """A one-video inventory and manifest (today's shard schema before issue 26) and label shards
    without error_item: every video post is a video post of one item, its visual tokens its video's;
    a post whose probe failed has no type. Then labels.parquet without the post's columns at all."""
    from vidlabel.prepare.manifest import SHARD_SCHEMA

    # The shard's columns before posts had items: everything up to the plan.
    old_shard = pa.schema(list(SHARD_SCHEMA)[:SHARD_SCHEMA.get_field_index("plan") + 1])
    rng = np.random.default_rng(4)
    n = 120
    ids = [f"v{i:03d}" for i in range(n)]
    broken = set(ids[:6])
    too_long = set(ids[6:8])
    pq.write_table(pa.table({"post_id": ids, "video_path": [f"/data/{p}.mp4" for p in ids],
                             "caption": ["c"] * n,
                             "probe_error": ["moov atom not found" if p in broken else None for p in ids]}),
                   tmp_path / "inventory.parquet")
    excluded = sorted(broken | too_long)
    pq.write_table(pa.table({"post_id": excluded, "video_path": [f"/data/{p}.mp4" for p in excluded],
                             "reason": ["probe_error" if p in broken else "too_long" for p in excluded],
                             "detail": ["x"] * len(excluded)}), tmp_path / "excluded.parquet")
    sent = [p for p in ids if p not in broken | too_long]
    visual = {p: int(rng.integers(1_000, 20_000)) for p in sent}
    text = {p: int(rng.integers(100, 500)) for p in sent}
    manifest = {c: [] for c in old_shard.names}
    for p in sent:
        row = {"request_id": f"r{p}", "post_id": p, "video_path": f"/data/{p}.mp4", "media_path": f"/data/{p}.mp4",
               "caption": "c", "transcript": "", "transcript_status": "no_audio", "transcript_id": None,
               "prompt": "Q?", "est_visual_tokens": visual[p], "est_text_tokens": text[p],
               "est_prompt_tokens": visual[p] + text[p], "plan": "as-is"}
        for c in old_shard.names:
            manifest[c].append(row[c])
    pq.write_table(pa.table(manifest, schema=old_shard), tmp_path / "manifest-0.parquet")
    answers = {p: "yes" if rng.random() < 0.3 else "no" for p in sent}
    old_schema = pa.schema([f for f in LABEL_SCHEMA if f.name != "error_item"])  # shards before error_item
    record = {"request_id": [f"r{p}" for p in sent], "post_id": sent, "shard": [0] * len(sent),
              "status": ["ok"] * len(sent), "attempts": [1] * len(sent),
              "prompt_tokens": [visual[p] + text[p] for p in sent], "completion_tokens": [30] * len(sent),
              "started_at": [float(i) for i in range(len(sent))], "finished_at": [i + 1.0 for i in range(len(sent))],
              "answers": [json.dumps({"promotes_product": answers[p], "shows_face": "no"}) for p in sent]}
    pq.write_table(pa.table({c: record.get(c, [None] * len(sent)) for c in old_schema.names}, schema=old_schema),
        tmp_path / "labels-0.parquet")
    labels = tmp_path / "labels.parquet"
    merge.merge(_config(), tmp_path / "inventory.parquet", tmp_path / "excluded.parquet",
                [tmp_path / "labels-0.parquet"], labels, manifest_paths=[tmp_path / "manifest-0.parquet"])
    rows = {r["post_id"]: r for r in pq.read_table(labels).to_pylist()}
    for p, r in rows.items():
        values = [r[c] for c in POST_COLUMNS]
        if p in broken:
            assert values == [None, 1, 0, 0, 0, None, None, None, None, None, None], p
        elif p in too_long:
            assert values == ["video", 1, 1, 0, 0, None, None, None, None, None, None], p
        else:
            assert values == ["video", 1, 1, 0, 0, None, visual[p], 0, 0, text[p], visual[p] + text[p]], p
        assert r["error_item"] is None

    summary = tmp_path / "summary"
    aggregate.run(_config(), labels, None, summary)
    overall = _read_csv(summary / "prevalence.csv")
    by_type = _read_csv(summary / "prevalence_by_type.csv")
    # one type: its rows are the overall ones
    assert [r["post_type"] for r in by_type] == ["video", "video"]
    assert [{k: v for k, v in r.items() if k != "post_type"} for r in by_type] == overall
    assert int(by_type[0]["yes"]) == sum(a == "yes" for a in answers.values())
    types = {r["post_type"]: r for r in _read_csv(summary / "post_types.csv")}
    assert list(types) == ["video", ""]
    assert (types["video"]["posts"], types["video"]["ok"], types["video"]["excluded"]) == (
        str(n - len(broken)), str(len(sent)), str(len(too_long)))
    assert (types[""]["posts"], types[""]["excluded"], types[""]["videos"]) == (str(len(broken)),) * 2 + ("0",)
    tok = {r["direction"]: r for r in _read_csv(summary / "tokens.csv")}
    assert int(tok["input_video"]["total"]) == sum(visual.values()) and int(tok["input_video"]["requests"]) == len(sent)
    assert tok["input_image"]["requests"] == "0" and tok["input_image"]["total"] == ""
    assert "image 0 (0.0%; no request sends image)" in (summary / "summary.md").read_text()
    for name in aggregate.PLOTS:
        assert (summary / "plots" / f"{name}.png").read_bytes()[:8] == PNG_MAGIC

    # labels.parquet merged before the post's columns existed: every post is of no type
    pq.write_table(pq.read_table(labels).drop(POST_COLUMNS), labels)
    aggregate.run(_config(), labels, None, summary)
    by_type = _read_csv(summary / "prevalence_by_type.csv")
    assert [r["post_type"] for r in by_type] == ["", ""]
    assert [{k: v for k, v in r.items() if k != "post_type"} for r in by_type] == _read_csv(summary / "prevalence.csv")
    assert [r["post_type"] for r in _read_csv(summary / "post_types.csv")] == [""]
    md = (summary / "summary.md").read_text()
    assert f"| no type | {n:,} | {len(sent):,} | 0 | {len(excluded):,} | n/a |" in md
    assert "No classified post has an input-token estimate by kind" in md
