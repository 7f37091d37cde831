"""Statistics: agreement metrics, Wilson/bootstrap intervals, and the PPI++ bias correction
(DuckDB SQL moments against ppi_py, and coverage over simulated datasets)."""

from __future__ import annotations

import math

import numpy as np
import ppi_py
import pyarrow as pa
import pytest
from ppi_py.ppi import _calc_lam_glm  # private: the lambda ppi_py tunes internally

from vidlabel.analyze import estimators, stats
from vidlabel.analyze.prevalence import ppi_moments_from_items

# ------------------------------------------------------------------------------------------
# Agreement against hand-computed confusion matrices

def test_confusion_metrics_hand_computed():
    # 40 TP, 10 FP, 20 FN, 30 TN (n = 100)
    m = stats.confusion_metrics(40, 10, 20, 30)
    assert m["accuracy"] == pytest.approx(0.70)
    assert m["precision"] == pytest.approx(0.80)
    assert m["recall"] == pytest.approx(40 / 60)
    assert m["f1"] == pytest.approx(2 * 0.8 * (2 / 3) / (0.8 + 2 / 3))
    # observed agreement 0.7; expected (50*60 + 50*40) / 100^2 = 0.5; kappa = 0.2 / 0.5
    assert m["kappa"] == pytest.approx(0.4)


def test_confusion_metrics_seed000_like_and_degenerate():
    # Precision 0.90, recall 0.69 as in seed 000: 69 TP, 31 FN, and FP so that 69/(69+FP) ~ 0.9
    m = stats.confusion_metrics(69, 8, 31, 42)
    assert m["precision"] == pytest.approx(69 / 77)
    assert m["recall"] == pytest.approx(0.69)
    # kappa by the textbook formula
    n = 150
    po = (69 + 42) / n
    pe = (77 / n) * (100 / n) + (73 / n) * (50 / n)
    assert m["kappa"] == pytest.approx((po - pe) / (1 - pe))
    # A model that never says yes: precision undefined, F1 = 0, recall 0
    d = stats.confusion_metrics(0, 0, 10, 20)
    assert math.isnan(d["precision"]) and d["recall"] == 0 and d["f1"] == 0
    # Both raters always "no": kappa undefined (expected agreement 1)
    assert math.isnan(stats.confusion_metrics(0, 0, 0, 30)["kappa"])
    # Vectorised form gives the same numbers as the scalar form
    vec = stats.confusion_metrics(np.array([40, 69]), np.array([10, 8]), np.array([20, 31]), np.array([30, 42]))
    assert vec["kappa"][0] == pytest.approx(0.4) and vec["f1"][1] == pytest.approx(m["f1"])


def _wilson_by_hand(k, n, z):
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return centre - half, centre + half


def test_wilson_interval_matches_formula_and_confidence():
    z95 = 1.959963984540054
    assert stats.z_value(0.95) == pytest.approx(z95, rel=1e-12)
    for k, n in [(40, 50), (0, 12), (12, 12), (69, 100)]:
        assert stats.wilson_interval(k, n, 0.95) == pytest.approx(_wilson_by_hand(k, n, z95), abs=1e-12)
    lo90, hi90 = stats.wilson_interval(40, 50, 0.90)
    lo95, hi95 = stats.wilson_interval(40, 50, 0.95)
    assert lo95 < lo90 < 0.8 < hi90 < hi95
    assert all(math.isnan(x) for x in stats.wilson_interval(0, 0, 0.95))


def test_agreement_intervals():
    a = stats.agreement(40, 10, 20, 30, 0.95, bootstrap_samples=2000, seed=1)
    assert a["n"] == 100
    assert (a["precision_lo"], a["precision_hi"]) == pytest.approx(_wilson_by_hand(40, 50, stats.z_value(0.95)))
    assert (a["recall_lo"], a["recall_hi"]) == pytest.approx(_wilson_by_hand(40, 60, stats.z_value(0.95)))
    for metric in ("f1", "kappa"):
        assert a[f"{metric}_lo"] < a[metric] < a[f"{metric}_hi"]
    # F1's bootstrap interval is roughly the normal one: sd of F1 at n=100 here is ~0.05
    assert 0.12 < a["f1_hi"] - a["f1_lo"] < 0.30
    # Reproducible, and four times the data roughly halves the width
    assert stats.agreement(40, 10, 20, 30, 0.95, 2000, seed=1) == a
    big = stats.agreement(160, 40, 80, 120, 0.95, 2000, seed=1)
    ratio = (big["kappa_hi"] - big["kappa_lo"]) / (a["kappa_hi"] - a["kappa_lo"])
    assert 0.35 < ratio < 0.65
    empty = stats.agreement(0, 0, 0, 0, 0.95, 200)
    assert empty["n"] == 0 and math.isnan(empty["kappa"]) and math.isnan(empty["accuracy_lo"])


# ------------------------------------------------------------------------------------------
# PPI++: DuckDB moments against ppi_py

