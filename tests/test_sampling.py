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


def test_calibrate_keeps_a_calibrated_model_and_repairs_the_others():
    rng = np.random.default_rng(7)
    n_posts = 20_000
    s = rng.beta(0.15, 0.35, n_posts)
    y = (rng.random(n_posts) < s).astype(float)
    burn = rng.permutation(n_posts)[:150]
    logit = np.log(s / (1 - s))
    overconfident = 1 / (1 + np.exp(-3 * logit))
    noise = rng.beta(0.15, 0.35, n_posts)  # varies, says nothing
    fixed = sampling.calibrate(overconfident, overconfident[burn], y[burn])
    flat = sampling.calibrate(noise, noise[burn], y[burn])
    # a calibrated model's own probabilities are kept (recalibrating them on 150 labels only adds noise),
    # but for the 5 % of burn-ins that reject them by chance; a model that says nothing never passes
    kept, passed = 0, 0
    for _ in range(40):
        other = rng.permutation(n_posts)[:150]
        kept += np.allclose(sampling.calibrate(s, s[other], y[other]), np.clip(s, 1e-6, 1 - 1e-6))
        passed += np.allclose(sampling.calibrate(noise, noise[other], y[other]), np.clip(noise, 1e-6, 1 - 1e-6))
    assert kept >= 34 and passed == 0
    # the overconfident model's probabilities move back towards the calibrated ones
    assert np.mean((fixed - s) ** 2) < 0.7 * np.mean((overconfident - s) ** 2)
    # the noise collapses towards the burn-in share: the design becomes nearly uniform
    assert flat.std() < 0.3 * noise.std() and abs(flat.mean() - y.mean()) < 0.1
    pi = sampling.inclusion_probabilities(sampling.post_uncertainty(flat), 300, 0.3)
    assert pi.max() / pi.min() < 3
    assert np.isnan(sampling.calibrate(np.array([np.nan, 0.5]), s[burn], y[burn])[0])
    with pytest.raises(ValueError, match="burn-in"):
        sampling.calibrate(s, np.array([np.nan]), np.array([1.0]))


def test_burn_in_size_holds_enough_positives_of_the_rarest_question():
    p = np.c_[np.full(10_000, 0.4), np.full(10_000, 0.02)]
    assert sampling.burn_in_size(p[:, 0], 300, 0.1) == 30  # the share: 30 expected positives anyway
    assert sampling.burn_in_size(p, 300, 0.1) == 150  # 5 / 0.02 = 250 positives' worth, capped at half
    assert sampling.burn_in_size(p, 1000, 0.1) == 250
    assert sampling.burn_in_size(np.full(100, np.nan), 50, 0.1) == 5  # no probability: the share
    mask = sampling.uniform_sample(1000, 37, seed=3)
    assert mask.sum() == 37 and np.array_equal(mask, sampling.uniform_sample(1000, 37, seed=3))
    with pytest.raises(ValueError):
        sampling.uniform_sample(10, 11, seed=1)


def _two_phase(rng, n_posts, prevalence, model, n_burn, budget):
    s = rng.beta(prevalence * 0.5, (1 - prevalence) * 0.5, n_posts)
    y = (rng.random(n_posts) < s).astype(float)
    if model == "overconfident":
        p = 1 / (1 + np.exp(-3 * np.log(np.clip(s, 1e-9, 1) / np.clip(1 - s, 1e-9, 1))))
    elif model == "uninformative":
        p = rng.beta(prevalence * 0.5, (1 - prevalence) * 0.5, n_posts)
    else:
        p = s
    burn = sampling.uniform_sample(n_posts, n_burn, int(rng.integers(2**32)))
    design = sampling.two_phase_design(p, burn, y[burn], budget, 0.2, folds=rng.integers(0, sampling.FOLDS, n_posts))
    return s, y, p, burn, design


