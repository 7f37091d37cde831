"""Agreement of a model's answers with the human labels per question: accuracy, precision, recall, F1 and
Cohen's kappa with their intervals (vidlabel.analyze.stats; docs/statistics.md)."""

from __future__ import annotations

import zlib
from typing import Any, Sequence

from vidlabel.analyze import stats
from vidlabel.analyze.labels_db import query_rows
from vidlabel.core import duck

AGREEMENT_COLUMNS = ["question", "n", "tp", "fp", "fn", "tn", "no_model_answer", "tied_labels"] + [
    f"{m}{s}" for m in stats.AGREEMENT_METRICS for s in ("", "_lo", "_hi")] + ["confidence", "ci_method", "note"]


def agreement(con, ids: Sequence[str], confidence: float, bootstrap_samples: int) -> list[dict[str, Any]]:
    counts = {r["question"]: r for r in query_rows(con, duck.sql("agreement_counts"))}
    method = (f"Wilson: accuracy, precision, recall; percentile bootstrap ({bootstrap_samples} resamples "
              "of the labelled pairs): f1, kappa (in simulation these covered 93-97 % at 150 or more labels, "
              "docs/statistics.md)")
    rows = []
    for qid in ids:
        c = counts.get(qid, {"tp": 0, "fp": 0, "fn": 0, "tn": 0, "no_model_answer": 0, "tied_labels": 0})
        seed = zlib.crc32(qid.encode())  # reproducible intervals, different per question
        row = {"question": qid,
               **stats.agreement(int(c["tp"]), int(c["fp"]), int(c["fn"]), int(c["tn"]), confidence,
                                 bootstrap_samples, seed),
               "no_model_answer": int(c["no_model_answer"]), "tied_labels": int(c["tied_labels"]),
               "confidence": confidence, "ci_method": method}
        rows.append(row)
    return rows
