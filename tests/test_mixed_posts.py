"""Posts of several media items through the real workflow (`snakemake --profile profiles/local`), only the
GPU server stood in: the mixed demo posts (a photo, a slideshow with a spoken soundtrack and a sideways
phone photo, a carousel of photos and a clip), a one-video post, a 35-photo slideshow at phone size, a
post with one broken item and one with nothing usable.

What is checked, each against a computation here: the inventory's items and post types; one transcript
per item with sound; the manifest's items, labels, per-item token estimates (images: smart_resize within
the image bounds, two vision markers each), the context gate on the 35-photo slideshow (a lower image
bound that fits, the photos written at their planned size); post_plans.csv and media_limits.json; the
requests the stand-in received (image_url / video_url parts in the post's order, each after its label);
and the labels through merge and aggregate.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import manifest_dir, model_dir, run_snakemake, write_overlay
from PIL import Image
from standin import is_probe, read_request_log, standin_command

from vidlabel import families
from vidlabel.core import config as cfgmod
from vidlabel.demo import make_video
from vidlabel.demo_mixed import camera_photo, make_mixed_set
from vidlabel.prepare import planning
from vidlabel.prepare.post_prompt import item_labels

pytestmark = pytest.mark.slow

RULES = {"promotes_product": "shoe", "sales_interaction": "link"}
LONG = 35  # photos in the long slideshow: ~94k visual tokens at the default image bound


@pytest.fixture(scope="module")
def posts(tmp_path_factory):
    """The posts table (the mixed demo posts and the others above) and what each post should become."""
    root = tmp_path_factory.mktemp("mixed")
    expected = make_mixed_set(root)
    media = root / "media" / "more"
    long = [camera_photo(media / "long" / f"{i:02d}.jpg", (1080, 1920), seed=100 + i) for i in range(LONG)]
    track = root / expected["slideshow-01"]["media"][-1]
    make_video(media / "talk.mp4", text="Buy this blender, the link is in my bio.", size=(360, 640), fps=15)
    broken = media / "broken.jpg"
    broken.write_bytes(b"\xff\xd8 not really a jpeg")
    good = camera_photo(media / "good.jpg", (1200, 900), seed=7)
    rows = [
        ("long-slideshow", [*long, track], "35 outfits for the week"),
        ("video-01", [media / "talk.mp4"], "kitchen gadgets"),
        ("one-dropped", [good, broken], "a photo and a broken file"),
        ("nothing-usable", [broken, media / "missing.mp4"], "all gone"),
    ]
    with open(root / "posts-mixed.csv", "a", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        for post_id, files, caption in rows:
            writer.writerow([post_id, json.dumps([f.relative_to(root).as_posix() for f in files]), caption, "dev"])
    expected["long-slideshow"] = {"post_type": "slideshow", "kinds": ["image"] * LONG + ["audio"]}
    expected["video-01"] = {"post_type": "video", "kinds": ["video"]}
    expected["one-dropped"] = {"post_type": "photo", "kinds": ["image"]}
    return root, expected


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, posts):
    root, _ = posts
    work = tmp_path_factory.mktemp("mixed-run")
    yes_if = [arg for qid, word in RULES.items() for arg in ("--yes-if", f"{qid}={word}")]
    command = standin_command(sys.executable, work / "requests.jsonl", *yes_if, "--latency", "0.02")
    write_overlay(work, root, {"posts": str(root / "posts-mixed.csv"), "classify": {"server_command": command,
                                                                                    "shards": 1}})
    return work


@pytest.fixture(scope="module")
def manifested(workdir):
    # The overlay's one model is planned as qwen2_5_vl with transcripts (vidlabel.core.models.plan_name).
    run_snakemake(workdir, "results/manifest/qwen2_5_vl/plan.csv")
    return workdir


@pytest.fixture(scope="module")
def finished(manifested):
    run_snakemake(manifested)
    return manifested


def shard_rows(workdir) -> dict[str, dict]:
    return {r["post_id"]: r for r in pq.read_table(manifest_dir(workdir / "results") / "shard-0.parquet").to_pylist()}


def config(workdir) -> dict:
    return cfgmod.validate({"posts": "p.csv", "media_root": str(workdir)})


def test_the_inventory_probes_every_item(manifested, posts):
    _, expected = posts
    rows = {r["post_id"]: r for r in pq.read_table(manifested / "results" / "inventory.parquet").to_pylist()}
    assert set(rows) == set(expected) | {"nothing-usable"}
    for post_id, exp in expected.items():
        usable = [i["kind"] for i in rows[post_id]["items"] if i["probe_error"] is None]
        assert usable == exp["kinds"], post_id
        assert rows[post_id]["post_type"] == exp["post_type"] and rows[post_id]["probe_error"] is None
    dropped = rows["one-dropped"]
    assert dropped["n_items"] == 2 and dropped["items_dropped"].startswith("1: ") and "broken.jpg" in \
        dropped["items_dropped"]
    gone = rows["nothing-usable"]
    assert gone["post_type"] is None and gone["probe_error"].startswith("no usable item: 0: ")
    assert "missing" in gone["probe_error"] and gone["n_items"] == 2


def test_every_item_with_sound_is_transcribed_once(manifested, posts):
    root, expected = posts
    rows = [r for c in sorted((manifested / "results" / "transcripts").glob("chunk-*.parquet"))
            for r in pq.read_table(c).to_pylist()]
    keys = [(r["post_id"], r["item_index"]) for r in rows]
    assert len(keys) == len(set(keys))
    assert set(keys) == {("slideshow-01", 5), ("carousel-01", 1), ("long-slideshow", LONG), ("video-01", 0)}
    by_key = {(r["post_id"], r["item_index"]): r for r in rows}
    assert "shoe" in by_key[("slideshow-01", 5)]["text"].lower()
    assert "pasta" in by_key[("carousel-01", 1)]["text"].lower()
    # The soundtrack two posts share is one audio file: one transcript identity for both.
    assert by_key[("slideshow-01", 5)]["transcript_id"] == by_key[("long-slideshow", LONG)]["transcript_id"]
    journal = manifested / "results" / "transcripts"
    records = [json.loads(line) for j in journal.glob("chunk-*.jsonl") for line in j.read_text().splitlines()]
    assert len(records) == 3  # three distinct files with sound


def test_the_manifest_sends_every_item_labelled_with_its_tokens(manifested, posts):
    root, expected = posts
    rows = shard_rows(manifested)
    assert set(rows) == set(expected)
    cfg = config(manifested)
    family, bounds = families.of_config(cfg), planning.image_bounds(cfg)
    for post_id in ("photo-01", "slideshow-01", "carousel-01", "one-dropped"):
        row = rows[post_id]
        kinds = [i["kind"] for i in row["items"]]
        assert kinds == expected[post_id]["kinds"] and row["post_type"] == expected[post_id]["post_type"]
        assert [i["label"] for i in row["items"]] == item_labels(kinds)
        for item in row["items"]:
            if item["kind"] != "image":
                continue
            with Image.open(item["media_path"]) as image:  # the file the server reads, as it shows it
                size = image.size if image.getexif().get(0x0112) in (None, 1) else image.size[::-1]
            assert item["est_tokens"] == family.image_tokens([size[0]], [size[1]], bounds)[0], (post_id, item)
        assert row["est_image_tokens"] == sum(i["est_tokens"] for i in row["items"] if i["kind"] == "image")
        assert row["est_prompt_tokens"] == row["est_video_tokens"] + row["est_image_tokens"] + row["est_text_tokens"]
        assert (row["n_images"], row["n_videos"], row["n_audio"]) == tuple(kinds.count(k) for k in
                                                                         ("image", "video", "audio"))
    slideshow = rows["slideshow-01"]
    sideways = slideshow["items"][4]
    # Stored sideways with an orientation tag: sent upright, converted once by the transcode stage.
    assert sideways["media_path"] != sideways["path"] and sideways["media_path"].endswith(".jpg")
    assert "Soundtrack transcript: " in slideshow["transcript"] and "shoe" in slideshow["prompt"].lower()
    assert slideshow["items"][5]["media_path"] is None and slideshow["items"][5]["transcript_id"]
    assert rows["carousel-01"]["video_path"] == rows["carousel-01"]["items"][1]["path"]
    assert rows["photo-01"]["video_path"] is None
    assert rows["one-dropped"]["items_dropped"].startswith("1: ")
    # A one-video post is sent as it always was: one unlabelled video, its transcript the post's.
    video = rows["video-01"]
    assert video["post_type"] == "video" and video["items"][0]["label"] is None
    assert video["items"][0]["est_tokens"] == video["est_visual_tokens"]  # its markers included
    assert "link" in video["transcript"].lower() and video["transcript_id"] == video["items"][0]["transcript_id"]
    excluded = {r["post_id"]: r for r in pq.read_table(manifest_dir(manifested / "results") / "excluded.parquet")
                .to_pylist()}
    assert set(excluded) == {"nothing-usable"} and excluded["nothing-usable"]["reason"] == "probe_error"


def test_a_35_photo_slideshow_is_planned_down_to_fit(manifested):
    cfg = config(manifested)
    row = shard_rows(manifested)["long-slideshow"]
    family, bounds = families.of_config(cfg), planning.image_bounds(cfg)
    full = int(family.image_tokens(np.full(LONG, 1080), np.full(LONG, 1920), bounds).sum())
    assert full > 90_000  # as-is it would be far over the 32k context
    match = re.search(r"images max_pixels 12845056->(\d+)", row["plan"])
    assert match, row["plan"]
    bound = int(match.group(1))
    c = cfg["classify"]
    budget = (c["max_model_len"] - c["max_tokens"] - row["est_text_tokens"]) / 1.02
    assert row["est_visual_tokens"] <= budget
    for item in row["items"][:LONG]:
        with Image.open(item["media_path"]) as image:
            width, height = image.size
        assert width % 28 == 0 and height % 28 == 0 and width * height <= bound, (width, height, bound)
        assert item["est_tokens"] == (width // 28) * (height // 28) + 2
    # One cell more per photo would not fit: the highest bound that does.
    more = LONG * (family.image_embeds([1080], [1920], bounds, bound + 28 * 28 * LONG)[0] + 2)
    assert more > budget or bound + 28 * 28 >= 12845056
    plans = {r["post_id"]: r for r in csv.DictReader(open(manifest_dir(manifested / "results") / "post_plans.csv"))}
    assert plans["long-slideshow"]["status"] == "kept" and plans["long-slideshow"]["plan"] == row["plan"]
    limits = json.loads((manifest_dir(manifested / "results") / "media_limits.json").read_text())
    items = [i for r in shard_rows(manifested).values() for i in r["items"]]
    assert limits == {"image": LONG, "video": 1, "audio": 0,  # its audio goes as its transcript
                      "largest_item_tokens": max(i["est_tokens"] for i in items)}


def media_sent(events) -> dict[str, list[str]]:
    """The files the stand-in read per request id, in the request's order (first attempt only)."""
    out: dict[str, list[str]] = {}
    first: dict[str, int] = {}
    for event in events:
        rid = event["request_id"]
        if is_probe(rid):
            continue
        if event["event"] == "received":
            first.setdefault(rid, event["attempt"])
            out.setdefault(rid, [])
        elif event["event"] == "media" and first.get(rid) == 1 and len(out[rid]) < 64:
            out[rid].append(event["path"])
    return out


