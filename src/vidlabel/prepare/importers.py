"""Posts tables from the folders the common downloaders write (nothing is downloaded here).

Each importer walks a download folder and returns a posts table: ``post_id``, ``caption``, ``media``
(the post's files in order, relative to the folder, posix separators), ``author``, ``timestamp``
(UTC, seconds) and ``source`` (which tool and site). ``write_posts`` writes it as Parquet (``media`` a
list column) or CSV (``media`` a JSON array), the forms ``vidlabel.prepare.posts`` reads.

The naming each importer relies on is the tool's default, read from its source:

* gallery-dl, TikTok (``gallery_dl/extractor/tiktok.py``): folder ``tiktok/{user}``, files
  ``{id}{num:?_//>02} {title[b:150]}{file_id:? [/]/}.{extension}``: the photos of a photo post are
  ``<id>_01 <title> [<file id>].jpeg``, ``_02``, ...; its music is ``<id> <title> [<music id>].mp3``
  (num 0); a video is ``<id> <title>.mp4``. The title is the description cut to 150 bytes, or
  "TikTok photo #<id>" without one. ``--write-metadata`` adds ``<file>.json`` beside each file
  (``desc``, ``createTime``, ``author.uniqueId``, ``num``, ``type``), preferred where present.
* instaloader (``instaloader/instaloader.py``): folder ``{target}``, base name ``{date_utc}_UTC``
  (``%Y-%m-%d_%H-%M-%S_UTC``; ``--filename-pattern={shortcode}`` gives ``<shortcode>``); a sidecar's
  items ``<base>_1.jpg``, ``<base>_2.mp4`` (a video item also leaves ``<base>_2.jpg``, its thumbnail,
  which is not an item), a single post ``<base>.jpg`` / ``<base>.mp4``; the caption in ``<base>.txt``;
  the metadata in ``<base>.json.xz`` (``--no-compress-json``: ``<base>.json``), ``{"node": {...}}``
  with ``shortcode``, ``taken_at_timestamp``, ``owner.username``, the caption edges.
* yt-dlp (``yt_dlp/utils/_utils.py: DEFAULT_OUTTMPL``): ``%(title)s [%(id)s].%(ext)s`` and, with
  ``--write-info-json``, ``%(title)s [%(id)s].info.json`` beside it (``id``, ``title`` (cut to 72
  characters for TikTok), ``description``, ``uploader``, ``timestamp``, ``extractor_key``, ``ext``).
"""

from __future__ import annotations

import glob
import json
import lzma
import os
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterable

import pyarrow as pa
import pyarrow.csv as pacsv

from vidlabel.core.io import atomic_path, write_parquet

SCHEMA = pa.schema([
    ("post_id", pa.string()),
    ("caption", pa.string()),
    ("media", pa.list_(pa.string())),
    ("author", pa.string()),
    ("timestamp", pa.timestamp("s", tz="UTC")),
    ("source", pa.string()),
])

#: Files a downloader writes beside the media that are never media items.
_SIDE_FILES = (".json", ".json.xz", ".txt", ".description", ".part", ".ytdl", ".vtt", ".srt")


class NothingToImport(ValueError):
    """The folder holds nothing this importer recognises."""


def _table(rows: list[dict]) -> pa.Table:
    rows = sorted(rows, key=lambda r: r["post_id"])
    return pa.Table.from_pylist([{f.name: r.get(f.name) for f in SCHEMA} for r in rows], schema=SCHEMA)


def _files(root: Path) -> Iterable[Path]:
    for folder, dirs, names in os.walk(root):
        dirs.sort()
        for name in sorted(names):
            if not name.startswith("."):
                yield Path(folder, name)


def _is_side_file(name: str) -> bool:
    return name.lower().endswith(_SIDE_FILES)