def _items(datasets):
    """ppi_items table from [(name, y_labelled, yhat_labelled, yhat_unlabelled, r_labelled or None)].

    The population is labelled + unlabelled items, as in the aggregate stage."""
    question, yhat, y, r = [], [], [], []
    for name, y_l, yhat_l, yhat_u, r_l in datasets:
        question += [name] * (len(y_l) + len(yhat_u))
        yhat += list(map(float, yhat_l)) + list(map(float, yhat_u))
        y += list(map(float, y_l)) + [None] * len(yhat_u)
        r += (list(map(float, r_l)) if r_l is not None else [1.0] * len(y_l)) + [None] * len(yhat_u)
    return pa.table({"question": question, "yhat": pa.array(yhat, pa.float64()),
                     "y": pa.array(y, pa.float64()), "r": pa.array(r, pa.float64())})


def _dataset(rng, n_all, n_lab, prevalence, recall, fpr, weighted=False, soft=False):
    truth = rng.random(n_all) < prevalence
    yhat = np.where(truth, rng.random(n_all) < recall, rng.random(n_all) < fpr).astype(float)
    if soft:  # imputed predictions for failed requests, as aggregate does: a constant in (0, 1)
        yhat[rng.random(n_all) < 0.05] = 0.37
    lab = rng.choice(n_all, n_lab, replace=False)
    r = rng.uniform(1, 20, n_lab) if weighted else None
    return truth[lab].astype(float), yhat[lab], yhat, r


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("soft", [False, True])
def test_sql_moments_match_ppi_py(weighted, soft):
    rng = np.random.default_rng(7 + 2 * weighted + soft)
    cases = {}
    for name, (n_all, n_lab, prev, rec, fpr) in {
        "balanced": (5000, 150, 0.5, 0.69, 0.08),
        "rare": (3000, 200, 0.08, 0.9, 0.02),
        "all_labelled": (300, 300, 0.4, 0.8, 0.1),
        "uninformative": (2000, 300, 0.5, 0.5, 0.5),
    }.items():
        cases[name] = _dataset(rng, n_all, n_lab, prev, rec, fpr, weighted=weighted, soft=soft)
    # The population passed to SQL is the labelled items plus the rest; ppi_py gets the whole
    # population as Yhat_unlabeled, which is how aggregate calls it.
    # (_items adds the labelled items to the population itself)
    sql_in = [(name, y, yhat_l, _remove_once(yhat_all, yhat_l), r)
              for name, (y, yhat_l, yhat_all, r) in cases.items()]
    moments = ppi_moments_from_items(_items(sql_in))
    z = stats.z_value(0.95)
    for name, (y, yhat_l, yhat_all, r) in cases.items():
        m = moments[name]
        assert m["big_n"] == len(yhat_all) and m["n"] == len(y)
        w = None if r is None else np.asarray(r)
        # lambda as ppi_py tunes it
        wn = np.ones(len(y)) if w is None else w / w.sum() * len(y)
        theta1 = yhat_all.mean() + (wn * (y - yhat_l)).mean()
        lam_ref = _calc_lam_glm(wn[:, None] * (y - theta1)[:, None], wn[:, None] * (yhat_l - theta1)[:, None],
                                (yhat_all - theta1)[:, None], np.eye(1), clip=True)
        assert m["theta1"] == pytest.approx(theta1, abs=1e-9)
        assert m["lambda"] == pytest.approx(float(lam_ref), abs=1e-9)
        lam = m["lambda"]
        # the moments, in ppi_py's own expressions
        assert m["imputed_var"] == pytest.approx(((lam * yhat_all).std() / np.sqrt(len(yhat_all))) ** 2, abs=1e-12)
        assert m["rectifier_var"] == pytest.approx(((wn * (y - lam * yhat_l)).std() / np.sqrt(len(y))) ** 2,
                                                   abs=1e-12)
        # estimate and interval from ppi_py's public API, at the same confidence
        est = float(np.ravel(ppi_py.ppi_mean_pointestimate(y, yhat_l, yhat_all, w=w))[0])
        lo, hi = (float(np.ravel(v)[0]) for v in ppi_py.ppi_mean_ci(y, yhat_l, yhat_all, alpha=0.05, w=w))
        assert abs(m["estimate"] - est) < 1e-9
        sql_lo, sql_hi = stats.ppi_interval(m["estimate"], m["imputed_var"], m["rectifier_var"], 0.95)
        assert abs(sql_lo - lo) < 1e-9 and abs(sql_hi - hi) < 1e-9
        assert (hi - lo) / 2 == pytest.approx(z * math.sqrt(m["imputed_var"] + m["rectifier_var"]), abs=1e-9)
        # stats.ppi_reference is the wrapper aggregate uses for its cross-check
        ref = stats.ppi_reference(y, yhat_l, yhat_all, 0.95, weights=w)
        assert abs(ref["lo"] - lo) < 1e-12 and abs(ref["estimate"] - est) < 1e-12
    # Power tuning does something: an informative model gets a large lambda, a useless one ~0
    assert moments["balanced"]["lambda"] > 0.4
    assert moments["uninformative"]["lambda"] < 0.25
    if not weighted:
        # With every post labelled (equal weights) the estimate is the human mean whatever lambda is
        assert moments["all_labelled"]["estimate"] == pytest.approx(cases["all_labelled"][0].mean(), abs=1e-12)


