"""Simulated populations and samples shared by benchmarks/interval_coverage.py and benchmarks/active_sampling.py.

A population is N posts with a true label Y and the model's P(yes). Every function works on R
datasets at once (arrays (R, N)) so that a thousand repetitions take seconds.
"""

from __future__ import annotations

import sys
from pathlib import Path

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
    """The aggregate's PPI++ moments (sql/ppi_moments.sql, the production query) for R datasets."""
    reps, n_posts = truth.shape
    items = pa.table({
        "question": pa.array(np.repeat(np.arange(reps, dtype=np.int32), n_posts)),
        "yhat": pa.array(f.ravel()),
        "y": pa.array(np.where(labelled, truth, np.nan).ravel(), from_pandas=True),
        "r": pa.array(np.where(labelled, 1.0, np.nan).ravel(), from_pandas=True),
    })
    moments = ppi_moments_from_items(items)
    keys = ("estimate", "imputed_var", "rectifier_var", "lambda")
    return {k: np.array([moments[i][k] for i in range(reps)], dtype=float) for k in keys}


def covers(lo, hi, target) -> np.ndarray:
    return (lo <= target) & (target <= hi)


def reported(estimate, se, truth, f, labelled, human, confidence, pi=None):
    """The reported corrected interval (stats.corrected_interval), as prevalence.py forms it."""
    events = stats.sample_events(truth, f, labelled, pi)
    r = stats.corrected_interval(estimate, se, events, human[0], human[1], confidence)
    return r["lo"], r["hi"]


def two_phase_sample(rng, truth: np.ndarray, p: np.ndarray, budget: int, burn_in_share: float, floor_share: float):
    """label_sample's two-phase design on R datasets (arrays (R, N)): a uniform burn-in of
    sampling.burn_in_size posts, then sampling.two_phase_design's draw. Returns (burn_in, drawn,
    pi_burn_in (R,), pi (R, N), combination (R,), mixture (R,))."""
    reps, n_posts = truth.shape
    burn = np.zeros((reps, n_posts), bool)
    pi, calibrated = np.zeros((reps, n_posts)), np.zeros((reps, n_posts))
    pi_burn_in, combination, mixture = np.empty(reps), np.empty(reps), np.empty(reps)
    for r in range(reps):
        n0 = sampling.burn_in_size(p[r], budget, burn_in_share)
        burn[r] = sampling.uniform_sample(n_posts, n0, int(rng.integers(2**32)))
        design = sampling.two_phase_design(p[r], burn[r], truth[r][burn[r]], budget, floor_share)
        pi[r], pi_burn_in[r], combination[r], mixture[r] = (design.pi, design.pi_burn_in, design.combination[0],
                                                             design.mixture)
        calibrated[r] = design.calibrated[:, 0]
    return burn, poisson_draw(rng, pi), pi_burn_in, pi, combination, calibrated, mixture


def two_phase_interval(truth, f, burn, drawn, pi_burn_in, pi, combination, calibrated, confidence):
    """The two-phase estimate and its reported interval, as prevalence.py forms them."""
    est = estimators.two_phase_mean(f, truth, burn, drawn, pi_burn_in, pi, combination, calibrated, confidence)
    human = estimators.two_phase_share(truth, burn, drawn, pi_burn_in, pi, combination, confidence)
    effective = estimators.two_phase_pi(burn, drawn, pi_burn_in, pi, combination)
    lo, hi = reported(est["estimate"], est["se"], truth, f, burn | drawn, (human["lo"], human["hi"]), confidence,
                      effective)
    return est, lo, hi


__all__ = ["population", "simple_random_sample", "active_design", "score_design", "poisson_draw", "uniform_ppi",
           "covers", "reported", "two_phase_sample", "two_phase_interval", "estimators", "stats", "sampling"]