def _rel(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


def _utc(seconds) -> datetime | None:
    try:
        return datetime.fromtimestamp(int(seconds), tz=timezone.utc)
    except (TypeError, ValueError, OverflowError, OSError):
        return None


def _read_json(path: Path) -> dict | None:
    try:
        opener = lzma.open if path.name.endswith(".xz") else open
        with opener(path, "rt", encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError, lzma.LZMAError):
        return None
    return data if isinstance(data, dict) else None


# ------------------------------------------------------------------ gallery-dl, TikTok

_GALLERY_DL_TIKTOK = re.compile(r"^(?P<id>\d{6,})(?:_(?P<num>\d{2,}))? (?P<title>.*?)(?: \[(?P<file_id>[^\[\]]*)\])?$")
_TIKTOK_PLACEHOLDER = re.compile(r"^TikTok (photo|video|audio) #\d+$")


def gallery_dl_tiktok(root: str | os.PathLike) -> pa.Table:
    """Posts of a gallery-dl TikTok download: a photo post's photos in order, then its music."""
    root = Path(root)
    posts: dict[str, dict] = {}
    for path in _files(root):
        if _is_side_file(path.name):
            continue
        stem = path.name[: -len(path.suffix)] if path.suffix else path.name
        match = _GALLERY_DL_TIKTOK.match(stem)
        if not match:
            continue
        meta = _read_json(path.with_name(path.name + ".json")) or {}
        post_id = str(meta.get("id") or match["id"])
        num = int(meta.get("num", match["num"] or 0) or 0)
        post = posts.setdefault(post_id, {"post_id": post_id, "items": [], "source": "gallery-dl:tiktok",
                                          "caption": None, "author": None, "timestamp": None})
        post["items"].append((num == 0, num, _rel(path, root)))  # photos (1..N) first, then num 0
        if meta:
            post["caption"] = meta.get("desc") or post["caption"]
            post["author"] = meta.get("user") or (meta.get("author") or {}).get("uniqueId") or post["author"]
            post["timestamp"] = _utc(meta.get("createTime")) or post["timestamp"]
        elif post["caption"] is None and not _TIKTOK_PLACEHOLDER.match(match["title"]):
            post["caption"] = match["title"]  # cut to 150 bytes by the file name
        if post["author"] is None and path.parent != root:
            post["author"] = path.parent.name  # the {user} folder
    if not posts:
        raise NothingToImport(f"{root} holds no gallery-dl TikTok files (<id>[_NN] <title>[ [<file id>]].<ext>)")
    rows = []
    for post in posts.values():
        post["media"] = [rel for _, _, rel in sorted(post.pop("items"))]
        rows.append(post)
    return _table(rows)


# ------------------------------------------------------------------ instaloader

_INSTALOADER_ITEM = re.compile(r"^(?P<base>.+?)(?:_(?P<index>\d+))?\.(?P<ext>[A-Za-z0-9]+)$")
_INSTALOADER_DATE = re.compile(r"^(\d{4}-\d{2}-\d{2}_\d{2}-\d{2}-\d{2})_UTC")


def instaloader(root: str | os.PathLike) -> pa.Table:
    """Posts of an instaloader download: one per ``<base>.json[.xz]`` or ``<base>.txt``, its items by index,
    a video item's .mp4 in place of its thumbnail .jpg."""
    root = Path(root)
    anchors: dict[Path, dict] = {}
    for path in _files(root):
        for suffix in (".json.xz", ".json", ".txt"):
            if path.name.endswith(suffix) and not path.name.endswith(("_comments.json", "_location.txt")):
                anchors.setdefault(path.parent / path.name[: -len(suffix)], {})[suffix] = path
    if not anchors:
        raise NothingToImport(f"{root} holds no instaloader posts (<base>.json.xz, <base>.json or <base>.txt)")
    items: dict[Path, dict[int, dict[str, Path]]] = {base: {} for base in anchors}
    for path in _files(root):
        if _is_side_file(path.name):
            continue
        match = _INSTALOADER_ITEM.match(path.name)
        if not match:
            continue
        base = path.parent / match["base"]
        index = int(match["index"]) if match["index"] else 0
        if base not in items and match["index"]:  # a base that itself ends in _<digits>
            base, index = path.parent / path.name[: -len(match["ext"]) - 1], 0
        if base in items:
            items[base].setdefault(index, {})[match["ext"].lower()] = path
    rows = []
    for base, files in anchors.items():
        meta = ((_read_json(files[".json.xz"]) if ".json.xz" in files else None)
                or (_read_json(files[".json"]) if ".json" in files else None) or {})
        node = meta.get("node", {}) if isinstance(meta.get("node"), dict) else {}
        media = []
        for index in sorted(items[base]):
            by_ext = items[base][index]
            video = by_ext.get("mp4") or by_ext.get("mov")
            media.append(_rel(video or next(iter(by_ext.values())), root))
        if not media:
            continue
        caption = _instaloader_caption(node)
        if caption is None and ".txt" in files:
            caption = files[".txt"].read_text(encoding="utf-8").strip() or None
        date = _INSTALOADER_DATE.match(base.name)
        stamp = _utc(node.get("taken_at_timestamp") or node.get("date"))
        if stamp is None and date:
            stamp = datetime.strptime(date[1], "%Y-%m-%d_%H-%M-%S").replace(tzinfo=timezone.utc)
        owner = node.get("owner") if isinstance(node.get("owner"), dict) else {}
        rows.append({"post_id": str(node.get("shortcode") or base.name), "caption": caption, "media": media,
                     "author": owner.get("username") or (base.parent.name if base.parent != root else None),
                     "timestamp": stamp, "source": "instaloader"})
    return _table(rows)


def _instaloader_caption(node: dict) -> str | None:
    edges = (node.get("edge_media_to_caption") or {}).get("edges") or []
    if edges and isinstance(edges[0], dict):
        return (edges[0].get("node") or {}).get("text") or None
    caption = node.get("caption")
    return caption.get("text") if isinstance(caption, dict) else caption or None


# ------------------------------------------------------------------ yt-dlp

def yt_dlp(root: str | os.PathLike) -> pa.Table:
    """Posts of a yt-dlp download: one per ``<name>.info.json`` with its media file ``<name>.<ext>``."""
    root = Path(root)
    rows = []
    for path in _files(root):
        if not path.name.endswith(".info.json"):
            continue
        info = _read_json(path) or {}
        name = path.name[: -len(".info.json")]
        media = path.with_name(f"{name}.{info['ext']}") if info.get("ext") else None
        if media is None or not media.exists():
            siblings = [p for p in path.parent.glob(f"{glob.escape(name)}.*")
                        if not _is_side_file(p.name) and p.suffix.lower() not in (".jpg", ".webp", ".png")]
            media = siblings[0] if len(siblings) == 1 else media
        if media is None or info.get("_type") == "playlist":
            continue
        stamp = _utc(info.get("timestamp"))
        if stamp is None and info.get("upload_date"):
            stamp = datetime.strptime(str(info["upload_date"]), "%Y%m%d").replace(tzinfo=timezone.utc)
        rows.append({"post_id": str(info.get("id") or name), "caption": info.get("description") or info.get("title"),
                     "media": [_rel(media, root)], "author": info.get("uploader") or info.get("channel")
                     or info.get("uploader_id"), "timestamp": stamp,
                     "source": f"yt-dlp:{(info.get('extractor_key') or info.get('extractor') or 'unknown').lower()}"})
    if not rows:
        raise NothingToImport(f"{root} holds no yt-dlp downloads with --write-info-json (<name>.info.json)")
    return _table(rows)


IMPORTERS: dict[str, Callable[[str | os.PathLike], pa.Table]] = {
    "gallery-dl-tiktok": gallery_dl_tiktok,
    "instaloader": instaloader,
    "yt-dlp": yt_dlp,
}


def write_posts(table: pa.Table, path: str | os.PathLike) -> None:
    """Write a posts table (atomically): Parquet keeps ``media`` a list; CSV writes it as a JSON array."""
    path = Path(path)
    if path.suffix.lower() in (".parquet", ".pq"):
        write_parquet(table, path)
        return
    media = pa.array([json.dumps(m, ensure_ascii=False) for m in table.column("media").to_pylist()], pa.string())
    flat = table.set_column(table.column_names.index("media"), "media", media)
    with atomic_path(path) as tmp:
        pacsv.write_csv(flat, tmp)