def _remove_once(population: np.ndarray, labelled: np.ndarray) -> np.ndarray:
    """The population minus one occurrence of each labelled value (values are 0, 1 or one constant)."""
    rest = list(population)
    for v in labelled:
        rest.remove(v)
    return np.array(rest)


def test_constant_predictions_fall_back_to_human_only():
    # A model that answers "yes" to everything: no variance, lambda = 0, estimate = human mean.
    y = np.array([1, 0, 0, 1, 0, 0, 0, 1, 0, 0], float)
    m = ppi_moments_from_items(_items([("q", y, np.ones(10), np.ones(500), None)]))["q"]
    assert m["lambda"] == 0.0
    assert m["estimate"] == pytest.approx(0.3)
    assert m["imputed_var"] == 0.0
    assert m["rectifier_var"] == pytest.approx(y.var() / 10)


# ------------------------------------------------------------------------------------------
# Simulation: coverage and efficiency

N_POSTS, N_HUMAN, N_SIM, PREVALENCE = 5000, 150, 600, 0.53
PRECISION, RECALL = 0.90, 0.69  # seed 000's Qwen2.5-VL-72B against humans


def _simulate(rng, n_sim, weighted=False, skew=6.0):
    """n_sim datasets: truth, a biased model with the chosen precision/recall, a human subset.

    Uniform case: a simple random sample of N_HUMAN posts. Weighted case: Poisson sampling with
    probabilities that depend on the model's answer (posts the model calls "yes" are ``skew`` times
    likelier to be labelled), about N_HUMAN labels per dataset.
    """
    fpr = PREVALENCE * RECALL * (1 / PRECISION - 1) / (1 - PREVALENCE)
    truth = rng.random((n_sim, N_POSTS)) < PREVALENCE
    yhat = np.where(truth, rng.random((n_sim, N_POSTS)) < RECALL, rng.random((n_sim, N_POSTS)) < fpr)
    if weighted:
        prob = np.where(yhat, skew, 1.0)
        prob = prob / prob.mean(axis=1, keepdims=True) * N_HUMAN / N_POSTS
        labelled = rng.random((n_sim, N_POSTS)) < prob
    else:
        prob = np.full((n_sim, N_POSTS), N_HUMAN / N_POSTS)
        order = rng.random((n_sim, N_POSTS)).argsort(axis=1)[:, :N_HUMAN]
        labelled = np.zeros((n_sim, N_POSTS), bool)
        np.put_along_axis(labelled, order, True, axis=1)
    d = np.repeat(np.arange(n_sim), N_POSTS)
    items = pa.table({
        "question": pa.array(d.astype(str)),
        "yhat": pa.array(yhat.ravel().astype(float)),
        "y": pa.array(np.where(labelled, truth, np.nan).ravel(), from_pandas=True),
        "r": pa.array(np.where(labelled, 1 / prob, np.nan).ravel(), from_pandas=True),
    })
    return truth, yhat, labelled, prob, items


def test_simulation_coverage_and_width():
    rng = np.random.default_rng(2025)
    truth, yhat, labelled, _, items = _simulate(rng, N_SIM)
    moments = ppi_moments_from_items(items)  # all datasets in one SQL query
    target = truth.mean(axis=1)  # the share humans would find if they labelled every post
    covered, naive_covered, width_ppi, width_human = [], [], [], []
    for i in range(N_SIM):
        m = moments[str(i)]
        assert m["n"] == N_HUMAN and m["big_n"] == N_POSTS
        lo, hi = stats.ppi_interval(m["estimate"], m["imputed_var"], m["rectifier_var"], 0.95)
        covered.append(lo <= target[i] <= hi)
        width_ppi.append(hi - lo)
        k = int(truth[i][labelled[i]].sum())
        h_lo, h_hi = stats.wilson_interval(k, N_HUMAN, 0.95)
        width_human.append(h_hi - h_lo)
        m_lo, m_hi = stats.wilson_interval(int(yhat[i].sum()), N_POSTS, 0.95)
        naive_covered.append(m_lo <= target[i] <= m_hi)
    coverage = np.mean(covered)
    assert coverage >= 0.93, f"corrected 95% CI covered the truth in only {coverage:.1%}"
    assert np.mean(naive_covered) < 0.05, "the naive model share should miss the truth"
    width_ppi, width_human = np.array(width_ppi), np.array(width_human)
    assert width_ppi.mean() < 0.95 * width_human.mean()
    assert np.mean(width_ppi < width_human) > 0.9
    # And the model share is biased as designed: precision 0.9, recall 0.69 -> ~0.41 vs 0.53
    assert abs(yhat.mean() - PREVALENCE * RECALL / PRECISION) < 0.01


