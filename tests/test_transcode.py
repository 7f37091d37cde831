"""Pre-transcode: output fps, size and frame count checked with a probe; failures are records."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from planning_helpers import inventory_row, make_clip, write_inventory

from vidlabel import families
from vidlabel.core import config as cfgmod
from vidlabel.prepare import planning as pl
from vidlabel.prepare import transcode as tc


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    return {
        "land": make_clip(d / "land.mp4", 640, 360, 5),
        "port": make_clip(d / "port.mp4", 1080, 1920, 4),
        "long": make_clip(d / "long.mp4", 640, 360, 30, rate=10),
        "text": _text_file(d / "notavideo.mp4"),
        "root": d,
    }


def _text_file(path):
    path.write_text("this is not a video\n")
    return path


def make_config(root, tmp_path, **planning) -> dict:
    cfg = cfgmod.validate({"posts": "p.csv", "media_root": str(root), "results": str(tmp_path / "results")})
    cfg["planning"]["transcode"].update({"chunks": 1, **planning.pop("transcode", {})})
    cfg["planning"].update(planning)
    return cfg


def inventory(clips, tmp_path):
    rows = [
        inventory_row("land", clips["land"], duration_s=5.0, fps=30.0, width=640, height=360, caption="hi"),
        inventory_row("port", clips["port"], duration_s=4.0, fps=30.0, width=1080, height=1920),
        inventory_row("long", clips["long"], duration_s=30.0, fps=10.0, width=640, height=360),
        # Probed fine earlier, unreadable now: the transcode must record, not crash.
        inventory_row("text", clips["text"], duration_s=3.0, fps=30.0, width=640, height=360),
        inventory_row("gone", clips["root"] / "missing.mp4", probe_error="No such file or directory"),
    ]
    return write_inventory(rows, tmp_path / "inventory.parquet")


def test_transcode_all_posts_to_the_planned_fps_and_size(clips, tmp_path):
    cfg = make_config(clips["root"], tmp_path, transcode={"enabled": True})
    inv = inventory(clips, tmp_path)
    out = tmp_path / "transcoded" / "chunk-0.parquet"
    table = tc.run_chunk(cfg, inv, 0, out, tmp_path / "media-out")
    rows = {r["post_id"]: r for r in pq.read_table(out).to_pylist()}
    assert set(rows) == {"land", "port", "long", "text"}  # the probe-error post is not this stage's
    # 640x360 -> 644x364 (nearest 28-multiples), 2 fps over 5 s = 10 frames.
    for pid, (w, h, frames) in {"land": (644, 364, 10), "port": (560, 1008, 8), "long": (644, 364, 60)}.items():
        r = rows[pid]
        assert r["status"] == "ok", r
        probed = tc.probe_output(r["media_path"])
        assert (probed["width"], probed["height"], probed["frames"]) == (w, h, frames)
        assert (r["width"], r["height"], r["frames"]) == (w, h, frames)
        assert probed["fps"] == pytest.approx(2.0, rel=0.02)
        assert r["plan"] == "as-is"
        with __import__("av").open(r["media_path"]) as c:
            assert len(c.streams.audio) == 0
    bad = rows["text"]
    assert bad["status"] == "error" and bad["media_path"] is None
    assert "Invalid data" in bad["error"] or "moov atom" in bad["error"]
    assert table.num_rows == 4


def test_disabled_transcodes_only_replanned_posts_and_resumes(clips, tmp_path):
    # A small context: the 30 s clip (60 frames = 30 pairs * 299 cells = 8,970 tokens) cannot fit.
    cfg = make_config(clips["root"], tmp_path)
    cfg["classify"]["max_model_len"] = 4096
    inv = inventory(clips, tmp_path)
    out = tmp_path / "transcoded" / "chunk-0.parquet"
    media = tmp_path / "media-out"
    tc.run_chunk(cfg, inv, 0, out, media)
    rows = {r["post_id"]: r for r in pq.read_table(out).to_pylist()}
    assert set(rows) == {"long"}
    r = rows["long"]
    assert r["status"] == "ok" and r["plan_action"] == "replan" and r["plan"].startswith("replan: ")
    probed = tc.probe_output(r["media_path"])
    # The file the server reads has exactly the plan's frames and size, and fits the context.
    plan = pl.plan_posts(cfg, [30.0], [10.0], [640], [360],
                         pl.text_tokens_for(cfg, [None], None, [30.0]))
    fps, w, h = pl.transcode_target(cfg, plan.fps, plan.max_pixels, [640.0], [360.0], [10.0])
    assert (probed["width"], probed["height"]) == (int(w[0]), int(h[0]))
    assert probed["frames"] == round(30 * float(fps[0]))
    est = pl.media_estimate(cfg, [probed["duration_s"]], [probed["fps"]], [probed["width"]], [probed["height"]])
    assert int(est.tokens[0]) <= int(plan.visual_tokens[0]) + (int(w[0]) // 28) * (int(h[0]) // 28)
    assert int(est.tokens[0]) + int(plan.text_tokens[0]) + 512 <= 4096

    # Resume: a rerun re-encodes nothing and keeps the same file.
    journal = out.with_suffix(".jsonl")
    before = journal.read_text()
    mtime = (media / r["media_path"].split("/")[-1]).stat().st_mtime_ns
    tc.run_chunk(cfg, inv, 0, out, media)
    assert journal.read_text() == before
    assert (media / r["media_path"].split("/")[-1]).stat().st_mtime_ns == mtime
    assert [json.loads(x)["post_id"] for x in before.splitlines()] == ["long"]


def test_transcode_file_failure_message(tmp_path):
    with pytest.raises(RuntimeError, match="No such file or directory"):
        tc.transcode_file(str(tmp_path / "absent.mp4"), tmp_path / "o.mp4", 2, 280, 280)
    assert not (tmp_path / "o.mp4").exists()
    assert list(tmp_path.iterdir()) == []  # no temporary file left behind


def test_trim(clips, tmp_path):
    dst = tmp_path / "t.mp4"
    tc.transcode_file(str(clips["long"]), dst, 1.0, 336, 196, duration_s=12.0)
    probed = tc.probe_output(dst)
    assert probed["frames"] == 12 and probed["duration_s"] == pytest.approx(12.0, abs=0.6)
    assert (probed["width"], probed["height"]) == (336, 196)


# ------------------------------------------------------------------ real formats and short clips

def _ffmpeg(*args):
    import subprocess

    subprocess.run(["ffmpeg", "-nostdin", "-v", "error", "-y", *map(str, args)], check=True, capture_output=True)


def _av1_encoder() -> str | None:
    import subprocess

    listed = subprocess.run(["ffmpeg", "-hide_banner", "-encoders"], capture_output=True, text=True).stdout
    for name in ("libsvtav1", "libaom-av1", "librav1e"):
        if f" {name} " in listed:
            return name
    return None


@pytest.fixture(scope="module")
def formats(tmp_path_factory):
    """Small real files in the formats users download; AV1 only where this ffmpeg has an encoder."""
    d = tmp_path_factory.mktemp("formats")
    src = ["-f", "lavfi", "-i", "testsrc2=size=320x240:rate=30"]
    files = {
        "h264": (d / "h264.mp4", [*src, "-t", 2, "-c:v", "libx264", "-preset", "ultrafast", "-pix_fmt", "yuv420p"]),
        "h264_444_10bit": (d / "h264-444-10.mov", [*src, "-t", 2, "-c:v", "libx264", "-preset", "ultrafast",
                                                   "-pix_fmt", "yuv444p10le"]),
        "hevc_10bit": (d / "hevc-10.mkv", [*src, "-t", 2, "-c:v", "libx265", "-preset", "ultrafast",
                                           "-pix_fmt", "yuv420p10le", "-x265-params", "log-level=error"]),
        "vp9": (d / "vp9.webm", [*src, "-t", 2, "-c:v", "libvpx-vp9", "-deadline", "realtime", "-cpu-used", 8]),
        "mpeg4": (d / "mpeg4.avi", [*src, "-t", 2, "-c:v", "mpeg4"]),
        "half_second": (d / "half.mp4", [*src, "-t", 0.5, "-c:v", "libx264", "-preset", "ultrafast"]),
        "fifth_second": (d / "fifth.mp4", [*src, "-t", 0.2, "-c:v", "libx264", "-preset", "ultrafast"]),
        "one_frame": (d / "one-frame.mp4", ["-f", "lavfi", "-i", "color=c=red:s=320x240:r=1", "-frames:v", 1,
                                            "-c:v", "libx264", "-preset", "ultrafast"]),
    }
    encoder = _av1_encoder()
    if encoder:
        files["av1"] = (d / "av1.mp4", [*src, "-t", 2, "-c:v", encoder, "-pix_fmt", "yuv420p"]
                        + (["-preset", 12] if encoder == "libsvtav1" else ["-cpu-used", 8]))
    for path, args in files.values():
        _ffmpeg(*args, path)
    return {name: path for name, (path, _) in files.items()}, d


def _probed_inventory(formats, tmp_path, broken_av1=False):
    """The inventory stage on the real files (PyAV probes), as the workflow builds it."""
    import pyarrow as pa

    from vidlabel.prepare.inventory import build_inventory

    files, root = formats
    posts = tmp_path / "posts.csv"
    posts.write_text("post_id,video_path\n" + "".join(f"{k},{v}\n" for k, v in files.items()))
    cfg = make_config(root, tmp_path)
    cfg["posts"] = str(posts)
    inv = tmp_path / "inventory.parquet"
    build_inventory(cfg, inv, threads=2)
    table = pq.read_table(inv)
    if "av1" not in files:
        # No AV1 encoder in this ffmpeg: an H.264 file recorded as AV1 stands in (what the planner
        # sees is the probed codec name).
        codecs = ["av1" if p == "h264" else c for p, c in zip(table.column("post_id").to_pylist(),
                                                               table.column("video_codec").to_pylist())]
        table = table.set_column(table.column_names.index("video_codec"), "video_codec", pa.array(codecs))
    if broken_av1:
        # Probed as AV1, unreadable by the time the transcoder runs: neither can decode it.
        av1_path = next(r["video_path"] for r in table.to_pylist() if r["video_codec"] == "av1")
        (tmp_path / "gone.mp4").write_text("not a video any more\n")
        paths = [str(tmp_path / "gone.mp4") if p == av1_path else p for p in table.column("video_path").to_pylist()]
        table = table.set_column(table.column_names.index("video_path"), "video_path", pa.array(paths))
    if broken_av1 or "av1" not in files:
        # The post columns were edited: the stages read the items from them (an inventory without items).
        table = table.drop_columns(["items"])
    pq.write_table(table, inv)
    return cfg, inv, table


def test_every_format_reaches_the_server_in_a_form_it_decodes(formats, tmp_path):
    """Transcoding disabled: only the codecs the server cannot decode and the too-short files are
    transcoded, to H.264 with at least a frame pair; the rest go as they are."""
    cfg, inv, table = _probed_inventory(formats, tmp_path)
    codec = dict(zip(table.column("post_id").to_pylist(), table.column("video_codec").to_pylist()))
    assert codec["hevc_10bit"] == "hevc" and codec["vp9"] == "vp9" and codec["mpeg4"] == "mpeg4"
    if "av1" in formats[0]:
        assert codec["av1"] == "av1"  # the codec, not the decoder PyAV picked (libdav1d)
    assert all(e is None for e in table.column("probe_error").to_pylist())
    out = tmp_path / "transcoded" / "chunk-0.parquet"
    tc.run_chunk(cfg, inv, 0, out, tmp_path / "media-out")
    rows = {r["post_id"]: r for r in pq.read_table(out).to_pylist()}
    av1_post = "av1" if "av1" in formats[0] else "h264"
    assert set(rows) == {av1_post, "mpeg4", "one_frame"}
    assert rows[av1_post]["plan"].startswith("transcode to h264: the server cannot decode av1")
    assert rows["mpeg4"]["plan"].startswith("transcode to h264: codec mpeg4 is not among those measured")
    assert rows["one_frame"]["plan"].startswith("transcode to h264: 1 frame(s) in the file")
    for r in rows.values():
        assert r["status"] == "ok" and r["plan_action"] == "replan", r
        with __import__("av").open(r["media_path"]) as c:
            assert c.streams.video[0].codec_context.name == "h264"
        assert tc.probe_output(r["media_path"])["frames"] >= families.of_config(cfg).min_file_frames


def test_short_clips_are_transcoded_with_enough_frames(formats, tmp_path):
    """A 0.5 s clip at 2 fps would be one frame, on which vLLM's sampler divides by zero."""
    cfg, inv, _ = _probed_inventory(formats, tmp_path)
    cfg["planning"]["transcode"]["enabled"] = True
    out = tmp_path / "transcoded" / "chunk-0.parquet"
    tc.run_chunk(cfg, inv, 0, out, tmp_path / "media-out")
    rows = {r["post_id"]: r for r in pq.read_table(out).to_pylist()}
    assert len(rows) == len(formats[0])
    for pid, r in rows.items():
        assert r["status"] == "ok", r
        probed = tc.probe_output(r["media_path"])
        assert probed["frames"] >= families.of_config(cfg).min_file_frames, (pid, probed)
    assert rows["h264"]["frames"] == 4  # 2 s at 2 fps: the planned rate where it gives enough frames


