"""Active sampling of posts for human coding (Zrnic & Candès 2024, batch form).

Each classified post i gets an inclusion probability pi_i fixed from the model's output before any
human label is seen; each post is then drawn independently (Poisson sampling) with that probability.
The prevalence estimate from such a sample is ``estimators.active_mean`` (Horvitz-Thompson with power
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


def _platt_fit(x: np.ndarray, y: np.ndarray, penalty: float) -> np.ndarray:
    """(a, b) of P(Y = 1) = sigmoid(a + b x) by penalised maximum likelihood, ridge ``penalty``
    around (logit of the sample's share, 0), with b >= 0 (Newton steps; the objective is concave)."""
    share = float(np.clip(y.mean(), 0.5 / (y.size + 1), 1 - 0.5 / (y.size + 1)))
    prior = np.array([np.log(share / (1 - share)), 0.0])
    theta = prior.copy()
    design = np.c_[np.ones(y.size), x]
    for _ in range(100):
        mu = 1 / (1 + np.exp(-(design @ theta)))
        grad = design.T @ (y - mu) - penalty * (theta - prior)
        hess = design.T @ (design * (mu * (1 - mu))[:, None]) + penalty * np.eye(2)
        step = np.linalg.solve(hess, grad)
        theta = theta + step
        if theta[1] < 0:  # an anti-informative fit: treat the model as saying nothing
            theta[1] = 0.0
        if np.abs(step).max() < 1e-10:
            break
    return theta


def _logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-6, 1 - 1e-6)
    return np.log(p / (1 - p))


def recalibrate(p_yes: np.ndarray, p_burnin: np.ndarray, y_burnin: np.ndarray, penalty: float = 1.0) -> np.ndarray:
    """The model's P(yes) recalibrated on a labelled burn-in sample (Platt scaling).

    Fits P(Y = 1) = sigmoid(a + b logit(p)) on the burn-in (``p_burnin``, labels ``y_burnin`` in
    [0, 1]) by penalised maximum likelihood (ridge ``penalty`` on a and b around the burn-in's
    share and 0: a small burn-in pulls towards "the model says nothing", the safe side), with b >= 0,
    and applies it to ``p_yes`` (NaN stays NaN). An over-confident model gets b < 1, an
    uninformative one b ~ 0, so its probabilities collapse to the share and the design to uniform
    instead of spending labels on noise. ``burn_in_design`` builds the whole design from it.
    """
    p_b = np.asarray(p_burnin, dtype=float)
    y_b = np.asarray(y_burnin, dtype=float)
    keep = np.isfinite(p_b) & np.isfinite(y_b)
    if not keep.any():
        raise ValueError("no labelled burn-in post with a probability to recalibrate on")
    a, b = _platt_fit(_logit(p_b[keep]), y_b[keep], penalty)
    p = np.asarray(p_yes, dtype=float)
    return np.where(np.isfinite(p), 1 / (1 + np.exp(-(a + b * _logit(p)))), np.nan)


def burn_in_design(p_yes: np.ndarray, burn_in: np.ndarray, y_burn_in: np.ndarray, budget: float,
                   floor_share: float, penalty: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Active design after a uniform burn-in: (sampling_probability of every post, pi_active).

    ``p_yes``: (N, Q) or (N,) model probabilities; ``burn_in``: (N,) bool, the posts of a uniform
    burn-in sample (already labelled); ``y_burn_in``: their labels, (n0, Q) or (n0,), NaN where
    missing; ``budget``: labels in all, burn-in included. Each question's P(yes) is recalibrated on
    the burn-in (``recalibrate``), the remaining budget is spread over the other posts with
    ``inclusion_probabilities``, and every post gets its inclusion probability in the union of the
    two samples, n0/N + (1 - n0/N) pi_active (``union_inclusion``). A burn-in post's pi_active is
    computed from a recalibration fitted without its own label: with its label in the fit its
    probability would lean towards its own answer and its weight 1/pi with it (a few rare positives
    in a small burn-in then bias the estimate low).

    Returns (pi, pi_active): pi is what the label file's ``sampling_probability`` must hold for
    every labelled post; pi_active is the probability to draw each other post with
    (``draw(pi_active, seed)``; 0 for the burn-in posts).
    """
    p = np.asarray(p_yes, dtype=float)
    p = p[:, None] if p.ndim == 1 else p
    burn = np.asarray(burn_in, bool)
    y_b = np.asarray(y_burn_in, dtype=float)
    y_b = y_b[:, None] if y_b.ndim == 1 else y_b
    n_posts, n_questions = p.shape
    n_burn = int(burn.sum())
    if y_b.shape != (n_burn, n_questions):
        raise ValueError(f"y_burn_in must have shape ({n_burn}, {n_questions}), got {y_b.shape}")
    if not 0 < n_burn < budget:
        raise ValueError(f"the burn-in ({n_burn} posts) must be non-empty and smaller than the budget ({budget})")
    x = _logit(p)
    fits = []
    calibrated = np.empty_like(p)
    for q in range(n_questions):
        keep = np.isfinite(p[burn, q]) & np.isfinite(y_b[:, q])
        if not keep.any():
            raise ValueError(f"question {q}: no labelled burn-in post with a probability to recalibrate on")
        theta = _platt_fit(x[burn, q][keep], y_b[keep, q], penalty)
        fits.append((theta, keep))
        calibrated[:, q] = np.where(np.isfinite(p[:, q]), 1 / (1 + np.exp(-(theta[0] + theta[1] * x[:, q]))), np.nan)
    uncertainty = post_uncertainty(calibrated)
    pi_active = np.zeros(n_posts)
    rest = ~burn
    pi_active[rest] = inclusion_probabilities(uncertainty[rest], budget - n_burn, floor_share)
    # Burn-in posts: the probability they would have had, with their own label left out of the fit,
    # on the same scale as the others (the normaliser of sqrt(u) hardly moves without one post).
    root_sum = np.sqrt(uncertainty[rest]).sum()
    scale = (budget - n_burn) * (1 - floor_share) / root_sum if root_sum > 0 else 0.0
    floor = (budget - n_burn) * floor_share / rest.sum() if root_sum > 0 else (budget - n_burn) / rest.sum()
    burn_index = np.flatnonzero(burn)
    for j, i in enumerate(burn_index):
        loo = np.empty(n_questions)
        for q, (theta, keep) in enumerate(fits):
            idx = np.flatnonzero(keep)
            if not np.isfinite(p[i, q]):
                loo[q] = np.nan
                continue
            if j in idx and idx.size > 1:
                others = idx[idx != j]
                theta = _platt_fit(x[burn, q][others], y_b[others, q], penalty)
            loo[q] = 1 / (1 + np.exp(-(theta[0] + theta[1] * x[i, q])))
        pi_active[i] = min(1.0, scale * np.sqrt(post_uncertainty(loo[None, :])[0]) + floor)
    return union_inclusion(n_burn / n_posts, pi_active), np.where(burn, 0.0, pi_active)


def union_inclusion(*pis: np.ndarray) -> np.ndarray:
    """Inclusion probability in the union of independent samples: 1 - prod(1 - pi_k). A uniform
    burn-in of n0 of N posts (pi = n0/N) and an active sample drawn independently of its labels
    combine this way; give the result as sampling_probability for every labelled post."""
    out = np.ones(np.broadcast_shapes(*(np.shape(p) for p in pis)))
    for p in pis:
        out = out * (1 - np.asarray(p, dtype=float))
    return 1 - out