def test_simulation_inverse_probability_weights():
    """Labels sampled 6x more often among the model's "yes": weights restore coverage; ignoring
    them (r = 1) gives a biased estimate that misses the truth much more often."""
    rng = np.random.default_rng(11)
    n_sim = 400
    truth, yhat, labelled, prob, items = _simulate(rng, n_sim, weighted=True)
    target = truth.mean(axis=1)
    weighted = ppi_moments_from_items(items)
    unweighted = ppi_moments_from_items(
        items.set_column(3, "r", pa.array(np.where(labelled, 1.0, np.nan).ravel(), from_pandas=True)))

    def coverage(moments):
        hits = []
        for i in range(n_sim):
            m = moments[str(i)]
            lo, hi = stats.ppi_interval(m["estimate"], m["imputed_var"], m["rectifier_var"], 0.95)
            hits.append(lo <= target[i] <= hi)
        return np.mean(hits)

    assert coverage(weighted) >= 0.92
    assert coverage(unweighted) < 0.70
    # The weighted human-only share (Hajek) and the active estimator cover the truth as well, and
    # the active estimator is at least as narrow as the human-only share
    y, f = truth.astype(float), yhat.astype(float)
    h = estimators.hajek_share(y, prob, 0.95, labelled)
    a = estimators.active_mean(f, y, labelled, prob, 0.95)
    ci = stats.corrected_interval(a["estimate"], a["se"], stats.sample_events(y, f, labelled, prob), h["lo"], h["hi"],
                                  0.95)
    assert np.mean((h["lo"] <= target) & (target <= h["hi"])) >= 0.92
    assert np.mean((ci["lo"] <= target) & (target <= ci["hi"])) >= 0.92
    # with its intercept the active estimator is at least as precise as the Hajek share (the model
    # helps a little here: precision 0.9, recall 0.69); without it, it would be less precise
    assert np.mean(a["se"]) < np.mean(h["se"])
    plain = estimators.active_mean(f, y, labelled, prob, 0.95, intercept=False)
    assert np.mean(plain["se"]) > np.mean(h["se"])


# ------------------------------------------------------------------------------------------
# Degenerate inputs and the reported intervals (issue: intervals you can publish)

def test_wilson_bounds_exact_at_the_edges():
    n = np.arange(1, 5001)
    lo0, hi0 = stats.wilson_bounds(np.zeros(n.size), n, 0.95)
    lo1, hi1 = stats.wilson_bounds(n, n, 0.95)
    assert np.all(lo0 == 0.0) and np.all(hi0 > 0) and np.all(hi1 == 1.0) and np.all(lo1 < 1)
    k = np.arange(0, 5001)
    lo, hi = stats.wilson_bounds(k, 5000, 0.95)
    assert np.all((0 <= lo) & (lo <= k / 5000) & (k / 5000 <= hi) & (hi <= 1))
    assert stats.wilson_interval(0, 3, 0.95)[0] == 0.0  # was 5.6e-17
    # a tied label counts 0.5: fractional successes sit between their neighbours
    two, half, three = (stats.wilson_interval(k, 10, 0.95) for k in (2, 2.5, 3))
    assert two < half < three
    assert all(math.isnan(x) for x in stats.wilson_interval(0, 0, 0.95))


def test_bootstrap_fills_empty_cells_and_refuses_one_class():
    # FP cell empty: resampling the observed shares would never fill it (kappa 1.00-1.00 style)
    a = stats.agreement(12, 0, 3, 15, 0.95, 2000, seed=3)
    assert a["kappa_lo"] < a["kappa"] and a["kappa_hi"] - a["kappa_lo"] > 0.1
    assert a["f1_hi"] - a["f1_lo"] > 0.05 and "smoothed" in a["note"]
    # every human label "no": kappa and F1 of the sample say nothing about the population
    b = stats.agreement(0, 4, 0, 26, 0.95, 2000, seed=3)
    assert math.isnan(b["kappa_lo"]) and math.isnan(b["f1_hi"]) and "n/a" in b["note"]
    assert b["accuracy_lo"] < b["accuracy"] < b["accuracy_hi"]
    assert stats.agreement(40, 10, 20, 30, 0.95, 500)["note"] == ""
    # the vectorised form gives each dataset its own interval
    boot = stats.bootstrap_agreement(np.array([40, 12]), np.array([10, 0]), np.array([20, 3]), np.array([30, 15]),
                                     0.95, 2000, seed=3)
    assert boot["kappa"][0][1] - boot["kappa"][0][0] > 0 and boot["kappa"][1][1] - boot["kappa"][1][0] > 0.1


def test_hajek_share_formula_census_and_zero():
    rng = np.random.default_rng(4)
    y = (rng.random(200) < 0.3).astype(float)
    pi = rng.uniform(0.05, 0.9, 200)
    h = estimators.hajek_share(y, pi, 0.95)
    w = 1 / pi
    mean = (w * y).sum() / w.sum()
    se = math.sqrt((w * w * (1 - pi) * (y - mean) ** 2).sum()) / w.sum()
    assert h["estimate"] == pytest.approx(mean) and h["se"] == pytest.approx(se)
    n_eff = mean * (1 - mean) / se**2
    assert h["n_eff"] == pytest.approx(n_eff)
    assert (h["lo"], h["hi"]) == pytest.approx(stats.wilson_interval(mean * n_eff, n_eff, 0.95))
    census = estimators.hajek_share(y, np.ones(200), 0.95)
    assert census["lo"] == census["hi"] == pytest.approx(y.mean())
    zero = estimators.hajek_share(np.zeros(50), pi[:50], 0.95)
    assert zero["estimate"] == 0 and zero["lo"] == 0 and 0 < zero["hi"] < 0.2  # Kish size, not a point


def _active_direct(f, y, xi, pi, lam, mu):
    return np.array([lam * fi + mu + ((yi - lam * fi - mu) / p if x else 0.0) for fi, yi, x, p in zip(f, y, xi, pi)])


