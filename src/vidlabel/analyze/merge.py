"""Merge stage: label shards + exclusions + inventory (+ manifest) -> ``labels.parquet`` (one row per post).

Runs entirely in DuckDB over the Parquet files (no Python loop over posts), so a million posts
merge in seconds. The inputs are checked first: a post missing from every shard, a post labelled
twice, a post both labelled and excluded, or a labelled post the inventory does not know stops the
merge with a message naming the problem, how many posts it affects and a few example post ids.

Each post also gets what it is (issue 26: ``post_type``, its items by kind, the items dropped) and the
manifest's token estimates per kind (``POST_COLUMNS``, ``post_columns``), from inventories and
manifests of every age: one written before posts had several items gets the values its one video
implies, or null.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Iterable, NamedTuple

import pyarrow as pa

from vidlabel.core import duck
from vidlabel.serve.record import LABEL_SCHEMA, MERGED_FIELDS

log = logging.getLogger(__name__)

# What made an answer; one labels table mixes none of them without saying so.
PROVENANCE_COLUMNS = ("model", "server", "settings_fingerprint", "prompt_hash")

# What the post is and what it was sent with (docs/outputs.md): its type and items by kind (the
# manifest's row where the post has one, i.e. what was sent; else the inventory's), and the manifest's
# token estimates per kind (null for a post the manifest does not hold: excluded).
POST_COLUMNS = ("post_type", "n_items", "n_videos", "n_images", "n_audio", "items_dropped",
                "est_video_tokens", "est_image_tokens", "est_audio_tokens", "est_text_tokens", "est_prompt_tokens")
KINDS_COUNTED = {"n_videos": "video", "n_images": "image", "n_audio": "audio"}

# Columns of labels.parquet besides the question columns (docs/outputs.md); a question id must not
# shadow one of them. Those after the first five are the journal record's (vidlabel.serve.record),
# then the post's (POST_COLUMNS).
FIXED_COLUMNS = ("post_id", "shard", "status", "error_kind", "error", *MERGED_FIELDS, *POST_COLUMNS)
_SQL_TYPES = {pa.string(): "VARCHAR", pa.int64(): "BIGINT", pa.float64(): "DOUBLE", pa.bool_(): "BOOLEAN"}


class Provenance(NamedTuple):
    """One provenance of a labels table's answers and how many answers it made."""
    model: str
    model_revision: str | None
    server: str | None
    settings_fingerprint: str
    prompt_hash: str
    answers: int


class MergeError(ValueError):
    """The shards, exclusions and inventory do not fit together; the message says how."""


def relation_columns(con, relation: str) -> list[str]:
    """The column names of a table or view, in order."""
    return [row[0] for row in con.execute(f"DESCRIBE {relation}").fetchall()]


def question_ids(config: dict[str, Any]) -> list[str]:
    ids = [q["id"] for q in config["classify"]["questions"]]
    clash = sorted(set(ids) & set(FIXED_COLUMNS))
    if clash:
        raise MergeError(f"question id(s) {clash} clash with fixed columns of labels.parquet; rename them")
    for qid in ids:
        duck.identifier(qid)
    return ids


def _answer_columns(ids: Iterable[str]) -> str:
    # answers is cast to VARCHAR because a shard whose requests all failed may store it as a null column.
    return ",\n    ".join(
        f"json_extract_string(CAST(l.answers AS VARCHAR), '$.\"{qid}\"') AS {duck.identifier(qid)}"
        for qid in ids)


def provenance_counts(con) -> list[Provenance]:
    """The provenances of view ``labels``'s answered and failed requests, most answers first (a
    labels.parquet older than the provenance columns: none)."""
    columns = set(relation_columns(con, "labels"))
    if not set(PROVENANCE_COLUMNS) <= columns:
        return []
    revision = "model_revision" if "model_revision" in columns else "CAST(NULL AS VARCHAR)"
    return [Provenance(*row) for row in con.execute(duck.sql("provenance", model_revision=revision)).fetchall()]


