"""Prevalence per question: the model's share, the human-only share and the bias-corrected share, each
over the population it describes (docs/statistics.md, "The shares and their populations").

Uniform human sample: Wilson and PPI++ (DuckDB SQL sql/ppi_moments.sql, cross-checked against ppi_py).
Known varying sampling probabilities: Hajek and the active estimator (vidlabel.analyze.stats).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Sequence

import numpy as np
import pyarrow as pa

from vidlabel.analyze import estimators, sampling, stats
from vidlabel.analyze.labels_db import float_array, query_rows, register_table
from vidlabel.analyze.sample_design import floor_warning
from vidlabel.analyze.summary_text import pct
from vidlabel.core import duck

log = logging.getLogger(__name__)

PREVALENCE_COLUMNS = [
    "question", "posts", "answered", "yes", "no", "no_answer", "model_share", "model_lo", "model_hi",
    "human_n", "human_yes", "human_share", "human_lo", "human_hi", "human_ci_method",
    "corrected", "corrected_lo", "corrected_hi", "corrected_se", "corrected_method", "lambda", "events",
    "ppi_population", "ppi_labelled", "design", "weighted", "uniform_halfwidth", "run_no_answer_share",
    "human_no_answer_share", "outside_frame", "outside_answered", "outside_model_share", "outside_model_lo",
    "outside_model_hi", "confidence", "note",
]

# A human sample whose share of posts without a model answer differs from the run's at this
# significance level gets a warning: coders skipping failed posts (unplayable media) would leave
# the corrected share describing the answered posts only.
NO_ANSWER_SHARE_ALPHA = 0.01
# Under unequal sampling probabilities, fewer effective events than this left the reported interval
# at 91-93 % coverage in benchmarks/interval_coverage.py when the probabilities followed the model's P(yes)
# (0.95 or more when they followed its uncertainty, as vidlabel.analyze.sampling draws them); said in a note.
WEIGHTED_FEW_EVENTS = 30
# Below this many labels Wilson's coverage oscillates down to 0.93 at some prevalences
# (benchmarks/interval_coverage.py: 0.928 at prevalence 0.05 with 30 labels); said in a note.
FEW_LABELS_FOR_WILSON = 50
# Labels with sampling probabilities but no design file stand for about sum 1/pi posts (Horvitz-Thompson);
# when the classified posts exceed that by more than this many standard errors (Poisson sampling's
# sqrt(sum (1 - pi)/pi^2)), posts were classified after the draw: the shares would speak for posts the
# sample could not draw (coverage fell to 0.88 with a uniform sample, 0.61 with an active one).
LATE_POSTS_SE = 3
# The SQL moments must reproduce ppi_py; a larger gap means a bug, reported loudly.
PPI_CROSSCHECK_TOLERANCE = 1e-9


def ppi_moments(con) -> dict[str, dict[str, Any]]:
    """PPI++ moments per question from table ``ppi_items`` (sql/ppi_moments.sql)."""
    return {row["question"]: row for row in query_rows(con, duck.sql("ppi_moments"))}


def ppi_moments_from_items(items: pa.Table) -> dict[str, dict[str, Any]]:
    """The same SQL on a given ``ppi_items`` table (question, yhat, y, r): y NULL = unlabelled,
    r = inverse sampling probability of a labelled item. Used by the tests and the simulation, where
    ``question`` can stand for a simulated dataset so that hundreds are computed in one query."""
    con = duck.connect()
    register_table(con, "ppi_items", items)
    return ppi_moments(con)


def prevalence(con, ids: Sequence[str], confidence: float, human: dict | None, answers: str = "answers_long",
               population: str | None = None) -> list[dict[str, Any]]:
    """One row per question (PREVALENCE_COLUMNS) from table ``answers`` (``answers_long`` or a part of it,
    e.g. one post type's posts, named ``population`` in the notes) and the human-label tables.
    With a design file (``human["sample_design"]``) the human-only and corrected shares are over the
    classified posts of its frame; the others are estimated apart, from the model alone."""
    answers = duck.identifier(answers)
    model = {r["question"]: r for r in query_rows(con, duck.sql("prevalence_model", answers=answers))}
    moments: dict[str, dict] = {}
    outside: dict[str, dict] = {}
    if human:
        con.execute(duck.sql("ppi_items", answers=answers))
        moments = ppi_moments(con)
        outside = {r["question"]: r for r in query_rows(con, duck.sql("prevalence_outside_frame", answers=answers))}
    rows = []
    for qid in ids:
        m = model.get(qid, {"posts": 0, "answered": 0, "yes": 0, "no": 0, "no_answer": 0})
        row: dict[str, Any] = {"question": qid, **{k: m[k] for k in ("posts", "answered", "yes", "no", "no_answer")},
                               "confidence": confidence}
        row["model_share"] = m["yes"] / m["answered"] if m["answered"] else math.nan
        row["model_lo"], row["model_hi"] = stats.wilson_interval(m["yes"], m["answered"], confidence)
        notes = []
        if m["posts"] and not m["answered"]:
            notes.append("the model answered no post for this question: no model share")
        if human:
            notes += _outside_frame(row, outside.get(qid), human, confidence)
            notes += _human_and_corrected(con, qid, row, moments.get(qid), confidence, human, population)
        row["note"] = "; ".join(notes)
        rows.append(row)
    return rows


def _outside_frame(row: dict, outside: dict | None, human: dict, confidence: float) -> list[str]:
    """Posts classified since the sample was drawn: counted apart, with the model's share alone."""
    sample = human["sample_design"]
    if not sample:
        return []
    row["outside_frame"] = int(outside["posts"]) if outside else 0
    if not row["outside_frame"]:
        return []
    answered, yes = int(outside["answered"]), int(outside["yes"])
    row["outside_answered"] = answered
    row["outside_model_share"] = yes / answered if answered else math.nan
    row["outside_model_lo"], row["outside_model_hi"] = stats.wilson_interval(yes, answered, confidence)
    return [f"{row['outside_frame']:,} classified post(s) are outside the frame the human sample was drawn from "
            f"({sample['path']}, drawn {sample.get('created_at', '?')}): the human-only and corrected shares are over "
            f"the posts of the frame only; for the others the model alone says \"yes\" for {pct(row['outside_model_share'])} "
            f"of the {answered:,} it answered (outside_model_share, not corrected)"]


def _design_of(labelled: np.ndarray, pi: np.ndarray, phase: np.ndarray) -> str:
    """One question's design: two_phase when a label comes from a second draw, weighted when the labels'
    probabilities vary, uniform otherwise."""
    if (labelled & (phase == 2)).any():
        return "two_phase"
    return "weighted" if labelled.any() and np.ptp(pi[labelled]) > 1e-12 else "uniform"


# Per post of the frame, the P(yes) a two-phase design's second draw was made from, for one question
# (its position in the design's question list), in post_id order like the items.
CALIBRATED_SQL = """SELECT d.calibrated[$position] FROM ppi_items i JOIN design_posts d USING (post_id)
    WHERE i.question = $question ORDER BY i.post_id"""


def _calibrated(con, qid: str, sample: dict, post_ids) -> np.ndarray:
    """The second phase's prediction of a two-phase design for question ``qid`` (``sample_design``)."""
    if qid not in sample.get("questions", []):
        raise ValueError(f"{sample['path']} was not drawn for question {qid}: its second draw's labels cannot be "
                         "estimated with it")
    values = con.execute(CALIBRATED_SQL, {"position": sample["questions"].index(qid) + 1,
                                          "question": qid}).fetchnumpy()
    calibrated = float_array(next(iter(values.values())))
    if calibrated.size != len(post_ids) or not np.isfinite(calibrated).all():
        raise ValueError(f"{sample['path']} lacks the calibrated P(yes) of some post of its frame for question {qid}")
    return calibrated


def _human_and_corrected(con, qid: str, row: dict, mom: dict | None, confidence: float,
                         human: dict, population: str | None = None) -> list[str]:
    """Human-only and corrected share of one question into ``row``; returns the notes (``population``:
    what the posts are when they are part of the classified posts, e.g. "photo posts")."""
    items = con.execute("SELECT post_id, yhat, y, r, no_answer, phase FROM ppi_items WHERE question = ? "
                        "ORDER BY post_id", [qid]).fetchnumpy()
    f = float_array(items["yhat"])
    y = float_array(items["y"])
    labelled = ~np.isnan(y)
    pi = np.where(labelled, 1.0 / np.where(labelled, float_array(items["r"]), 1.0), 1.0)
    phase = float_array(items["phase"])
    no_answer = np.asarray(items["no_answer"], dtype=bool)
    n = int(labelled.sum())
    y_sum = float(y[labelled].sum())
    design = _design_of(labelled, pi, phase)
    row["design"], row["weighted"] = design, design != "uniform"
    row["human_n"] = n
    row["human_yes"] = int(y_sum) if y_sum.is_integer() else y_sum
    among = f" among the {population}" if population else ""
    if n == 0:
        return [f"no usable human label for this question{among}: no human-only or corrected share (n/a)"]
    sample = human["sample_design"]
    unlabelled = int((~labelled).sum())
    if human["has_probability"] and unlabelled and np.all(pi[labelled] >= 1 - 1e-12) and design != "two_phase":
        # Every label drawn with probability 1 stands for its own post only: no label speaks for the others,
        # and the Hajek share of such a "census" has no sampling error, a zero-width interval for the wrong posts.
        log.warning("question %s: every one of the %d labelled posts has sampling probability 1 while %d classified "
                    "posts are unlabelled: no human-only or corrected share", qid, n, unlabelled)
        return [f"WARNING: every one of the {n} labelled post(s){among} was drawn with sampling probability 1, so each "
                f"stands for itself only, while {unlabelled:,} classified post(s) were not labelled: no label speaks "
                "for those (a census of the labelled posts, not of the population), so no human-only or corrected "
                "share (n/a); the design gave the undrawn posts a probability below 1 and drew none of them"]
    notes = []
    warning = floor_warning(sample) if sample else None
    if warning:
        notes.append(warning + ": the human-only and corrected shares of this question")
    if human["has_probability"] and not sample:
        notes += _late_posts_check(qid, pi[labelled], f.size)
    row["ppi_population"], row["ppi_labelled"] = f.size, n
    if design == "two_phase":
        burn_in, second = labelled & (phase == 1), labelled & (phase == 2)
        if not burn_in.any():
            # Part of the posts (a post type) the uniform burn-in drew none of: the first phase's
            # estimate of it does not exist, and the design's combination weight has nothing to weigh.
            return [f"the {n} human label(s){among} all come from the second draw of the two-phase sample, none "
                    "from its uniform burn-in: the two-phase estimator needs both, no human-only or corrected "
                    "share (n/a)"]
        weight = float(sample.get("combination", {}).get(qid, math.nan))
        if not 0 <= weight <= 1:
            raise ValueError(f"{sample['path']} gives no combination weight for question {qid}: it is not the design "
                             "the second draw's labels were drawn under")
        pi0 = float(sample["pi_burn_in"])
        calibrated = _calibrated(con, qid, sample, items["post_id"])
        fold_weights = sample.get("fold_combination", {}).get(qid)
        folds = sampling.fold_of(items["post_id"]) if fold_weights else None
        if not fold_weights:
            notes.append(f"{sample['path']} was drawn before the combination weights were cross-fitted: the burn-in's "
                         "weight was chosen from the labels it weighs (a bias of up to -0.15 SD at prevalence 0.02 with "
                         "100 labels in simulation)")
        h = estimators.two_phase_share(y, burn_in, second, pi0, pi, weight, confidence, folds, fold_weights)
        est = estimators.two_phase_mean(f, y, burn_in, second, pi0, pi, weight, calibrated, confidence, folds,
                                        fold_weights)
        weight = float(est["combination"])
        pi = estimators.two_phase_pi(burn_in, second, pi0, pi, weight)  # each label's weight in the estimate
        row["human_ci_method"] = (f"two-phase: the burn-in's mean and the second draw's Hajek mean combined (weight "
                                  f"{weight:.2f} on the burn-in), Wilson at the effective size ({h['n_eff']:,.0f})")
        row["corrected_method"] = (f"two-phase estimator (the uniform burn-in and the second draw, Horvitz-Thompson "
                                   f"with power tuning cross-fitted, combined with weight {weight:.2f} on the burn-in, "
                                   "each fold's weight chosen without its labels)")
    elif design == "weighted":
        h = estimators.hajek_share(y[labelled], pi[labelled], confidence)
        est = estimators.active_mean(f, y, labelled, pi, confidence)
        row["human_ci_method"] = f"Hajek mean, Wilson at the design's effective size ({h['n_eff']:,.0f})"
        row["corrected_method"] = "active estimator (Horvitz-Thompson with power tuning)"
    if design != "uniform":
        row["human_share"], row["human_lo"], row["human_hi"] = h["estimate"], h["lo"], h["hi"]
        estimate, se, lam = est["estimate"], est["se"], est["lambda"]
        events = stats.sample_events(y, f, labelled, pi)
        row["uniform_halfwidth"] = stats.z_value(confidence) * estimators.uniform_equivalent_se(f, y, labelled, pi)
    else:
        row["human_share"] = y_sum / n
        row["human_lo"], row["human_hi"] = stats.wilson_interval(y_sum, n, confidence)
        row["human_ci_method"] = "Wilson"
        if n < FEW_LABELS_FOR_WILSON:
            notes.append(f"{n} human labels: below {FEW_LABELS_FOR_WILSON}, Wilson's coverage dips to about 93 % at "
                         "some prevalences (docs/statistics.md)")
        estimate = mom["crossfit_estimate"]
        se, lam = math.sqrt(mom["crossfit_imputed_var"] + mom["crossfit_rectifier_var"]), mom["crossfit_lambda"]
        events = stats.sample_events(y[labelled], f[labelled])
        row["corrected_method"] = "PPI++ (lambda cross-fitted: each label corrected with the lambda of the others)"
        notes += _crosscheck(con, qid, y[labelled], f[labelled], f, mom, confidence)
    if y_sum in (0, n):
        notes.append(f"every human label is \"{'no' if y_sum == 0 else 'yes'}\": the human-only interval is "
                     f"{pct(row['human_lo'])}–{pct(row['human_hi'])}, not a point")
    ci = stats.corrected_interval(estimate, se, events, row["human_lo"], row["human_hi"], confidence)
    if not 0 <= estimate <= 1:
        notes.append(f"the corrected estimate {estimate:.4f} lies outside [0, 1] (the estimator is unbiased, not "
                     "bounded) and is reported clipped")
        estimate = min(1.0, max(0.0, estimate))
    row.update({"corrected": estimate, "corrected_se": se, "lambda": lam, "events": events,
                "corrected_lo": ci["lo"], "corrected_hi": ci["hi"]})
    if ci["few"]:
        notes.append(f"only {events:.1f} events back the corrected interval (the fewest of labelled \"yes\", "
                     f"labelled \"no\" and model-human disagreements; fewer than {stats.MIN_EVENTS}): it is "
                     "widened to contain the human-only interval")
    elif design != "uniform" and events < WEIGHTED_FEW_EVENTS:
        notes.append(f"{events:.1f} effective events under unequal sampling probabilities: such intervals "
                     "covered 91-93 % in simulation when the probabilities followed the model's P(yes), 95 % or more "
                     "when they followed its uncertainty (docs/statistics.md)")
    if not np.ptp(f) > 0:
        notes.append("the model's prediction is the same for every post: lambda = 0, the corrected share rests on "
                     "the human labels alone (with a t interval): the human-only interval is the one to quote")
    notes += _no_answer_share_check(row, no_answer, labelled, pi, design != "uniform")
    return notes


def _late_posts_check(qid: str, pi: np.ndarray, classified: int) -> list[str]:
    """Labels with sampling probabilities and no design file: the posts they stand for (sum 1/pi) against
    the classified posts. Many more classified posts mean posts classified after the draw."""
    frame = float(np.sum(1 / pi))
    se = math.sqrt(float(np.sum((1 - pi) / pi**2)))
    if classified - frame <= LATE_POSTS_SE * max(se, 1.0):
        return []
    log.warning("question %s: the human labels stand for about %.0f posts (sum of 1/sampling_probability) but %d are "
                "classified: posts classified after the draw, and no human_design", qid, frame, classified)
    return [f"WARNING: the human labels stand for about {frame:,.0f} posts (the sum of 1/sampling_probability, ± "
            f"{se:,.0f}) but {classified:,} posts are classified: posts classified after the sample was drawn are not "
            "in the population it was drawn from, and the human-only and corrected shares above speak for them "
            "anyway (their coverage fell to 0.88 with a uniform sample, 0.61 with an active one in simulation). Set "
            "config key human_design to label_sample's design.parquet: the shares are then over the posts of the "
            "frame and the later posts are described apart"]


def _no_answer_share_check(row: dict, no_answer: np.ndarray, labelled: np.ndarray, pi: np.ndarray,
                           weighted: bool) -> list[str]:
    """Warn when the human sample's share of posts without a model answer differs from the run's."""
    from scipy.stats import binomtest, norm

    run_share = float(no_answer.mean()) if no_answer.size else math.nan
    n = int(labelled.sum())
    if weighted:
        w = 1.0 / pi[labelled]
        sample_share = float((w * no_answer[labelled]).sum() / w.sum())
        kish = float(w.sum() ** 2 / (w * w).sum())
        spread = math.sqrt(run_share * (1 - run_share) / kish)
        p_value = 2 * norm.sf(abs(sample_share - run_share) / spread) if spread > 0 else float(
            sample_share == run_share)
    else:
        k = int(no_answer[labelled].sum())
        sample_share = k / n
        p_value = binomtest(k, n, run_share).pvalue if 0 < run_share < 1 else float(sample_share == run_share)
    row["run_no_answer_share"], row["human_no_answer_share"] = run_share, sample_share
    if p_value < NO_ANSWER_SHARE_ALPHA:
        log.warning("question %s: %.1f%% of the human-labelled posts have no model answer, %.1f%% of the run's",
                    row["question"], 100 * sample_share, 100 * run_share)
        return [f"WARNING: {pct(sample_share)} of the human-labelled posts have no model answer against "
                f"{pct(run_share)} of all classified posts (p = {p_value:.2g}): if the coders skipped posts "
                "(e.g. unplayable media) the human labels do not represent every classified post, and the "
                "shares above describe the posts that were labelled alike"]
    return []


def _crosscheck(con, qid, y, yhat, yhat_all, mom, confidence) -> list[str]:
    """Recompute the PPI++ estimate and its normal interval with ppi_py; the SQL moments must agree."""
    lam = None if mom["pooled_var"] and mom["pooled_var"] > 0 else 0.0
    ref = stats.ppi_reference(y, yhat, yhat_all, confidence, lam=lam)
    lo, hi = stats.ppi_interval(mom["estimate"], mom["imputed_var"], mom["rectifier_var"], confidence)
    gap = max(abs(ref["estimate"] - mom["estimate"]), abs(ref["lo"] - lo), abs(ref["hi"] - hi))
    if not gap <= PPI_CROSSCHECK_TOLERANCE:
        log.warning("question %s: SQL PPI++ result differs from ppi_py by %.3g (estimate %r vs %r)",
                    qid, gap, mom["estimate"], ref["estimate"])
        return [f"SQL and ppi_py disagree by {gap:.3g}"]
    return []
