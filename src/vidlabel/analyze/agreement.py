"""Agreement of a model's answers with the human labels per question: accuracy, precision, recall, F1 and
Cohen's kappa with their intervals, estimated for all classified posts under the design the human
sample was drawn with (docs/statistics.md, "Agreement under the design").

- A labelled post the model gave no answer for counts as a wrong answer (sql/agreement_cells.sql), so
  every model is scored on the same labelled posts and a failure never flatters a model.
- Uniform sample: the plain counts (Wilson, and the bootstrap of the labelled pairs for F1 and kappa,
  ``stats.agreement``). Varying sampling probabilities: the confusion totals weighted by 1/pi and the
  design bootstrap (``estimators.weighted_agreement``): an active sample draws the posts the steering
  model is unsure about, and unweighted counts would score that model on its hardest posts.
"""

from __future__ import annotations

import zlib
from typing import Any, Sequence

import numpy as np

from vidlabel.analyze import estimators, stats
from vidlabel.analyze.labels_db import float_array
from vidlabel.core import duck

AGREEMENT_COLUMNS = ["question", "design", "n", "tp", "fp", "fn", "tn", "no_model_answer", "tied_labels"] + [
    f"{m}{s}" for m in stats.AGREEMENT_METRICS for s in ("", "_lo", "_hi")] + ["confidence", "ci_method", "note"]


def agreement(con, ids: Sequence[str], confidence: float, bootstrap_samples: int,
              human: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per question from tables ``human_valid`` and ``answers_long`` (AGREEMENT_COLUMNS)."""
    pairs = con.execute(duck.sql("agreement_cells")).fetchnumpy()
    questions = np.asarray(pairs["question"], dtype=object)
    cells_all = float_array(pairs["cell"])
    answered_all = np.asarray(pairs["answered"], dtype=bool)
    probability_all = float_array(pairs["probability"])
    weighted = human["weighted"]
    if weighted:
        method = (f"estimated for all classified posts, each label weighted by 1/sampling_probability; Wilson at the "
                  f"design's effective size: accuracy, precision, recall; percentile bootstrap ({bootstrap_samples} "
                  "replicates resampling the design): f1, kappa")
    else:
        method = (f"Wilson: accuracy, precision, recall; percentile bootstrap ({bootstrap_samples} resamples of the "
                  "labelled pairs): f1, kappa (in simulation these covered 93-97 % at 150 or more labels, "
                  "docs/statistics.md)")
    rows = []
    for qid in ids:
        mine = questions == qid
        compared = mine & np.isfinite(cells_all)
        cells = cells_all[compared].astype(int)
        seed = zlib.crc32(qid.encode())  # reproducible intervals, different per question
        if weighted:
            result = estimators.weighted_agreement(cells, estimators.poisson_design(probability_all[compared]),
                                                   confidence, bootstrap_samples, seed)
        else:
            counts = np.bincount(cells, minlength=4)
            result = stats.agreement(*(int(c) for c in counts), confidence, bootstrap_samples, seed)
        failed = int((compared & ~answered_all).sum())
        notes = [result["note"]] if result["note"] else []
        if failed:
            notes.append(f"{failed} labelled post(s) without a model answer are counted as wrong answers (fn where "
                         "the human said \"yes\", fp where \"no\")")
        rows.append({"question": qid, "design": human["design"], **result, "no_model_answer": failed,
                     "tied_labels": int((mine & ~np.isfinite(cells_all)).sum()), "confidence": confidence,
                     "ci_method": method, "note": "; ".join(notes)})
    return rows
