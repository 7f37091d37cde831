"""Stage 1, inventory: probe every media item of every post, in parallel.

``vidlabel.prepare.posts.load_posts`` reads and checks the posts table (cheap: no media is opened, so
the workflow calls it before any job). ``build_inventory`` probes every item with
``vidlabel.prepare.item_probe.probe_item`` in threads (PyAV and Pillow release the GIL while they read): the
kind (video, image, audio) comes from the file's content. A missing, empty or corrupt item gets a
``probe_error`` of its own and is dropped from its post, which keeps its other items
(``items_dropped`` says which and why); a post with no usable item gets a ``probe_error`` (its item's
own for a post of one item, else every item's) and is excluded later, never a failed run.

``inventory.parquet`` has one row per post: post_id, source_path, video_path, caption, the probe
fields of the post's first usable video (else of its first usable item: ``PROBE_SCHEMA``), the extra
columns of the posts table, and ``post_type`` (``vidlabel.prepare.post_plan.post_type``), ``n_items``,
``items_dropped`` and ``items`` (every item in the post's order: ``ITEM_TYPE``). A one-video post's row
is what it always was, plus those four. ``vidlabel.prepare.inventory_schema.items_table`` gives the
items one row each, also for an inventory written before items existed.

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
from vidlabel.prepare.inventory_schema import BASE_COLUMNS, ITEM_FIELDS, POST_COLUMNS, PROBE_SCHEMA
from vidlabel.prepare.item_probe import probe_item
from vidlabel.prepare.post_plan import post_type
from vidlabel.prepare.posts import load_posts

log = logging.getLogger(__name__)

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
