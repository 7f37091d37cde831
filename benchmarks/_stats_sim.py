"""Simulated populations and samples shared by benchmarks/interval_coverage.py and benchmarks/active_sampling.py.

A population is N posts with a true label Y and the model's P(yes). Every function works on R
datasets at once (arrays (R, N)) so that a thousand repetitions take seconds.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from vidlabel.analyze import estimators, sampling, stats  # noqa: E402
from vidlabel.analyze.prevalence import ppi_moments_from_items  # noqa: E402


def population(rng, reps: int, n_posts: int, prevalence: float, concentration: float, model: str):
    """(truth Y, the model's reported P(yes)) for ``reps`` datasets.

    Each post has a latent chance s ~ Beta(prevalence c, (1 - prevalence) c) and Y ~ Bernoulli(s);
    a smaller concentration c makes s more extreme, i.e. the model more informative.
    ``model``: "calibrated" reports s; "overconfident" reports sigmoid(3 logit s) (right ranking,
    probabilities pushed towards 0 and 1); "uninformative" reports a draw from the same Beta,
    independent of Y (varies as much as the calibrated one but carries no information);
    "constant" reports the prevalence for every post (calibrated and uninformative).
    """
    s = rng.beta(prevalence * concentration, (1 - prevalence) * concentration, (reps, n_posts))
    truth = (rng.random((reps, n_posts)) < s).astype(float)
    if model == "calibrated":
        p = s
    elif model == "overconfident":
        logit = np.log(np.clip(s, 1e-12, 1)) - np.log(np.clip(1 - s, 1e-12, 1))
        p = 1 / (1 + np.exp(-3 * logit))
    elif model == "uninformative":
        p = rng.beta(prevalence * concentration, (1 - prevalence) * concentration, (reps, n_posts))
    elif model == "constant":
        p = np.full((reps, n_posts), prevalence)
    else:
        raise ValueError(model)
    return truth, p


def simple_random_sample(rng, reps: int, n_posts: int, n: int) -> np.ndarray:
    """(R, N) mask of a simple random sample of exactly n posts per dataset."""
    keys = rng.random((reps, n_posts))
    chosen = np.argpartition(keys, n - 1, axis=1)[:, :n]
    mask = np.zeros((reps, n_posts), bool)
    np.put_along_axis(mask, chosen, True, axis=1)
    return mask


def active_design(p: np.ndarray, budget: int, floor_share: float) -> np.ndarray:
    """(R, N) inclusion probabilities of the active design (vidlabel.analyze.sampling) per dataset."""
    return np.stack([sampling.inclusion_probabilities(sampling.post_uncertainty(row), budget, floor_share)
                     for row in p])


def score_design(p: np.ndarray, budget: int, floor_share: float) -> np.ndarray:
    """pi ∝ the model's P(yes) (oversampling likely positives), same floor: sqrt(p^2) = p."""
    return np.stack([sampling.inclusion_probabilities(row * row, budget, floor_share) for row in p])


def poisson_draw(rng, pi: np.ndarray) -> np.ndarray:
    return rng.random(pi.shape) < pi


def uniform_ppi(truth: np.ndarray, f: np.ndarray, labelled: np.ndarray) -> dict[str, np.ndarray]:
    """The aggregate's uniform-sample estimate (sql/ppi_moments.sql, the production query: the cross-fitted
    PPI++ moments) for R datasets: estimate, imputed_var, rectifier_var, lambda."""
    reps, n_posts = truth.shape
    items = pa.table({
        "question": pa.array(np.repeat(np.arange(reps, dtype=np.int32), n_posts)),
        "yhat": pa.array(f.ravel()),
        "y": pa.array(np.where(labelled, truth, np.nan).ravel(), from_pandas=True),
        "r": pa.array(np.where(labelled, 1.0, np.nan).ravel(), from_pandas=True),
    })
    moments = ppi_moments_from_items(items)
    keys = ("crossfit_estimate", "crossfit_imputed_var", "crossfit_rectifier_var", "crossfit_lambda")
    return {k.removeprefix("crossfit_"): np.array([moments[i][k] for i in range(reps)], dtype=float) for k in keys}


def covers(lo, hi, target) -> np.ndarray:
    return (lo <= target) & (target <= hi)


def reported(estimate, se, truth, f, labelled, human, confidence, pi=None):
    """The reported corrected interval (stats.corrected_interval), as prevalence.py forms it."""
    events = stats.sample_events(truth, f, labelled, pi)
    r = stats.corrected_interval(estimate, se, events, human[0], human[1], confidence)
    return r["lo"], r["hi"]


class TwoPhaseSample(NamedTuple):
    """label_sample's two-phase design on R datasets: burn_in, drawn, folds (R, N); pi_burn_in (R,); pi
    (R, N); combination (R,); fold_combination (R, FOLDS); calibrated (R, N); mixture (R,)."""

    burn_in: np.ndarray
    drawn: np.ndarray
    folds: np.ndarray
    pi_burn_in: np.ndarray
    pi: np.ndarray
    combination: np.ndarray
    fold_combination: np.ndarray
    calibrated: np.ndarray
    mixture: np.ndarray


def two_phase_sample(rng, truth: np.ndarray, p: np.ndarray, budget: int, burn_in_share: float,
                     floor_share: float) -> TwoPhaseSample:
    """label_sample's two-phase design on R datasets (arrays (R, N)): a uniform burn-in of
    sampling.burn_in_size posts, then sampling.two_phase_design's draw; each post's fold at random, as
    sampling.fold_of's hash of a post id gives it."""
    reps, n_posts = truth.shape
    burn = np.zeros((reps, n_posts), bool)
    folds = rng.integers(0, sampling.FOLDS, (reps, n_posts))
    pi, calibrated = np.zeros((reps, n_posts)), np.zeros((reps, n_posts))
    pi_burn_in, combination, mixture = np.empty(reps), np.empty(reps), np.empty(reps)
    fold_combination = np.empty((reps, sampling.FOLDS))
    for r in range(reps):
        n0 = sampling.burn_in_size(p[r], budget, burn_in_share)
        burn[r] = sampling.uniform_sample(n_posts, n0, int(rng.integers(2**32)))
        design = sampling.two_phase_design(p[r], burn[r], truth[r][burn[r]], budget, floor_share, folds[r])
        pi[r], pi_burn_in[r], combination[r], mixture[r] = (design.pi, design.pi_burn_in, design.combination[0],
                                                             design.mixture)
        fold_combination[r] = design.fold_combination[0]
        calibrated[r] = design.calibrated[:, 0]
    return TwoPhaseSample(burn, poisson_draw(rng, pi), folds, pi_burn_in, pi, combination, fold_combination,
                          calibrated, mixture)


def two_phase_interval(truth, f, sample: TwoPhaseSample, confidence):
    """The two-phase estimate and its reported interval, as prevalence.py forms them."""
    s = sample
    est = estimators.two_phase_mean(f, truth, s.burn_in, s.drawn, s.pi_burn_in, s.pi, s.combination, s.calibrated,
                                    confidence, s.folds, s.fold_combination)
    human = estimators.two_phase_share(truth, s.burn_in, s.drawn, s.pi_burn_in, s.pi, s.combination, confidence,
                                       s.folds, s.fold_combination)
    effective = estimators.two_phase_pi(s.burn_in, s.drawn, s.pi_burn_in, s.pi, est["combination"])
    lo, hi = reported(est["estimate"], est["se"], truth, f, s.burn_in | s.drawn, (human["lo"], human["hi"]),
                      confidence, effective)
    return est, lo, hi


__all__ = ["population", "simple_random_sample", "active_design", "score_design", "poisson_draw", "uniform_ppi",
           "covers", "reported", "TwoPhaseSample", "two_phase_sample", "two_phase_interval", "estimators", "stats", "sampling"]
