"""Stage 1: posts table checks, PyAV probing of good and bad files, inventory.parquet."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import numpy as np
import pyarrow as pa
import pyarrow.csv
import pyarrow.parquet as pq
import pytest
from demo_media import get_demo_set

from vidlabel.demo import make_video
from vidlabel.prepare.inventory import build_inventory
from vidlabel.prepare.posts import PostsError, load_posts
from vidlabel.prepare.media import AudioError, NoAudioStream, load_audio, probe

EXPECTED_REASON = {
    "empty": "empty file",
    "missing": "missing",
    "truncated_before_index": "no moov index",
    "truncated_after_index": "truncated",
    "not_video": "not a video",
}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return get_demo_set(tmp_path_factory)


@pytest.fixture(scope="module")
def inventory(demo):
    return {row["post_id"]: row for row in pq.read_table(demo.inventory).to_pylist()}


def write_csv(path, rows, header=("post_id", "video_path")):
    lines = [",".join(header)] + [",".join(r) for r in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_every_bad_case_gets_its_reason_and_the_good_ones_none(demo, inventory):
    assert set(inventory) == set(demo.expected)
    for post_id, exp in demo.expected.items():
        row = inventory[post_id]
        if exp["probe_ok"]:
            assert row["probe_error"] is None, (post_id, row["probe_error"])
            assert row["has_audio"] is exp["has_audio"], post_id
            assert row["video_codec"] == "h264"
            assert row["fps"] == pytest.approx(15.0)
            assert row["size_bytes"] == os.path.getsize(row["video_path"])
        else:
            assert row["probe_error"] and EXPECTED_REASON[exp["kind"]] in row["probe_error"], (post_id, row)


def test_truncation_is_caught_before_and_after_the_index(inventory):
    before = inventory["truncated-before-index"]
    after = inventory["truncated-after-index"]
    assert before["duration_s"] is None
    # Cut after the index, the container still opens and claims its full duration; the index
    # pointing beyond the end of the file gives it away.
    assert after["duration_s"] > 3.0
    assert "index refers to" in after["probe_error"]
    assert str(after["size_bytes"]) in after["probe_error"]


def test_display_orientation_portrait_landscape_and_rotated(demo, inventory):
    good = {p: e for p, e in demo.expected.items() if e["kind"] == "speech"}
    shapes = {(e["width"], e["height"]) for e in good.values()}
    assert (360, 640) in shapes and (640, 360) in shapes
    for post_id, exp in good.items():
        row = inventory[post_id]
        assert (row["width"], row["height"]) == (exp["width"], exp["height"]), post_id
        assert 3.0 <= row["duration_s"] <= 6.0, post_id


def test_rotation_metadata_swaps_width_and_height(tmp_path):
    path = tmp_path / "phone.mp4"
    make_video(path, duration=1.0, size=(320, 180), fps=10, audio=False, rotate=90)
    info = probe(path)
    assert info["probe_error"] is None
    assert (info["width"], info["height"]) == (180, 320)


def test_audio_files_are_not_videos_even_with_a_cover_image(tmp_path):
    cover = tmp_path / "song-with-cover.mp4"
    subprocess.run(
        ["ffmpeg", "-nostdin", "-v", "error", "-f", "lavfi", "-i", "sine=duration=1", "-f", "lavfi",
         "-i", "testsrc2=size=64x64:rate=1:duration=1", "-frames:v", "1", "-map", "0", "-map", "1", "-c:a", "aac", "-c:v", "png",
         "-disposition:v:0", "attached_pic", str(cover)],
        check=True,
        timeout=60,
    )
    info = probe(cover)
    assert info["probe_error"] == "no video stream (contains: audio, a cover image)"
    assert info["has_audio"] is True and info["width"] is None


def test_inventory_columns_paths_and_extras(demo, inventory):
    table = pq.read_table(demo.inventory)
    assert table.column_names[:12] == [
        "post_id", "source_path", "video_path", "caption", "size_bytes", "duration_s", "fps",
        "width", "height", "video_codec", "has_audio", "probe_error",
    ]
    assert "author" in table.column_names  # extra column kept
    assert table.schema.field("size_bytes").type == pa.int64()
    for post_id, exp in demo.expected.items():
        row = inventory[post_id]
        assert row["source_path"] == exp["video_path"]
        assert os.path.isabs(row["video_path"])
        assert row["video_path"] == os.path.realpath(demo.root / exp["video_path"])
        assert row["author"] == exp["author"]
        assert row["caption"] == exp["caption"]  # commas, quotes, newlines, emoji; empty -> null
    odd = [r for r in inventory.values() if " " in r["video_path"]]
    assert odd and odd[0]["probe_error"] is None and "é" in odd[0]["video_path"]
    # Written atomically: no temp file left next to it (the probes' journal and its lock are).
    assert sorted(p.name for p in demo.inventory.parent.iterdir()) == [
        "inventory.jsonl", "inventory.jsonl.lock", "inventory.parquet"]


def test_duplicate_post_ids_name_the_rows(demo, tmp_path):
    csv = write_csv(
        tmp_path / "posts.csv",
        [("a", f"{demo.media}/good-01.mp4"), ("b", f"{demo.media}/good-03.mp4"), ("a", f"{demo.media}/good-04.mp4")],
    )
    with pytest.raises(PostsError) as err:
        load_posts(csv, demo.media)
    assert "duplicate post_id" in str(err.value)
    assert "'a' (rows 1, 3)" in str(err.value)
    assert "'b'" not in str(err.value)


def test_many_problems_are_listed_first_ten_and_counted(demo, tmp_path):
    rows = [(f"id{i}", f"{demo.media}/good-01.mp4") for i in range(15)] * 2
    csv = write_csv(tmp_path / "posts.csv", rows)
    with pytest.raises(PostsError) as err:
        load_posts(csv, demo.media)
    message = str(err.value)
    assert "15 value(s)" in message and "and 5 more" in message
    assert "'id9'" in message and "'id10'" not in message


def test_paths_outside_media_root_stop_the_run(demo, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.copy(demo.media / "good-01.mp4", outside / "x.mp4")
    link = demo.media / "link-to-outside.mp4"
    link.symlink_to(outside / "x.mp4")
    try:
        csv = write_csv(
            tmp_path / "posts.csv",
            [
                ("inside", "demo/good-01.mp4"),
                ("dotdot", "demo/../elsewhere/x.mp4"),
                ("absolute", str(outside / "x.mp4")),
                ("symlink", str(link)),
            ],
        )
        (tmp_path / "demo").symlink_to(demo.media)  # a symlinked directory inside is fine
        with pytest.raises(PostsError) as err:
            load_posts(csv, demo.media)
    finally:
        link.unlink()
    message = str(err.value)
    assert "outside media_root" in message and "3 row(s)" in message
    for post_id in ("dotdot", "absolute", "symlink"):
        assert f"'{post_id}'" in message
    assert "'inside'" not in message


def test_relative_paths_resolve_against_the_posts_file(demo, tmp_path):
    sub = demo.root / "tables"
    sub.mkdir(exist_ok=True)
    csv = write_csv(sub / "posts.csv", [("p1", "../media/good-01.mp4"), ("p2", "../media/deleted.mp4")])
    table = load_posts(csv, demo.media)
    paths = dict(zip(table.column("post_id").to_pylist(), table.column("video_path").to_pylist()))
    assert paths["p1"] == str((demo.media / "good-01.mp4").resolve())
    assert paths["p2"] == str(demo.media.resolve() / "deleted.mp4")  # missing: not an error here


def test_missing_columns_and_empty_ids_are_rejected(demo, tmp_path):
    csv = write_csv(tmp_path / "a.csv", [("x", "y")], header=("post_id", "path"))
    with pytest.raises(PostsError, match="lacks required column.*video_path"):
        load_posts(csv, demo.media)
    csv = write_csv(tmp_path / "b.csv", [("ok", "media/good-01.mp4"), ("", "media/good-03.mp4"), (" ", "m.mp4")])
    with pytest.raises(PostsError) as err:
        load_posts(csv, demo.media)
    assert "empty post_id in 2 row(s): row 2, row 3" in str(err.value)


def test_reserved_column_names_are_rejected(demo, tmp_path):
    csv = write_csv(tmp_path / "a.csv", [("x", "media/good-01.mp4", "3")], header=("post_id", "video_path", "width"))
    with pytest.raises(PostsError, match="width"):
        load_posts(csv, demo.media)


def test_parquet_posts_keep_typed_extra_columns(demo, tmp_path):
    table = pa.table(
        {
            "post_id": pa.array([101, 102], pa.int64()),  # numeric ids become strings
            "video_path": ["media/good-01.mp4", "media/no-audio.mp4"],
            "likes": pa.array([5, 7], pa.int32()),
        }
    )
    path = demo.root / "posts.parquet"
    pq.write_table(table, path)
    out = tmp_path / "inventory.parquet"
    build_inventory({"posts": str(path), "media_root": str(demo.media)}, out, threads=2)
    inv = pq.read_table(out)
    assert inv.column("post_id").to_pylist() == ["101", "102"]
    assert inv.schema.field("likes").type == pa.int32()
    assert inv.column("likes").to_pylist() == [5, 7]
    assert inv.column("caption").to_pylist() == [None, None]
    assert inv.column("has_audio").to_pylist() == [True, False]


def test_directory_of_videos_recursive(demo, tmp_path):
    root = tmp_path / "videos"
    (root / "sub dir").mkdir(parents=True)
    shutil.copy(demo.media / "good-01.mp4", root / "first.mp4")
    shutil.copy(demo.media / "no-audio.mp4", root / "sub dir" / "second.MOV")
    (root / "notes.txt").write_text("not a video")
    (root / "broken.mp4").write_bytes(b"")
    out = tmp_path / "inventory.parquet"
    build_inventory({"posts": str(root), "media_root": str(tmp_path)}, out, threads=2)
    rows = {r["post_id"]: r for r in pq.read_table(out).to_pylist()}
    assert set(rows) == {"first", "second", "broken"}
    assert rows["second"]["source_path"] == "sub dir/second.MOV"
    assert rows["second"]["has_audio"] is False and rows["second"]["probe_error"] is None
    assert rows["broken"]["probe_error"].startswith("empty file")
    # The same stem twice is a duplicate post_id.
    shutil.copy(demo.media / "good-01.mp4", root / "sub dir" / "first.mp4")
    with pytest.raises(PostsError, match="'first'"):
        load_posts(root, tmp_path)


def test_load_audio(demo):
    audio, warning = load_audio(demo.media / "good-01.mp4")
    assert audio.dtype == np.float32 and audio.flags.writeable and warning is None
    assert 3.0 <= len(audio) / 16000 <= 6.0
    assert np.abs(audio).max() > 0.05  # speech, not silence
    with pytest.raises(NoAudioStream):
        load_audio(demo.media / "no-audio.mp4")
    with pytest.raises(AudioError, match="moov atom not found|Invalid data"):
        load_audio(demo.media / "not-a-video.mp4")
    with pytest.raises(AudioError, match="No such file"):
        load_audio(demo.media / "deleted-video.mp4")
    # Cut after its index: decodes "successfully" but short; the warning says so.
    audio, warning = load_audio(demo.media / "truncated-after-index.mp4", expected_s=3.5)
    assert warning and ("partial file" in warning or "decoded" in warning)


def _path_tree(tmp_path):
    """media/ with symlinks in and out, unicode names; outside/ next to it; posts rows covering each case."""
    media, outside = tmp_path / "media", tmp_path / "outside"
    (media / "sub dir").mkdir(parents=True)
    outside.mkdir()
    for path in (media / "real.mp4", media / "sub dir" / "é ü 🎬.mp4", outside / "x.mp4"):
        path.write_bytes(b"x")
    (media / "link-in.mp4").symlink_to(media / "real.mp4")
    (media / "chain.mp4").symlink_to("link-in.mp4")  # relative link to a link
    (media / "link-out.mp4").symlink_to(outside / "x.mp4")
    (media / "dangling.mp4").symlink_to(media / "nowhere.mp4")
    (media / "dir-in").symlink_to(media / "sub dir")
    (media / "dir-out").symlink_to(outside)
    rows = {
        "real": "media/real.mp4",
        "absolute": str(media / "real.mp4"),
        "unicode": "media/sub dir/é ü 🎬.mp4",
        "link_in": "media/link-in.mp4",
        "chain": "media/chain.mp4",
        "dangling": "media/dangling.mp4",
        "dir_in": "media/dir-in/é ü 🎬.mp4",
        "dir_in_missing": "media/dir-in/gone.mp4",
        "dotdot_in": "media/sub dir/../real.mp4",
        "double_slash": "media//sub dir//é ü 🎬.mp4",
        "missing": "media/missing.mp4",
        "missing_dir": "media/no such dir/missing.mp4",
        "trailing_dotdot": "media/sub dir/..",
        "home": "~/media/real.mp4",
        "link_out": "media/link-out.mp4",
        "dir_out": "media/dir-out/x.mp4",
        "dotdot_out": "media/../outside/x.mp4",
        "dotdot_link_out": "media/dir-out/../outside/x.mp4",  # '..' after a symlink: from its target
        "plain_out": str(outside / "x.mp4"),
    }
    return media, rows


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_paths_resolve_like_realpath_and_only_media_root_passes(tmp_path, monkeypatch, fmt):
    monkeypatch.setenv("HOME", str(tmp_path))
    media, rows = _path_tree(tmp_path)
    table = pa.table({"post_id": list(rows), "video_path": list(rows.values())})
    posts = tmp_path / f"posts.{fmt}"
    if fmt == "csv":
        pa.csv.write_csv(table, posts)
    else:
        pq.write_table(table, posts)
    # The expectation, row by row with the standard library.
    expected = {p: os.path.realpath(os.path.join(tmp_path, os.path.expanduser(s))) for p, s in rows.items()}
    root = os.path.realpath(media)
    expected_out = {p for p, full in expected.items() if os.path.commonpath([root, full]) != root}
    assert expected_out == {"link_out", "dir_out", "dotdot_out", "dotdot_link_out", "plain_out"}

    got = load_posts(posts, tmp_path)  # everything is inside tmp_path
    assert dict(zip(got.column("post_id").to_pylist(), got.column("video_path").to_pylist())) == expected
    assert got.column("source_path").to_pylist() == list(rows.values())

    with pytest.raises(PostsError) as err:
        load_posts(posts, media)
    message = str(err.value)
    assert f"outside media_root {root} " in message and f"in {len(expected_out)} row(s)" in message
    for post_id in rows:
        assert (f"'{post_id}'): {expected[post_id]}" in message) == (post_id in expected_out), post_id


def test_symlinks_found_where_a_directory_cannot_be_listed(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    media, rows = _path_tree(tmp_path)
    posts = write_csv(tmp_path / "posts.csv", [("link_in", rows["link_in"]), ("link_out", rows["link_out"])])

    def unlistable(path):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(os, "scandir", unlistable)
    with pytest.raises(PostsError) as err:
        load_posts(posts, media)
    assert "'link_out'" in str(err.value) and "'link_in'" not in str(err.value)
    got = load_posts(posts, tmp_path)
    assert got.column("video_path").to_pylist() == [str(media / "real.mp4"), str(tmp_path / "outside" / "x.mp4")]


def test_blank_paths_and_ids_with_unicode_whitespace(tmp_path):
    table = pa.table(
        {
            "post_id": ["ok", "\u3000", None, "a", "a ", "a"],
            "video_path": ["good-01.mp4", "good-03.mp4", "x.mp4", "\t\u00a0", None, "y.mp4"],
        }
    )
    posts = tmp_path / "posts.parquet"
    pq.write_table(table, posts)
    with pytest.raises(PostsError) as err:
        load_posts(posts, tmp_path)
    message = str(err.value)
    assert "empty post_id in 2 row(s): row 2, row 3" in message
    assert "duplicate post_id, 1 value(s): 'a' (rows 4, 6)" in message  # 'a ' is another id
    assert "empty video_path in 2 row(s): row 4 (post_id 'a'), row 5 (post_id 'a ')" in message
    assert "outside media_root" not in message


def test_probe_works_with_a_pyav_that_has_no_metadata_errors_option(tmp_path, monkeypatch):
    """PyAV 19 dropped av.open's metadata_errors keyword (it always replaces undecodable metadata)."""
    import av

    path = tmp_path / "clip.mp4"
    make_video(path, duration=1.0, size=(320, 180), fps=10, audio=False)
    real_open = av.open

    def pyav19_open(*args, **kwargs):
        if "metadata_errors" in kwargs:
            raise TypeError("open() got an unexpected keyword argument 'metadata_errors'")
        return real_open(*args, **kwargs)

    monkeypatch.setattr(av, "open", pyav19_open)
    info = probe(path)
    assert info["probe_error"] is None and info["duration_s"] > 0 and (info["width"], info["height"]) == (320, 180)


