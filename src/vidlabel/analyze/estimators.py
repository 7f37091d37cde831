"""Estimators under a known sampling design: each labelled post drawn with a known inclusion probability
pi (Poisson sampling, e.g. vidlabel.analyze.sampling's active design), or in two phases (a uniform burn-in,
then a Poisson draw whose probabilities were chosen from the burn-in's labels).

- ``hajek_share``: the human-only share (Hajek mean, Wilson at the design's effective size).
- ``active_mean``: the bias-corrected share (Horvitz-Thompson with power tuning, Zrnic & Candes 2024).
- ``uniform_equivalent_se``: what uniform PPI++ would have given with as many labels.
- ``weighted_agreement``: accuracy, precision, recall, F1 and kappa from confusion totals weighted by
  1/pi, with intervals from a bootstrap that resamples the design (``replicate_weights``).
- ``paired_difference``: two models on the same labelled posts, the design-weighted difference of
  their F1, precision, recall and prevalence error with its interval (compare's verdict).
Methods and simulated coverage: docs/statistics.md.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, NamedTuple

import numpy as np

from scipy.stats import norm

from vidlabel.analyze.stats import (
    BOOTSTRAP_METRICS,
    agreement_row,
    confusion_metrics,
    squeeze,
    wilson_bounds,
    z_value,
)

def hajek_share(y, pi, confidence: float, sampled=None) -> dict[str, Any]:
    """Human-only share of a sample drawn with known inclusion probabilities ``pi``.

    Hajek (self-normalised inverse-probability) mean with the linearised SE
    sqrt(sum w^2 (1 - pi) (y - mean)^2) / sum w, w = 1/pi (Poisson sampling; the (1 - pi) factor is
    the finite-population correction). The interval is Wilson's at the design's effective sample
    size n_eff = mean (1 - mean) / SE^2 (Kish's (sum w)^2 / sum w^2 when the mean is 0 or 1), which
    keeps the bounds in [0, 1] and honest at 0 or all "yes" labels. A census (every pi = 1) has no
    sampling error: the interval is the point.

    Vectorised over leading dimensions: arrays (..., N); ``sampled`` (bool, same shape) marks the
    labelled posts (None: every entry is labelled).
    """
    y = np.asarray(y, dtype=float)
    pi = np.asarray(pi, dtype=float)
    sampled = np.ones(y.shape, bool) if sampled is None else np.asarray(sampled, bool)
    w = np.where(sampled, 1.0 / np.where(sampled, pi, 1.0), 0.0)
    y0 = np.where(sampled, y, 0.0)
    w_sum = w.sum(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = (w * y0).sum(axis=-1) / w_sum
        var = (w * w * (1 - np.where(sampled, pi, 1.0)) * (y0 - mean[..., None]) ** 2).sum(axis=-1) / w_sum**2
        kish = w_sum**2 / (w * w).sum(axis=-1)
        interior = (mean > 0) & (mean < 1)
        n_eff = np.where(interior & (var > 0), mean * (1 - mean) / np.where(var > 0, var, 1.0), kish)
        census = interior & ~(var > 0)
    lo, hi = wilson_bounds(mean * np.where(census, 1.0, n_eff), np.where(census, 1.0, n_eff), confidence)
    lo, hi = np.where(census, mean, lo), np.where(census, mean, hi)
    return squeeze({"estimate": mean, "se": np.sqrt(var), "lo": lo, "hi": hi, "n_eff": n_eff})


def active_mean(f, y, sampled, pi, confidence: float, lam: float | None = None,
                intercept: bool = True, crossfit: bool = True) -> dict[str, Any]:
    """Prevalence from a sample drawn with known inclusion probabilities (active inference).

    Horvitz-Thompson form with power tuning (Zrnic & Candes 2024):
        z_i = g_i + (Y_i - g_i) xi_i / pi_i,  g_i = lam f_i + mu,  estimate = mean_i z_i,  SE = sd(z) / sqrt(N)
    over all N posts of the population; f_i is the model's prediction (probability of "yes", or the
    hard answer 0/1), xi_i = 1 for a labelled post. E[xi_i / pi_i] = 1, so the estimate is unbiased
    for any lam and mu fixed in advance; with mu = 0 it is Zrnic & Candes' estimator.
    ``lam=None`` takes the plug-in: the (lam, mu) that minimise the sample variance of z (a least
    squares fit of a = Y xi/pi on the control variates b1 = f (1 - xi/pi) and b0 = 1 - xi/pi), lam
    clipped to [0, 1] (mu refitted after clipping); lam = 0 when b1 does not vary. The intercept mu
    (``intercept=True``) is the Hajek-type ratio adjustment: without it, the HT estimator carries the
    randomness of the number of labels drawn, which made it wider than the Hajek human-only share
    when the probabilities follow the model; ``intercept=False`` fixes mu = 0.

    Cross-fitting (``crossfit=True``, the default): each post's z_i takes the (lam, mu) fitted on every
    other post, (lam_-i, mu_-i). Under Poisson sampling post i's draw is independent of the others', so
    E[lam_-i f_i (1 - xi_i/pi_i)] = E[lam_-i] f_i E[1 - xi_i/pi_i] = 0 and the estimate is exactly unbiased
    with tuned coefficients (for a simple random sample up to the O(1/N) dependence of a fixed-size
    draw). Fitted on the labels they are applied to, they leaned on them: -0.41 SD of bias at prevalence
    0.01 with an over-confident model and 100 labels, -0.39 SD for uniform PPI++ with a calibrated one
    (docs/statistics.md). ``lambda`` and ``mu`` returned are the full-sample fit (what the summary quotes).

    Vectorised over leading dimensions: arrays (..., N), ``y`` may hold anything (NaN) where not
    sampled. The interval is the normal one clipped to [0, 1]; ``corrected_interval`` makes the
    reported one.
    """
    f = np.asarray(f, dtype=float)
    sampled = np.asarray(sampled, bool)
    pi = np.asarray(pi, dtype=float)
    n_posts = f.shape[-1]
    w = np.where(sampled, 1.0 / np.where(sampled, pi, 1.0), 0.0)
    a = np.where(sampled, np.asarray(y, dtype=float), 0.0) * w
    b0 = 1.0 - w
    b1 = f * b0

    def centred(x):
        return x - x.mean(axis=-1, keepdims=True)

    a_c, b0_c, b1_c = centred(a), centred(b0), centred(b1)
    pairs = {"v00": (b0_c, b0_c), "v11": (b1_c, b1_c), "v01": (b0_c, b1_c), "c0": (a_c, b0_c), "c1": (a_c, b1_c)}
    moments = {key: (x * z).mean(axis=-1) for key, (x, z) in pairs.items()}
    lam_arr, mu = _power_tuning(moments, lam, intercept, a.shape[:-1])
    if crossfit and (lam is None or intercept) and n_posts > 2:
        # the same moments without post i: the centred variables sum to 0, so the others' mean of x is
        # -x_i / (N - 1) and their covariance (sum x z - x_i z_i) / (N - 1) - x_i z_i / (N - 1)^2
        m = n_posts - 1
        loo = {key: (moments[key][..., None] * n_posts - x * z) / m - x * z / (m * m) for key, (x, z) in pairs.items()}
        lam_i, mu_i = _power_tuning(loo, None if lam is None else lam_arr[..., None], intercept, a.shape)
    else:
        lam_i, mu_i = lam_arr[..., None], mu[..., None]
    z = a + lam_i * b1 + mu_i * b0
    estimate = z.mean(axis=-1)
    se = z.std(axis=-1, ddof=1) / math.sqrt(n_posts) if n_posts > 1 else np.full(estimate.shape, np.nan)
    half = z_value(confidence) * se
    return squeeze({"estimate": estimate, "se": se, "lo": np.clip(estimate - half, 0.0, 1.0),
                     "hi": np.clip(estimate + half, 0.0, 1.0), "lambda": lam_arr, "mu": mu,
                     "n": sampled.sum(axis=-1), "big_n": n_posts})


def _power_tuning(moments: dict, lam, intercept: bool, shape) -> tuple[np.ndarray, np.ndarray]:
    """(lam, mu) minimising the variance of z from its moments (v00 = Var b0, v11 = Var b1, v01, c0 =
    Cov(a, b0), c1 = Cov(a, b1)): the least-squares fit of ``active_mean``, lam clipped to [0, 1] and mu
    refitted after clipping; lam = 0 when b1 does not vary. ``lam`` given: only mu is fitted."""
    v00, v11, v01, c0, c1 = (moments[k] for k in ("v00", "v11", "v01", "c0", "c1"))
    if lam is None:
        if intercept:
            det = v00 * v11 - v01 * v01
            ok = det > 1e-12 * np.maximum(v00 * v11, 1e-300)
            lam_free = np.where(ok, (-c1 * v00 + c0 * v01) / np.where(ok, det, 1.0), 0.0)
        else:
            ok = v11 > 0
            lam_free = np.where(ok, -c1 / np.where(ok, v11, 1.0), 0.0)
        lam_arr = np.where(v11 > 0, np.clip(lam_free, 0.0, 1.0), 0.0)
    else:
        lam_arr = np.broadcast_to(np.asarray(lam, dtype=float), shape)
    if intercept:
        mu = np.where(v00 > 0, -(c0 + lam_arr * v01) / np.where(v00 > 0, v00, 1.0), 0.0)
    else:
        mu = np.zeros(np.shape(lam_arr))
    return lam_arr, mu


def uniform_equivalent_se(f, y, sampled, pi) -> Any:
    """SE that uniform-sample PPI++ would have had with as many labels as this weighted sample.

    PPI++ on a simple random sample of n of N posts has variance Var(Y - lam f)/n + lam^2 Var(f)/N
    with lam = Cov(Y, f)/Var(f) (clipped to [0, 1]; the n/N correction is negligible here). The
    population moments of Y are estimated from the weighted sample (Hajek weights 1/pi), those of f
    from every post. Shown beside the active interval so the design's gain (or loss) is visible.
    Vectorised like ``active_mean``.
    """
    f = np.asarray(f, dtype=float)
    sampled = np.asarray(sampled, bool)
    w = np.where(sampled, 1.0 / np.where(sampled, np.asarray(pi, dtype=float), 1.0), 0.0)
    y0 = np.where(sampled, np.asarray(y, dtype=float), 0.0)
    n = sampled.sum(axis=-1)
    w_sum = w.sum(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        y_mean = (w * y0).sum(axis=-1, keepdims=True) / w_sum
        f_mean_l = (w * f).sum(axis=-1, keepdims=True) / w_sum
        cov_yf = (w * (y0 - y_mean) * (f - f_mean_l)).sum(axis=-1) / w_sum[..., 0]
        var_f = f.var(axis=-1)
        lam = np.where(var_f > 0, np.clip(cov_yf / np.where(var_f > 0, var_f, 1.0), 0.0, 1.0), 0.0)
        r = y0 - lam[..., None] * f
        r_mean = (w * r).sum(axis=-1, keepdims=True) / w_sum
        var_r = (w * (r - r_mean) ** 2).sum(axis=-1) / w_sum[..., 0]
        se = np.sqrt(var_r / n + lam * lam * var_f / f.shape[-1])
    return squeeze(se)


# --------------------------------------------------------------------------------------------
# Two phases: a uniform burn-in, then a draw whose probabilities the burn-in's labels chose

def _per_dataset(value, shape):
    """A scalar or (R,) parameter as an array broadcasting against (R, N)."""
    return np.asarray(value, dtype=float).reshape(np.shape(value) + (1,) * (len(shape) - np.ndim(value)))


def conditional_pi(burn_in, drawn, pi):
    """Inclusion probabilities of the second phase's estimate, conditional on the burn-in: 1 for a
    burn-in post (it stands for itself), pi for a post of the second draw (1 elsewhere: unused)."""
    return np.where(burn_in, 1.0, np.where(drawn, pi, 1.0))


def two_phase_mean(f, y, burn_in, drawn, pi_burn_in, pi, combination, calibrated, confidence: float,
                   folds=None, fold_combination=None) -> dict[str, Any]:
    """Prevalence from a two-phase sample (vidlabel.analyze.sampling.two_phase_design).

    The burn-in is a uniform sample of n0 of N posts (probability ``pi_burn_in`` = n0/N each); the
    second draw took each other post with ``pi``, chosen from the burn-in's labels. Two estimates:
      first   over the burn-in alone, a uniform sample: PPI++ on each fold k of the burn-in (``folds``,
              sampling.fold_of: a uniform sample of n_k posts), lambda cross-fitted (``active_mean``);
      second  conditional on the burn-in: its posts count as themselves (pi = 1), the second draw's
              with its pi; prediction ``calibrated``, the P(yes) the design was drawn from (fixed by
              the burn-in), ``active_mean`` with lambda and the ratio-type intercept cross-fitted (each
              post's from the others: E[lambda_-i f_i (1 - xi_i/pi_i)] = 0 given the burn-in); given the
              burn-in it is unbiased whatever the burn-in was, so unbiased too,
    and E[second | burn-in] is the population share itself, so the two are uncorrelated:
      estimate = sum_k (n_k/n0) a_-k first_k + (1 - a) second,  a = sum_k (n_k/n0) a_-k,
      SE^2 = sum_k ((n_k/n0) a_-k)^2 SE1_k^2 + (1 - a)^2 SE2^2,
    with a_-k = ``fold_combination`` (per fold): the weight the design would have chosen without fold k's
    labels. It has not seen them, so E[a_-k first_k] = E[a_-k] theta, and a (a function of the burn-in)
    leaves the second estimate unbiased: the estimate is unbiased. Without ``fold_combination`` (a
    design file written before it) the burn-in is one fold with weight ``combination``: a weight chosen
    from the same labels as the first estimate, -0.15 SD of bias at prevalence 0.02 with 100 labels. No
    coefficient is fitted on the label it corrects: lambda fitted on all the second draw's labels at once
    leaned on them (a bias of 0.17 SD at N 3,000, prevalence 0.05, 60 + 150 labels), hence lambda = 1 there
    before; cross-fitted, the tuned lambda is unbiased and keeps an uninformative model that passed the
    burn-in's check from widening the interval (docs/statistics.md). ``lambda``: the first estimate's
    (weighted over the folds). Vectorised like ``active_mean``.
    """
    f = np.asarray(f, dtype=float)
    burn_in, drawn = np.asarray(burn_in, bool), np.asarray(drawn, bool)
    n_posts = f.shape[-1]
    second = active_mean(calibrated, y, burn_in | drawn, conditional_pi(burn_in, drawn, pi), confidence)
    a_total = first_sum = first_var = lam_sum = 0.0
    for mask, n_k, share in burn_in_folds(burn_in, combination, folds, fold_combination):
        pi_k = np.broadcast_to(_per_dataset(np.maximum(n_k, 1) / n_posts, f.shape), f.shape)
        first = active_mean(f, y, mask, pi_k, confidence, intercept=False)
        used = n_k > 0
        a_total = a_total + share
        first_sum = first_sum + np.where(used, share * np.nan_to_num(first["estimate"]), 0.0)
        first_var = first_var + np.where(used, (share * np.nan_to_num(first["se"])) ** 2, 0.0)
        lam_sum = lam_sum + np.where(used, share * first["lambda"], 0.0)
    estimate = first_sum + (1 - a_total) * second["estimate"]
    se = np.sqrt(first_var + (1 - a_total) ** 2 * np.asarray(second["se"]) ** 2)
    half = z_value(confidence) * se
    with np.errstate(invalid="ignore", divide="ignore"):
        lam = np.where(a_total > 0, lam_sum / np.where(a_total > 0, a_total, 1.0), 0.0)
    return squeeze({"estimate": estimate, "se": se, "lo": np.clip(estimate - half, 0.0, 1.0),
                    "hi": np.clip(estimate + half, 0.0, 1.0), "lambda": lam, "combination": a_total,
                    "n": (burn_in | drawn).sum(axis=-1), "big_n": n_posts})


def burn_in_folds(burn_in, combination, folds=None, fold_combination=None):
    """(mask, n_k, weight) per fold k of a two-phase burn-in: its posts, their number and the weight
    (n_k / n0) a_-k of its first-phase estimate (``two_phase_mean``); one fold weighing ``combination``
    without ``fold_combination``. The weights sum to the combination a of the two phases."""
    burn_in = np.asarray(burn_in, bool)
    if fold_combination is None:
        parts = [(burn_in, np.asarray(combination, dtype=float))]
    else:
        fold = np.asarray(folds)
        weights = np.asarray(fold_combination, dtype=float)
        parts = [(burn_in & (fold == k), weights[..., k]) for k in range(weights.shape[-1])]
    n_burn = burn_in.sum(axis=-1)
    out = []
    for mask, a_k in parts:
        n_k = mask.sum(axis=-1)
        out.append((mask, n_k, np.where(n_burn > 0, n_k / np.maximum(n_burn, 1), 0.0) * a_k))
    return out


def two_phase_share(y, burn_in, drawn, pi_burn_in, pi, combination, confidence: float, folds=None,
                    fold_combination=None) -> dict[str, Any]:
    """Human-only share of a two-phase sample: the burn-in's mean (per fold, weighted as in
    ``two_phase_mean``) and the second phase's Hajek mean (conditional on the burn-in) combined;
    Wilson's interval at the effective size share (1 - share) / SE^2 (Kish's size of the combined
    weights, ``two_phase_pi``, when the share is 0 or 1). Vectorised."""
    y = np.asarray(y, dtype=float)
    burn_in, drawn = np.asarray(burn_in, bool), np.asarray(drawn, bool)
    second = hajek_share(y, conditional_pi(burn_in, drawn, pi), confidence, burn_in | drawn)
    a = share = variance = 0.0
    for mask, n_k, weight in burn_in_folds(burn_in, combination, folds, fold_combination):
        pi_k = np.broadcast_to(_per_dataset(np.maximum(n_k, 1) / y.shape[-1], y.shape), y.shape)
        first = hajek_share(y, pi_k, confidence, mask)
        used = n_k > 0
        a = a + weight
        share = share + np.where(used, weight * np.nan_to_num(first["estimate"]), 0.0)
        variance = variance + np.where(used, (weight * np.nan_to_num(first["se"])) ** 2, 0.0)
    share = share + (1 - a) * np.asarray(second["estimate"])
    variance = variance + (1 - a) ** 2 * np.asarray(second["se"]) ** 2
    labelled = burn_in | drawn
    w = np.where(labelled, 1 / two_phase_pi(burn_in, drawn, pi_burn_in, pi, a), 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        kish = w.sum(axis=-1) ** 2 / (w * w).sum(axis=-1)
        interior = (share > 0) & (share < 1) & (variance > 0)
        n_eff = np.where(interior, share * (1 - share) / np.where(variance > 0, variance, 1.0), kish)
    lo, hi = wilson_bounds(share * n_eff, n_eff, confidence)
    return squeeze({"estimate": share, "se": np.sqrt(variance), "lo": lo, "hi": hi, "n_eff": n_eff})


def two_phase_pi(burn_in, drawn, pi_burn_in, pi, combination):
    """The inclusion probability each label carries in the combined estimate, 1 / its weight: a/pi0 +
    (1 - a) for a burn-in post (both estimates use it), (1 - a)/pi for a post of the second draw; for
    counting events and effective sizes (``stats.sample_events``), as a one-phase design's pi."""
    burn_in, drawn = np.asarray(burn_in, bool), np.asarray(drawn, bool)
    a = _per_dataset(combination, burn_in.shape)
    pi0 = _per_dataset(pi_burn_in, burn_in.shape)
    with np.errstate(divide="ignore"):
        return np.where(burn_in, 1 / (a / pi0 + (1 - a)), np.where(drawn, np.asarray(pi, dtype=float) / (1 - a), 1.0))


