"""Pilot and ETA: classify a cost-stratified sample, measure the server's steady throughput, project the run.

A pilot of ``planning.pilot_size`` requests (it should hold ``REQUESTS_PER_SLOT`` per request
slot, i.e. per request the job keeps in flight: ``classify.concurrency`` x server copies; a smaller
one is warned about in the log and the summary) is drawn from the manifest, stratified by estimated
prompt tokens (equal-count strata of ``est_prompt_tokens``, a proportional random draw in each, so
the heavy tail is represented), written as a shard file in the manifest format and classified by
``vidlabel.serve.classify.run_shard`` exactly as a shard job would (same server, same concurrency).

The fit, from the pilot's label records (status ok):

* calibration ``r = sum(prompt_tokens) / sum(est_prompt_tokens)``: the server's real token count
  against the manifest's estimate;
* relative cost per request by non-negative least squares
  ``latency = a * prompt_tokens + b * completion_tokens + c`` over the requests sent after the first
  answer (the first wave's latencies also hold the pipeline's filling); a term is dropped when its
  coefficient comes out negative or its column is constant. Under a saturated server latency is
  mostly waiting, so the fit may put all weight on ``c``: then every request costs the same and
  throughput follows the number of requests, not their tokens (``Fit.model`` says which model came
  out; the summary describes that one);
* the steady window: from the first answer (before it the pipeline is still filling: videos are
  decoded while nothing has reached the GPU) to the last moment the client had its peak number of
  requests in flight (after it the job drains). The server's ``rate`` is the cost done per second in
  that window: each request's fitted cost spread evenly over the span of that length before its
  answer (never before it was sent: a request of the first wave waited for the pipeline before its
  work began), counted where it falls inside the window. ``steady`` is False when the window is
  shorter than ``STEADY_LATENCIES`` median latencies (too few requests per slot): the rate is then
  taken over the whole request phase and the summary says so;
* ``ramp_drain_s``: the pilot's request phase minus its cost at the steady rate, i.e. the time a job
  loses filling its pipeline at the start and draining it at the end (once per job).

Projection: every request's cost is ``a * r * est_prompt_tokens + b * mean_completion + c``; a shard
job takes ``startup + ramp_drain + sum(cost) / rate`` seconds (startup as measured in the pilot: job
start to the first request); shard jobs run ``planning.concurrent_jobs`` at a time (list scheduling
in shard order). GPU-hours = sum of shard job hours x the GPUs the pilot job was granted (the
estimate job asks for the classify job's resources; ``cost.gpus_per_job`` only where no GPU is
visible); cost = GPU-hours x ``cost.gpu_hour_usd``. Per model, ``results/models/<name>/estimate.json``
holds the numbers and ``estimate.md`` a readable summary; ``results/estimate.md`` puts the models side
by side (``compare_projections``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from vidlabel.core.io import write_parquet, write_text
from vidlabel.serve.parallelism import choose_layout, granted_gpus
from vidlabel.serve.settings import ServeSettings

log = logging.getLogger(__name__)

STRATA = 10
# Pilot requests per request slot: with fewer, most of the pilot is ramp-up and drain (a 48-request
# pilot at 32 in flight measured 9.5k prompt tok/s against 12.9k sustained on the same server).
REQUESTS_PER_SLOT = 4
# The steady window must last this many median latencies (about as many waves of requests).
STEADY_LATENCIES = 2.0
MIN_FIT_REQUESTS = 10  # fewest requests sent after the first answer to fit the cost model on them alone
MIN_HELD_S = 1e-3  # an in-flight level held for less is the instant between an answer and its replacement


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
    steady: bool  # the window lasted STEADY_LATENCIES median latencies (else: whole request phase)
    peak_in_flight: int
    prompt_tokens_per_s: float
    completion_tokens_per_s: float
    requests_per_s: float
    ramp_drain_s: float  # request phase minus its cost at the steady rate: lost once per job
    wall_s: float
    startup_s: float

    def cost(self, est_prompt_tokens) -> np.ndarray:
        p = np.asarray(est_prompt_tokens, dtype=np.float64) * self.calibration
        return self.a_per_prompt_token * p + self.b_per_completion_token * self.mean_completion_tokens \
            + self.c_per_request

    @property
    def model(self) -> str:
        """Which terms the fit kept, in words."""
        terms = []
        if self.a_per_prompt_token > 0:
            terms.append("prompt tokens")
        if self.b_per_completion_token > 0:
            terms.append("completion tokens")
        if self.c_per_request > 0:
            terms.append("a fixed cost per request")
        return " + ".join(terms) or "nothing (all coefficients zero)"


def _nonneg_lstsq(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with the columns whose coefficient would be negative (or that are constant) dropped."""
    cols = list(range(X.shape[1]))
    for j in list(cols[:-1]):  # the last column is the intercept
        if np.ptp(X[:, j]) == 0:
            cols.remove(j)
    while cols:
        coef, *_ = np.linalg.lstsq(X[:, cols], y, rcond=None)
        # A term worth less than a millionth of the mean latency is rounding noise, not a cost.
        coef[np.abs(coef * X[:, cols].mean(axis=0)) < 1e-6 * abs(y.mean())] = 0.0
        if (coef >= 0).all():
            out = np.zeros(X.shape[1])
            out[cols] = coef
            return out
        cols.pop(int(np.argmin(coef)))
    return np.zeros(X.shape[1])


