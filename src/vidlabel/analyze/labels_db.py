"""The labels database: a model's ``labels.parquet`` in DuckDB, its answers in long form, and the query
and CSV helpers every analysis stage shares (aggregate, compare, label_sample).

- ``labels`` (a view over labels.parquet) and ``answers_long`` (one row per post and question with the
  answer and the model's P(yes), sql/answers_long.sql).
- The model's P(yes) of a question is an SQL expression over ``answer_probs`` (sql/answer_prob.sql),
  NULL for labels merged before it existed.
"""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pyarrow as pa

from vidlabel.analyze.merge import FIXED_COLUMNS, POST_COLUMNS, PROVENANCE_COLUMNS, relation_columns
from vidlabel.core import duck
from vidlabel.core.io import write_text


# Columns of labels.parquet that older merges did not write: without answer_probs the model's hard
# answers are the predictions; the provenance columns only feed the provenance section; without the
# post's columns every post is of no known type (aggregate's post-type tables say so).
OPTIONAL_LABEL_COLUMNS = ("answer_probs", *PROVENANCE_COLUMNS, "request_fingerprint", "gpus", "transcript_status",
                          "model_revision", "server_fingerprint", "job_id", "error_item", *POST_COLUMNS)


def register_table(con, name: str, table: pa.Table) -> None:
    con.register(f"{name}_arrow", table)
    con.execute(f"CREATE OR REPLACE TABLE {name} AS SELECT * FROM {name}_arrow")
    con.unregister(f"{name}_arrow")


def check_label_columns(con, ids: Sequence[str], labels_path) -> None:
    columns = set(relation_columns(con, "labels"))
    missing = [c for c in FIXED_COLUMNS if c not in columns and c not in OPTIONAL_LABEL_COLUMNS]
    missing += [q for q in ids if q not in columns]
    if missing:
        raise ValueError(f"{labels_path} lacks column(s) {missing}: was it merged with another question set? "
                         "Rerun the merge rule.")


def answer_prob_expressions(con, ids: Sequence[str]) -> tuple[str, list[str]]:
    """The SQL expression of every question's P(yes) and P(no) texts (one parse of ``answer_probs``,
    the ``_prob_texts`` of sql/answers_long.sql), and per question the expression of the model's P(yes)
    over them (sql/answer_prob.sql); NULL for labels written before ``answer_probs`` existed."""
    if "answer_probs" not in relation_columns(con, "labels"):
        return "CAST(NULL AS VARCHAR[])", ["CAST(NULL AS DOUBLE)"] * len(ids)
    paths = [duck.literal(f"$.{duck.identifier(q)}.{side}") for q in ids for side in ("yes", "no")]
    texts = f"json_extract_string(answer_probs, [{', '.join(paths)}])"
    return texts, ["(" + duck.sql("answer_prob", yes=f"_prob_texts[{2 * k + 1}]", no=f"_prob_texts[{2 * k + 2}]") + ")"
                   for k in range(len(ids))]


def create_answers_long(con, ids: Sequence[str], relation: str = "answers_long") -> None:
    """Table ``relation``: view ``labels``'s answers in long form (sql/answers_long.sql)."""
    con.execute(f"CREATE OR REPLACE TABLE {relation} AS " + answers_long_sql(con, ids))


def answers_long_sql(con, ids: Sequence[str]) -> str:
    """The query of ``answers_long`` over view ``labels`` for the question ids ``ids``."""
    texts, probs = answer_prob_expressions(con, ids)
    return duck.sql("answers_long",
                    question_names=", ".join(duck.literal(q) for q in ids),
                    question_columns=", ".join(duck.identifier(q) for q in ids),
                    question_probs=", ".join(probs), prob_texts=texts)


def query_rows(con, query: str, params: dict | None = None) -> list[dict[str, Any]]:
    cur = con.execute(query, params) if params else con.execute(query)
    names = [d[0] for d in cur.description]
    return [dict(zip(names, row)) for row in cur.fetchall()]


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, (bool, np.bool_)):
        return "true" if value else "false"
    if isinstance(value, (float, np.floating)):
        return "" if math.isnan(value) else repr(float(value))
    if isinstance(value, np.integer):
        return str(int(value))
    return str(value)


def write_csv(path: str | Path, columns: Sequence[str], rows: Sequence[dict[str, Any]]) -> None:
    """CSV with a header (also when there are no rows); empty cell = not available."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(columns)
    for row in rows:
        writer.writerow([_cell(row.get(c)) for c in columns])
    write_text(buf.getvalue(), path)


def float_array(values) -> np.ndarray:
    # fetchnumpy gives a masked array when there are NULLs
    if isinstance(values, np.ma.MaskedArray):
        values = values.astype(float).filled(np.nan)
    return np.asarray(values, dtype=float)
