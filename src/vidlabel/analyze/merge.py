"""Merge stage: label shards + exclusions + inventory -> ``labels.parquet`` (one row per post).

Runs entirely in DuckDB over the Parquet files (no Python loop over posts), so a million posts
merge in seconds. The inputs are checked first: a post missing from every shard, a post labelled
twice, a post both labelled and excluded, or a labelled post the inventory does not know stops the
merge with a message naming the problem, how many posts it affects and a few example post ids.
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

# Columns of labels.parquet besides the question columns (docs/outputs.md); a question id must not
# shadow one of them. Those after the first five are the journal record's (vidlabel.serve.record).
FIXED_COLUMNS = ("post_id", "shard", "status", "error_kind", "error", *MERGED_FIELDS)
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
    columns = {r[0] for r in con.execute("DESCRIBE labels").fetchall()}
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
    present = {row[0] for row in con.execute("DESCRIBE shard_labels").fetchall()}
    types = {f.name: _SQL_TYPES[f.type] for f in LABEL_SCHEMA}
    return ",\n    ".join(f"CAST({'l.' + name if name in present else 'NULL'} AS {types[name]}) AS {name}"
                           for name in MERGED_FIELDS)


def check_inputs(con) -> None:
    problems = con.execute(duck.sql("merge_problems")).fetchall()
    if problems:
        lines = [f"{problem}: {n} post(s), e.g. {', '.join(map(str, examples))}"
                 for problem, n, examples in problems]
        raise MergeError("cannot merge labels:\n  " + "\n  ".join(lines))


def merge(config: dict[str, Any], inventory_path: str | Path, excluded_path: str | Path,
          label_paths: Iterable[str | Path], output_path: str | Path) -> None:
    """Write ``labels.parquet`` (docs/outputs.md) from the inventory, the exclusions and the label shards."""
    t0 = time.perf_counter()
    label_paths = [str(p) for p in label_paths]
    if not label_paths:
        raise MergeError("no label shards given")
    ids = question_ids(config)
    con = duck.connect()
    duck.parquet_view(con, "inventory", inventory_path, file_row_number=True)
    duck.parquet_view(con, "excluded", excluded_path)
    duck.parquet_view(con, "shard_labels", label_paths, union_by_name=True)
    check_inputs(con)
    duck.copy_to_parquet(con, duck.sql("merge_labels", answer_columns=_answer_columns(ids),
                                       record_columns=record_columns(con)), output_path)
    counts = dict(con.execute(
        f"SELECT status, count(*) FROM read_parquet({duck.literal(output_path)}) GROUP BY status").fetchall())
    check_provenance(con, output_path)
    log.info("merged %d posts from %d shard(s) into %s in %.2f s: %s", sum(counts.values()),
             len(label_paths), output_path, time.perf_counter() - t0,
             ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