# --------------------------------------------------------------------------------------------
# Agreement under the design

class Design(NamedTuple):
    """How each labelled post stands for the population, for point estimates and for resampling.

    A post's weight is ``srs_weight + poisson_weight + fixed_weight``: a component from a simple
    random sample (resampled as one: multinomial counts over the posts that have it), one from a
    Poisson draw with inclusion probability ``pi`` (resampled post by post), and one counted exactly
    (a post that stands for itself, resampled never). One-phase designs have one component; a
    two-phase design (``two_phase_design``) mixes them.
    """

    srs_weight: np.ndarray
    poisson_weight: np.ndarray
    pi: np.ndarray
    fixed_weight: np.ndarray

    @property
    def weight(self) -> np.ndarray:
        return self.srs_weight + self.poisson_weight + self.fixed_weight


def poisson_design(pi) -> Design:
    """Each labelled post drawn independently with probability ``pi``: weight 1/pi."""
    pi = np.asarray(pi, dtype=float)
    zero = np.zeros(pi.size)
    return Design(zero, 1.0 / pi, pi, zero)


def two_phase_weights(burn_in, pi_burn_in: float, pi, combination: float) -> Design:
    """The labelled posts of a two-phase sample (``two_phase_mean``): a burn-in post counts a/pi0 in the
    first estimate (a uniform sample, resampled as one) and 1 - a in the second (exactly); a post of
    the second draw (1 - a)/pi (Poisson)."""
    burn_in = np.asarray(burn_in, bool)
    pi = np.asarray(pi, dtype=float)
    a = float(combination)
    zero = np.zeros(burn_in.size)
    return Design(np.where(burn_in, a / pi_burn_in, 0.0), np.where(burn_in, 0.0, (1 - a) / np.where(burn_in, 1.0, pi)),
                  np.where(burn_in, 1.0, pi), np.where(burn_in, 1 - a, zero))