def in_flight_steps(start, finish) -> tuple[np.ndarray, np.ndarray]:
    """Times of every start and finish (sorted) and the requests in flight just after each."""
    times = np.concatenate([start, finish])
    steps = np.concatenate([np.ones(len(start)), -np.ones(len(finish))])
    order = np.lexsort((steps, times))  # at equal times a finish (-1) before a start (+1)
    return times[order], np.cumsum(steps[order])


def steady_window(start, finish) -> tuple[float, float, int]:
    """(begin, end, peak in flight): from the first answer (before it the pipeline is still filling)
    to the last moment the peak number of requests was in flight (a one-request dip, the moment
    between an answer and its replacement, still counts as the peak)."""
    times, level = in_flight_steps(start, finish)
    held = np.diff(times, append=times[-1]) >= MIN_HELD_S  # a level that lasted (not a same-instant swap)
    peak = int(level[held].max()) if held.any() else int(level.max())
    full = times[held & (level >= max(1, peak - 1))]
    begin = float(finish.min())
    return begin, float(full.max() if len(full) else begin), peak


def window_share(work_start, finish, begin: float, end: float) -> np.ndarray:
    """Share of each request's work (from ``work_start`` to its answer) inside [begin, end]."""
    inside = np.clip(np.minimum(finish, end) - np.maximum(work_start, begin), 0.0, None)
    span = finish - work_start
    answered_inside = ((finish > begin) & (finish <= end)).astype(np.float64)
    return np.where(span > 0, inside / np.where(span > 0, span, 1.0), answered_inside)


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
    # The cost model is fitted on the requests sent once the pipeline was full: the first wave's
    # latencies also hold the pipeline's filling, which no later request pays.
    settled = start >= finish.min()
    rows_fit = settled if settled.sum() >= MIN_FIT_REQUESTS else np.ones(len(ok), bool)
    coef = _nonneg_lstsq(np.column_stack([p, c, np.ones_like(p)])[rows_fit], lat[rows_fit])
    if not coef.any():
        coef = np.array([lat.sum() / p.sum(), 0.0, 0.0])
    cost = coef[0] * p + coef[1] * c + coef[2]

    # In flight counts every request the client sent, failed ones included: they held a slot too.
    timed = [r for r in rows if r.get("started_at") is not None and r.get("finished_at") is not None]
    all_start = np.array([r["started_at"] for r in timed], dtype=np.float64)
    all_finish = np.array([r["finished_at"] for r in timed], dtype=np.float64)
    begin, end, peak = steady_window(all_start, all_finish)
    phase_begin, phase_end = float(start.min()), float(finish.max())
    steady = end - begin >= STEADY_LATENCIES * float(np.median(lat))
    if not steady:  # too few requests per slot: the whole request phase, ramp-up and drain included
        begin, end = phase_begin, phase_end
    window = max(end - begin, 1e-9)
    # Work in the window: each request's fitted cost, spread evenly over the time before its answer
    # that the cost spans (never before it was sent), counted where that time falls in the window.
    # A request of the first wave waited for the pipeline to fill before its work began: its work is
    # the end of its time in flight, not all of it.
    share = window_share(np.maximum(start, finish - cost), finish, begin, end)
    rate = float((cost * share).sum() / window)
    wall = phase_end - phase_begin
    startup = float(start.min() - job_started_at) if job_started_at else 0.0
    return Fit(requests=len(ok), calibration=float(p.sum() / est.sum()), a_per_prompt_token=float(coef[0]),
               b_per_completion_token=float(coef[1]), c_per_request=float(coef[2]),
               mean_completion_tokens=float(c.mean()), rate=rate, steady_window_s=float(window), steady=bool(steady),
               peak_in_flight=peak, prompt_tokens_per_s=float((p * share).sum() / window),
               completion_tokens_per_s=float((c * share).sum() / window),
               requests_per_s=float(share.sum() / window),
               ramp_drain_s=max(0.0, float(wall - cost.sum() / rate)) if rate > 0 else 0.0,
               wall_s=float(wall), startup_s=max(0.0, startup))