def check_provenance(con, labels_path: str | Path) -> None:
    """Answers of one question set and model only; several servers, model revisions or settings are
    said loudly."""
    duck.parquet_view(con, "labels", labels_path)
    rows = provenance_counts(con)
    if len({(r.model, r.prompt_hash) for r in rows}) > 1:
        raise MergeError("labels come from more than one model or question set: "
                         + "; ".join(f"{r.answers} from model {r.model}, prompt {r.prompt_hash}" for r in rows)
                         + ". Rerun classify (a record is reused only under the settings it was made with).")
    if len(rows) > 1:
        log.warning("labels come from %d provenances (model revision, server, settings): %s; summary.md lists them",
                    len(rows), "; ".join(f"{r.answers} answers by {r.server} ({r.model_revision}) under settings "
                                         f"{r.settings_fingerprint}" for r in rows))


def record_columns(con) -> str:
    """The SELECT list of the record's columns (``MERGED_FIELDS``), NULL where no shard has one."""
    present = set(relation_columns(con, "shard_labels"))
    types = {f.name: _SQL_TYPES[f.type] for f in LABEL_SCHEMA}
    return ",\n    ".join(f"CAST({'l.' + name if name in present else 'NULL'} AS {types[name]}) AS {name}"
                           for name in MERGED_FIELDS)


def _inventory_expressions(inventory: set[str]) -> dict[str, str]:
    """Per post column, its SQL expression over the inventory (alias ``i``) as far as its columns allow."""
    if "video_path" in inventory:
        # An inventory written before posts had several items (no post_type, items) holds one video per
        # post: the post lists that one video, and it is a usable video post unless its probe failed, in
        # which case it has no usable item and no type, as a post of the new inventory without one.
        usable = "i.probe_error IS NULL" if "probe_error" in inventory else "TRUE"
        one_video = {"post_type": f"CASE WHEN i.video_path IS NOT NULL AND {usable} THEN 'video' END",
                     "n_items": "CASE WHEN i.video_path IS NOT NULL THEN 1 END",
                     "n_videos": f"CASE WHEN i.video_path IS NOT NULL THEN CASE WHEN {usable} THEN 1 ELSE 0 END END",
                     "n_images": "CASE WHEN i.video_path IS NOT NULL THEN 0 END",
                     "n_audio": "CASE WHEN i.video_path IS NOT NULL THEN 0 END"}
    else:
        one_video = {}
    out = {name: one_video.get(name, "NULL") for name in ("post_type", "n_items", *KINDS_COUNTED, "items_dropped")}
    if "items" in inventory:
        # The items a post would be sent with: those of the kind whose probe did not fail (a dropped
        # item has a probe error), as the manifest counts the items it sends.
        for name, kind in KINDS_COUNTED.items():
            out[name] = f"len([x FOR x IN i.items IF x.kind = '{kind}' AND x.probe_error IS NULL])"
        out["n_items"] = "len(i.items)"
    for name in ("post_type", "n_items", "items_dropped"):
        if name in inventory:
            out[name] = f"i.{name}"
    return out


def _manifest_token_expressions(manifest: set[str]) -> dict[str, str]:
    """The token estimates per kind over the manifest (alias ``m``); NULL where it has no such column."""
    out = {name: f"m.{name}" if name in manifest else "NULL"
           for name in ("est_video_tokens", "est_image_tokens", "est_audio_tokens", "est_text_tokens",
                        "est_prompt_tokens")}
    if "est_visual_tokens" in manifest:
        # A manifest row written before posts had several items sent one video: its visual tokens are
        # the video's and it has no image tokens.
        out["est_video_tokens"] = f"coalesce({out['est_video_tokens']}, m.est_visual_tokens)"
        out["est_image_tokens"] = (f"coalesce({out['est_image_tokens']}, "
                                   "CASE WHEN m.est_visual_tokens IS NOT NULL THEN 0 END)")
    if "est_audio_tokens" not in manifest and "est_visual_tokens" in manifest:
        out["est_audio_tokens"] = "CASE WHEN m.est_visual_tokens IS NOT NULL THEN 0 END"  # before audio was heard
    return out


