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
from vidlabel.core import duck

log = logging.getLogger(__name__)


class HumanLabelError(ValueError):
    """The human-label file cannot be read as a table of post_id, question, label."""


def _empty_human_tables(con) -> None:
    con.execute("CREATE TABLE human_checked (line BIGINT, post_id VARCHAR, question VARCHAR, label_text VARCHAR, "
                "y DOUBLE, adjudicated DOUBLE, probability DOUBLE, issue VARCHAR)")
    con.execute("CREATE TABLE human_resolved (post_id VARCHAR, question VARCHAR, y DOUBLE, probability DOUBLE, "
                "copies BIGINT, resolution VARCHAR)")
    con.execute("CREATE VIEW human_valid AS SELECT post_id, question, y, probability FROM human_resolved")


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


def load_human_labels(con, path: str | Path | None) -> dict[str, Any] | None:
    """Read, check and resolve the human labels: table ``human_checked`` (every row, with its issue),
    table ``human_resolved`` and view ``human_valid`` (one label per post and question).

    Returns None without human labels (empty tables are still created so the SQL stays uniform),
    else a description: path, rows, usable rows, labelled posts, the design ("uniform" or
    "weighted"), the labelled posts' sampling probabilities, the issues found (issue, rows,
    examples) and how duplicates were resolved (resolution, post-questions, examples).
    """
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
    con.execute(duck.sql(
        "human_labels",
        question_column=_quote_any(question_column),
        probability_column=_quote_any(probability_column) if probability_column else "NULL",
        adjudication_column=_quote_any(adjudication_column) if adjudication_column else "NULL",
        has_probability="true" if probability_column else "false"))
    con.execute("CREATE VIEW human_valid AS SELECT post_id, question, y, probability FROM human_resolved")
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
    weighted = probabilities.size > 0 and float(probabilities.max() - probabilities.min()) > 1e-12
    # fetchall, not fetchone: callers go on using the connection, which a half-read result blocks
    posts = con.execute("SELECT count(DISTINCT post_id) FROM human_resolved").fetchall()[0][0]
    return {"path": str(path), "rows": rows, "usable": usable, "posts": posts,
            "design": "weighted" if weighted else "uniform", "weighted": weighted,
            "has_probability": probability_column is not None,
            "sampling_probabilities": probabilities, "issues": issues, "resolutions": resolutions}


def _quote_any(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def example_rows(examples: Iterable[dict]) -> str:
    return "; ".join(f"line {e['line']}: post {e['post_id']!r}, question {e['question']!r}, label {e['label']!r}"
                     for e in examples)


def resolution_examples(examples: Iterable[dict]) -> str:
    return "; ".join(f"post {e['post_id']!r}, question {e['question']!r}: {e['copies']} labels -> {e['label']:g}"
                     for e in examples)
