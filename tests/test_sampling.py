"""Active sampling (vidlabel.analyze.sampling) and, end to end, the active estimator on its samples."""

from __future__ import annotations

import numpy as np
import pytest

from vidlabel.analyze import estimators, sampling, stats


def test_post_uncertainty_combines_questions():
    p = np.array([[0.5, 0.1], [0.9, np.nan], [0.0, 1.0]])
    u = sampling.post_uncertainty(p)
    # mean of p(1 - p) over the questions; an unknown probability counts as 0.25
    assert u == pytest.approx([(0.25 + 0.09) / 2, (0.09 + 0.25) / 2, 0.0])
    assert sampling.post_uncertainty(np.array([0.2, np.nan])) == pytest.approx([0.16, 0.25])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        sampling.post_uncertainty(np.array([[0.5, 1.2]]))


def test_inclusion_probabilities_follow_sqrt_uncertainty_with_floor():
    rng = np.random.default_rng(3)
    u = rng.beta(0.3, 0.7, 10_000) * 0.25
    budget, floor = 300, 0.4
    pi = sampling.inclusion_probabilities(u, budget, floor)
    assert pi.sum() == pytest.approx(budget)
    assert pi.min() >= floor * budget / u.size * (1 - 1e-12)
    # no clipping here: exactly the mixture of sqrt(u) and the uniform floor
    expected = budget * ((1 - floor) * np.sqrt(u) / np.sqrt(u).sum() + floor / u.size)
    assert pi == pytest.approx(expected, rel=1e-12)
    assert np.corrcoef(pi, np.sqrt(u))[0, 1] > 0.999


def test_inclusion_probabilities_clip_at_one_and_keep_the_budget():
    u = np.r_[np.full(5, 0.25), np.full(995, 1e-6)]
    pi = sampling.inclusion_probabilities(u, 100, 0.1)
    assert pi.max() == 1.0 and np.all(pi[:5] == 1.0)
    assert pi.sum() == pytest.approx(100)
    # the rest keep their relative sizes: one value for the 995 equal posts
    assert np.ptp(pi[5:]) < 1e-12 and pi[5] == pytest.approx(95 / 995)
    # every post at 1 when the budget is the population
    assert np.all(sampling.inclusion_probabilities(u, 1000, 0.1) == pytest.approx(1.0))


def test_inclusion_probabilities_without_signal_is_uniform_and_bad_input_is_refused():
    assert sampling.inclusion_probabilities(np.zeros(50), 10, 0.0) == pytest.approx(np.full(50, 0.2))
    for u, budget, floor, match in [(np.ones(10), 0, 0.5, "budget"), (np.ones(10), 11, 0.5, "budget"),
                                    (np.ones(10), 5, 1.5, "floor_share"), (np.array([0.1, -0.1]), 1, 0.5, ">= 0"),
                                    (np.array([0.1, np.nan]), 1, 0.5, "finite"), (np.array([]), 1, 0.5, "no posts")]:
        with pytest.raises(ValueError, match=match):
            sampling.inclusion_probabilities(u, budget, floor)


def test_draw_is_independent_bernoulli_and_seeded():
    pi = np.r_[np.zeros(1000), np.ones(1000), np.full(200_000, 0.3)]
    mask = sampling.draw(pi, seed=5)
    assert mask.dtype == bool and not mask[:1000].any() and mask[1000:2000].all()
    share = mask[2000:].mean()
    assert abs(share - 0.3) < 5 * np.sqrt(0.3 * 0.7 / 200_000)
    assert np.array_equal(mask, sampling.draw(pi, seed=5))
    assert not np.array_equal(mask, sampling.draw(pi, seed=6))
    with pytest.raises(ValueError):
        sampling.draw(np.array([0.5, 1.5]), seed=1)


def test_active_design_small_coverage_and_gain():
    """A small version of benchmarks/active_sampling.py: a calibrated model, N = 5,000, 300 labels,
    300 repetitions. The active estimator covers and is narrower than uniform-sample PPI++ would be."""
    rng = np.random.default_rng(18)
    reps, n_posts, budget = 300, 5_000, 300
    s = rng.beta(0.15 * 0.5, 0.85 * 0.5, (reps, n_posts))
    truth = (rng.random((reps, n_posts)) < s).astype(float)
    pi = np.stack([sampling.inclusion_probabilities(sampling.post_uncertainty(row), budget, 0.5) for row in s])
    drawn = rng.random(pi.shape) < pi
    est = estimators.active_mean(s, truth, drawn, pi, 0.95)
    h = estimators.hajek_share(truth, pi, 0.95, drawn)
    ci = stats.corrected_interval(est["estimate"], est["se"], stats.sample_events(truth, s, drawn, pi), h["lo"],
                                  h["hi"], 0.95)
    target = truth.mean(axis=1)
    assert abs(np.mean(est["estimate"] - target)) < 3 * np.std(est["estimate"] - target) / np.sqrt(reps)  # unbiased
    assert np.mean((ci["lo"] <= target) & (target <= ci["hi"])) >= 0.92
    uniform = estimators.uniform_equivalent_se(s, truth, drawn, pi)
    assert np.mean(est["se"]) < 0.8 * np.mean(uniform)


