"""Reference implementations the statistics tests check the production code against."""

from __future__ import annotations

import numpy as np


def crossfit_ppi(y, yhat, yhat_all) -> tuple[float, float]:
    """PPI++ with lambda cross-fitted (sql/ppi_moments.sql's crossfit_*), by its definition: label i is
    corrected with lambda_i = Cov(y, yhat) of the other labels / ((1 + (n - 1)/N) Var(yhat) of all posts),
    clipped to [0, 1]. Returns (estimate, standard error)."""
    y, yhat, yhat_all = (np.asarray(a, dtype=float) for a in (y, yhat, yhat_all))
    n, big_n = len(y), len(yhat_all)
    lam_i = np.empty(n)
    for i in range(n):
        others = np.arange(n) != i
        cov = np.mean(y[others] * yhat[others]) - y[others].mean() * yhat[others].mean()
        lam_i[i] = min(1.0, max(0.0, cov / ((1 + (n - 1) / big_n) * yhat_all.var()))) if yhat_all.var() > 0 else 0.0
    est = float(np.mean(lam_i * yhat_all.mean() + y - lam_i * yhat))
    se = float(np.sqrt(np.var(y - lam_i * yhat) / n + lam_i.mean() ** 2 * yhat_all.var() / big_n))
    return est, se
