"""Active sampling of posts for human coding (Zrnic & Candès 2024, batch form).

Each classified post i gets an inclusion probability pi_i fixed from the model's output before any
human label is seen; each post is then drawn independently (Poisson sampling) with that probability.
The prevalence estimate from such a sample is ``stats.active_mean`` (Horvitz-Thompson with power
tuning), which stays unbiased whatever the model's quality: only its width depends on it.

- Uncertainty u_i: the expected squared error of a calibrated prediction, p(1 - p) for P(yes) = p.
  One human codes every question of a post, so one pi per post serves every question: u_i is the
  mean of p(1 - p) over the questions. With pi ∝ sqrt(u) this is the allocation that minimises the sum
  of the questions' variances (each question's variance is ~ sum_i u_iq / pi_i; Cauchy-Schwarz gives
  pi ∝ sqrt(sum_q u_iq)). A question without a probability for a post (failed request, no
  log-probabilities) counts as maximal uncertainty, 0.25: the model knows nothing there.
- pi ∝ sqrt(u), scaled to sum to the budget, mixed with a uniform floor so that pi_i >= floor_share *
  budget / N (no weight 1/pi explodes, and a post the model is sure about can still be checked), and
  clipped at 1 (the excess is spread over the others so the expected sample size stays = budget).
"""

from __future__ import annotations

import numpy as np

# p(1 - p) at p = 1/2: the uncertainty of a post-question with no usable probability.
MAX_UNCERTAINTY = 0.25


def post_uncertainty(p_yes: np.ndarray) -> np.ndarray:
    """(N, Q) calibrated P(yes) per post and question (NaN where unknown) -> (N,) uncertainty u_i.

    u_i = mean over the questions of p(1 - p), with a NaN counted as ``MAX_UNCERTAINTY``. A 1-d
    array is taken as one question. Hard answers (p in {0, 1}) give u = 0: with no confidence signal
    the design falls back to the uniform floor, i.e. a uniform sample.
    """
    p = np.asarray(p_yes, dtype=float)
    if p.ndim == 1:
        p = p[:, None]
    if p.ndim != 2:
        raise ValueError(f"p_yes must be an (N, Q) array, got shape {p.shape}")
    finite = p[np.isfinite(p)]
    if finite.size and (finite.min() < 0 or finite.max() > 1):
        raise ValueError("p_yes must lie in [0, 1] (NaN where unknown)")
    if p.shape[1] == 0:
        return np.full(p.shape[0], MAX_UNCERTAINTY)
    u = np.where(np.isfinite(p), p * (1 - p), MAX_UNCERTAINTY)
    return u.mean(axis=1)


def inclusion_probabilities(uncertainty: np.ndarray, budget: float, floor_share: float) -> np.ndarray:
    """pi_i ∝ sqrt(u_i), sum = budget, mixed with a uniform floor pi_i >= floor_share*budget/N, clipped at 1
    (re-scaled so the sum stays = budget after clipping).

    pi = budget * ((1 - floor_share) * sqrt(u) / sum(sqrt(u)) + floor_share / N); when every u is 0
    (no signal) the design is uniform. Raises ValueError for a budget outside (0, N], a floor share
    outside [0, 1], or a negative or non-finite uncertainty.
    """
    u = np.asarray(uncertainty, dtype=float)
    n_posts = u.size
    if u.ndim != 1:
        raise ValueError(f"uncertainty must be a 1-d array, got shape {u.shape}")
    if n_posts == 0:
        raise ValueError("no posts to sample from")
    if not np.all(np.isfinite(u)) or u.min() < 0:
        raise ValueError("uncertainty must be finite and >= 0")
    if not 0 < budget <= n_posts:
        raise ValueError(f"budget must be in (0, {n_posts}] (the number of posts), not {budget}")
    if not 0 <= floor_share <= 1:
        raise ValueError(f"floor_share must be in [0, 1], not {floor_share}")
    root = np.sqrt(u)
    if root.sum() > 0:
        shape = (1 - floor_share) * root / root.sum() + floor_share / n_posts
    else:
        shape = np.full(n_posts, 1.0 / n_posts)
    return _scale_and_clip(shape, float(budget))


def _scale_and_clip(shape: np.ndarray, budget: float) -> np.ndarray:
    """budget * shape / sum(shape), with values above 1 set to 1 and the rest re-scaled so the total
    stays = budget. Each pass fixes at least one more post at 1, so this ends within N passes."""
    pi = np.empty_like(shape)
    capped = np.zeros(shape.size, dtype=bool)
    while True:
        free_budget = budget - capped.sum()
        free = ~capped
        pi[capped] = 1.0
        pi[free] = free_budget * shape[free] / shape[free].sum()
        over = free & (pi > 1.0)
        if not over.any():
            return pi
        capped |= over


def draw(pi: np.ndarray, seed: int) -> np.ndarray:
    """Boolean mask: post i drawn with probability pi_i, independently of every other post (seeded)."""
    pi = np.asarray(pi, dtype=float)
    if pi.size and (not np.all(np.isfinite(pi)) or pi.min() < 0 or pi.max() > 1):
        raise ValueError("inclusion probabilities must lie in [0, 1]")
    rng = np.random.default_rng(seed)
    return rng.random(pi.shape) < pi
