"""Statistics for the summary: agreement with human labels and bias-corrected prevalence
(methods, populations and simulated coverage: docs/statistics.md).

Intervals
- Proportions (accuracy, precision, recall, uniform human-only shares): Wilson score interval
  (statsmodels), exact at 0 and 1 (``wilson_bounds``).
- F1 and Cohen's kappa have no closed-form interval: percentile bootstrap. Resampling the labelled
  (human, model) pairs with replacement is the same as drawing the four cells of the confusion matrix
  from a multinomial with the observed cell shares, which is what ``bootstrap_agreement`` does
  (vectorised, seeded, so the summary is reproducible; an empty cell is smoothed).
- Human-only share of a weighted sample: Hajek mean, Wilson at the design's effective size
  (``hajek_share``).
- Bias-corrected prevalence, uniform sample: PPI++ (prediction-powered inference with the
  power-tuning lambda, Angelopoulos, Duchi & Zrnic 2023). The moments are computed in DuckDB SQL
  (``sql/ppi_moments.sql``, see ``vidlabel.analyze.aggregate``); ``ppi_reference`` is the same estimate from
  ``ppi_py`` and serves as the cross-check. Weighted sample (known inclusion probabilities, e.g.
  active sampling): the Horvitz-Thompson active estimator (``active_mean``).
- The reported corrected interval: ``corrected_interval`` (t quantile on the events, the human-only
  interval folded in below ``MIN_EVENTS``).
Every interval uses ``confidence`` (config ``stats.confidence``), never ppi_py's default alpha of 0.1.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
from scipy.stats import norm
from statsmodels.stats.proportion import proportion_confint

AGREEMENT_METRICS = ("accuracy", "precision", "recall", "f1", "kappa")
WILSON_METRICS = ("accuracy", "precision", "recall")
BOOTSTRAP_METRICS = ("f1", "kappa")


def z_value(confidence: float) -> float:
    """Two-sided normal quantile for ``confidence`` (0.95 -> 1.96)."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), not {confidence}")
    return float(norm.ppf(1 - (1 - confidence) / 2))


def wilson_bounds(successes, trials, confidence: float) -> tuple[np.ndarray, np.ndarray]:
    """Wilson score bounds, vectorised (statsmodels' formula); NaN where ``trials`` is 0.

    ``successes`` and ``trials`` may be fractional (a tied duplicate label counts 0.5; a weighted
    sample passes its effective size). The bounds are exact at the edges: 0 successes give a lower
    bound of exactly 0 and ``trials`` successes an upper bound of exactly 1 (the formula leaves
    rounding residue such as 5.6e-17 there, which once drew a negative error bar).
    """
    k = np.asarray(successes, dtype=float)
    n = np.asarray(trials, dtype=float)
    ok = n > 0
    safe_n = np.where(ok, n, 1.0)
    share = np.clip(np.where(ok, k / safe_n, 0.0), 0.0, 1.0)
    lo, hi = proportion_confint(share * safe_n, safe_n, alpha=1 - confidence, method="wilson")
    lo = np.where(share <= 0, 0.0, np.clip(lo, 0.0, 1.0))
    hi = np.where(share >= 1, 1.0, np.clip(hi, 0.0, 1.0))
    return np.where(ok, lo, np.nan), np.where(ok, hi, np.nan)


def wilson_interval(successes: float, trials: float, confidence: float) -> tuple[float, float]:
    """Wilson score interval of a proportion; (nan, nan) when there are no trials."""
    lo, hi = wilson_bounds(successes, trials, confidence)
    return float(lo), float(hi)


def _ratio(num, den):
    num = np.asarray(num, dtype=float)
    den = np.asarray(den, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1), np.nan)


def confusion_metrics(tp, fp, fn, tn) -> dict[str, np.ndarray | float]:
    """Accuracy, precision, recall, F1 and Cohen's kappa from confusion counts ("yes" is positive).

    Works on scalars or arrays of counts (the bootstrap passes arrays). An undefined metric
    (e.g. precision when the model never says "yes") is NaN.
    """
    tp, fp, fn, tn = (np.asarray(x, dtype=float) for x in (tp, fp, fn, tn))
    n = tp + fp + fn + tn
    accuracy = _ratio(tp + tn, n)
    precision = _ratio(tp, tp + fp)
    recall = _ratio(tp, tp + fn)
    f1 = _ratio(2 * tp, 2 * tp + fp + fn)
    # Cohen's kappa: observed agreement against the agreement expected from the two marginals.
    with np.errstate(divide="ignore", invalid="ignore"):
        expected = ((tp + fp) * (tp + fn) + (fn + tn) * (fp + tn)) / np.where(n > 0, n * n, 1)
    kappa = _ratio(accuracy - expected, 1 - expected)
    kappa = np.where((n > 0) & (expected < 1), kappa, np.nan)
    out = {"accuracy": accuracy, "precision": precision, "recall": recall, "f1": f1, "kappa": kappa}
    if all(np.ndim(x) == 0 for x in (tp, fp, fn, tn)):
        return {k: float(v) for k, v in out.items()}
    return out