def test_recalibrate_repairs_overconfidence_and_flattens_noise():
    rng = np.random.default_rng(7)
    n_posts = 20_000
    s = rng.beta(0.15, 0.35, n_posts)
    y = (rng.random(n_posts) < s).astype(float)
    burn = rng.permutation(n_posts)[:150]
    logit = np.log(s / (1 - s))
    overconfident = 1 / (1 + np.exp(-3 * logit))
    noise = rng.beta(0.15, 0.35, n_posts)  # varies, says nothing
    fixed = sampling.recalibrate(overconfident, overconfident[burn], y[burn])
    flat = sampling.recalibrate(noise, noise[burn], y[burn])
    # the overconfident model's probabilities move back towards the calibrated ones
    assert np.mean((fixed - s) ** 2) < 0.7 * np.mean((overconfident - s) ** 2)
    # the noise collapses towards the burn-in share: the design becomes nearly uniform
    assert flat.std() < 0.3 * noise.std() and abs(flat.mean() - y.mean()) < 0.1
    pi = sampling.inclusion_probabilities(sampling.post_uncertainty(flat), 300, 0.3)
    assert pi.max() / pi.min() < 3
    assert np.isnan(sampling.recalibrate(np.array([np.nan, 0.5]), s[burn], y[burn])[0])
    with pytest.raises(ValueError, match="burn-in"):
        sampling.recalibrate(s, np.array([np.nan]), np.array([1.0]))


def test_union_inclusion():
    assert sampling.union_inclusion(0.1, np.array([0.0, 0.5, 1.0])) == pytest.approx([0.1, 0.55, 1.0])
    assert sampling.union_inclusion(np.array([0.2, 0.3])) == pytest.approx([0.2, 0.3])


def test_burn_in_design_probabilities():
    rng = np.random.default_rng(11)
    n_posts, budget = 8_000, 300
    s = rng.beta(0.1, 0.4, (n_posts, 2))
    y = (rng.random((n_posts, 2)) < s).astype(float)
    burn = np.zeros(n_posts, bool)
    burn[rng.permutation(n_posts)[:60]] = True
    pi, pi_active = sampling.burn_in_design(s, burn, y[burn], budget, 0.2)
    assert np.all(pi_active[burn] == 0) and pi_active[~burn].sum() == pytest.approx(budget - 60)
    assert pi[~burn] == pytest.approx(60 / n_posts + (1 - 60 / n_posts) * pi_active[~burn])
    assert np.all((pi >= 60 / n_posts) & (pi <= 1))
    # the other posts follow sqrt(u) of the recalibrated probabilities
    full = np.c_[sampling.recalibrate(s[:, 0], s[burn, 0], y[burn, 0]),
                 sampling.recalibrate(s[:, 1], s[burn, 1], y[burn, 1])]
    u_full = sampling.post_uncertainty(full)
    assert np.corrcoef(pi[~burn], np.sqrt(u_full[~burn]))[0, 1] > 0.99
    assert np.all(np.isfinite(pi[burn]))
    with pytest.raises(ValueError, match="shape"):
        sampling.burn_in_design(s, burn, y[burn][:, 0], budget, 0.2)
    with pytest.raises(ValueError, match="smaller than the budget"):
        sampling.burn_in_design(s, burn, y[burn], 60, 0.2)


def test_burn_in_design_estimate_is_unbiased_at_low_prevalence():
    """The burn-in posts' weights come from leave-one-out fits: no downward pull from the few
    positives a small burn-in holds (300 repetitions, prevalence ~5 %, an over-confident model)."""
    rng = np.random.default_rng(12)
    reps, n_posts, budget = 300, 4_000, 200
    errors = []
    for _ in range(reps):
        s = rng.beta(0.05 * 0.5, 0.95 * 0.5, n_posts)
        y = (rng.random(n_posts) < s).astype(float)
        p = 1 / (1 + np.exp(-3 * np.log(np.clip(s, 1e-9, 1) / np.clip(1 - s, 1e-9, 1))))
        burn = np.zeros(n_posts, bool)
        burn[rng.permutation(n_posts)[:40]] = True
        pi, pi_active = sampling.burn_in_design(p, burn, y[burn], budget, 0.2)
        drawn = burn | (rng.random(n_posts) < pi_active)
        est = estimators.active_mean(sampling.recalibrate(p, p[burn], y[burn]), y, drawn, pi, 0.95)
        errors.append(est["estimate"] - y.mean())
    assert abs(np.mean(errors)) < 3 * np.std(errors) / np.sqrt(reps)
