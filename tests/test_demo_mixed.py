"""The mixed demo posts: a photo post, a slideshow with a soundtrack and a carousel, probed item by
item and planned by tokens."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from vidlabel.core import config as cfgmod
from vidlabel.demo_mixed import make_mixed_set
from vidlabel.prepare import images
from vidlabel.prepare import post_plan as pp
from vidlabel.prepare.item_probe import probe_item
from vidlabel.prepare.inventory import build_inventory


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixed-demo")
    return root, make_mixed_set(root)


def test_every_item_is_probed_as_the_kind_it_is(mixed, tmp_path):
    root, expected = mixed
    out = tmp_path / "inventory.parquet"
    build_inventory({"posts": str(root / "posts-mixed.csv"), "media_root": str(root / "media")}, out, threads=2)
    rows = pq.read_table(out).to_pylist()
    assert [r["post_id"] for r in rows] == list(expected)
    for row in rows:
        post = expected[row["post_id"]]
        assert [i["probe_error"] for i in row["items"]] == [None] * len(post["media"]), row["post_id"]
        assert [i["kind"] for i in row["items"]] == post["kinds"], row["post_id"]
        assert [i["source_path"] for i in row["items"]] == post["media"]
        assert (row["post_type"], row["n_items"], row["items_dropped"], row["probe_error"]) == (
            post["post_type"], len(post["media"]), None, None)
        first_video = next((i["path"] for i in row["items"] if i["kind"] == "video"), row["items"][0]["path"])
        assert row["video_path"] == first_video


def test_the_slideshow_has_a_sideways_phone_photo_and_a_spoken_soundtrack(mixed):
    root, expected = mixed
    paths = [root / p for p in expected["slideshow-01"]["media"]]
    sideways = probe_item(paths[4])
    assert (sideways["width"], sideways["height"], sideways["orientation"]) == (1080, 1920, 6)
    assert "orientation 6" in images.server_image_problem(images.probe_image(paths[4]))
    assert probe_item(paths[3])["media_format"] == "webp"
    track = probe_item(paths[5])
    assert track["kind"] == "audio" and track["audio_codec"] == "aac" and track["duration_s"] > 2.0


def test_the_demo_posts_fit_as_they_are(mixed):
    root, expected = mixed
    cfg = cfgmod.validate({"posts": str(root / "posts-mixed.csv"), "media_root": str(root / "media")})
    for post_id, post in expected.items():
        infos = [probe_item(root / p) for p in post["media"]]
        items = [pp.Item(i["kind"], i["width"] or 0, i["height"] or 0, i["duration_s"] or 0, i["fps"] or 0)
                 for i in infos]
        plan = pp.plan_post(cfg, items, 200)
        assert plan.action == "as-is", (post_id, plan.plan)
        assert plan.items_by_kind == {k: post["kinds"].count(k) for k in set(post["kinds"])}
