"""Statistics for the summary: agreement with human labels and bias-corrected prevalence.

Intervals
- Proportions (accuracy, precision, recall, shares): Wilson score interval (statsmodels).
- F1 and Cohen's kappa have no closed-form interval: percentile bootstrap. Resampling the labelled
  (human, model) pairs with replacement is the same as drawing the four cells of the confusion matrix
  from a multinomial with the observed cell shares, which is what ``bootstrap_agreement`` does
  (vectorised, seeded, so the summary is reproducible).
- Bias-corrected prevalence: PPI++ (prediction-powered inference with the power-tuning lambda,
  Angelopoulos, Duchi & Zrnic 2023) for a mean. The moments are computed in DuckDB SQL
  (``sql/ppi_moments.sql``, see ``vidlabel.aggregate``); ``ppi_reference`` is the same estimate from
  ``ppi_py`` and serves as the cross-check. Every interval uses ``confidence`` (config
  ``stats.confidence``), never ppi_py's default alpha of 0.1.
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


def wilson_interval(successes: int, trials: int, confidence: float) -> tuple[float, float]:
    """Wilson score interval of a proportion; (nan, nan) when there are no trials."""
    if trials <= 0:
        return math.nan, math.nan
    lo, hi = proportion_confint(successes, trials, alpha=1 - confidence, method="wilson")
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


def bootstrap_agreement(tp: int, fp: int, fn: int, tn: int, confidence: float, samples: int,
                        seed: int = 0) -> dict[str, tuple[float, float]]:
    """Percentile-bootstrap intervals of every agreement metric (resampling the labelled pairs)."""
    n = tp + fp + fn + tn
    if n == 0:
        return {m: (math.nan, math.nan) for m in AGREEMENT_METRICS}
    rng = np.random.default_rng(seed)
    cells = rng.multinomial(n, np.array([tp, fp, fn, tn], dtype=float) / n, size=samples)
    metrics = confusion_metrics(cells[:, 0], cells[:, 1], cells[:, 2], cells[:, 3])
    tail = 100 * (1 - confidence) / 2
    out = {}
    for name, values in metrics.items():
        values = values[~np.isnan(values)]
        if values.size == 0:
            out[name] = (math.nan, math.nan)
        else:
            lo, hi = np.percentile(values, [tail, 100 - tail])
            out[name] = (float(lo), float(hi))
    return out


def agreement(tp: int, fp: int, fn: int, tn: int, confidence: float, bootstrap_samples: int,
              seed: int = 0) -> dict[str, Any]:
    """Agreement of model with human labels: each metric with its interval and the interval's method."""
    point = confusion_metrics(tp, fp, fn, tn)
    boot = bootstrap_agreement(tp, fp, fn, tn, confidence, bootstrap_samples, seed)
    wilson = {
        "accuracy": wilson_interval(tp + tn, tp + fp + fn + tn, confidence),
        "precision": wilson_interval(tp, tp + fp, confidence),
        "recall": wilson_interval(tp, tp + fn, confidence),
    }
    out: dict[str, Any] = {"n": tp + fp + fn + tn, "tp": tp, "fp": fp, "fn": fn, "tn": tn}
    for name in AGREEMENT_METRICS:
        lo, hi = wilson[name] if name in WILSON_METRICS else boot[name]
        out[name], out[f"{name}_lo"], out[f"{name}_hi"] = point[name], lo, hi
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


def weighted_mean_interval(y: np.ndarray, weights: np.ndarray, confidence: float) -> tuple[float, float, float]:
    """Human-only share under unequal sampling probabilities: weighted (Hajek) mean with the CLT
    interval ppi_py uses for its classical baseline (equal to PPI++ with lambda = 0)."""
    from ppi_py import classical_mean_ci

    y = np.asarray(y, dtype=float)
    w = np.asarray(weights, dtype=float)
    mean = float((w * y).sum() / w.sum())
    lo, hi = classical_mean_ci(y, w=w, alpha=1 - confidence)
    return mean, float(lo), float(hi)