def test_active_mean_matches_a_direct_implementation():
    rng = np.random.default_rng(21)
    n_posts = 3000
    s = rng.beta(0.4, 1.2, n_posts)
    y = (rng.random(n_posts) < s).astype(float)
    s = 0.5 * s + 0.5 * rng.beta(0.4, 1.2, n_posts)  # a prediction that knows half of it: lambda inside (0, 1)
    pi = np.clip(0.02 + 0.2 * np.sqrt(s * (1 - s)), 0, 1)
    xi = rng.random(n_posts) < pi
    y_seen = np.where(xi, y, np.nan)
    # fixed lambda, no intercept: Zrnic & Candes' estimator term by term
    fixed = estimators.active_mean(s, y_seen, xi, pi, 0.95, lam=0.7, intercept=False)
    z = _active_direct(s, y, xi, pi, 0.7, 0.0)
    assert fixed["estimate"] == pytest.approx(z.mean(), abs=1e-12)
    assert fixed["se"] == pytest.approx(z.std(ddof=1) / math.sqrt(n_posts), rel=1e-10)
    half = stats.z_value(0.95) * fixed["se"]
    assert (fixed["lo"], fixed["hi"]) == pytest.approx((z.mean() - half, z.mean() + half))
    # plug-in: the (lambda, mu) of least squares of -a on the control variates
    plain = estimators.active_mean(s, y_seen, xi, pi, 0.95, crossfit=False)
    a, b1, b0 = y * xi / pi, s * (1 - xi / pi), 1 - xi / pi
    design = np.c_[np.ones(n_posts), b1, b0]
    coef = np.linalg.lstsq(design, -a, rcond=None)[0]
    assert 0 < coef[1] < 1  # inside the clipping range here
    assert plain["lambda"] == pytest.approx(coef[1], rel=1e-8) and plain["mu"] == pytest.approx(coef[2], abs=1e-8)
    z = _active_direct(s, y, xi, pi, coef[1], coef[2])
    assert plain["estimate"] == pytest.approx(z.mean(), abs=1e-10)
    assert plain["se"] <= fixed["se"] + 1e-12  # the tuned pair minimises the variance
    # cross-fitted (the default): each post's z with the least squares of every other post
    tuned = estimators.active_mean(s, y_seen, xi, pi, 0.95)
    assert tuned["lambda"] == plain["lambda"] and tuned["mu"] == plain["mu"]  # the full fit is what is quoted
    others = np.ones(n_posts, bool)
    z_loo = np.empty(n_posts)
    for i in range(n_posts):
        others[i] = False
        lam_i, mu_i = np.linalg.lstsq(design[others], -a[others], rcond=None)[0][1:]
        if not 0 <= lam_i <= 1:  # clipped, mu refitted with lambda fixed
            lam_i = min(1.0, max(0.0, lam_i))
            mu_i = np.linalg.lstsq(design[others][:, [0, 2]], -a[others] - lam_i * b1[others], rcond=None)[0][1]
        others[i] = True
        z_loo[i] = _active_direct(s[i:i + 1], y[i:i + 1], xi[i:i + 1], pi[i:i + 1], lam_i, mu_i)[0]
    assert tuned["estimate"] == pytest.approx(z_loo.mean(), abs=1e-10)
    assert tuned["se"] == pytest.approx(z_loo.std(ddof=1) / math.sqrt(n_posts), rel=1e-8)
    assert tuned["estimate"] != pytest.approx(plain["estimate"], abs=1e-8)
    # batched rows give the per-row answers
    batch = estimators.active_mean(np.stack([s, s[::-1]]), np.stack([y_seen, y_seen[::-1]]), np.stack([xi, xi[::-1]]),
                              np.stack([pi, pi[::-1]]), 0.95)
    assert batch["estimate"][0] == pytest.approx(tuned["estimate"])
    # a constant prediction: lambda 0, still a valid (Hajek-like) estimate
    flat = estimators.active_mean(np.full(n_posts, 0.3), y_seen, xi, pi, 0.95)
    assert flat["lambda"] == 0 and abs(flat["estimate"] - y.mean()) < 5 * flat["se"]


def test_sample_events_and_corrected_interval():
    y = np.array([1, 1, 0, 0, 0, 0], float)
    f = np.array([1, 0.5, 0, 0.2, 0, 1], float)
    assert stats.sample_events(y, f) == pytest.approx(min(2, 4, 0.5 + 0.2 + 1))
    pi = np.array([0.5, 0.5, 0.5, 0.5, 0.05, 0.05])
    w = 1 / pi
    # the effective numbers (sum v)^2 / sum v^2 of positives, negatives and disagreements join the minimum:
    # here the heavy disagreement (weight 20, f = 1 for a "no") leaves about one event
    effective = [v.sum() ** 2 / (v * v).sum() for v in (w * y, w * (1 - y), w * np.abs(y - f))]
    assert stats.sample_events(y, f, pi=pi) == pytest.approx(min(1.7, *effective))
    assert min(effective) == pytest.approx(21.4**2 / (1 + 0.16 + 400))
    # enough events: t quantile, no hull
    ci = stats.corrected_interval(0.3, 0.02, 25.0, 0.1, 0.6, 0.95)
    from scipy.stats import t as student_t
    q = student_t.ppf(0.975, 24)
    assert not ci["few"] and (ci["lo"], ci["hi"]) == pytest.approx((0.3 - q * 0.02, 0.3 + q * 0.02))
    # few events: the hull with the human-only interval
    ci = stats.corrected_interval(0.01, 0.0, 3.0, 0.0, 0.12, 0.95)
    assert ci["few"] and (ci["lo"], ci["hi"]) == (0.0, 0.12)
    # clipped to [0, 1]
    ci = stats.corrected_interval(0.99, 0.02, 40.0, 0.9, 1.0, 0.95)
    assert ci["hi"] == 1.0