def request_slots(settings: ServeSettings, largest_request_tokens: int) -> int:
    """Requests a shard job keeps in flight: ``classify.concurrency`` per server copy (the copies the
    job's layout gives, as ``classify.run_shard`` chooses it) or per external endpoint."""
    if settings.endpoints:
        return settings.client.concurrency * len(settings.endpoints)
    return settings.client.concurrency * choose_layout(settings, largest_request_tokens).data


def pilot_too_small(config: dict, slots: int) -> str | None:
    """Why ``planning.pilot_size`` is too small for a steady window with ``slots`` requests in
    flight (fewer than ``REQUESTS_PER_SLOT`` per slot), or None."""
    wanted = REQUESTS_PER_SLOT * max(1, slots)
    if config["planning"]["pilot_size"] >= wanted:
        return None
    return (f"planning.pilot_size {config['planning']['pilot_size']} is below {REQUESTS_PER_SLOT} requests per "
            f"request slot ({slots} in flight): set it to at least {wanted}, or most of the pilot is ramp-up "
            "and drain")


def list_schedule(durations, slots: int) -> float:
    """Makespan of jobs started in order on ``slots`` parallel slots, each as soon as one is free."""
    free = [0.0] * max(1, slots)
    for d in durations:
        i = int(np.argmin(free))
        free[i] += float(d)
    return max(free) if len(free) else 0.0


def job_gpus(config: dict, environ=os.environ) -> tuple[int, str]:
    """GPUs a shard job holds: those this (estimate) job was granted, which asks for the classify
    job's resources; ``cost.gpus_per_job`` where no GPU is visible (external endpoints, no GPU here)."""
    ids, source = granted_gpus(environ)
    if ids:
        return len(ids), f"granted to the pilot job ({source})"
    return int(config["cost"]["gpus_per_job"]), f"cost.gpus_per_job ({source})"


def project(config: dict, f: Fit, shard_est_tokens: list[np.ndarray], gpus: int | None = None) -> dict:
    """Projected wall time, GPU-hours and cost of classifying every shard (``gpus`` per job; default
    ``cost.gpus_per_job``)."""
    jobs = [f.startup_s + f.ramp_drain_s + float(f.cost(t).sum()) / f.rate if len(t) else 0.0
            for t in shard_est_tokens]
    slots = config["planning"]["concurrent_jobs"]
    wall = list_schedule(jobs, slots)
    gpus = int(config["cost"]["gpus_per_job"] if gpus is None else gpus)
    gpu_hours = sum(jobs) * gpus / 3600
    n = int(sum(len(t) for t in shard_est_tokens))
    return {
        "requests": n,
        "shards": len(jobs),
        "est_prompt_tokens": int(sum(float(np.sum(t)) for t in shard_est_tokens)),
        "concurrent_jobs": slots,
        "gpus_per_job": gpus,
        "shard_hours": {"min": min(jobs) / 3600, "mean": float(np.mean(jobs)) / 3600, "max": max(jobs) / 3600},
        "wall_hours": wall / 3600,
        "gpu_hours": gpu_hours,
        "cost_usd": gpu_hours * config["cost"]["gpu_hour_usd"],
        "naive_wall_hours_per_item_mean": (n * f.wall_s / max(f.requests, 1)) / min(slots, len(jobs)) / 3600,
    }


def _fmt_h(hours: float) -> str:
    return f"{hours:.2f} h" if hours < 48 else f"{hours / 24:.1f} days ({hours:.0f} h)"


def _model_text(f: Fit) -> str:
    """The fitted cost model in words: what a request's cost follows, and so what throughput follows."""
    if f.a_per_prompt_token > 0 or f.b_per_completion_token > 0:
        parts = [f"{f.a_per_prompt_token:.3g} s x prompt tokens"] if f.a_per_prompt_token > 0 else []
        if f.b_per_completion_token > 0:
            parts.append(f"{f.b_per_completion_token:.3g} s x completion tokens")
        if f.c_per_request > 0:
            parts.append(f"{f.c_per_request:.3g} s")
        follows = ("tokens" if f.c_per_request == 0 else "both tokens and the number of requests")
        return (f"latency = {' + '.join(parts)}: a request costs in proportion to its tokens"
                + ("" if f.c_per_request == 0 else " plus a fixed part")
                + f", so throughput follows {follows}; the manifest's token estimates, scaled by the "
                  "calibration factor, stand for the real counts of requests outside the pilot.")
    return (f"latency = {f.c_per_request:.3g} s per request, whatever its tokens (the fit gave tokens no "
            "weight: under a saturated server a request's latency is mostly waiting), so throughput "
            "follows the number of requests, not their tokens.")


