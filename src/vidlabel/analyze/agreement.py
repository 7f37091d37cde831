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
    phase_all = float_array(pairs["phase"])
    weighted_method = (f"estimated for all classified posts, each label weighted by the design (1/sampling_probability; "
                       f"two phases: as in the two-phase estimate); Wilson at the design's effective size: accuracy, "
                       f"precision, recall; percentile bootstrap ({bootstrap_samples} replicates resampling the design): "
                       "f1, kappa")
    uniform_method = (f"Wilson: accuracy, precision, recall; percentile bootstrap ({bootstrap_samples} resamples of the "
                      "labelled pairs): f1, kappa (in simulation these covered 93-97 % at 150 or more labels, "
                      "docs/statistics.md)")
    rows = []
    for qid in ids:
        mine = questions == qid
        compared = mine & np.isfinite(cells_all)
        cells = cells_all[compared].astype(int)
        pi, phase = probability_all[compared], phase_all[compared]
        seed = zlib.crc32(qid.encode())  # reproducible intervals, different per question
        design, weights = label_design(qid, pi, phase, human)
        if design == "uniform":
            counts = np.bincount(cells, minlength=4)
            result = stats.agreement(*(int(c) for c in counts), confidence, bootstrap_samples, seed)
        else:
            result = estimators.weighted_agreement(cells, weights, confidence, bootstrap_samples, seed)
        failed = int((compared & ~answered_all).sum())
        notes = [result["note"]] if result["note"] else []
        if failed:
            notes.append(f"{failed} labelled post(s) without a model answer are counted as wrong answers (fn where "
                         "the human said \"yes\", fp where \"no\")")
        rows.append({"question": qid, "design": design, **result, "no_model_answer": failed,
                     "tied_labels": int((mine & ~np.isfinite(cells_all)).sum()), "confidence": confidence,
                     "ci_method": uniform_method if design == "uniform" else weighted_method,
                     "note": "; ".join(notes)})
    return rows


def label_design(qid: str, pi: np.ndarray, phase: np.ndarray, human: dict[str, Any]) -> tuple[str, estimators.Design]:
    """The design of one question's labelled posts (their sampling probabilities ``pi`` and ``phase``, in
    sql/agreement_cells.sql's order): "two_phase" when a label comes from a second draw, "weighted" when
    the probabilities vary, else "uniform" (a simple random sample), with each post's weights."""
    if (phase == 2).any():
        sample = human["sample_design"]
        return "two_phase", estimators.two_phase_weights(phase == 1, float(sample["pi_burn_in"]), pi,
                                                         float(sample["combination"][qid]))
    if pi.size and np.ptp(pi) > 1e-12:
        return "weighted", estimators.poisson_design(pi)
    return "uniform", estimators.srs_design(pi.size)
