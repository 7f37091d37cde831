"""Pilot and ETA: classify a cost-stratified sample, fit throughput on tokens, project the whole run.

A pilot of ``planning.pilot_size`` requests is drawn from the manifest, stratified by estimated
prompt tokens (equal-count strata of ``est_prompt_tokens``, a proportional random draw in each, so
the heavy tail is represented), written as a shard file in the manifest format and classified by
``vidlabel.classify.run_shard`` exactly as a shard job would (same server, same concurrency).

The fit, from the pilot's label records (status ok):

* calibration ``r = sum(prompt_tokens) / sum(est_prompt_tokens)``: the server's real token count
  against the manifest's estimate;
* relative cost per request by least squares ``latency = a * prompt_tokens + b * completion_tokens + c``
  (non-negative; a term is dropped when its coefficient comes out negative or its column is constant);
* the server's throughput ``rate`` in cost units per second of wall time, measured on the steady
  part of the pilot (between the 10th and 90th percentile of completion times, which leaves out the
  ramp-up and the drain of the last requests).

Projection: every request's cost is ``a * r * est_prompt_tokens + b * mean_completion + c``; a shard
job takes ``startup + sum(cost) / rate`` seconds (startup as measured in the pilot: job start to the
first request); shard jobs run ``planning.concurrent_jobs`` at a time (list scheduling in shard
order). GPU-hours = sum of shard job hours x ``cost.gpus_per_job``; cost = GPU-hours x
``cost.gpu_hour_usd``. ``results/estimate.json`` holds the numbers, ``estimate.md`` a readable summary.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from vidlabel.io import write_parquet, write_text

STRATA = 10
STEADY_QUANTILES = (0.10, 0.90)
MIN_STEADY_REQUESTS = 20


def stratified_sample(est_tokens, n: int, strata: int = STRATA, seed: int = 0) -> np.ndarray:
    """Indices of a sample of ``n`` rows, proportional across equal-count strata of ``est_tokens``."""
    est = np.asarray(est_tokens, dtype=np.float64)
    total = len(est)
    if n >= total:
        return np.arange(total)
    rng = np.random.default_rng(seed)
    order = np.argsort(est, kind="stable")
    groups = np.array_split(order, min(strata, total))
    sizes = np.array([len(g) for g in groups], dtype=np.float64)
    quota = np.floor(sizes * n / total).astype(int)
    # Largest remainders get the leftover slots, so the sample has exactly n rows.
    rem = sizes * n / total - quota
    for i in np.argsort(-rem, kind="stable")[: n - quota.sum()]:
        quota[i] += 1
    picks = [rng.choice(g, size=q, replace=False) for g, q in zip(groups, quota) if q > 0]
    return np.sort(np.concatenate(picks))


@dataclass
class Fit:
    requests: int
    calibration: float  # real / estimated prompt tokens
    a_per_prompt_token: float
    b_per_completion_token: float
    c_per_request: float
    mean_completion_tokens: float
    rate: float  # cost units (latency seconds) completed per wall second: effective concurrency
    steady_window_s: float
    prompt_tokens_per_s: float
    completion_tokens_per_s: float
    wall_s: float
    startup_s: float

    def cost(self, est_prompt_tokens) -> np.ndarray:
        p = np.asarray(est_prompt_tokens, dtype=np.float64) * self.calibration
        return self.a_per_prompt_token * p + self.b_per_completion_token * self.mean_completion_tokens \
            + self.c_per_request


def _nonneg_lstsq(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with the columns whose coefficient would be negative (or that are constant) dropped."""
    cols = list(range(X.shape[1]))
    for j in list(cols[:-1]):  # the last column is the intercept
        if np.ptp(X[:, j]) == 0:
            cols.remove(j)
    while cols:
        coef, *_ = np.linalg.lstsq(X[:, cols], y, rcond=None)
        if (coef >= 0).all():
            out = np.zeros(X.shape[1])
            out[cols] = coef
            return out
        cols.pop(int(np.argmin(coef)))
    return np.zeros(X.shape[1])


