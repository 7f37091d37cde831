"""Human labels: reading, checking and resolving them (one label per post and question), and the
design they were drawn under (their sampling probabilities).

The file is CSV, Parquet or a Label Studio JSON export with ``post_id``, ``question`` (or
``question_id``), ``label`` and optionally ``sampling_probability`` and ``adjudication``
(docs/statistics.md, "Human labels"). Every row stays in table ``human_checked`` with the reason it
cannot be used; ``human_resolved`` holds one label per post and question (the adjudication, else the
majority, a tie as 0.5) and view ``human_valid`` the columns the estimators read.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from vidlabel.analyze.labels_db import relation_columns
from vidlabel.analyze.sample_design import DesignError, file_digest, read_design
from vidlabel.core import duck

log = logging.getLogger(__name__)


class HumanLabelError(ValueError):
    """The human-label file cannot be read as a table of post_id, question, label."""


# The columns the estimators read: one label per post and question with its design.
HUMAN_VALID_VIEW = "CREATE VIEW human_valid AS SELECT post_id, question, y, probability, phase FROM human_resolved"


def _empty_human_tables(con) -> None:
    con.execute("CREATE TABLE human_checked (line BIGINT, post_id VARCHAR, question VARCHAR, label_text VARCHAR, "
                "y DOUBLE, adjudicated DOUBLE, probability DOUBLE, phase INTEGER, issue VARCHAR)")
    con.execute("CREATE TABLE human_resolved (post_id VARCHAR, question VARCHAR, y DOUBLE, probability DOUBLE, "
                "phase INTEGER, copies BIGINT, resolution VARCHAR)")
    con.execute(HUMAN_VALID_VIEW)


def register_design(con, design_path: str | Path | None) -> dict[str, Any] | None:
    """Table ``design_posts`` (post_id, pi, drawn, phase, calibrated): the frame of the design the human
    labels were drawn under (``sample_design``; empty without one). Returns the design's description or None."""
    con.execute("CREATE OR REPLACE TABLE design_posts (post_id VARCHAR, pi DOUBLE, drawn BOOLEAN, phase INTEGER, "
                "calibrated DOUBLE[])")
    if design_path is None or str(design_path) == "":
        return None
    try:
        table, metadata = read_design(design_path)
    except DesignError as exc:
        raise HumanLabelError(str(exc)) from None
    con.register("design_arrow", table.select(["post_id", "pi", "drawn", "phase", "calibrated"]))
    con.execute("INSERT INTO design_posts SELECT post_id, pi, drawn, CAST(phase AS INTEGER), calibrated "
                "FROM design_arrow")
    con.unregister("design_arrow")
    return {**metadata, "path": str(design_path)}


def _read_human_raw(con, path: Path) -> None:
    """View ``human_raw`` over the file: CSV (every column as text: labels come as yes/no, 1/0 or
    true/false and are normalised in SQL), Parquet, or a Label Studio JSON export."""
    if path.suffix.lower() == ".json":
        from vidlabel.analyze.labelstudio import (
            read_export,  # only for Label Studio exports
        )

        try:
            table = read_export(path)
        except (OSError, ValueError) as exc:
            raise HumanLabelError(f"cannot read the Label Studio export {path}: {exc}") from None
        con.register("human_raw_arrow", table)
        con.execute("CREATE TABLE human_raw AS SELECT * FROM human_raw_arrow")
        con.unregister("human_raw_arrow")
        return
    if path.suffix.lower() in (".parquet", ".pq"):
        reader = f"read_parquet({duck.literal(path)})"
    else:
        reader = f"read_csv({duck.literal(path)}, header = true, all_varchar = true)"
    con.execute(f"CREATE VIEW human_raw AS SELECT * FROM {reader}")


# Posts of the design's frame that are not classified posts of today's labels (excluded since, or gone).
FRAME_MISSING_SQL = """SELECT count(*) FROM design_posts
    WHERE post_id NOT IN (SELECT post_id FROM labels WHERE status IN ('ok', 'error'))"""
FRAME_OUTSIDE_SQL = """SELECT count(*) FROM labels WHERE status IN ('ok', 'error')
    AND post_id NOT IN (SELECT post_id FROM design_posts)"""


def check_frame(con, sample: dict[str, Any], labels_path: str | Path) -> None:
    """Today's classified posts against the design's frame, into ``sample``: ``outside`` (classified
    since the draw), ``missing`` (frame posts no longer classified) and ``labels_changed`` (labels.parquet
    is not the file the sample was drawn from); each is logged and said in summary.md."""
    sample["outside"] = con.execute(FRAME_OUTSIDE_SQL).fetchall()[0][0]
    sample["missing"] = con.execute(FRAME_MISSING_SQL).fetchall()[0][0]
    sample["labels_changed"] = sample.get("labels_sha256") != file_digest(labels_path)
    if sample["outside"] or sample["missing"]:
        log.warning("human sample design %s: %d classified post(s) outside its frame (estimated apart, from the "
                    "model alone), %d post(s) of its frame no longer classified", sample["path"], sample["outside"],
                    sample["missing"])
    if sample["labels_changed"]:
        log.warning("human sample design %s was drawn from another labels.parquet (%s)", sample["path"],
                    sample.get("labels_path"))