def summary_md(config: dict, f: Fit, proj: dict, pilot_n: int, gpus_source: str = "cost.gpus_per_job",
               warning: str | None = None, succeeded: int | None = None) -> str:
    """``succeeded``: the pilot's answered requests, where the fit used only those of this run (``f.requests``)."""
    c = config["cost"]
    succeeded = f.requests if succeeded is None else succeeded
    reused = (f" Throughput was measured on the {f.requests} answered in this run; the other {succeeded - f.requests} "
              "answers were reused from an earlier run of the pilot (their timings belong to that run)."
              if succeeded > f.requests else "")
    window = (f"the steady part of the pilot ({f.steady_window_s:.0f} s, from the first answer to the last moment "
              f"{f.peak_in_flight} requests were in flight)" if f.steady else
              f"the whole request phase ({f.steady_window_s:.0f} s, ramp-up and drain included: the pilot was too "
              f"short for a steady window of {STEADY_LATENCIES:g} latencies; raise planning.pilot_size above "
              f"{REQUESTS_PER_SLOT} x {f.peak_in_flight} requests in flight)")
    return f"""# vidlabel: estimated run time and cost

Projection for **{proj['requests']:,} requests** in {proj['shards']} shards
({proj['est_prompt_tokens']:,} estimated prompt tokens), {proj['concurrent_jobs']} shard jobs at a time.

| | |
|---|---|
| wall time | **{_fmt_h(proj['wall_hours'])}** |
| shard job time (min / mean / max) | {proj['shard_hours']['min']:.2f} / {proj['shard_hours']['mean']:.2f} \
/ {proj['shard_hours']['max']:.2f} h |
| GPU-hours | {proj['gpu_hours']:,.1f} ({proj['gpus_per_job']} GPUs per job: {gpus_source}) |
| cost | **${proj['cost_usd']:,.0f}** at ${c['gpu_hour_usd']}/GPU-hour |
| naive per-item projection (for comparison) | {_fmt_h(proj['naive_wall_hours_per_item_mean'])} |

## Pilot
{pilot_n} requests sampled at random within {STRATA} strata of estimated prompt tokens; {succeeded} succeeded.{reused}{
    chr(10) + "**" + warning + ".**" if warning else ""}
Server throughput over {window}: {f.prompt_tokens_per_s:,.0f} prompt tokens/s, {f.completion_tokens_per_s:,.1f}
completion tokens/s, {f.requests_per_s:.2f} requests/s; effective concurrency {f.rate:.2f}.
Fitted cost model ({f.model}): {_model_text(f)}
Real prompt tokens / estimate = {f.calibration:.3f}. Mean completion tokens {f.mean_completion_tokens:.1f}.
Per job: server start-up (job start to first request) {f.startup_s:.0f} s, ramp-up and drain (request phase
minus its work at the steady rate) {f.ramp_drain_s:.0f} s.

## Assumptions
- The pilot ran on the same server configuration, GPUs and `classify.concurrency` as the shard jobs.
- A shard job takes start-up + ramp-up and drain + the cost of its requests at the steady rate, with
  each request's cost from the model above.
- Shard jobs start as soon as one of the {proj['concurrent_jobs']} slots is free (no queueing delay on the
  cluster), and none fails or is re-run.
- Sustained throughput over hours can be lower than in a short pilot (seed 002): treat this as a lower
  bound on the wall time and re-run the estimate on a larger pilot before committing to a deadline.
"""


