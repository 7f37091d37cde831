"""Stage 1, inventory: read the posts table, check it, and probe every video in parallel.

``load_posts`` is cheap (no media is opened) so the workflow can call it before any job and stop
with a message naming the offending rows. ``build_inventory`` probes with PyAV in threads (PyAV
releases the GIL while it reads) and writes ``inventory.parquet`` atomically; a missing, empty or
corrupt file becomes a row with a ``probe_error``, never a failed run.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from vidlabel.io import write_parquet
from vidlabel.media import probe

log = logging.getLogger(__name__)

VIDEO_EXTENSIONS = frozenset(
    {".mp4", ".m4v", ".mov", ".webm", ".mkv", ".avi", ".3gp", ".flv", ".wmv", ".mpg", ".mpeg", ".ts"}
)
PARQUET_EXTENSIONS = (".parquet", ".pq")
REQUIRED = ("post_id", "video_path")

PROBE_SCHEMA = pa.schema(
    [
        ("size_bytes", pa.int64()),
        ("duration_s", pa.float64()),
        ("fps", pa.float64()),
        ("width", pa.int64()),
        ("height", pa.int64()),
        ("video_codec", pa.string()),
        ("has_audio", pa.bool_()),
        ("probe_error", pa.string()),
    ]
)
BASE_COLUMNS = ("post_id", "source_path", "video_path", "caption")
#: Columns the inventory writes itself; a posts table may not bring its own.
RESERVED = frozenset({"source_path", *PROBE_SCHEMA.names})

_SHOW = 10  # offending rows named in a message before "and N more"


class PostsError(ValueError):
    """The posts table cannot be used as given; the message names the offending rows."""


def _listing(items: list[str]) -> str:
    shown = ", ".join(items[:_SHOW])
    if len(items) > _SHOW:
        shown += f", and {len(items) - _SHOW} more"
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
                column_types={c: pa.string() for c in ("post_id", "video_path", "caption") if c in header},
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


class _Resolver:
    """Resolve symlinks and '..' of many paths, caching the directories (one lstat per file)."""

    def __init__(self) -> None:
        self._dirs: dict[str, str] = {}

    def __call__(self, path: str) -> str:
        head, name = os.path.split(path)
        if name in ("", ".", ".."):
            return os.path.realpath(path)
        parent = self._dirs.get(head)
        if parent is None:
            parent = self._dirs[head] = os.path.realpath(head)
        full = os.path.join(parent, name)
        return os.path.realpath(full) if os.path.islink(full) else full


def _row_label(table: pa.Table, index: int) -> str:
    post_id = table.column("post_id")[index].as_py()
    return f"row {index + 1} (post_id {post_id!r})" if post_id not in (None, "") else f"row {index + 1}"


def load_posts(posts: str | os.PathLike, media_root: str | os.PathLike) -> pa.Table:
    """Read and check the posts table; return post_id, source_path, video_path, caption, extras.

    ``posts`` is a CSV or Parquet file (columns post_id, video_path, optional caption, any
    extra columns) or a directory of videos. Relative video paths resolve against the posts
    file's directory; ``video_path`` comes back absolute with symlinks and '..' resolved.
    Raises PostsError naming the rows for: missing columns, empty post_id or video_path,
    duplicate post_ids, paths outside ``media_root``, columns the inventory reserves.
    A missing video file is not an error here (it becomes a probe_error).
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

    missing = [c for c in REQUIRED if c not in table.column_names]
    if missing:
        raise PostsError(
            f"posts table {posts} lacks required column(s) {', '.join(missing)} "
            f"(it has: {', '.join(table.column_names) or 'no columns'})"
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

    post_ids = table.column("post_id").to_pylist()
    sources = table.column("video_path").to_pylist()
    problems: list[str] = []

    empty_ids = [i for i, p in enumerate(post_ids) if p is None or not p.strip()]
    if empty_ids:
        problems.append(f"empty post_id in {len(empty_ids)} row(s): " + _listing([f"row {i + 1}" for i in empty_ids]))

    rows_by_id: dict[str, list[int]] = {}
    for i, p in enumerate(post_ids):
        if p is not None and p.strip():
            rows_by_id.setdefault(p, []).append(i)
    dups = [(p, rows) for p, rows in rows_by_id.items() if len(rows) > 1]
    if dups:
        problems.append(
            f"duplicate post_id, {len(dups)} value(s): "
            + _listing([f"{p!r} (rows {', '.join(str(r + 1) for r in rows)})" for p, rows in dups])
        )

    empty_paths = [i for i, s in enumerate(sources) if s is None or not s.strip()]
    if empty_paths:
        problems.append(
            f"empty video_path in {len(empty_paths)} row(s): " + _listing([_row_label(table, i) for i in empty_paths])
        )

    resolve = _Resolver()
    resolved: list[str | None] = []
    outside: list[int] = []
    for i, source in enumerate(sources):
        if source is None or not source.strip():
            resolved.append(None)
            continue
        full = resolve(os.path.join(base_dir, os.path.expanduser(source)))
        resolved.append(full)
        if os.path.commonpath([root, full]) != root:
            outside.append(i)
    if outside:
        problems.append(
            f"video_path outside media_root {root} (after resolving symlinks and '..') in {len(outside)} row(s): "
            + _listing([f"{_row_label(table, i)}: {resolved[i]}" for i in outside])
        )

    if problems:
        raise PostsError(f"posts table {posts} cannot be used:\n  " + "\n  ".join(problems))

    extras = [c for c in table.column_names if c not in ("post_id", "video_path", "caption")]
    return pa.table(
        {
            "post_id": table.column("post_id"),
            "source_path": table.column("video_path"),
            "video_path": pa.array(resolved, pa.string()),
            "caption": table.column("caption"),
            **{c: table.column(c) for c in extras},
        }
    )


# --------------------------------------------------------------------------- probing


def probe_all(paths: Iterable[str], threads: int, progress_every_s: float = 10.0) -> list[dict[str, Any]]:
    """Probe ``paths`` with ``threads`` threads, in order; log progress and the rate."""
    paths = list(paths)
    started = last = time.monotonic()
    results: list[dict[str, Any]] = []
    with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="probe") as pool:
        for info in pool.map(probe, paths):
            results.append(info)
            now = time.monotonic()
            if now - last >= progress_every_s:
                last = now
                log.info("probed %d/%d files (%.1f files/s)", len(results), len(paths), len(results) / (now - started))
    elapsed = time.monotonic() - started
    failed = sum(1 for r in results if r["probe_error"])
    log.info(
        "probed %d files in %.2f s (%.1f files/s with %d threads); %d with a probe error",
        len(results), elapsed, len(results) / elapsed if elapsed > 0 else float("inf"), threads, failed,
    )
    return results


def build_inventory(config: dict, output_path: str | os.PathLike, threads: int | None = None) -> None:
    """Read ``config['posts']``, probe every video and write ``inventory.parquet`` atomically."""
    posts = load_posts(config["posts"], config["media_root"])
    if threads is None:
        threads = config.get("inventory", {}).get("threads", 8)
    infos = probe_all(posts.column("video_path").to_pylist(), threads)
    probed = pa.table(
        {f.name: pa.array([info[f.name] for info in infos], f.type) for f in PROBE_SCHEMA},
        schema=PROBE_SCHEMA,
    )
    columns = {name: posts.column(name) for name in BASE_COLUMNS}
    columns.update({name: probed.column(name) for name in PROBE_SCHEMA.names})
    columns.update({name: posts.column(name) for name in posts.column_names if name not in BASE_COLUMNS})
    write_parquet(pa.table(columns), output_path)
