"""Stage 1, inventory: read the posts table, check it, and probe every video in parallel.

``load_posts`` is cheap (no media is opened) so the workflow can call it before any job and stop
with a message naming the offending rows. ``build_inventory`` probes with PyAV in threads (PyAV
releases the GIL while it reads) and writes ``inventory.parquet`` atomically; a missing, empty or
corrupt file becomes a row with a ``probe_error``, never a failed run.

Incremental: every probe is journaled beside the output (``inventory.jsonl``, key ``video_path``, with
the file's identity); a rerun probes only the files that are new or whose size or modification time
changed. The Snakefile reruns this rule when the media change (``vidlabel.core.identity.media_state``
of every path is its params), and every stage after it reruns through its input, each redoing only
the changed posts from its own journal.
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

from vidlabel.core import identity
from vidlabel.core.io import write_parquet
from vidlabel.core.journal import Journal, journal_beside
from vidlabel.prepare.media import probe

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
        ("pix_fmt", pa.string()),
        ("rotation", pa.int64()),
        ("container", pa.string()),
        ("header_frames", pa.int64()),
        ("base_fps", pa.float64()),
    ]
)
BASE_COLUMNS = ("post_id", "source_path", "video_path", "caption")
#: Columns the inventory writes itself; a posts table may not bring its own.
RESERVED = frozenset({"source_path", *PROBE_SCHEMA.names})

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

    post_ids = table.column("post_id").combine_chunks()
    sources = table.column("video_path").combine_chunks()
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

    empty_path = _blank(sources)
    empty_paths = _rows(empty_path)
    if empty_paths:
        problems.append(
            f"empty video_path in {len(empty_paths)} row(s): "
            + _listing([_row_label(table, i) for i in empty_paths[:_SHOW]], len(empty_paths))
        )

    resolved = _resolve_paths(pc.if_else(empty_path, pa.scalar(None, pa.string()), sources), str(base_dir))
    outside = _rows(_outside(resolved, root))
    if outside:
        problems.append(
            f"video_path outside media_root {root} (after resolving symlinks and '..') in {len(outside)} row(s): "
            + _listing([f"{_row_label(table, i)}: {resolved[i].as_py()}" for i in outside[:_SHOW]], len(outside))
        )

    if problems:
        raise PostsError(f"posts table {posts} cannot be used:\n  " + "\n  ".join(problems))

    extras = [c for c in table.column_names if c not in ("post_id", "video_path", "caption")]
    return pa.table(
        {
            "post_id": table.column("post_id"),
            "source_path": table.column("video_path"),
            "video_path": resolved,
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
    """Read ``config['posts']``, probe every video whose file is new or changed since its journaled
    probe (path, size and modification time: vidlabel.core.identity) and write ``inventory.parquet``
    atomically."""
    posts = load_posts(config["posts"], config["media_root"])
    if threads is None:
        threads = config.get("inventory", {}).get("threads", 8)
    paths = posts.column("video_path").to_pylist()
    items = identity.media_items(paths, "stat", threads=max(threads, 16))
    with Journal(journal_beside(output_path), key="video_path") as journal:
        probes = journal.read()
        todo = [p for p in items if p not in probes or probes[p].get("identity") != items[p]]
        log.info("inventory: %d files, %d probed before with the same size and modification time, %d to probe",
                 len(items), len(items) - len(todo), len(todo))
        for path, info in zip(todo, probe_all(todo, threads) if todo else []):
            probes[path] = {"video_path": path, "identity": items[path], **info}
            journal.append(probes[path])
    infos = [probes[p] for p in paths]
    probed = pa.table(
        {f.name: pa.array([info[f.name] for info in infos], f.type) for f in PROBE_SCHEMA},
        schema=PROBE_SCHEMA,
    )
    columns = {name: posts.column(name) for name in BASE_COLUMNS}
    columns.update({name: probed.column(name) for name in PROBE_SCHEMA.names})
    columns.update({name: posts.column(name) for name in posts.column_names if name not in BASE_COLUMNS})
    write_parquet(pa.table(columns), output_path)