def post_columns(con) -> str:
    """The SELECT list of ``POST_COLUMNS`` over views ``inventory`` (``i``) and ``manifest`` (``m``):
    type, item counts and items dropped from the post's manifest row where it has one (what was sent,
    after any item the manifest dropped), else from the inventory; token estimates from the manifest."""
    inventory = set(relation_columns(con, "inventory"))
    manifest = set(relation_columns(con, "manifest"))
    exprs = _inventory_expressions(inventory)
    for name in ("post_type", *KINDS_COUNTED, "items_dropped"):
        if name in manifest:
            exprs[name] = f"coalesce(m.{name}, {exprs[name]})"
    exprs.update(_manifest_token_expressions(manifest))
    types = {"post_type": "VARCHAR", "items_dropped": "VARCHAR"}
    return ",\n    ".join(f"CAST({exprs[name]} AS {types.get(name, 'BIGINT')}) AS {name}" for name in POST_COLUMNS)


# No manifest given (callers that predate it): no row matches, every estimate is null.
EMPTY_MANIFEST_VIEW = "CREATE OR REPLACE VIEW manifest AS SELECT CAST(NULL AS VARCHAR) AS post_id WHERE false"


def manifest_view(con, manifest_paths: list[str]) -> None:
    """View ``manifest`` over the manifest shards; without any, an empty one (the token columns are null)."""
    if manifest_paths:
        duck.parquet_view(con, "manifest", manifest_paths, union_by_name=True)
    else:
        con.execute(EMPTY_MANIFEST_VIEW)



def check_inputs(con, with_manifest: bool = False) -> None:
    problems = con.execute(duck.sql("merge_problems")).fetchall()
    if with_manifest:
        problems += con.execute(duck.sql("merge_manifest_problems")).fetchall()
    if problems:
        lines = [f"{problem}: {n} post(s), e.g. {', '.join(map(str, examples))}"
                 for problem, n, examples in problems]
        raise MergeError("cannot merge labels:\n  " + "\n  ".join(lines))


def merge(config: dict[str, Any], inventory_path: str | Path, excluded_path: str | Path,
          label_paths: Iterable[str | Path], output_path: str | Path,
          manifest_paths: Iterable[str | Path] | None = None) -> None:
    """Write ``labels.parquet`` (docs/outputs.md) from the inventory, the exclusions, the label shards and
    the manifest shards (the token estimates per kind; without them those columns are null)."""
    t0 = time.perf_counter()
    label_paths = [str(p) for p in label_paths]
    manifest_paths = [str(p) for p in manifest_paths or ()]
    if not label_paths:
        raise MergeError("no label shards given")
    ids = question_ids(config)
    con = duck.connect()
    duck.parquet_view(con, "inventory", inventory_path, file_row_number=True)
    duck.parquet_view(con, "excluded", excluded_path)
    duck.parquet_view(con, "shard_labels", label_paths, union_by_name=True)
    manifest_view(con, manifest_paths)
    check_inputs(con, with_manifest=bool(manifest_paths))
    duck.copy_to_parquet(con, duck.sql("merge_labels", answer_columns=_answer_columns(ids),
                                       record_columns=record_columns(con), post_columns=post_columns(con)),
                         output_path)
    counts = dict(con.execute(
        f"SELECT status, count(*) FROM read_parquet({duck.literal(output_path)}) GROUP BY status").fetchall())
    check_provenance(con, output_path)
    log.info("merged %d posts from %d shard(s) into %s in %.2f s: %s", sum(counts.values()),
             len(label_paths), output_path, time.perf_counter() - t0,
             ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
