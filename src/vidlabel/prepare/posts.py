"""The posts table: read it, check it, and resolve every media path it names.

A posts table is a CSV or Parquet file (or a directory of videos, one post per file). Each row is a
post: ``post_id``, an optional ``caption``, any extra columns, and its media in one of two forms:

- ``media``: the post's files in the order it shows them (a JSON array of paths in CSV, a list of
  strings in Parquet): a TikTok photo post's photos and its music track, a carousel's photos and clips;
- ``video_path``: one file, the one-video form.

A row may have both only if they agree (``media`` of one path equal to ``video_path``), so that no
table says two things. ``load_posts`` is cheap (no media is opened) so that the workflow can call it
before any job and stop with a message naming the offending rows: missing columns, empty or duplicate
post ids, rows without media or with a malformed ``media``, paths outside ``media_root`` (after
resolving symlinks and '..'), columns the inventory writes itself. A missing file is not an error here
(the inventory records it for its item).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from vidlabel.prepare.inventory_schema import ITEM_FIELDS, PROBE_FIELDS

VIDEO_EXTENSIONS = frozenset(
    {".mp4", ".m4v", ".mov", ".webm", ".mkv", ".avi", ".3gp", ".flv", ".wmv", ".mpg", ".mpeg", ".ts"}
)
PARQUET_EXTENSIONS = (".parquet", ".pq")
MEDIA_COLUMNS = ("media", "video_path")  # a post's files: a list, or the one-video form
#: Columns the inventory writes itself; a posts table may not bring its own.
RESERVED = frozenset({"source_path", "items", "post_type", "n_items", "items_dropped", *PROBE_FIELDS,
                      *ITEM_FIELDS})
MEDIA_TYPE = pa.list_(pa.string())

_SHOW = 10  # offending rows named in a message before "and N more"


class PostsError(ValueError):
    """The posts table cannot be used as given; the message names the offending rows."""


def _listing(items: list[str], total: int | None = None) -> str:
    """The first items (of ``total``, by default all of them) and how many more there are."""
    total = len(items) if total is None else total
    shown = ", ".join(items[:_SHOW])
    if total > _SHOW:
        shown += f", and {total - _SHOW} more"
    return shown


# --------------------------------------------------------------------------- reading


def _read_table(posts: Path) -> pa.Table:
    if posts.suffix.lower() in PARQUET_EXTENSIONS:
        try:
            return pq.read_table(posts)
        except (pa.ArrowInvalid, OSError) as exc:
            raise PostsError(f"cannot read posts table {posts}: {exc}") from None
    try:
        # Columns we rely on are strings whatever they look like (ids like 0012 keep their zeros).
        header = pacsv.open_csv(posts, parse_options=pacsv.ParseOptions(newlines_in_values=True)).schema.names
        return pacsv.read_csv(
            posts,
            parse_options=pacsv.ParseOptions(newlines_in_values=True),
            convert_options=pacsv.ConvertOptions(
                column_types={c: pa.string() for c in ("post_id", "video_path", "caption", "media") if c in header},
                strings_can_be_null=True,  # an empty caption is no caption
            ),
        )
    except (pa.ArrowInvalid, OSError) as exc:
        raise PostsError(f"cannot read posts table {posts}: {exc}") from None


def _scan_directory(directory: Path) -> pa.Table:
    """A posts table from a directory of videos: post_id = file stem, found recursively."""
    post_ids, sources = [], []
    for root, dirs, files in os.walk(directory):
        dirs.sort()
        for name in sorted(files):
            if name.startswith(".") or Path(name).suffix.lower() not in VIDEO_EXTENSIONS:
                continue
            full = Path(root, name)
            post_ids.append(full.stem)
            sources.append(full.relative_to(directory).as_posix())
    if not post_ids:
        raise PostsError(
            f"posts directory {directory} holds no video files ({', '.join(sorted(VIDEO_EXTENSIONS))})"
        )
    return pa.table({"post_id": pa.array(post_ids, pa.string()), "video_path": pa.array(sources, pa.string())})


def _blank(values: pa.Array) -> pa.Array:
    """True where a string is null or whitespace only (the whitespace ``str.strip`` removes)."""
    return pc.fill_null(pc.equal(pc.utf8_trim_whitespace(values), ""), True)


def _rows(mask: pa.Array) -> list[int]:
    return pc.indices_nonzero(mask).to_pylist()


def _symlinks_in(directory: str) -> list[str] | None:
    """Names of the symlinks in ``directory``; None where it exists but cannot be listed."""
    try:
        with os.scandir(directory) as entries:
            return [entry.name for entry in entries if entry.is_symlink()]
    except (FileNotFoundError, NotADirectoryError):
        return []  # nothing there, so no symlinks either
    except OSError:
        return None  # e.g. one may pass through but not list it: each file there gets its realpath


def _resolve_paths(sources: pa.Array, base_dir: str) -> pa.Array:
    """``os.path.realpath`` of every path (null stays null), relative ones taken from ``base_dir``.

    '~' is expanded. A realpath per file is a million lstat calls on a large table, so the
    directories are resolved once each, and one listing per directory finds its symlinked files:
    only those (and names '', '.', '..') get a realpath of their own. A missing file keeps its name.
    """
    tilde = pc.fill_null(pc.starts_with(sources, "~"), False)
    if pc.any(tilde).as_py():
        expanded = [os.path.expanduser(s) for s in sources.filter(tilde).to_pylist()]
        sources = pc.replace_with_mask(sources, tilde, pa.array(expanded, pa.string()))
    absolute = sources
    relative = pc.invert(pc.fill_null(pc.starts_with(sources, "/"), True))
    if pc.any(relative).as_py():
        absolute = pc.if_else(relative, pc.binary_join_element_wise(base_dir.rstrip("/"), sources, "/"), sources)

    parts = pc.split_pattern(absolute, "/", max_splits=1, reverse=True)
    heads = pc.dictionary_encode(pc.list_element(parts, 0))
    names = pc.list_element(parts, 1)
    # "" is the head of "/name"; a trailing "/" on a head does not change its realpath.
    real_dirs = [os.path.realpath(head or "/") for head in heads.dictionary.to_pylist()]
    prefixes = [d if d.endswith("/") else d + "/" for d in real_dirs]
    full = pc.binary_join_element_wise(pa.array(prefixes, pa.string()).take(heads.indices), names, "")

    listings: dict[str, list[str] | None] = {}
    for prefix in prefixes:
        if prefix not in listings:
            listings[prefix] = _symlinks_in(prefix)
    links = [prefix + name for prefix, found in listings.items() for name in found or ()]
    unlisted = [index for index, prefix in enumerate(prefixes) if listings[prefix] is None]
    own = pc.is_in(names, value_set=pa.array(["", ".", ".."]))
    if links:
        own = pc.or_(own, pc.is_in(full, value_set=pa.array(links, pa.string())))
    if unlisted:
        own = pc.or_(own, pc.is_in(heads.indices, value_set=pa.array(unlisted, heads.indices.type)))
    own = pc.fill_null(own, False)
    if pc.any(own).as_py():
        resolved = [os.path.realpath(path) for path in absolute.filter(own).to_pylist()]
        full = pc.replace_with_mask(full, own, pa.array(resolved, pa.string()))
    return full


def _outside(paths: pa.Array, root: str) -> pa.Array:
    """True where a resolved path is neither ``root`` nor below it (null paths are not outside)."""
    below = pc.starts_with(paths, root if root.endswith("/") else root + "/")
    return pc.fill_null(pc.invert(pc.or_(pc.equal(paths, root), below)), False)


def _row_label(table: pa.Table, index: int) -> str:
    post_id = table.column("post_id")[index].as_py()
    return f"row {index + 1} (post_id {post_id!r})" if post_id not in (None, "") else f"row {index + 1}"

# --------------------------------------------------------------------------- the media column


def _parse_media(value) -> list[str] | str:
    """A row's media list, or what is wrong with it (a string)."""
    if value is None:
        return []
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return []
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            return f"media is not a JSON array of paths ({exc.msg} at character {exc.pos})"
    if not isinstance(value, list):
        return "media is not a list of paths"
    if not all(isinstance(p, str) and p.strip() for p in value):
        return "media holds an empty or non-text entry"
    return [p.strip() for p in value]


