"""The posts table's ``media`` column: a post's files in order, and its long form (one row per item).

A posts table names a post's media either in ``media`` (a JSON array of paths in CSV, a list of
strings in Parquet, in the order the post shows them) or, the one-video form, in ``video_path``. A
row may have both only if they agree (``media`` of one path equal to ``video_path``), so that no
table says two things. ``media_lists`` returns each row's list; ``post_items`` the long table
(post_id, caption, item_index, path) the inventory probes item by item.
"""

from __future__ import annotations

import json

import pyarrow as pa

from vidlabel.prepare.inventory import PostsError, _listing

ITEM_SCHEMA = pa.schema([
    ("post_id", pa.string()),
    ("caption", pa.string()),
    ("item_index", pa.int32()),
    ("path", pa.string()),
])


def _parse(value, row: int) -> list[str] | str:
    """A row's media list, or the problem with it (a string)."""
    if value is None:
        return []
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return []
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            return f"row {row}: media is not a JSON array of paths ({exc.msg} at character {exc.pos})"
    if not isinstance(value, list):
        return f"row {row}: media is not a list of paths"
    if not all(isinstance(p, str) and p.strip() for p in value):
        return f"row {row}: media holds an empty or non-text entry"
    return list(value)


def media_lists(table: pa.Table) -> list[list[str]]:
    """Each row's media paths in order (from ``media``, else ``video_path``); PostsError names bad rows."""
    n = table.num_rows
    media = table.column("media").to_pylist() if "media" in table.column_names else [None] * n
    video = table.column("video_path").to_pylist() if "video_path" in table.column_names else [None] * n
    out, problems = [], []
    for i, (value, one) in enumerate(zip(media, video), start=1):
        parsed = _parse(value, i)
        if isinstance(parsed, str):
            problems.append(parsed)
            continue
        one = one.strip() if isinstance(one, str) and one.strip() else None
        if parsed and one and parsed != [one]:
            problems.append(f"row {i}: video_path {one!r} and media {parsed!r} disagree (give one of them)")
            continue
        if not parsed and not one:
            problems.append(f"row {i}: no media (media and video_path are both empty)")
            continue
        out.append(parsed or [one])
    if problems:
        raise PostsError(f"posts table cannot be used: {len(problems)} row(s) with bad media: "
                         + _listing(problems))
    return out


def post_items(table: pa.Table) -> pa.Table:
    """One row per media item: post_id, caption, item_index (0-based, the post's order), path."""
    lists = media_lists(table)
    ids = table.column("post_id").to_pylist()
    captions = table.column("caption").to_pylist() if "caption" in table.column_names else [None] * len(ids)
    rows = {"post_id": [], "caption": [], "item_index": [], "path": []}
    for post_id, caption, paths in zip(ids, captions, lists):
        for index, path in enumerate(paths):
            rows["post_id"].append(post_id)
            rows["caption"].append(caption)
            rows["item_index"].append(index)
            rows["path"].append(path)
    return pa.table(rows, schema=ITEM_SCHEMA)
