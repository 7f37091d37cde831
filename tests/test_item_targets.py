"""The plan of a post of several items and its manifest row, from inventory item rows (no media opened):
which items the transcode stage must write, and what the manifest does when it did not."""

from __future__ import annotations

import pytest

from vidlabel.core import config as cfgmod
from vidlabel.prepare import item_targets, mixed_rows
from vidlabel.prepare.inventory_schema import ITEM_TYPE


def item(index: int, kind: str, width=0, height=0, duration_s=None, fps=None, **fields) -> dict:
    row = {f.name: None for f in ITEM_TYPE}
    row.update(post_id="p", caption="new shoes", index=index, kind=kind, path=f"/m/p-{index}", width=width,
               height=height, duration_s=duration_s, fps=fps, has_audio=kind != "image", **fields)
    if kind == "image":
        row.update(media_format="jpeg", image_mode="RGB")
    if kind == "video":
        row.update(video_codec="h264", header_frames=int(duration_s * fps), container="mov,mp4,m4a,3gp,3g2,mj2",
                   base_fps=fps, pix_fmt="yuv420p", rotation=0)
    return row


def post(*items) -> item_targets.MixedPost:
    from vidlabel.prepare.post_prompt import item_labels

    return item_targets.MixedPost("p", "new shoes", list(items), item_labels(i["kind"] for i in items))


@pytest.fixture
def cfg():
    return cfgmod.validate({"posts": "p.csv", "media_root": "/m"})


SPOKEN = {("p", 1): {"status": "ok", "text": "buy these", "transcript_id": "t1"}}


def rows(cfg, the_post, transcoded=None, transcripts=SPOKEN, exclude=True):
    return mixed_rows.post_rows(cfg, [the_post], transcripts, transcoded or {}, {}, exclude)


def test_a_pre_transcode_the_stage_did_not_write_falls_back_to_the_original(cfg):
    cfg["planning"]["transcode"]["enabled"] = True
    carousel = post(item(0, "image", 1080, 1350), item(1, "video", 720, 1280, 6.0, 30.0))
    (work,) = item_targets.work(cfg, carousel, item_targets.plan(cfg, carousel, 300), {})
    assert (work.index, work.action, work.required) == (1, "transcode", False)
    out = rows(cfg, carousel)
    assert not out.excluded
    (row,) = out.kept
    assert row["items"][1]["media_path"] == "/m/p-1" and row["plan"] == "as-is; item 1 as-is"
    # Written, it is what the server reads, counted from its own size and rate.
    done = {("p", 1, ""): {"status": "ok", "media_path": "/t/p-1.mp4", "width": 504, "height": 896, "fps": 2.0,
                       "duration_s": 6.0, "error": None}}
    (row,) = rows(cfg, carousel, done).kept
    assert row["items"][1]["media_path"] == "/t/p-1.mp4"
    assert row["items"][1]["est_tokens"] == 6 * 18 * 32 + 2  # 6 s at 2 fps: 12 frames, 6 pairs of 18x32 cells


def test_photos_planned_smaller_need_the_transcode_stages_files(cfg):
    slideshow = post(*[item(i, "image", 1080, 1920) for i in range(20)], item(20, "audio", duration_s=20.0))
    plan = item_targets.plan(cfg, slideshow, 300)
    assert plan.action == "replan"
    works = item_targets.work(cfg, slideshow, plan, {})
    assert len(works) == 20 and all(w.required and w.action == "convert" and w.width % 28 == 0 for w in works)
    transcripts = {("p", 20): {"status": "ok", "text": "a song", "transcript_id": "t"}}
    out = rows(cfg, slideshow, transcripts=transcripts)
    assert out.excluded[0][2] == "too_long" and "run the transcode rule" in out.excluded[0][3]
    failed = {("p", i, ""): {"status": "error", "error": "disk full", "media_path": None} for i in range(20)}
    out = rows(cfg, slideshow, failed, transcripts=transcripts)
    assert out.excluded[0][2] == "transcode_error" and "disk full" in out.excluded[0][3]
    # Without its soundtrack's transcript the reason is that, before its length (as for one-video posts:
    # tests/test_manifest.py).
    out = rows(cfg, slideshow, failed, transcripts={})
    assert out.excluded[0][2] == "transcript_error"


def test_a_missing_soundtrack_transcript_is_never_no_speech(cfg):
    slideshow = post(item(0, "image", 1080, 1920), item(1, "audio", duration_s=10.0))
    out = rows(cfg, slideshow, transcripts={})
    assert out.excluded == [("p", "/m/p-0", "transcript_error", "item 1: no transcript in the transcript chunks")]
    (row,) = rows(cfg, slideshow, transcripts={}, exclude=False).kept
    assert row["transcript_status"] == "unavailable"
    assert "Soundtrack transcript: (transcript unavailable)" in row["prompt"] and "(no speech)" not in row["prompt"]
    (row,) = rows(cfg, slideshow).kept
    assert row["transcript"] == "Soundtrack transcript: buy these" and row["items"][1]["transcript_id"] == "t1"