def load_human_labels(con, path: str | Path | None, design_path: str | Path | None = None) -> dict[str, Any] | None:
    """Read, check and resolve the human labels: table ``human_checked`` (every row, with its issue),
    table ``human_resolved`` and view ``human_valid`` (one label per post and question), with the
    design ``design_path`` (``register_design``) when given.

    Returns None without human labels (empty tables are still created so the SQL stays uniform),
    else a description: path, rows, usable rows, labelled posts, the design ("uniform", "weighted"
    or "two_phase"; ``weighted`` is true for the last two), the labelled posts' sampling
    probabilities, the design file's description (``sample_design``, None without one), the issues
    found (issue, rows, examples) and how duplicates were resolved (resolution, post-questions,
    examples). Labels of a two-phase design's second draw without the design file stop it: their
    estimate needs the design's combination weights.
    """
    sample = register_design(con, design_path)
    if path is None or str(path) == "":
        _empty_human_tables(con)
        return None
    path = Path(path)
    if not path.is_file():
        raise HumanLabelError(f"human labels file {path} does not exist (config key human_labels)")
    try:
        _read_human_raw(con, path)
        columns = {c.lower(): c for c in relation_columns(con, "human_raw")}
    except HumanLabelError:
        raise
    except Exception as exc:  # duckdb raises several exception types for unreadable files
        raise HumanLabelError(f"cannot read human labels {path}: {exc}") from None
    question_column = columns.get("question") or columns.get("question_id")
    missing = [name for name, present in (("post_id", "post_id" in columns),
                                          ("question", question_column is not None),
                                          ("label", "label" in columns)) if not present]
    if missing:
        raise HumanLabelError(f"human labels {path} lack column(s) {missing}; found {sorted(columns.values())}. "
                              "Expected post_id, question, label and optionally sampling_probability, adjudication.")
    probability_column = columns.get("sampling_probability")
    adjudication_column = columns.get("adjudication")
    phase_column = columns.get("phase")
    con.execute(duck.sql(
        "human_labels",
        question_column=_quote_any(question_column),
        probability_column=_quote_any(probability_column) if probability_column else "NULL",
        adjudication_column=_quote_any(adjudication_column) if adjudication_column else "NULL",
        phase_column=_quote_any(phase_column) if phase_column else "NULL",
        has_probability="true" if probability_column else "false",
        has_design="true" if sample else "false"))
    con.execute(HUMAN_VALID_VIEW)
    rows, usable = con.execute("SELECT count(*), count(*) FILTER (WHERE issue IS NULL) FROM human_checked").fetchone()
    issues = con.execute("""
        SELECT issue, count(*), list({'line': line, 'post_id': post_id, 'question': question,
                                      'label': label_text} ORDER BY line)[1:3]
        FROM human_checked WHERE issue IS NOT NULL GROUP BY issue ORDER BY count(*) DESC, issue
    """).fetchall()
    for issue, count, examples in issues:
        log.warning("human labels: %d row(s) not used: %s (e.g. %s)", count, issue, example_rows(examples))
    resolutions = con.execute("""
        SELECT resolution, count(*), list({'post_id': post_id, 'question': question, 'copies': copies,
                                           'label': y} ORDER BY post_id, question)[1:3]
        FROM human_resolved WHERE resolution IS NOT NULL AND resolution <> 'agreeing copies'
        GROUP BY resolution ORDER BY count(*) DESC, resolution
    """).fetchall()
    for resolution, count, examples in resolutions:
        log.warning("human labels: %d post-question(s) with several labels: %s (e.g. %s)", count, resolution,
                    resolution_examples(examples))
    # One inclusion probability per post (a post drawn once serves every question).
    probabilities = np.array([p for (p,) in con.execute(
        "SELECT any_value(probability) FROM human_resolved GROUP BY post_id").fetchall()
        if p is not None], dtype=float)
    varying = probabilities.size > 0 and float(probabilities.max() - probabilities.min()) > 1e-12
    # fetchall, not fetchone: callers go on using the connection, which a half-read result blocks
    posts, second = con.execute("SELECT count(DISTINCT post_id), count(*) FILTER (WHERE phase = 2) "
                                "FROM human_resolved").fetchall()[0]
    if second and not sample:
        raise HumanLabelError(f"{path}: {second} label(s) of a two-phase design's second draw (column phase = 2): "
                              "their estimate needs the design they were drawn under; set config key human_design "
                              "to label_sample's design.parquet (results/label_sample/design.parquet or a copy)")
    design = "two_phase" if second else "weighted" if varying else "uniform"
    return {"path": str(path), "rows": rows, "usable": usable, "posts": posts, "design": design,
            "weighted": design != "uniform", "has_probability": probability_column is not None or sample is not None,
            "sampling_probabilities": probabilities, "sample_design": sample, "issues": issues,
            "resolutions": resolutions}


def _quote_any(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def example_rows(examples: Iterable[dict]) -> str:
    return "; ".join(f"line {e['line']}: post {e['post_id']!r}, question {e['question']!r}, label {e['label']!r}"
                     for e in examples)


def resolution_examples(examples: Iterable[dict]) -> str:
    return "; ".join(f"post {e['post_id']!r}, question {e['question']!r}: {e['copies']} labels -> {e['label']:g}"
                     for e in examples)