def test_two_phase_design_probabilities():
    rng = np.random.default_rng(11)
    n_posts, budget = 8_000, 300
    s = rng.beta(0.1, 0.4, (n_posts, 2))
    y = (rng.random((n_posts, 2)) < s).astype(float)
    burn = sampling.uniform_sample(n_posts, 60, seed=1)
    design = sampling.two_phase_design(s, burn, y[burn], budget, 0.2)
    assert np.all(design.pi[burn] == 0) and design.pi[~burn].sum() == pytest.approx(budget - 60)
    assert design.pi_burn_in == pytest.approx(60 / n_posts) and design.mixture in sampling.MIXTURE_WEIGHTS
    assert len(design.combination) == 2 and all(0 < a < 1 for a in design.combination)
    # a calibrated model: its probabilities kept, the second draw follows sqrt(u), the active design in full
    np.testing.assert_allclose(design.calibrated, np.clip(s, 1e-6, 1 - 1e-6))
    assert design.mixture == 1.0
    assert np.corrcoef(design.pi[~burn], np.sqrt(sampling.post_uncertainty(s)[~burn]))[0, 1] > 0.99
    with pytest.raises(ValueError, match="shape"):
        sampling.two_phase_design(s, burn, y[burn][:, 0], budget, 0.2)
    with pytest.raises(ValueError, match="smaller than the budget"):
        sampling.two_phase_design(s, burn, y[burn], 60, 0.2)


def test_two_phase_design_turns_uniform_for_a_model_that_says_nothing():
    rng = np.random.default_rng(5)
    spreads = []
    for _ in range(20):
        _, _, _, burn, design = _two_phase(rng, 20_000, 0.3, "uninformative", 30, 300)
        spreads.append(design.pi[~burn].max() / design.pi[~burn].min())
    assert np.median(spreads) < 1.5  # the uninformative probabilities varied over 5 orders of magnitude


def test_two_phase_estimate_is_unbiased_where_the_burn_in_chooses_the_design():
    """The issue's case (N 3,000, prevalence 0.05, a burn-in of 60 then 150): the second draw's
    probabilities depend on the burn-in's labels, and the estimate, conditional on the burn-in for the
    second draw, stays unbiased (600 repetitions, an over-confident model) and covers."""
    rng = np.random.default_rng(12)
    errors, covered = [], []
    for _ in range(600):
        _, y, p, burn, design = _two_phase(rng, 3_000, 0.05, "overconfident", 60, 210)
        drawn = rng.random(y.size) < design.pi
        est = estimators.two_phase_mean(p, y, burn, drawn, design.pi_burn_in, design.pi, design.combination[0],
                                        design.calibrated[:, 0], 0.95)
        errors.append(est["estimate"] - y.mean())
        covered.append(est["lo"] <= y.mean() <= est["hi"])
    errors = np.array(errors)
    assert abs(errors.mean()) < 3 * errors.std() / np.sqrt(errors.size)
    assert np.mean(covered) >= 0.9


def test_cross_fitted_combination_weights_remove_the_small_sample_bias():
    """The issue's cell (prevalence 0.02, 100 labels, a burn-in of 50, a calibrated model), N 2,000: the
    combination weight chosen from every burn-in label leans on them (a burn-in that caught no positive
    gets more weight): biased by more than 3 standard errors over 700 repetitions. Each fold's estimate
    weighed with the weight chosen without its labels is not."""
    rng = np.random.default_rng(31)
    crossfit, single = [], []
    for _ in range(700):
        n_posts = 2_000
        s = rng.beta(0.01, 0.49, n_posts)
        y = (rng.random(n_posts) < s).astype(float)
        folds = rng.integers(0, sampling.FOLDS, n_posts)
        burn = sampling.uniform_sample(n_posts, 50, int(rng.integers(2**32)))
        design = sampling.two_phase_design(s, burn, y[burn], 100, 0.2, folds)
        assert len(design.fold_combination[0]) == sampling.FOLDS
        drawn = rng.random(n_posts) < design.pi
        args = (s, y, burn, drawn, design.pi_burn_in, design.pi, design.combination[0], design.calibrated[:, 0], 0.95)
        crossfit.append(estimators.two_phase_mean(*args, folds, design.fold_combination[0])["estimate"] - y.mean())
        single.append(estimators.two_phase_mean(*args)["estimate"] - y.mean())
    for errors, biased in ((np.array(crossfit), False), (np.array(single), True)):
        standard_error = errors.std() / np.sqrt(errors.size)
        assert (abs(errors.mean()) > 3 * standard_error) == biased
    assert abs(np.mean(crossfit)) < 0.1 * np.std(crossfit)


def test_fold_of_is_a_stable_hash_of_the_post_id():
    folds = sampling.fold_of([f"p{i:05d}" for i in range(2000)])
    assert set(folds) == set(range(sampling.FOLDS)) and 0.45 < folds.mean() < 0.55
    assert list(sampling.fold_of(["p00001", "p00002"])) == list(folds[1:3])  # the same post, the same fold
