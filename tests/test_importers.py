"""Importers of downloader folders, and the posts table's media column.

Each layout is built from the tool's default naming as its own source writes it (nothing is
downloaded): gallery-dl 1.32 ``gallery_dl/extractor/tiktok.py`` (``filename_fmt``, the photo loop
numbering 1..N and the audio item with num 0) with ``--write-metadata`` (``postprocessor/metadata.py``:
``<file>.json``); instaloader 4.16 ``instaloader/instaloader.py`` (``{date_utc}_UTC``, sidecar suffixes
``_1``, ``_2`` and a video item's thumbnail, ``<base>.txt``, ``save_metadata_json``: ``<base>.json.xz``);
yt-dlp 2026.10 ``yt_dlp/utils/_utils.py`` (``DEFAULT_OUTTMPL`` and the ``info.json`` type).
"""

from __future__ import annotations

import json
import lzma
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from vidlabel.prepare import importers
from vidlabel.prepare.posts import PostsError, load_posts, media_lists


def touch(path: Path, data: bytes = b"x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def rows(table: pa.Table) -> dict[str, dict]:
    return {r["post_id"]: r for r in table.to_pylist()}


def test_gallery_dl_tiktok_photo_post_with_its_music_and_a_video_post(tmp_path):
    user = tmp_path / "tiktok" / "ana.b"
    photo_id, video_id = "7301234567890123456", "7309876543210987654"
    # filename_fmt "{id}{num:?_//>02} {title[b:150]}{file_id:? [/]/}.{extension}"
    for num, file_id in ((2, "b2c3"), (1, "a1b2"), (10, "j0k1")):  # listed out of order on purpose
        touch(user / f"{photo_id}_{num:02d} beach day [{file_id}].jpeg")
    touch(user / f"{photo_id} beach day [7012345].mp3")  # num 0, file_id = the music's id
    touch(user / f"{video_id} cooking pasta tonight.mp4")  # num 0, no file_id
    meta = {"id": photo_id, "desc": "beach day 🌊 #summer", "createTime": 1700000000, "user": "ana.b",
            "author": {"uniqueId": "ana.b"}, "num": 1, "type": "image", "category": "tiktok"}
    (user / f"{photo_id}_01 beach day [a1b2].jpeg.json").write_text(json.dumps(meta))
    table = importers.gallery_dl_tiktok(tmp_path)
    assert table.schema == importers.SCHEMA
    posts = rows(table)
    photo = posts[photo_id]
    assert photo["media"] == [f"tiktok/ana.b/{photo_id}_01 beach day [a1b2].jpeg",
                              f"tiktok/ana.b/{photo_id}_02 beach day [b2c3].jpeg",
                              f"tiktok/ana.b/{photo_id}_10 beach day [j0k1].jpeg",
                              f"tiktok/ana.b/{photo_id} beach day [7012345].mp3"]
    assert photo["caption"] == "beach day 🌊 #summer"  # from the metadata, not the cut title
    assert photo["timestamp"] == datetime(2023, 11, 14, 22, 13, 20, tzinfo=timezone.utc)
    assert (photo["author"], photo["source"]) == ("ana.b", "gallery-dl:tiktok")
    video = posts[video_id]
    assert video["media"] == [f"tiktok/ana.b/{video_id} cooking pasta tonight.mp4"]
    assert (video["caption"], video["author"], video["timestamp"]) == ("cooking pasta tonight", "ana.b", None)


def test_gallery_dl_placeholder_title_is_no_caption(tmp_path):
    touch(tmp_path / "tiktok" / "dev" / "7300000000000000001_01 TikTok photo #7300000000000000001 [f1].jpeg")
    (post,) = importers.gallery_dl_tiktok(tmp_path).to_pylist()
    assert post["caption"] is None and post["author"] == "dev"


def instaloader_meta(shortcode: str, caption: str, children: list[bool] | None = None) -> dict:
    node = {"shortcode": shortcode, "__typename": "GraphSidecar" if children else "GraphImage",
            "taken_at_timestamp": 1704164645, "owner": {"username": "chloe", "id": "42"},
            "edge_media_to_caption": {"edges": [{"node": {"text": caption}}]}}
    if children:
        node["edge_sidecar_to_children"] = {"edges": [{"node": {"is_video": v}} for v in children]}
    return {"node": node, "instaloader": {"version": "4.16", "node_type": "Post"}}


def test_instaloader_sidecar_default_names_and_compressed_metadata(tmp_path):
    target = tmp_path / "chloe"
    base = "2024-01-02_03-04-05_UTC"
    touch(target / f"{base}_1.jpg")
    touch(target / f"{base}_2.jpg")  # the thumbnail of the video item
    touch(target / f"{base}_2.mp4")
    touch(target / f"{base}_3.jpg")
    (target / f"{base}.txt").write_text("new drop\nlink in bio\n")
    with lzma.open(target / f"{base}.json.xz", "wt") as fh:
        json.dump(instaloader_meta("C1a2B3c4D5e", "new drop\nlink in bio", [False, True, False]), fh)
    single = "2024-01-05_10-00-00_UTC"
    touch(target / f"{single}.jpg")  # a video post: thumbnail + video
    touch(target / f"{single}.mp4")
    (target / f"{single}.txt").write_text("sleepy cat\n")
    posts = rows(importers.instaloader(tmp_path))
    carousel = posts["C1a2B3c4D5e"]
    assert carousel["media"] == [f"chloe/{base}_1.jpg", f"chloe/{base}_2.mp4", f"chloe/{base}_3.jpg"]
    assert carousel["caption"] == "new drop\nlink in bio"
    assert carousel["timestamp"] == datetime(2024, 1, 2, 3, 4, 5, tzinfo=timezone.utc)  # its base name
    assert (carousel["author"], carousel["source"]) == ("chloe", "instaloader")
    clip = posts[single]  # no metadata: the base is the id, the date comes from the name
    assert clip["media"] == [f"chloe/{single}.mp4"]
    assert (clip["caption"], clip["author"]) == ("sleepy cat", "chloe")
    assert clip["timestamp"] == datetime(2024, 1, 5, 10, 0, 0, tzinfo=timezone.utc)


def test_instaloader_shortcode_pattern_and_plain_json(tmp_path):
    # --filename-pattern={shortcode} --no-compress-json
    target = tmp_path / "#food"
    touch(target / "Cx_9Lm_1.jpg")
    touch(target / "Cx_9Lm_2.jpg")
    (target / "Cx_9Lm.json").write_text(json.dumps(instaloader_meta("Cx_9Lm", "pasta", [False, False])))
    (post,) = importers.instaloader(tmp_path).to_pylist()
    assert post["post_id"] == "Cx_9Lm" and post["media"] == ["#food/Cx_9Lm_1.jpg", "#food/Cx_9Lm_2.jpg"]
    assert post["caption"] == "pasta"


def test_yt_dlp_info_json_beside_the_video(tmp_path):
    info = {"id": "7301112223334445556", "title": "I want you to buy the new phone case from my s",
            "description": "I want you to buy the new phone case from my shop. #ad", "uploader": "ben",
            "timestamp": 1700000123, "extractor_key": "TikTok", "ext": "mp4"}
    name = f"{info['title']} [{info['id']}]"  # DEFAULT_OUTTMPL "%(title)s [%(id)s].%(ext)s"
    touch(tmp_path / f"{name}.mp4")
    touch(tmp_path / f"{name}.webp")  # --write-thumbnail
    (tmp_path / f"{name}.info.json").write_text(json.dumps(info))
    merged = {"id": "abc", "title": "clip", "upload_date": "20240102", "channel": "dev", "ext": "webm",
              "extractor": "youtube"}
    touch(tmp_path / "sub" / "clip [abc].webm")
    (tmp_path / "sub" / "clip [abc].info.json").write_text(json.dumps(merged))
    posts = rows(importers.yt_dlp(tmp_path))
    post = posts[info["id"]]
    assert post["media"] == [f"{name}.mp4"] and post["caption"] == info["description"]
    assert (post["author"], post["source"]) == ("ben", "yt-dlp:tiktok")
    other = posts["abc"]
    assert other["media"] == ["sub/clip [abc].webm"] and other["author"] == "dev"
    assert other["timestamp"] == datetime(2024, 1, 2, tzinfo=timezone.utc)


@pytest.mark.parametrize("name", sorted(importers.IMPORTERS))
def test_an_empty_folder_is_a_clear_error(tmp_path, name):
    with pytest.raises(importers.NothingToImport, match=str(tmp_path)):
        importers.IMPORTERS[name](tmp_path)


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_written_tables_read_back_as_ordered_media_lists(tmp_path, suffix):
    user = tmp_path / "tiktok" / "ana"
    for num in (1, 2, 3):
        touch(user / f"7300000000000000009_{num:02d} three, \"quoted\" [f{num}].jpeg")
    touch(user / "7300000000000000009 three, \"quoted\" [m1].mp3")
    table = importers.gallery_dl_tiktok(tmp_path)
    out = tmp_path / f"posts{suffix}"
    importers.write_posts(table, out)
    if suffix == ".csv":
        back = pacsv.read_csv(out)
        assert json.loads(back.column("media")[0].as_py()) == table.column("media")[0].as_py()
    else:
        back = pq.read_table(out)
        assert back.schema.field("media").type == pa.list_(pa.string())
    assert media_lists(back) == (table.column("media").to_pylist(), {})


def test_media_column_and_video_path_forms(tmp_path):
    posts = tmp_path / "posts.csv"
    pacsv.write_csv(pa.table({"post_id": ["a", "b", "c"], "caption": ["x", None, "z"],
                              "media": ['["p/1.jpg", "p/2.jpg", "p/a.mp3"]', None, '["c.mp4"]'],
                              "video_path": [None, "b.mp4", "c.mp4"]}), posts)
    table = load_posts(posts, tmp_path)  # no file needs to exist yet: the inventory records missing ones
    root = str(tmp_path.resolve())
    assert table.column("media").to_pylist() == [[f"{root}/p/1.jpg", f"{root}/p/2.jpg", f"{root}/p/a.mp3"],
                                                 [f"{root}/b.mp4"], [f"{root}/c.mp4"]]
    assert table.column("source_media").to_pylist() == [["p/1.jpg", "p/2.jpg", "p/a.mp3"], ["b.mp4"], ["c.mp4"]]
    assert table.column("video_path").to_pylist() == [f"{root}/p/1.jpg", f"{root}/b.mp4", f"{root}/c.mp4"]
    assert "media" in table.column_names and table.column("caption").to_pylist() == ["x", None, "z"]


def test_bad_media_rows_are_named(tmp_path):
    posts = tmp_path / "posts.parquet"
    pq.write_table(pa.table({"post_id": ["a", "b", "c", "d", "e", "f"],
                             "media": ['["x.jpg"', '{"a": 1}', '["", "y.jpg"]', None, '["e.jpg"]',
                                       '["../outside.jpg", "in.jpg"]'],
                             "video_path": [None, None, None, " ", "other.mp4", None]}), posts)
    with pytest.raises(PostsError) as err:
        load_posts(posts, tmp_path)
    text = str(err.value)
    for expected in ("bad media in 4 row(s)", "row 1 (post_id 'a'): media is not a JSON array",
                     "row 2 (post_id 'b'): media is not a list", "row 3 (post_id 'c'): media holds an empty",
                     "empty media in 1 row(s): row 4 (post_id 'd')",
                     "row 5 (post_id 'e'): video_path 'other.mp4' and media ['e.jpg'] disagree",
                     f"media path outside media_root {tmp_path.resolve()}", "in 1 row(s): row 6 (post_id 'f'): "
                     f"{tmp_path.resolve().parent}/outside.jpg"):
        assert expected in text, (expected, text)


def test_the_import_command_writes_a_table_the_workflow_reads(tmp_path):
    """`python -m vidlabel.cli import yt-dlp FOLDER OUT`: the paths are made relative to OUT's folder, so
    that load_posts resolves them to the downloaded files wherever the table is written."""
    from vidlabel.cli import main

    downloads = tmp_path / "downloads"
    touch(downloads / "My day [abc123].mp4")
    (downloads / "My day [abc123].info.json").write_text(json.dumps(
        {"id": "abc123", "title": "My day", "description": "a day out", "uploader": "dev", "timestamp": 1700000000,
         "extractor_key": "TikTok", "ext": "mp4"}))
    out = tmp_path / "tables" / "posts.csv"
    out.parent.mkdir()
    assert main(["import", "yt-dlp", str(downloads), str(out)]) == 0
    posts = load_posts(out, tmp_path)
    assert posts.column("post_id").to_pylist() == ["abc123"]
    assert posts.column("media").to_pylist() == [[str((downloads / "My day [abc123].mp4").resolve())]]
    assert posts.column("caption").to_pylist() == ["a day out"]
    assert main(["import", "instaloader", str(tmp_path / "tables"), str(tmp_path / "x.csv")]) == 1  # nothing there