def replicate_weights(design: Design, samples: int, rng: np.random.Generator) -> np.ndarray:
    """(samples, n) bootstrap weights that resample the design: the simple-random-sample component by
    multinomial counts over its posts (resampling them with replacement), the Poisson component by
    multipliers 1 + sqrt(1 - pi) (P - 1), P ~ Poisson(1) (mean 1, variance 1 - pi: the replicates'
    variance of a weighted total is the Horvitz-Thompson variance estimate of Poisson sampling, a post
    drawn with pi = 1 does not vary), the exact component unchanged. Every weight stays >= 0."""
    n = design.pi.size
    out = np.broadcast_to(design.fixed_weight, (samples, n)).copy()
    srs = design.srs_weight > 0
    if srs.any():
        counts = rng.multinomial(int(srs.sum()), np.full(int(srs.sum()), 1.0 / srs.sum()), size=samples)
        out[:, srs] += design.srs_weight[srs] * counts
    poisson = design.poisson_weight > 0
    if poisson.any():
        spread = np.sqrt(np.clip(1.0 - design.pi[poisson], 0.0, 1.0))
        out[:, poisson] += design.poisson_weight[poisson] * (1.0 + spread * (rng.poisson(1.0, (samples, int(poisson.sum()))) - 1.0))
    return out