def test_requests_and_labels_of_mixed_posts(finished, posts):
    _, expected = posts
    rows = shard_rows(finished)
    events = read_request_log(finished / "requests.jsonl")
    sent = media_sent(events)
    assert set(sent) == {r["request_id"] for r in rows.values()}
    for post_id, row in rows.items():  # every image and video, in the post's order; audio goes as text
        assert sent[row["request_id"]] == [os.path.realpath(i["media_path"]) for i in row["items"] if i["media_path"]]
    labels = {r["post_id"]: r for r in pq.read_table(model_dir(finished / "results") / "labels.parquet").to_pylist()}
    assert labels["nothing-usable"]["status"] == "excluded"
    for post_id, row in rows.items():
        assert labels[post_id]["status"] == "ok", labels[post_id]
        said = f"{row['caption']} {row['transcript']}".lower()
        assert labels[post_id]["promotes_product"] == ("yes" if RULES["promotes_product"] in said else "no"), post_id
    assert labels["slideshow-01"]["promotes_product"] == "yes" and labels["carousel-01"]["promotes_product"] == "no"
    # A second run sends nothing: every answer is journaled under its items' identities.
    before = len(events)
    run_snakemake(finished)
    assert not [e for e in read_request_log(finished / "requests.jsonl")[before:]
                if e["event"] == "received" and not is_probe(e["request_id"])]
    # One photo of the carousel replaced at its path: that post alone is sent again.
    photo = next(i["path"] for i in rows["carousel-01"]["items"] if i["kind"] == "image")
    shutil.copy(next(i["path"] for i in rows["photo-01"]["items"]), photo)
    run_snakemake(finished)
    again = {e["request_id"] for e in read_request_log(finished / "requests.jsonl")[before:]
             if e["event"] == "received" and not is_probe(e["request_id"])}
    assert again == {rows["carousel-01"]["request_id"]}