def test_a_rerun_probes_only_the_files_that_changed(tmp_path, demo):
    """The probes are journaled with each file's identity: a rerun probes what is new or replaced."""
    media = tmp_path / "media"
    media.mkdir()
    good = [p for p, e in demo.expected.items() if e["kind"] == "speech"][:2]
    for i, pid in enumerate(good):
        shutil.copy(demo.root / demo.expected[pid]["video_path"], media / f"v{i}.mp4")
    (tmp_path / "posts.csv").write_text("post_id,video_path\na,media/v0.mp4\nb,media/v1.mp4\n")
    config = {"posts": str(tmp_path / "posts.csv"), "media_root": str(media)}
    out = tmp_path / "results" / "inventory.parquet"
    journal = out.with_name("inventory.jsonl")
    build_inventory(config, out, threads=2)
    build_inventory(config, out, threads=2)
    assert len(journal.read_text().splitlines()) == 2  # nothing probed again
    before = {r["post_id"]: r for r in pq.read_table(out).to_pylist()}
    (media / "v1.mp4").write_bytes(b"")  # replaced at the same path by a broken download
    build_inventory(config, out, threads=2)
    lines = [json.loads(line) for line in journal.read_text().splitlines()]
    assert len(lines) == 3 and lines[-1]["item_path"] == os.path.realpath(media / "v1.mp4")
    after = {r["post_id"]: r for r in pq.read_table(out).to_pylist()}
    assert after["a"] == before["a"]
    assert before["b"]["probe_error"] is None and after["b"]["probe_error"]