def _uniform_reported(rng, reps, n_posts, n, prevalence):
    """Reported PPI++ intervals (SQL moments + stats.corrected_interval) on simulated uniform samples."""
    s = rng.beta(prevalence, 1 - prevalence, (reps, n_posts))
    truth = (rng.random((reps, n_posts)) < s).astype(float)
    f = (s > 0.5).astype(float)
    order = rng.random((reps, n_posts)).argsort(axis=1)[:, :n]
    labelled = np.zeros((reps, n_posts), bool)
    np.put_along_axis(labelled, order, True, axis=1)
    items = pa.table({"question": pa.array(np.repeat(np.arange(reps), n_posts).astype(str)),
                      "yhat": pa.array(f.ravel()),
                      "y": pa.array(np.where(labelled, truth, np.nan).ravel(), from_pandas=True),
                      "r": pa.array(np.where(labelled, 1.0, np.nan).ravel(), from_pandas=True)})
    moments = ppi_moments_from_items(items)
    m = {k: np.array([moments[str(i)][k] for i in range(reps)]) for k in ("estimate", "imputed_var", "rectifier_var")}
    k = np.where(labelled, truth, 0).sum(axis=1)
    human_lo, human_hi = stats.wilson_bounds(k, n, 0.95)
    ci = stats.corrected_interval(m["estimate"], np.sqrt(m["imputed_var"] + m["rectifier_var"]),
                                  stats.sample_events(truth, f, labelled), human_lo, human_hi, 0.95)
    return truth.mean(axis=1), ci, (human_lo, human_hi)


@pytest.mark.parametrize("prevalence", [0.01, 0.05, 0.3])
def test_small_coverage_check_of_the_reported_intervals(prevalence):
    """A small version of benchmarks/interval_coverage.py (N = 3,000, 150 labels, 300 repetitions): the
    reported corrected interval and the Wilson human-only interval cover, and no reported interval
    has zero width (at prevalence 0.01 a fifth of the samples have no positive at all)."""
    rng = np.random.default_rng(int(prevalence * 1000))
    target, ci, (h_lo, h_hi) = _uniform_reported(rng, 300, 3_000, 150, prevalence)
    assert np.mean((ci["lo"] <= target) & (target <= ci["hi"])) >= 0.92
    assert np.mean((h_lo <= target) & (target <= h_hi)) >= 0.92
    assert np.all(ci["hi"] - ci["lo"] > 0) and np.all(h_hi - h_lo > 0)


# ------------------------------------------------------------------------------------------
# Agreement under the design (issue: human labels you can rely on)

def _two_models(rng, n_posts, prevalence=0.3, mu=1.0):
    """Two equally good models: each reports P(yes) from its own independent signal of the truth."""
    truth = rng.random(n_posts) < prevalence
    prior = np.log(prevalence / (1 - prevalence))
    p = [1 / (1 + np.exp(-(prior + 2 * mu * rng.normal(mu * (2 * truth - 1), 1.0)))) for _ in range(2)]
    return truth, p[0], p[1]


def _cells(truth, p):
    says = p > 0.5
    return np.where(truth, np.where(says, estimators.TP, estimators.FN), np.where(says, estimators.FP, estimators.TN))


def test_weighted_agreement_is_unbiased_where_the_sample_follows_one_model():
    """The sample is drawn where model A is unsure (active design, floor 0.4): counted plainly, A is
    scored on its hardest posts and looks worse than the equally good B; weighted by the design, the
    difference is ~0 and each model's F1 interval covers the population F1 (250 repetitions)."""
    from vidlabel.analyze import sampling

    rng = np.random.default_rng(31)
    plain, weighted, covered = [], [], []
    for rep in range(250):
        truth, p_a, p_b = _two_models(rng, 5_000)
        pi = sampling.inclusion_probabilities(sampling.post_uncertainty(p_a), 300, 0.4)
        drawn = rng.random(pi.size) < pi
        design = estimators.poisson_design(pi[drawn])
        f1 = {}
        for name, p in (("A", p_a), ("B", p_b)):
            c = _cells(truth, p)
            population = stats.confusion_metrics(*np.bincount(c, minlength=4))["f1"]
            counted = stats.confusion_metrics(*np.bincount(c[drawn], minlength=4))["f1"]
            w = estimators.weighted_agreement(c[drawn], design, 0.95, 300, seed=rep)
            f1[name] = (population, counted, w["f1"])
            covered.append(w["f1_lo"] <= population <= w["f1_hi"])
        plain.append((f1["A"][1] - f1["B"][1]) - (f1["A"][0] - f1["B"][0]))
        weighted.append((f1["A"][2] - f1["B"][2]) - (f1["A"][0] - f1["B"][0]))
    plain, weighted = np.array(plain), np.array(weighted)
    assert plain.mean() < -0.02 and plain.mean() < -4 * plain.std() / np.sqrt(plain.size)
    assert abs(weighted.mean()) < 3 * weighted.std() / np.sqrt(weighted.size) and abs(weighted.mean()) < 0.01
    assert np.mean(covered) >= 0.9