def run(config: dict, shard_paths, json_path, md_path, workdir,
        server_log_path="logs/classify/server-pilot.log", seed: int = 0) -> dict:
    """Draw the pilot from the manifest shards, classify it, fit, project; write JSON and Markdown.

    The pilot's shard file, labels and journal live in ``workdir``. The shard file is the draw (its
    rows follow from the manifest, ``planning.pilot_size`` and ``seed``): a rerun whose draw differs
    writes it anew, and the journal's answers of requests still in it are reused (``run_shard``); an
    unchanged rerun resumes the pilot from its journal instead of classifying it again. Where some of
    the pilot's answers come from an earlier run, the throughput is fitted on this run's alone (the
    others were timed under another run), provided it has at least 3.
    """
    from vidlabel.serve import classify

    tables = [pq.read_table(p) for p in shard_paths]
    shard_tokens = [t.column("est_prompt_tokens").to_numpy(zero_copy_only=False) for t in tables]
    everything = pa.concat_tables(tables)
    if everything.num_rows == 0:
        raise ValueError("the manifest has no requests to estimate")
    est_tokens = everything.column("est_prompt_tokens").to_numpy(zero_copy_only=False)
    settings = ServeSettings.from_config(config)
    slots = request_slots(settings, int(est_tokens.max()) + settings.client.max_tokens)
    small = pilot_too_small(config, slots) if len(est_tokens) > config["planning"]["pilot_size"] else None
    if small:
        log.warning("estimate: %s", small)
    pick = stratified_sample(est_tokens, config["planning"]["pilot_size"], seed=seed)
    workdir = Path(workdir)
    pilot_path = workdir / "pilot-shard.parquet"
    labels_path = workdir / "pilot-labels.parquet"
    journal_path = workdir / "pilot.jsonl"
    pilot = everything.take(pa.array(pick))
    if not pilot_path.exists() or not pq.read_table(pilot_path).equals(pilot):
        write_parquet(pilot, pilot_path)  # another draw: other pilot size, manifest or seed
    job_started = time.time()
    # The pilot's server sized for the whole data set, as the shard jobs' (the manifest's media limits).
    classify.classify_shard(settings, pilot_path, labels_path, journal_path, server_log_path, 0,
                            manifest_dir=Path(shard_paths[0]).parent)
    labels = pq.read_table(labels_path).to_pylist()
    fresh = [r for r in labels if (r.get("started_at") or 0) >= job_started - 1]
    measured = fresh if sum(r["status"] == "ok" for r in fresh) >= 3 else labels
    # Start-up is known only when this run classified the whole pilot.
    f = fit(measured, job_started_at=job_started if len(fresh) == len(labels) else None)
    succeeded = sum(r["status"] == "ok" for r in labels)
    gpus, gpus_source = job_gpus(config)
    proj = project(config, f, shard_tokens, gpus)
    result = {"pilot": {"requests": len(labels), "succeeded": succeeded, "model": f.model, **asdict(f)},
              "projection": proj,
              "config": {"classify_model": config["classify"]["model"],
                         "concurrent_jobs": config["planning"]["concurrent_jobs"],
                         "gpus_per_job": gpus, "gpus_per_job_from": gpus_source,
                         "gpu_hour_usd": config["cost"]["gpu_hour_usd"],
                         "concurrency": config["classify"]["concurrency"], "request_slots": slots,
                         "pilot_warning": small}}
    write_text(json.dumps(result, indent=2, default=_json_default) + "\n", json_path)
    write_text(summary_md(config, f, proj, len(labels), gpus_source, small, succeeded), md_path)
    return result


def compare_projections(json_paths, md_path) -> None:
    """``results/estimate.md``: the pilot projection of every model (``results/models/<name>/estimate.json``)
    side by side, cheapest first."""
    rows = []
    for path in json_paths:
        data = json.loads(Path(path).read_text())
        proj, pilot = data["projection"], data["pilot"]
        rows.append((proj["gpu_hours"], Path(path).parent.name, data["config"].get("classify_model", "?"), proj,
                     pilot))
    rows.sort(key=lambda r: r[0])
    lines = ["# vidlabel: estimated run time and cost per model", "",
             "Each model's pilot (its own `estimate.md` beside its `estimate.json` says how it was fitted).", "",
             "| model | served as | requests | wall time | GPU-hours | cost | pilot prompt tok/s |",
             "|---|---|---|---|---|---|---|"]
    for gpu_hours, name, served, proj, pilot in rows:
        lines.append(f"| {name} | {served} | {proj['requests']:,} | {_fmt_h(proj['wall_hours'])} | "
                     f"{gpu_hours:,.1f} | ${proj['cost_usd']:,.0f} | {pilot['prompt_tokens_per_s']:,.0f} |")
    if len(rows) > 1 and rows[0][0] > 0:
        lines += ["", f"The most expensive model ({rows[-1][1]}) costs {rows[-1][0] / rows[0][0]:.1f} x the GPU-hours "
                      f"of the cheapest ({rows[0][1]}). Whether the cheaper one is good enough is a question for the "
                      "human labels: see results/compare/compare.md after a full run."]
    write_text("\n".join(lines) + "\n", md_path)


def _json_default(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return None if math.isnan(x) else float(x)
    raise TypeError(type(x))