def media_lists(table: pa.Table) -> tuple[list[list[str]], dict[int, str]]:
    """Each row's media paths in order (from ``media``, else ``video_path``), and the problem of each
    row whose media cannot be read (its list is empty)."""
    n = table.num_rows
    media = table.column("media").to_pylist() if "media" in table.column_names else [None] * n
    video = table.column("video_path").to_pylist() if "video_path" in table.column_names else [None] * n
    lists: list[list[str]] = []
    problems: dict[int, str] = {}
    for i, (value, one) in enumerate(zip(media, video)):
        parsed = _parse_media(value)
        one = one.strip() if isinstance(one, str) and one.strip() else None
        if isinstance(parsed, str):
            problems[i] = parsed
            parsed = []
        elif parsed and one and parsed != [one]:
            problems[i] = f"video_path {one!r} and media {parsed!r} disagree (give one of them)"
            parsed = []
        lists.append(parsed or ([one] if one else []))
    return lists, problems


def media_paths(posts: pa.Table) -> list[str]:
    """Every media file the posts name (``load_posts``' resolved ``media``), in order."""
    return pc.list_flatten(posts.column("media")).to_pylist()


def load_posts(posts: str | os.PathLike, media_root: str | os.PathLike) -> pa.Table:
    """Read and check the posts table (module docstring); return post_id, source_path, video_path,
    caption, ``media`` (every file of the post, absolute with symlinks and '..' resolved, in order),
    ``source_media`` (the same as the table gives them) and the extra columns. Relative paths resolve
    against the posts file's directory. ``video_path`` and ``source_path`` are the post's first file
    (the inventory makes ``video_path`` the post's first usable video once it knows the kinds).
    Raises PostsError naming the rows at fault.
    """
    posts = Path(posts).absolute()
    root = os.path.realpath(media_root)
    if not os.path.isdir(root):
        raise PostsError(f"media_root {media_root} is not a directory")
    if posts.is_dir():
        table = _scan_directory(posts)
        base_dir = posts
    elif posts.is_file():
        table = _read_table(posts)
        base_dir = posts.parent
    else:
        raise PostsError(f"posts table {posts} does not exist")

    has = set(table.column_names)
    missing = ([] if "post_id" in has else ["post_id"]) + ([] if has & set(MEDIA_COLUMNS) else ["video_path"])
    if missing:
        raise PostsError(
            f"posts table {posts} lacks required column(s) {', '.join(missing)} "
            f"(a post's files: video_path for one video, or media for a list; "
            f"it has: {', '.join(table.column_names) or 'no columns'})"
        )
    clash = sorted(RESERVED.intersection(table.column_names))
    if clash:
        raise PostsError(
            f"posts table {posts} has column(s) {', '.join(clash)} that the inventory writes itself; rename them"
        )
    if len(set(table.column_names)) != len(table.column_names):
        raise PostsError(f"posts table {posts} has duplicate column names: {table.column_names}")

    for name in ("post_id", "video_path", "caption"):
        if name in table.column_names and table.schema.field(name).type != pa.string():
            table = table.set_column(table.column_names.index(name), name, pc.cast(table.column(name), pa.string()))
    if "caption" not in table.column_names:
        table = table.append_column("caption", pa.nulls(len(table), pa.string()))

    post_ids = table.column("post_id").combine_chunks()
    problems: list[str] = []

    empty_id = _blank(post_ids)
    empty_ids = _rows(empty_id)
    if empty_ids:
        problems.append(f"empty post_id in {len(empty_ids)} row(s): " + _listing([f"row {i + 1}" for i in empty_ids]))

    ids = pc.if_else(empty_id, pa.scalar(None, pa.string()), post_ids)
    counts = pc.value_counts(ids.drop_null())
    repeated = counts.field("values").filter(pc.greater(counts.field("counts"), 1))
    if len(repeated):
        rows_by_id: dict[str, list[int]] = {}  # in the order of each id's first row
        dup_rows = _rows(pc.fill_null(pc.is_in(ids, value_set=repeated), False))
        for i, p in zip(dup_rows, ids.take(dup_rows).to_pylist()):
            rows_by_id.setdefault(p, []).append(i)
        problems.append(
            f"duplicate post_id, {len(rows_by_id)} value(s): "
            + _listing([f"{p!r} (rows {', '.join(str(r + 1) for r in rows)})" for p, rows in rows_by_id.items()])
        )

    one_video_form = "media" not in table.column_names
    named = "video_path" if one_video_form else "media"
    if one_video_form:  # vectorised: a million rows of one video each take no Python loop
        video = table.column("video_path").combine_chunks()
        given = pc.invert(_blank(video))
        flat = pc.utf8_trim_whitespace(video).filter(given)
        lengths = given.to_numpy(zero_copy_only=False).astype(np.int64)
        media_problems: dict[int, str] = {}
    else:
        lists, media_problems = media_lists(table)
        flat = pa.array([p for paths in lists for p in paths], pa.string())
        lengths = np.fromiter((len(paths) for paths in lists), np.int64, len(lists))
    if media_problems:
        problems.append(f"bad media in {len(media_problems)} row(s): "
                        + _listing([f"{_row_label(table, i)}: {why}" for i, why in media_problems.items()]))
    empty = [int(i) for i in np.flatnonzero(lengths == 0) if int(i) not in media_problems]
    if empty:
        problems.append(
            f"empty {named} in {len(empty)} row(s): "
            + _listing([_row_label(table, i) for i in empty[:_SHOW]], len(empty))
        )

    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32), pa.int32())
    resolved = _resolve_paths(flat, str(base_dir))
    outside_items = _rows(_outside(resolved, root))
    if outside_items:
        post_of_item = np.repeat(np.arange(len(lengths)), lengths)
        by_row: dict[int, list[str]] = {}
        for j in outside_items:
            by_row.setdefault(int(post_of_item[j]), []).append(resolved[j].as_py())
        shown = [f"{_row_label(table, i)}: {', '.join(paths)}" for i, paths in list(by_row.items())[:_SHOW]]
        problems.append(
            f"{'video_path' if one_video_form else 'media path'} outside media_root {root} (after resolving symlinks "
            f"and '..') in {len(by_row)} row(s): " + _listing(shown, len(by_row))
        )

    if problems:
        raise PostsError(f"posts table {posts} cannot be used:\n  " + "\n  ".join(problems))

    media = pa.ListArray.from_arrays(offsets, resolved)
    source_media = pa.ListArray.from_arrays(offsets, flat)
    extras = [c for c in table.column_names if c not in ("post_id", "video_path", "caption", "media")]
    return pa.table(
        {
            "post_id": table.column("post_id"),
            "source_path": pc.list_element(source_media, 0),
            "video_path": pc.list_element(media, 0),
            "caption": table.column("caption"),
            "media": media,
            "source_media": source_media,
            **{c: table.column(c) for c in extras},
        }
    )