def test_replicate_weights_give_the_design_variance():
    rng = np.random.default_rng(4)
    pi = rng.uniform(0.05, 0.9, 400)
    y = rng.random(400)
    replicates = estimators.replicate_weights(estimators.poisson_design(pi), 20_000, rng)
    assert replicates.min() >= 0 and replicates.mean(axis=0) == pytest.approx(1 / pi, rel=0.05)
    # the variance of a weighted total across replicates: Horvitz-Thompson's estimate for Poisson sampling
    assert (replicates @ y).var() == pytest.approx(np.sum((1 - pi) * (y / pi) ** 2), rel=0.05)
    # a simple random sample: resampling with replacement, multinomial counts
    srs = estimators.replicate_weights(estimators.Design(np.ones(50), np.zeros(50), np.ones(50), np.zeros(50)), 20_000,
                                       rng)
    assert np.all(srs.sum(axis=1) == 50) and (srs @ y[:50]).var() == pytest.approx(50 * y[:50].var(), rel=0.05)
    # a post drawn with pi = 1, or counted exactly, never varies
    exact = estimators.Design(np.zeros(3), np.array([1.0, 0.0, 2.0]), np.array([1.0, 1.0, 0.5]), np.array([0, 4.0, 0]))
    r = estimators.replicate_weights(exact, 1000, rng)
    assert np.all(r[:, 0] == 1.0) and np.all(r[:, 1] == 4.0) and r[:, 2].std() > 0


def test_two_phase_estimates_by_their_definition():
    rng = np.random.default_rng(8)
    n_posts = 4_000
    s = rng.beta(0.3, 0.7, n_posts)
    y = (rng.random(n_posts) < s).astype(float)
    f = np.clip(s + rng.normal(0, 0.1, n_posts), 0, 1)
    burn = np.zeros(n_posts, bool)
    burn[rng.permutation(n_posts)[:80]] = True
    folds = rng.integers(0, 2, n_posts)
    pi = np.where(burn, 0.0, np.clip(0.3 * np.sqrt(s * (1 - s)), 0.01, 1))
    drawn = ~burn & (rng.random(n_posts) < pi)
    pi0, a = 80 / n_posts, 0.3
    calibrated = np.clip(0.5 * s + 0.5 * rng.beta(0.3, 0.7, n_posts), 0, 1)  # half noise: lambda inside (0, 1)
    fold_a = np.array([0.25, 0.4])  # the weight each fold's estimate gets, chosen without its labels
    est = estimators.two_phase_mean(f, y, burn, drawn, pi0, pi, a, calibrated, 0.95, folds, fold_a)
    conditional = np.where(burn, 1.0, np.where(drawn, pi, 1.0))
    second = estimators.active_mean(calibrated, y, burn | drawn, conditional, 0.95)  # lambda, mu cross-fitted
    assert 0 < second["lambda"] < 1
    # each fold's estimate: a uniform sample of its n_k posts, lambda cross-fitted, no intercept
    weights, firsts = [], []
    for k in range(2):
        fold = burn & (folds == k)
        weights.append(fold.sum() / burn.sum() * fold_a[k])
        firsts.append(estimators.active_mean(f, y, fold, np.full(n_posts, fold.sum() / n_posts), 0.95,
                                             intercept=False))
    combined = sum(weights)
    assert est["combination"] == pytest.approx(combined)
    assert est["estimate"] == pytest.approx(sum(w * r["estimate"] for w, r in zip(weights, firsts))
                                            + (1 - combined) * second["estimate"], abs=1e-12)
    assert est["se"] == pytest.approx(np.sqrt(sum((w * r["se"]) ** 2 for w, r in zip(weights, firsts))
                                              + (1 - combined) ** 2 * second["se"] ** 2), rel=1e-9)
    # without fold weights (a design file written before them): the burn-in is one fold weighing a
    single = estimators.two_phase_mean(f, y, burn, drawn, pi0, pi, a, calibrated, 0.95)
    first = estimators.active_mean(f, y, burn, np.full(n_posts, pi0), 0.95, intercept=False)
    assert single["estimate"] == pytest.approx(a * first["estimate"] + (1 - a) * second["estimate"], abs=1e-12)
    # every label's weight in the combined estimate, and the same weights for the agreement totals
    effective = estimators.two_phase_pi(burn, drawn, pi0, pi, a)
    assert 1 / effective[burn] == pytest.approx(a / pi0 + 1 - a)
    assert 1 / effective[drawn] == pytest.approx((1 - a) / pi[drawn])
    labelled = burn | drawn
    design_weights = estimators.two_phase_weights(burn[labelled], pi0, pi[labelled], a)
    assert design_weights.weight == pytest.approx(1 / effective[labelled])
    share = estimators.two_phase_share(y, burn, drawn, pi0, pi, a, 0.95, folds, fold_a)
    hajek = estimators.hajek_share(y, conditional, 0.95, labelled)
    assert share["estimate"] == pytest.approx(sum(w * y[burn & (folds == k)].mean() for k, w in enumerate(weights))
                                              + (1 - combined) * hajek["estimate"])
    assert share["lo"] < share["estimate"] < share["hi"]


