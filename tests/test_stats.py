"""Statistics: agreement metrics, Wilson/bootstrap intervals, and the PPI++ bias correction
(DuckDB SQL moments against ppi_py, and coverage over simulated datasets)."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest

from vidlabel import aggregate, stats

import ppi_py
from ppi_py.ppi import _calc_lam_glm  # private: the lambda ppi_py tunes internally


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
    moments = aggregate.ppi_moments_from_items(_items(sql_in))
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
    m = aggregate.ppi_moments_from_items(_items([("q", y, np.ones(10), np.ones(500), None)]))["q"]
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
    moments = aggregate.ppi_moments_from_items(items)  # all datasets in one SQL query
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
    weighted = aggregate.ppi_moments_from_items(items)
    unweighted = aggregate.ppi_moments_from_items(
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
    h = stats.hajek_share(truth.astype(float), prob, 0.95, labelled)
    a = stats.active_mean(yhat.astype(float), truth.astype(float), labelled, prob, 0.95)
    assert np.mean((h["lo"] <= target) & (target <= h["hi"])) >= 0.92
    assert np.mean((a["lo"] <= target) & (target <= a["hi"])) >= 0.92
    assert np.mean(a["hi"] - a["lo"]) < np.mean(h["hi"] - h["lo"])
