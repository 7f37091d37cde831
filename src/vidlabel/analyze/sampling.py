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
- Two phases (label_sample's default): a uniform burn-in (``burn_in_size``, ``uniform_sample``) is
  coded first; ``two_phase_design`` then checks the model's P(yes) on it (``calibrate``) and draws the
  rest with a mixture of the uniform and the active design, its weight chosen from the burn-in. The
  estimate combines the two phases (``estimators.two_phase_mean``).
"""

from __future__ import annotations

import zlib
from typing import NamedTuple

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


def _clip(p: np.ndarray) -> np.ndarray:
    return np.clip(p, 1e-6, 1 - 1e-6)


def _logit(p: np.ndarray) -> np.ndarray:
    p = _clip(p)
    return np.log(p / (1 - p))


# The calibration check of ``calibrate``: the model's own P(yes) are kept when a burn-in cannot reject
# them (likelihood ratio against the recalibrated fit below the chi-square(2) 95 % point) and shows
# they carry information (the recalibrated fit beats the burn-in's share alone, chi-square(1) 95 %).
CALIBRATION_REJECT = 5.99
INFORMATIVE = 3.84
# A burn-in holds at least this many expected positives (and negatives) of the rarest question, by the
# model's mean P(yes): with fewer, neither the recalibration nor the estimate has anything to go on.
BURN_IN_MIN_POSITIVES = 5
# Candidate weights alpha of the active part in the mixture (1 - alpha) uniform + alpha active.
MIXTURE_WEIGHTS = (0.0, 0.25, 0.5, 0.75, 1.0)


# The one-round active design leans on the model's probabilities before any label has checked them. The
# draw cannot tell a calibrated model from one whose probabilities are noise (the same P(yes) spread), and
# with noise its interval covered 0.75-0.90 at prevalence 0.01-0.05 with 100-300 labels
# (benchmarks/active_sampling.py). Where a uniform sample of the budget expects at least this many
# positives and negatives of every question (by the model's mean P(yes)), it covered 0.93 or more with every
# model simulated; below, label_sample draws a uniform sample instead (``active_design_refusal``).
ACTIVE_MIN_EXPECTED_POSITIVES = 10


def active_design_refusal(p_yes: np.ndarray, budget: float, question_ids=None) -> str | None:
    """Why the one-round active design cannot promise its coverage at this budget (None when it can): the
    rarest side of some question expects fewer than ``ACTIVE_MIN_EXPECTED_POSITIVES`` in a uniform sample
    of the budget, by the model's mean P(yes) (NaN ignored)."""
    p = np.asarray(p_yes, dtype=float)
    p = p[:, None] if p.ndim == 1 else p
    names = list(question_ids) if question_ids is not None else [str(q) for q in range(p.shape[1])]
    short = []
    for q, name in enumerate(names):
        column = p[:, q][np.isfinite(p[:, q])]
        share = float(column.mean()) if column.size else 0.5
        expected = budget * min(share, 1 - share)
        if expected < ACTIVE_MIN_EXPECTED_POSITIVES:
            short.append(f"{name}: {expected:.1f} expected {'positives' if share <= 0.5 else 'negatives'} "
                         f"(model's mean P(yes) {share:.3g})")
    if not short:
        return None
    return (f"a uniform sample of {budget:g} labels would hold fewer than {ACTIVE_MIN_EXPECTED_POSITIVES} positives "
            f"or negatives of {'; '.join(short)}: there an active draw on probabilities no label has checked covered "
            "as little as 0.75 in simulation when they were noise (docs/statistics.md)")


def burn_in_size(p_yes: np.ndarray, budget: float, share: float) -> int:
    """Posts of the uniform burn-in: ``share`` of the budget, raised so that the rarest question (by the
    model's mean P(yes), NaN ignored) expects ``BURN_IN_MIN_POSITIVES`` positives and negatives in it,
    at most half the budget, at least 1."""
    p = np.asarray(p_yes, dtype=float)
    p = p[:, None] if p.ndim == 1 else p
    n0 = share * budget
    with np.errstate(invalid="ignore"):
        means = np.array([np.nanmean(col) if np.isfinite(col).any() else np.nan for col in p.T])
    rarest = np.nanmin(np.minimum(means, 1 - means)) if np.isfinite(means).any() else np.nan
    if np.isfinite(rarest) and rarest > 0:
        n0 = max(n0, BURN_IN_MIN_POSITIVES / rarest)
    return int(max(1, min(round(n0), budget // 2)))


def uniform_sample(n_posts: int, size: int, seed: int) -> np.ndarray:
    """Boolean mask of a simple random sample of exactly ``size`` of ``n_posts`` posts (seeded)."""
    if not 0 < size <= n_posts:
        raise ValueError(f"a uniform sample of {size} of {n_posts} posts is not possible")
    mask = np.zeros(n_posts, dtype=bool)
    mask[np.random.default_rng(seed).choice(n_posts, size, replace=False)] = True
    return mask


def _log_likelihood(q: np.ndarray, y: np.ndarray) -> float:
    q = np.clip(q, 1e-12, 1 - 1e-12)
    return float(np.sum(y * np.log(q) + (1 - y) * np.log(1 - q)))


def calibrate(p_yes: np.ndarray, p_burn_in: np.ndarray, y_burn_in: np.ndarray, penalty: float = 1.0) -> np.ndarray:
    """The model's P(yes) as the burn-in sees them (one question).

    The model's own probabilities when the burn-in (``p_burn_in``, labels ``y_burn_in`` in [0, 1]) cannot
    reject them (``CALIBRATION_REJECT``) and shows they carry information (``INFORMATIVE``); otherwise a
    Platt recalibration P(Y = 1) = sigmoid(a + b logit(p)) by penalised maximum likelihood (ridge
    ``penalty`` around the burn-in's share and b = 0, b >= 0): an over-confident model gets b < 1, an
    uninformative one b ~ 0, so its probabilities collapse to the share and the design to uniform
    instead of spending labels on noise. Recalibrating a calibrated model on a small burn-in only adds
    noise, hence the check. NaN stays NaN.
    """
    p_b = np.asarray(p_burn_in, dtype=float)
    y_b = np.asarray(y_burn_in, dtype=float)
    keep = np.isfinite(p_b) & np.isfinite(y_b)
    if not keep.any():
        raise ValueError("no labelled burn-in post with a probability to calibrate on")
    p_b, y_b = p_b[keep], y_b[keep]
    a, b = _platt_fit(_logit(p_b), y_b, penalty)
    p = np.asarray(p_yes, dtype=float)
    fitted = 1 / (1 + np.exp(-(a + b * _logit(p_b))))
    share = float(np.clip(y_b.mean(), 0.5 / (y_b.size + 1), 1 - 0.5 / (y_b.size + 1)))
    rejected = 2 * (_log_likelihood(fitted, y_b) - _log_likelihood(_clip(p_b), y_b))
    informative = 2 * (_log_likelihood(fitted, y_b) - _log_likelihood(np.full(y_b.size, share), y_b))
    if rejected < CALIBRATION_REJECT and informative > INFORMATIVE:
        return np.where(np.isfinite(p), _clip(p), np.nan)
    return np.where(np.isfinite(p), 1 / (1 + np.exp(-(a + b * _logit(p)))), np.nan)


def kept_as_given(p_yes: np.ndarray, calibrated: np.ndarray) -> bool:
    """Whether ``calibrate`` kept the model's own probabilities (where it has them)."""
    p = np.asarray(p_yes, dtype=float)
    known = np.isfinite(p)
    return bool(np.allclose(np.asarray(calibrated)[known], _clip(p[known])))


# The burn-in is cut into this many folds for the cross-fitted combination weights (``fold_of``).
FOLDS = 2


def fold_of(post_ids) -> np.ndarray:
    """Each post's fold (0 .. FOLDS - 1): a hash of its id, so that label_sample and aggregate cut a burn-in
    alike, and independent of its label (a uniform burn-in's folds are uniform samples too)."""
    return np.array([zlib.crc32(str(post_id).encode()) % FOLDS for post_id in post_ids], dtype=np.int64)


class TwoPhaseDesign(NamedTuple):
    """The second phase of a two-phase design (``two_phase_design``).

    ``pi``: each post's probability in the second draw (0 for burn-in posts, which are not drawn
    again); ``pi_burn_in``: n0/N, every post's probability of being in the uniform burn-in;
    ``calibrated``: (N, Q) P(yes) as the burn-in sees them (``calibrate``; the burn-in's share for a post
    without a probability), the second phase's prediction; ``mixture``: the weight
    alpha of the active part; ``combination``: per question the weight a of the burn-in's estimate in
    the two-phase estimator (vidlabel.analyze.estimators.two_phase_mean), fixed here from the design and
    the calibrated probabilities alone, before any second-phase label is seen; ``fold_combination``: per
    question the weight a_-k the design would have chosen without the labels of the burn-in's fold k
    (``fold_of``), one per fold: the estimate weighs fold k's first-phase estimate with a_-k, a weight
    that has not seen its labels (with ``combination`` itself, chosen from every burn-in label, a burn-in
    that happened to catch few positives also got a larger weight: -0.15 SD of bias at prevalence 0.02
    with 100 labels).
    """

    pi: np.ndarray
    pi_burn_in: float
    calibrated: np.ndarray
    mixture: float
    combination: tuple[float, ...]
    fold_combination: tuple[tuple[float, ...], ...]


def two_phase_design(p_yes: np.ndarray, burn_in: np.ndarray, y_burn_in: np.ndarray, budget: float,
                     floor_share: float, folds: np.ndarray | None = None) -> TwoPhaseDesign:
    """The second draw after a uniform burn-in: a mixture of the uniform and the active design whose
    weight the burn-in chooses (Zrnic & Candes 2024 discuss the mixture).

    ``p_yes``: (N, Q) or (N,) model probabilities; ``burn_in``: (N,) bool, the posts of a uniform
    burn-in (already labelled); ``y_burn_in``: their labels (n0, Q) or (n0,), NaN where missing, 0.5
    for a tie; ``budget``: labels in all, burn-in included; ``folds``: (N,) each post's fold (``fold_of``;
    None: by position). Per question ``calibrate`` on the burn-in;
    the active part pi ∝ sqrt(mean over questions of q(1 - q)) over the other posts (floor
    ``floor_share``, sum budget - n0); alpha from ``MIXTURE_WEIGHTS`` minimises the burn-in's estimate
    of the second phase's variance, sum over its posts and the questions of (1/pi_alpha - 1) (y - q)^2
    relative to the uniform design's, i.e. how the posts the burn-in saw err where each design puts
    its labels (ties go to the larger alpha: the burn-in saw no error to weigh against the model). The
    second draw's probabilities depend on the burn-in's labels, so its posts are estimated conditional
    on the burn-in, and the two phases' estimates combined (estimators.two_phase_mean): unbiased.
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
    pi, alpha, calibrated, combination = _second_phase(p, burn, y_b, budget, floor_share)
    fold = (np.arange(n_posts) % FOLDS) if folds is None else np.asarray(folds)
    fold_burn = fold[burn]
    fold_combination = []
    for k in range(FOLDS):
        # the weight the design would have chosen without fold k's labels (label-free when that leaves none)
        y_without = np.where((fold_burn == k)[:, None], np.nan, y_b)
        try:
            fold_combination.append(_second_phase(p, burn, y_without, budget, floor_share)[3])
        except ValueError:  # a question without a label in the other folds
            fold_combination.append([n_burn / budget] * n_questions)
    # The second estimate's prediction: a post without a probability (failed request) takes the burn-in's
    # share, a value fixed by the burn-in like the rest.
    with np.errstate(invalid="ignore"):
        shares = np.array([np.nanmean(y_b[:, q]) if np.isfinite(y_b[:, q]).any() else 0.5 for q in range(n_questions)])
    prediction = np.where(np.isfinite(calibrated), calibrated, shares[None, :])
    return TwoPhaseDesign(pi, n_burn / n_posts, prediction, alpha, tuple(combination),
                          tuple(tuple(float(fold_combination[k][q]) for k in range(FOLDS)) for q in range(n_questions)))


def _second_phase(p: np.ndarray, burn: np.ndarray, y_b: np.ndarray, budget: float, floor_share: float):
    """(pi, alpha, calibrated, combination) of ``two_phase_design`` from the burn-in labels ``y_b`` (NaN where
    unknown)."""
    n_posts, n_questions = p.shape
    n_burn = int(burn.sum())
    calibrated = np.empty_like(p)
    for q in range(n_questions):
        try:
            calibrated[:, q] = calibrate(p[:, q], p[burn, q], y_b[:, q])
        except ValueError as exc:
            raise ValueError(f"question {q}: {exc}") from None
    rest = ~burn
    second = budget - n_burn
    uncertainty = post_uncertainty(calibrated)
    active = inclusion_probabilities(uncertainty[rest], second, floor_share)
    uniform = second / rest.sum()
    # the active part's probability for the burn-in posts, had they been among the others
    root = np.sqrt(uncertainty[rest]).sum()
    scale = second * (1 - floor_share) / root if root > 0 else 0.0
    floor = second * floor_share / rest.sum() if root > 0 else uniform
    active_burn = np.minimum(1.0, scale * np.sqrt(uncertainty[burn]) + floor)
    errors = np.where(np.isfinite(y_b), (y_b - calibrated[burn]) ** 2, 0.0)
    errors = np.where(np.isfinite(errors), errors, 0.0).sum(axis=1)
    variance = [float(np.sum((1 / ((1 - a) * uniform + a * active_burn) - 1) * errors)) for a in MIXTURE_WEIGHTS]
    best = len(MIXTURE_WEIGHTS) - 1 - int(np.argmin(variance[::-1]))
    alpha = MIXTURE_WEIGHTS[best]
    pi = np.zeros(n_posts)
    pi[rest] = (1 - alpha) * uniform + alpha * active
    # a: the burn-in's share of the combination, from the model-based variances of the two estimates
    # (expected squared error q(1 - q)), so that it does not depend on any label of the second phase
    combination = []
    for q in range(n_questions):
        h = calibrated[rest, q]
        h = np.where(np.isfinite(h), h * (1 - h), MAX_UNCERTAINTY)
        v_burn = (n_posts / n_burn - 1) * h.sum()
        v_second = float(np.sum((1 / pi[rest] - 1) * h))
        combination.append(v_second / (v_burn + v_second) if v_burn + v_second > 0 else n_burn / budget)
    return pi, alpha, calibrated, combination