def test_cross_fitted_ppi_is_unbiased_where_the_tuned_lambda_leans_on_the_labels():
    """Prevalence 0.01, 100 of 2,000 posts labelled, a calibrated model: lambda tuned on the labels it
    corrects is 0 exactly when the sample holds no positive, and the PPI++ estimate is biased low (by more
    than 3 standard errors over 600 datasets); the cross-fitted estimate the summary reports is not."""
    rng = np.random.default_rng(17)
    reps, n_posts, n = 600, 2_000, 100
    s = rng.beta(0.005, 0.495, (reps, n_posts))
    y = (rng.random((reps, n_posts)) < s).astype(float)
    labelled = np.zeros((reps, n_posts), bool)
    for r in range(reps):
        labelled[r, rng.choice(n_posts, n, replace=False)] = True
    items = pa.table({"question": pa.array(np.repeat(np.arange(reps, dtype=np.int32), n_posts)),
                      "yhat": pa.array(s.ravel()),
                      "y": pa.array(np.where(labelled, y, np.nan).ravel(), from_pandas=True),
                      "r": pa.array(np.where(labelled, 1.0, np.nan).ravel(), from_pandas=True)})
    moments = ppi_moments_from_items(items)
    truth = y.mean(axis=1)
    for key, biased in (("estimate", True), ("crossfit_estimate", False)):
        errors = np.array([moments[r][key] for r in range(reps)]) - truth
        assert (abs(errors.mean()) > 3 * errors.std() / np.sqrt(reps)) == biased, key
    # one dataset by the definition: label i corrected with the lambda of the others
    r = int(np.argmax(np.where(labelled, y, 0).sum(axis=1) >= 2))  # a dataset with positives among the labels
    li = labelled[r]
    yy, ff = y[r][li], s[r][li]
    lam_i = np.array([min(1.0, max(0.0, (np.mean(np.delete(yy * ff, i)) - np.mean(np.delete(yy, i))
                                         * np.mean(np.delete(ff, i))) / ((1 + (n - 1) / n_posts) * s[r].var())))
                      for i in range(n)])
    assert moments[r]["crossfit_estimate"] == pytest.approx(np.mean(lam_i * s[r].mean() + yy - lam_i * ff), abs=1e-12)
    assert moments[r]["crossfit_lambda"] == pytest.approx(lam_i.mean(), abs=1e-12)


def test_paired_difference_resamples_both_models_together():
    rng = np.random.default_rng(6)
    n = 300
    truth = rng.random(n) < 0.3
    a = np.where(rng.random(n) < 0.85, truth, ~truth)
    b = np.where(rng.random(n) < 0.9, a, ~a)  # B copies A on 90 % of the posts
    cell = lambda says: np.where(truth, np.where(says, estimators.TP, estimators.FN),  # noqa: E731
                                 np.where(says, estimators.FP, estimators.TN))
    cells_a, cells_b = cell(a), cell(b)
    out = estimators.paired_difference(cells_a, cells_b, estimators.srs_design(n), 0.95, 2000, seed=3)
    counts_a, counts_b = np.bincount(cells_a, minlength=4), np.bincount(cells_b, minlength=4)
    f1 = lambda c: 2 * c[..., 0] / (2 * c[..., 0] + c[..., 1] + c[..., 2])  # noqa: E731
    assert out["f1"]["a"] == pytest.approx(f1(counts_a)) and out["f1"]["b"] == pytest.approx(f1(counts_b))
    assert out["f1"]["difference"] == pytest.approx(f1(counts_a) - f1(counts_b))
    assert out["prevalence_error"]["a"] == pytest.approx(abs(counts_a[1] - counts_a[2]) / n)
    assert out["f1"]["discordant"] == int(np.sum(cells_a != cells_b)) > 0
    # the replicates: one multinomial resample of the posts for both models (estimators.replicate_weights)
    counts = np.random.default_rng(3).multinomial(n, np.full(n, 1 / n), size=2000)
    onehot = np.eye(4)
    diff = f1(counts @ onehot[cells_a]) - f1(counts @ onehot[cells_b])
    assert (out["f1"]["lo"], out["f1"]["hi"]) == pytest.approx(tuple(np.percentile(diff, [2.5, 97.5])))
    assert out["f1"]["detectable"] == pytest.approx((1.959963984540054 + 0.8416212335729143) * diff.std(ddof=1))
    # paired: far narrower than two separate intervals' spread would say
    separate = np.hypot(np.std(f1(counts @ onehot[cells_a])), np.std(f1(np.random.default_rng(4).multinomial(
        n, np.full(n, 1 / n), size=2000) @ onehot[cells_b])))
    assert diff.std() < 0.7 * separate
