"""Stage 1, inventory: probe every media item of every post, in parallel.

``vidlabel.prepare.posts.load_posts`` reads and checks the posts table (cheap: no media is opened, so
the workflow calls it before any job). ``build_inventory`` probes every item with
``vidlabel.prepare.items.probe_item`` in threads (PyAV and Pillow release the GIL while they read): the
kind (video, image, audio) comes from the file's content. A missing, empty or corrupt item gets a
``probe_error`` of its own and is dropped from its post, which keeps its other items
(``items_dropped`` says which and why); a post with no usable item gets a ``probe_error`` (its item's
own for a post of one item, else every item's) and is excluded later, never a failed run.

``inventory.parquet`` has one row per post: post_id, source_path, video_path, caption, the probe
fields of the post's first usable video (else of its first usable item: ``PROBE_SCHEMA``), the extra
columns of the posts table, and ``post_type`` (``vidlabel.prepare.post_plan.post_type``), ``n_items``,
``items_dropped`` and ``items`` (every item in the post's order: ``ITEM_TYPE``). A one-video post's row
is what it always was, plus those four. ``items_table`` gives the items one row each, also for an
inventory written before items existed.

Incremental: every probe is journaled beside the output (``inventory.jsonl``, key ``item_path``, with
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
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.compute as pc

from vidlabel.core import identity
from vidlabel.core.io import write_parquet
from vidlabel.core.journal import Journal, journal_beside
from vidlabel.prepare.items import ITEM_FIELDS, probe_item
from vidlabel.prepare.post_plan import post_type
from vidlabel.prepare.posts import load_posts

log = logging.getLogger(__name__)

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
_ITEM_TYPES = {**{f.name: f.type for f in PROBE_SCHEMA}, "kind": pa.string(), "media_format": pa.string(),
               "audio_codec": pa.string(), "orientation": pa.int64(), "frames": pa.int64(), "image_mode": pa.string()}
ITEM_TYPE = pa.struct([("index", pa.int32()), ("path", pa.string()), ("source_path", pa.string()),
                       *((name, _ITEM_TYPES[name]) for name in ITEM_FIELDS)])
BASE_COLUMNS = ("post_id", "source_path", "video_path", "caption")
POST_COLUMNS = pa.schema([("post_type", pa.string()), ("n_items", pa.int64()), ("items_dropped", pa.string()),
                          ("items", pa.list_(ITEM_TYPE))])


# --------------------------------------------------------------------------- probing


def probe_all(paths: Iterable[str], threads: int, progress_every_s: float = 10.0) -> list[dict[str, Any]]:
    """Probe ``paths`` (media items) with ``threads`` threads, in order; log progress and the rate."""
    paths = list(paths)
    started = last = time.monotonic()
    results: list[dict[str, Any]] = []
    with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="probe") as pool:
        for info in pool.map(probe_item, paths):
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


def usable(item: dict[str, Any]) -> bool:
    """An item the post keeps: probed without error, of a known kind."""
    return item["kind"] is not None and item["probe_error"] is None


def post_columns(items: list[dict[str, Any]]) -> dict[str, Any]:
    """A post's row from its probed items (module docstring): the probe fields of its first usable
    video, else of its first usable item, else of its first item; its type, item count and drops."""
    good = [i for i in items if usable(i)]
    primary = next((i for i in good if i["kind"] == "video"), good[0] if good else items[0])
    row = {name: primary.get(name) for name in PROBE_SCHEMA.names}
    row.update(video_path=primary["path"], source_path=primary["source_path"], n_items=len(items),
               post_type=post_type(i["kind"] for i in good), items_dropped=None)
    problems = [f"{i['index']}: {i['path']}: {i['probe_error']}" for i in items if not usable(i)]
    if good:
        row["probe_error"] = None
        row["items_dropped"] = "; ".join(problems) or None
    elif len(items) > 1:
        row["probe_error"] = f"no usable item: {'; '.join(problems)}"
    return row


def build_inventory(config: dict, output_path: str | os.PathLike, threads: int | None = None) -> None:
    """Read ``config['posts']``, probe every media item whose file is new or changed since its journaled
    probe (path, size and modification time: vidlabel.core.identity) and write ``inventory.parquet``
    atomically (module docstring)."""
    posts = load_posts(config["posts"], config["media_root"])
    if threads is None:
        threads = config.get("inventory", {}).get("threads", 8)
    media = posts.column("media").to_pylist()
    sources = posts.column("source_media").to_pylist()
    files = identity.media_items([p for paths in media for p in paths], "stat", threads=max(threads, 16))
    with Journal(journal_beside(output_path), key="item_path") as journal:
        probes = journal.read()
        todo = [p for p in files if p not in probes or probes[p].get("identity") != files[p]]
        log.info("inventory: %d posts, %d files, %d probed before with the same size and modification time, "
                 "%d to probe", posts.num_rows, len(files), len(files) - len(todo), len(todo))
        for path, info in zip(todo, probe_all(todo, threads) if todo else []):
            probes[path] = {"item_path": path, "identity": files[path], **info}
            journal.append(probes[path])
    items = [[{"index": i, "path": p, "source_path": s, **{f: probes[p].get(f) for f in ITEM_FIELDS}}
              for i, (p, s) in enumerate(zip(paths, given))] for paths, given in zip(media, sources)]
    rows = [post_columns(post) for post in items]
    columns = {"post_id": posts.column("post_id"), "caption": posts.column("caption")}
    for name in ("source_path", "video_path"):
        columns[name] = pa.array([r[name] for r in rows], pa.string())
    for field in (*PROBE_SCHEMA, *POST_COLUMNS):
        values = items if field.name == "items" else [r[field.name] for r in rows]
        columns[field.name] = pa.array(values, field.type)
    extras = [c for c in posts.column_names if c not in (*BASE_COLUMNS, "media", "source_media")]
    columns.update({name: posts.column(name) for name in extras})
    order = [*BASE_COLUMNS, *PROBE_SCHEMA.names, *extras, *POST_COLUMNS.names]
    write_parquet(pa.table({name: columns[name] for name in order}), output_path)
    kinds = pc.value_counts(pc.fill_null(columns["post_type"], "none")).to_pylist()
    log.info("inventory: posts by type: %s", {k["values"]: k["counts"] for k in kinds})


# --------------------------------------------------------------------------- items, one row each


def items_table(inventory: pa.Table) -> pa.Table:
    """One row per media item: post_id, caption, then ``ITEM_TYPE``'s fields, in the posts' order.

    An inventory written before posts had items (no ``items`` column) is read as one video item per
    post, from the post's own probe fields, so that the stages after it need no rerun of the inventory.
    """
    if "items" in inventory.column_names:
        items = inventory.column("items").combine_chunks()
        parents = pc.list_parent_indices(items)
        flat = pc.list_flatten(items)
        columns = {"post_id": inventory.column("post_id").combine_chunks().take(parents)}
        columns["caption"] = inventory.column("caption").combine_chunks().take(parents)
        columns.update({name: flat.field(name) for name in (f.name for f in ITEM_TYPE)})
        return pa.table(columns)
    n = inventory.num_rows
    ok = pc.is_null(inventory.column("probe_error"))
    columns = {"post_id": inventory.column("post_id"), "caption": inventory.column("caption"),
               "index": pa.array([0] * n, pa.int32()), "path": inventory.column("video_path"),
               "source_path": inventory.column("source_path")}
    for field in ITEM_TYPE:
        if field.name in columns:
            continue
        if field.name == "kind":
            columns["kind"] = pc.if_else(ok, pa.scalar("video"), pa.scalar(None, pa.string()))
        elif field.name in inventory.column_names:
            columns[field.name] = inventory.column(field.name)
        else:
            columns[field.name] = pa.nulls(n, field.type)
    return pa.table(columns)