def fit(records: pa.Table | list[dict], job_started_at: float | None = None) -> Fit:
    """Fit the throughput model on pilot label records (see the module docstring)."""
    rows = records.to_pylist() if isinstance(records, pa.Table) else list(records)
    ok = [r for r in rows if r.get("status") == "ok" and r.get("prompt_tokens") is not None
          and r.get("latency_s") is not None and r.get("finished_at") is not None]
    if len(ok) < 3:
        raise ValueError(f"the pilot has {len(ok)} successful requests; at least 3 are needed to fit throughput "
                         f"(errors: {sorted({r.get('error_kind') for r in rows if r.get('status') != 'ok'})})")
    p = np.array([r["prompt_tokens"] for r in ok], dtype=np.float64)
    c = np.array([r.get("completion_tokens") or 0 for r in ok], dtype=np.float64)
    est = np.array([r.get("est_prompt_tokens") or r["prompt_tokens"] for r in ok], dtype=np.float64)
    lat = np.array([r["latency_s"] for r in ok], dtype=np.float64)
    start = np.array([r["started_at"] for r in ok], dtype=np.float64)
    finish = np.array([r["finished_at"] for r in ok], dtype=np.float64)
    coef = _nonneg_lstsq(np.column_stack([p, c, np.ones_like(p)]), lat)
    if not coef.any():
        coef = np.array([lat.sum() / p.sum(), 0.0, 0.0])
    cost = coef[0] * p + coef[1] * c + coef[2]

    order = np.argsort(finish, kind="stable")
    f_sorted, cum = finish[order], np.cumsum(cost[order])
    lo, hi = (int(q * (len(ok) - 1)) for q in STEADY_QUANTILES)
    window = f_sorted[hi] - f_sorted[lo]
    if len(ok) >= MIN_STEADY_REQUESTS and window > 0:
        rate = (cum[hi] - cum[lo]) / window
        sel = order[lo + 1: hi + 1]
    else:  # a small pilot: the whole span
        window = finish.max() - start.min()
        rate = cost.sum() / window
        sel = order
    wall = float(finish.max() - start.min())
    startup = float(start.min() - job_started_at) if job_started_at else 0.0
    return Fit(requests=len(ok), calibration=float(p.sum() / est.sum()), a_per_prompt_token=float(coef[0]),
               b_per_completion_token=float(coef[1]), c_per_request=float(coef[2]),
               mean_completion_tokens=float(c.mean()), rate=float(rate), steady_window_s=float(window),
               prompt_tokens_per_s=float(p[sel].sum() / window), completion_tokens_per_s=float(c[sel].sum() / window),
               wall_s=wall, startup_s=max(0.0, startup))


def list_schedule(durations, slots: int) -> float:
    """Makespan of jobs started in order on ``slots`` parallel slots, each as soon as one is free."""
    free = [0.0] * max(1, slots)
    for d in durations:
        i = int(np.argmin(free))
        free[i] += float(d)
    return max(free) if len(free) else 0.0


def project(config: dict, f: Fit, shard_est_tokens: list[np.ndarray]) -> dict:
    """Projected wall time, GPU-hours and cost of classifying every shard."""
    jobs = [f.startup_s + float(f.cost(t).sum()) / f.rate if len(t) else 0.0 for t in shard_est_tokens]
    slots = config["planning"]["concurrent_jobs"]
    wall = list_schedule(jobs, slots)
    gpus = config["cost"]["gpus_per_job"]
    gpu_hours = sum(jobs) * gpus / 3600
    n = int(sum(len(t) for t in shard_est_tokens))
    return {
        "requests": n,
        "shards": len(jobs),
        "est_prompt_tokens": int(sum(float(np.sum(t)) for t in shard_est_tokens)),
        "concurrent_jobs": slots,
        "shard_hours": {"min": min(jobs) / 3600, "mean": float(np.mean(jobs)) / 3600, "max": max(jobs) / 3600},
        "wall_hours": wall / 3600,
        "gpu_hours": gpu_hours,
        "cost_usd": gpu_hours * config["cost"]["gpu_hour_usd"],
        "naive_wall_hours_per_item_mean": (n * f.wall_s / max(f.requests, 1)) / min(slots, len(jobs)) / 3600,
    }


def _fmt_h(hours: float) -> str:
    return f"{hours:.2f} h" if hours < 48 else f"{hours / 24:.1f} days ({hours:.0f} h)"