def test_a_file_neither_the_server_nor_the_transcoder_reads_is_an_error_record(formats, tmp_path):
    cfg, inv, table = _probed_inventory(formats, tmp_path, broken_av1=True)
    out = tmp_path / "transcoded" / "chunk-0.parquet"
    tc.run_chunk(cfg, inv, 0, out, tmp_path / "media-out")
    rows = {r["post_id"]: r for r in pq.read_table(out).to_pylist()}
    bad = rows["av1" if "av1" in formats[0] else "h264"]
    assert bad["status"] == "error" and bad["media_path"] is None
    assert bad["plan_action"] == "replan" and "the server cannot decode av1" in bad["plan"]
    assert "Invalid data" in bad["error"]


def test_manifest_sends_the_server_only_what_it_decodes(formats, tmp_path):
    """Through the manifest: the AV1 post's request reads the H.264 transcode; an AV1 post the
    transcoder cannot read either is excluded before any GPU time."""
    from vidlabel.prepare.manifest import build

    for broken, sub in ((False, "ok"), (True, "broken")):
        work = tmp_path / sub
        work.mkdir()
        cfg, inv, table = _probed_inventory(formats, work, broken_av1=broken)
        chunk = work / "transcoded" / "chunk-0.parquet"
        tc.run_chunk(cfg, inv, 0, chunk, work / "media-out")
        shard, excluded, plan = work / "shard-0.parquet", work / "excluded.parquet", work / "plan.csv"
        build(cfg, inv, [], [chunk], [shard], excluded, plan)
        requests = {r["post_id"]: r for r in pq.read_table(shard).to_pylist()}
        av1_post = "av1" if "av1" in formats[0] else "h264"
        if broken:
            gone = {r["post_id"]: r for r in pq.read_table(excluded).to_pylist()}
            assert av1_post not in requests and gone[av1_post]["reason"] == "transcode_error"
        else:
            media = requests[av1_post]["media_path"]
            assert media != requests[av1_post]["video_path"] and media.startswith(str(work / "media-out"))
            with __import__("av").open(media) as c:
                assert c.streams.video[0].codec_context.name == "h264"