# Cells of the 2x2 table, in stats.confusion_metrics' order ("yes" is positive).
TP, FP, FN, TN = range(4)


def weighted_agreement(cells, design: Design, confidence: float, samples: int, seed: int = 0) -> dict[str, Any]:
    """Agreement metrics estimated for the population the design stands for.

    ``cells``: per labelled post its cell (``TP``, ``FP``, ``FN``, ``TN``); ``design``: its weights.
    Every metric is a function of the confusion totals sum w (Hajek: the ratios do not depend on the
    scale of w), so on a uniform sample it is the plain one. Intervals: F1 and kappa, percentile
    bootstrap over ``replicate_weights``; accuracy, precision and recall (shares), Wilson's interval at
    the design's effective size p(1 - p) / Var*, Var* their bootstrap variance (Kish's size of the
    share's posts when the share is 0 or 1, as ``hajek_share``). An empty cell gets, in the replicates
    only, a pseudo-post of half the mean weight (resampled like a Poisson post with pi = 0), as the
    uniform bootstrap smooths its cell shares.
    """
    cells = np.asarray(cells, dtype=int)
    onehot = np.eye(4)[cells] if cells.size else np.zeros((0, 4))
    weight = design.weight
    totals = weight @ onehot
    counts = onehot.sum(axis=0)
    point = confusion_metrics(*totals)
    rng = np.random.default_rng(seed)
    replicate_totals = replicate_weights(design, samples, rng) @ onehot
    empty = counts == 0
    pseudo = 0.5 * (float(weight.mean()) if weight.size else 1.0)
    if cells.size and empty.any():
        replicate_totals[:, empty] += pseudo * rng.poisson(1.0, (samples, int(empty.sum())))
    with warnings.catch_warnings(), np.errstate(invalid="ignore", divide="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)  # a metric undefined in every replicate: NaN
        replicates = confusion_metrics(*replicate_totals.T)
        tail = 100 * (1 - confidence) / 2
        intervals = {name: tuple(float(b) for b in np.nanpercentile(replicates[name], [tail, 100 - tail]))
                     if cells.size else (math.nan, math.nan) for name in BOOTSTRAP_METRICS}
        for name, domain in (("accuracy", (TP, FP, FN, TN)), ("precision", (TP, FP)), ("recall", (TP, FN))):
            share = point[name]
            in_domain = np.isin(cells, domain)
            w = weight[in_domain]
            if not w.size or not np.isfinite(share):
                intervals[name] = (math.nan, math.nan)
                continue
            variance = float(np.nanvar(replicates[name]))
            kish = float(w.sum() ** 2 / (w * w).sum())
            n_eff = share * (1 - share) / variance if 0 < share < 1 and variance > 0 else kish
            lo, hi = wilson_bounds(share * n_eff, n_eff, confidence)
            intervals[name] = (float(lo), float(hi))
    return agreement_row(counts, point, intervals, f"a pseudo-post of half the mean weight ({pseudo:.3g})")


def srs_design(n: int) -> Design:
    """A uniform sample of n labelled posts: each counts 1 and is resampled as a simple random sample."""
    zero = np.zeros(n)
    return Design(np.ones(n), zero, np.ones(n), zero)


# The metrics compared between two models on the same labelled posts ("prevalence_error": the error of the
# model's own "yes" share, |FP - FN| / posts, of which lower is better).
PAIRED_METRICS = ("f1", "precision", "recall", "prevalence_error")
# The power at which ``paired_difference`` states the smallest difference the labels can detect.
DETECTION_POWER = 0.8


def paired_difference(cells_a, cells_b, design: Design, confidence: float, samples: int,
                      seed: int = 0) -> dict[str, dict[str, float]]:
    """Model A against model B on the same labelled posts, per metric of ``PAIRED_METRICS``: each one's
    design-weighted estimate (``weighted_agreement``'s confusion totals), their difference A - B and its
    percentile interval from ``replicate_weights``, the same replicate weights for both models, so the
    interval keeps the pairing (posts both get right or both get wrong cancel out), and ``detectable``:
    the smallest difference these labels find with probability ``DETECTION_POWER``,
    (z_(1 - (1 - confidence)/2) + z_power) x the replicates' standard deviation of the difference;
    ``discordant``: the labelled posts on which the two fall in different cells (with none, every
    replicate gives a difference of 0: the labels hold nothing that tells the models apart).
    ``cells_a``, ``cells_b``: each labelled post's cell for A and B (``TP`` ...)."""
    cells_a, cells_b = np.asarray(cells_a, dtype=int), np.asarray(cells_b, dtype=int)
    onehot_a = np.eye(4)[cells_a] if cells_a.size else np.zeros((0, 4))
    onehot_b = np.eye(4)[cells_b] if cells_b.size else np.zeros((0, 4))
    replicates = replicate_weights(design, samples, np.random.default_rng(seed))

    def metrics(totals):
        with np.errstate(invalid="ignore", divide="ignore"):
            out = confusion_metrics(*np.moveaxis(np.asarray(totals, dtype=float), -1, 0))
            tp, fp, fn, tn = np.moveaxis(np.asarray(totals, dtype=float), -1, 0)
            total = tp + fp + fn + tn
            out["prevalence_error"] = np.where(total > 0, np.abs(fp - fn) / np.where(total > 0, total, 1.0), np.nan)
        return out

    discordant = int(np.sum(cells_a != cells_b))
    point_a, point_b = metrics(design.weight @ onehot_a), metrics(design.weight @ onehot_b)
    rep_a, rep_b = metrics(replicates @ onehot_a), metrics(replicates @ onehot_b)
    tail = 100 * (1 - confidence) / 2
    reach = z_value(confidence) + float(norm.ppf(DETECTION_POWER))
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a metric undefined in every replicate: NaN
        for name in PAIRED_METRICS:
            a, b = float(point_a[name]), float(point_b[name])
            differences = rep_a[name] - rep_b[name]
            finite = differences[np.isfinite(differences)]
            lo, hi = (np.percentile(finite, [tail, 100 - tail]) if finite.size else (math.nan, math.nan))
            spread = float(finite.std(ddof=1)) if finite.size > 1 else math.nan
            out[name] = {"a": a, "b": b, "difference": a - b, "lo": float(lo), "hi": float(hi),
                         "detectable": reach * spread, "discordant": discordant}
    return out