def summary_md(config: dict, f: Fit, proj: dict, pilot_n: int) -> str:
    c = config["cost"]
    return f"""# vidlabel: estimated run time and cost

Projection for **{proj['requests']:,} requests** in {proj['shards']} shards
({proj['est_prompt_tokens']:,} estimated prompt tokens), {proj['concurrent_jobs']} shard jobs at a time.

| | |
|---|---|
| wall time | **{_fmt_h(proj['wall_hours'])}** |
| shard job time (min / mean / max) | {proj['shard_hours']['min']:.2f} / {proj['shard_hours']['mean']:.2f} / {proj['shard_hours']['max']:.2f} h |
| GPU-hours | {proj['gpu_hours']:,.1f} ({c['gpus_per_job']} GPUs per job) |
| cost | **${proj['cost_usd']:,.0f}** at ${c['gpu_hour_usd']}/GPU-hour |
| naive per-item projection (for comparison) | {_fmt_h(proj['naive_wall_hours_per_item_mean'])} |

## Pilot
{pilot_n} requests sampled at random within {STRATA} strata of estimated prompt tokens; {f.requests} succeeded.
Server throughput on the steady part of the pilot ({f.steady_window_s:.0f} s): {f.prompt_tokens_per_s:,.0f} prompt
tokens/s and {f.completion_tokens_per_s:,.1f} completion tokens/s; effective concurrency {f.rate:.2f}.
Per-request cost model: latency = {f.a_per_prompt_token:.3g} s x prompt tokens + {f.b_per_completion_token:.3g} s x
completion tokens + {f.c_per_request:.3g} s. Real prompt tokens / estimate = {f.calibration:.3f}. Mean completion
tokens {f.mean_completion_tokens:.1f}. Server start-up (job start to first request) {f.startup_s:.0f} s.

## Assumptions
- The pilot ran on the same server configuration, GPUs and `classify.concurrency` as the shard jobs.
- Throughput depends on tokens, not on item count: each request costs in proportion to its prompt and
  completion tokens as fitted above; the manifest's token estimates, scaled by the calibration factor,
  stand for the real counts of requests outside the pilot.
- Shard jobs start as soon as one of the {proj['concurrent_jobs']} slots is free (no queueing delay on the
  cluster), each pays the measured start-up once, and none fails or is re-run.
- Sustained throughput over hours can be lower than in a short pilot (seed 002): treat this as a lower
  bound on the wall time and re-run the estimate on a larger pilot before committing to a deadline.
"""


def run(config: dict, shard_paths, json_path, md_path, workdir,
        server_log_path="logs/classify/server-pilot.log", seed: int = 0) -> dict:
    """Draw the pilot from the manifest shards, classify it, fit, project; write JSON and Markdown.

    The pilot's shard file, labels and journal live in ``workdir``; a rerun resumes the pilot from
    its journal instead of classifying it again.
    """
    from vidlabel import classify

    tables = [pq.read_table(p) for p in shard_paths]
    shard_tokens = [t.column("est_prompt_tokens").to_numpy(zero_copy_only=False) for t in tables]
    everything = pa.concat_tables(tables)
    if everything.num_rows == 0:
        raise ValueError("the manifest has no requests to estimate")
    pick = stratified_sample(everything.column("est_prompt_tokens").to_numpy(zero_copy_only=False),
                             config["planning"]["pilot_size"], seed=seed)
    workdir = Path(workdir)
    pilot_path = workdir / "pilot-shard.parquet"
    labels_path = workdir / "pilot-labels.parquet"
    journal_path = workdir / "pilot.jsonl"
    if not pilot_path.exists():
        write_parquet(everything.take(pa.array(pick)), pilot_path)
    job_started = time.time()
    classify.run_shard(config, pilot_path, labels_path, journal_path, server_log_path, 0)
    labels = pq.read_table(labels_path)
    fresh = [r for r in labels.to_pylist() if (r.get("started_at") or 0) >= job_started - 1]
    # A resumed pilot has older records; their start-up is unknown, so measure it on fresh ones only.
    f = fit(labels, job_started_at=job_started if len(fresh) == labels.num_rows else None)
    proj = project(config, f, shard_tokens)
    result = {"pilot": {"requests": int(len(pick)), **asdict(f)}, "projection": proj,
              "config": {"concurrent_jobs": config["planning"]["concurrent_jobs"],
                         "gpus_per_job": config["cost"]["gpus_per_job"],
                         "gpu_hour_usd": config["cost"]["gpu_hour_usd"],
                         "concurrency": config["classify"]["concurrency"]}}
    write_text(json.dumps(result, indent=2, default=_json_default) + "\n", json_path)
    write_text(summary_md(config, f, proj, len(pick)), md_path)
    return result


def _json_default(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return None if math.isnan(x) else float(x)
    raise TypeError(type(x))