# Pseudo-count added to each cell of the 2x2 table before resampling when a cell is empty
# (Jeffreys' prior): resampling the observed shares can never fill an empty cell, so every
# resample would give the same kappa or F1 and the interval would have zero width.
EMPTY_CELL_PSEUDOCOUNT = 0.5


def bootstrap_agreement(tp, fp, fn, tn, confidence: float, samples: int,
                        seed: int = 0) -> dict[str, tuple[Any, Any]]:
    """Percentile-bootstrap intervals of every agreement metric (resampling the labelled pairs).

    Vectorised: the counts may be arrays of one shape S (the coverage benchmark passes one per
    simulated dataset); each bound then has shape S. When a cell is empty the cell shares are
    smoothed by ``EMPTY_CELL_PSEUDOCOUNT`` (see there).
    """
    counts = np.stack(np.broadcast_arrays(*(np.asarray(c, dtype=float) for c in (tp, fp, fn, tn))), axis=-1)
    n = counts.sum(axis=-1)
    smoothed = np.where((counts == 0).any(axis=-1, keepdims=True), counts + EMPTY_CELL_PSEUDOCOUNT, counts)
    shares = smoothed / smoothed.sum(axis=-1, keepdims=True)
    rng = np.random.default_rng(seed)
    # resampled cells: shape S + (samples, 4)
    cells = rng.multinomial(np.broadcast_to(n.astype(np.int64)[..., None], n.shape + (samples,)),
                            np.broadcast_to(shares[..., None, :], n.shape + (samples, 4)))
    metrics = confusion_metrics(cells[..., 0], cells[..., 1], cells[..., 2], cells[..., 3])
    tail = 100 * (1 - confidence) / 2
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a metric undefined in every resample: NaN
        for name, values in metrics.items():
            lo, hi = np.nanpercentile(values, [tail, 100 - tail], axis=-1)
            lo, hi = np.where(n > 0, lo, np.nan), np.where(n > 0, hi, np.nan)
            out[name] = (float(lo), float(hi)) if np.ndim(lo) == 0 else (lo, hi)
    return out


def agreement(tp: int, fp: int, fn: int, tn: int, confidence: float, bootstrap_samples: int,
              seed: int = 0) -> dict[str, Any]:
    """Agreement of model with human labels on a uniform sample: Wilson for accuracy, precision and
    recall, the bootstrap for F1 and kappa (``agreement_row`` adds the notes)."""
    boot = bootstrap_agreement(tp, fp, fn, tn, confidence, bootstrap_samples, seed)
    intervals = {
        "accuracy": wilson_interval(tp + tn, tp + fp + fn + tn, confidence),
        "precision": wilson_interval(tp, tp + fp, confidence),
        "recall": wilson_interval(tp, tp + fn, confidence),
        **{name: boot[name] for name in BOOTSTRAP_METRICS},
    }
    return agreement_row((tp, fp, fn, tn), confusion_metrics(tp, fp, fn, tn), intervals,
                         f"+{EMPTY_CELL_PSEUDOCOUNT}")


def agreement_row(counts, point: dict[str, float], intervals: dict[str, tuple[float, float]],
                  smoothing: str) -> dict[str, Any]:
    """One agreement result: the labelled counts, each metric with its interval, and a note on the
    intervals that are smoothed (``smoothing`` says by how much) or cannot be estimated (one human
    class only: the sample's kappa and F1 say nothing about the population's)."""
    tp, fp, fn, tn = (int(c) for c in counts)
    n = tp + fp + fn + tn
    out: dict[str, Any] = {"n": n, "tp": tp, "fp": fp, "fn": fn, "tn": tn}
    for name in AGREEMENT_METRICS:
        lo, hi = intervals[name]
        out[name], out[f"{name}_lo"], out[f"{name}_hi"] = point[name], lo, hi
    out["note"] = ""
    if n and (tp + fn == 0 or fp + tn == 0):
        for name in BOOTSTRAP_METRICS:
            out[f"{name}_lo"] = out[f"{name}_hi"] = math.nan
        out["note"] = (f"every human label is \"{'no' if tp + fn == 0 else 'yes'}\": the F1 and kappa "
                       "intervals cannot be estimated (n/a)")
    elif n and min(tp, fp, fn, tn) == 0:
        out["note"] = f"a cell of the 2x2 table is empty: F1 and kappa resampled with each cell smoothed by {smoothing}"
    return out


# --------------------------------------------------------------------------------------------
# Bias-corrected prevalence (PPI++)

def ppi_interval(estimate: float, imputed_var: float, rectifier_var: float,
                 confidence: float) -> tuple[float, float]:
    """Normal interval of the PPI++ estimate from its two variance terms (as ppi_py forms it)."""
    half = z_value(confidence) * math.sqrt(imputed_var + rectifier_var)
    return estimate - half, estimate + half


def ppi_reference(y: np.ndarray, yhat: np.ndarray, yhat_all: np.ndarray, confidence: float,
                  weights: np.ndarray | None = None, lam: float | None = None) -> dict[str, float]:
    """PPI++ estimate and interval computed by ppi_py (the reference for the SQL moments).

    ``y``/``yhat``: human labels and model predictions of the labelled posts; ``yhat_all``: model
    predictions of every post of the population; ``weights``: inverse sampling probabilities of the
    labelled posts (ppi_py rescales them to average 1). ``lam=None`` lets ppi_py tune lambda.
    """
    import ppi_py  # heavy import (numba, sklearn): only when needed

    y, yhat, yhat_all = (np.asarray(a, dtype=float) for a in (y, yhat, yhat_all))
    w = None if weights is None else np.asarray(weights, dtype=float)
    alpha = 1 - confidence  # ppi_py's default alpha=0.1 would be a 90% interval
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = ppi_py.ppi_mean_pointestimate(y, yhat, yhat_all, lam=lam, w=w)
        lo, hi = ppi_py.ppi_mean_ci(y, yhat, yhat_all, alpha=alpha, lam=lam, w=w)
    return {"estimate": float(np.ravel(est)[0]), "lo": float(np.ravel(lo)[0]), "hi": float(np.ravel(hi)[0])}


def squeeze(value):
    """Scalars out of 0-d arrays (the single-dataset call), arrays untouched (the batched one)."""
    if isinstance(value, dict):
        return {k: squeeze(v) for k, v in value.items()}
    if isinstance(value, np.ndarray) and value.ndim == 0:
        return value.item()
    return value


# --------------------------------------------------------------------------------------------
# The corrected interval that is reported

# The corrected share's variance is estimated from the labelled "yes", the labelled "no" and the
# model-human disagreements; with fewer than this many of any of them its normal interval cannot be
# trusted (a rare question with one or two positives in the sample, or a model the sample never
# caught erring, gives an interval of almost zero width), so the human-only interval is folded in.
MIN_EVENTS = 10


def sample_events(y, f, labelled=None, pi=None):
    """The fewest of: labelled positives, labelled negatives, disagreement mass sum |y - f| (a
    probability counts by how far it is off). Vectorised over leading dimensions.

    With inclusion probabilities ``pi`` (a weighted design), w = 1/pi, a label drawn with a small
    probability carries the weight of many and the normal interval behaves as if there were fewer
    events: the effective numbers of positives, negatives and disagreements, (sum v)^2 / sum v^2 with
    v = w y, w (1 - y) and w |y - f|, join the minimum (one heavy positive the model missed counts as
    ~1). Kish's effective share of all the labels, (sum w)^2 / (n sum w^2), once scaled the counts as
    well; it also counts the heavy weights of posts the model is sure about, which carry little of
    the variance, and cost an active or two-phase design a third of its gain where a calibrated
    model put most labels on few posts (docs/statistics.md).
    """
    y = np.asarray(y, dtype=float)
    labelled = np.ones(y.shape, bool) if labelled is None else np.asarray(labelled, bool)
    y0 = np.where(labelled, y, 0.0)
    n = labelled.sum(axis=-1)
    positives = y0.sum(axis=-1)
    negatives = n - positives
    miss = np.where(labelled, np.abs(y0 - np.asarray(f, dtype=float)), 0.0)
    events = np.minimum(np.minimum(positives, negatives), miss.sum(axis=-1))
    if pi is not None:
        w = np.where(labelled, 1.0 / np.where(labelled, np.asarray(pi, dtype=float), 1.0), 0.0)
        with np.errstate(invalid="ignore", divide="ignore"):
            for v in (w * y0, w * np.where(labelled, 1.0 - y0, 0.0), w * miss):
                total, square = v.sum(axis=-1), (v * v).sum(axis=-1)
                events = np.minimum(events, np.where(square > 0, total**2 / np.where(square > 0, square, 1.0), 0.0))
    return squeeze(events)


def corrected_interval(estimate, se, events, human_lo, human_hi, confidence: float) -> dict[str, Any]:
    """The reported interval of a corrected share (uniform PPI++, the active or the two-phase estimator).

    - Student t quantile with ``events - 1`` degrees of freedom instead of the normal one: the
      variance rests on that many events and lambda is tuned on the same labels; this is what brings
      the coverage at 20-50 events from 0.92-0.93 up to >= 0.94 (benchmarks/interval_coverage.py).
    - Below ``MIN_EVENTS`` events, the hull with the human-only interval: it covers the truth
      whenever either does, so it keeps the human-only interval's coverage where the corrected
      one's normal approximation fails.
    - Clipped to [0, 1] (a share lies there; clipping keeps the coverage).
    Returns lo, hi, quantile, few (bool: the hull was taken). Vectorised.
    """
    from scipy.stats import t as student_t

    estimate, se, events = (np.asarray(x, dtype=float) for x in (estimate, se, events))
    quantile = student_t.ppf(1 - (1 - confidence) / 2, np.maximum(events - 1, 1))
    lo = np.clip(estimate - quantile * se, 0.0, 1.0)
    hi = np.clip(estimate + quantile * se, 0.0, 1.0)
    few = events < MIN_EVENTS
    lo = np.where(few, np.fmin(lo, human_lo), lo)
    hi = np.where(few, np.fmax(hi, human_hi), hi)
    return squeeze({"lo": lo, "hi": hi, "quantile": quantile, "few": few})
