"""Pilot sampling, the throughput fit and the projection (on synthetic pilot records)."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from vidlabel.core import config as cfgmod
from vidlabel.serve import pilot as es


def test_stratified_sample_covers_every_stratum():
    rng = np.random.default_rng(0)
    est = rng.lognormal(9, 1, 10_000)
    pick = es.stratified_sample(est, 200, seed=3)
    assert len(pick) == 200 == len(set(pick.tolist()))
    # Each decile of the cost distribution holds 20 of the 200.
    edges = np.quantile(est, np.linspace(0, 1, 11))
    counts, _ = np.histogram(est[pick], bins=edges)
    assert counts.min() >= 19 and counts.max() <= 21
    assert np.array_equal(pick, es.stratified_sample(est, 200, seed=3))  # deterministic
    assert len(es.stratified_sample(est[:50], 200)) == 50


def synthetic_pilot(n=200, a=2e-4, b=0.02, c=0.5, concurrency=8, seed=1, calibration=1.1, ramp_s=0.0):
    """Records of a server that serves `concurrency` requests at once, each taking a*p + b*c + c;
    with ``ramp_s``, the first wave waits that long more (the pipeline filling: videos decoded before
    anything reaches the GPU)."""
    rng = np.random.default_rng(seed)
    est = rng.lognormal(np.log(15000), 0.6, n).astype(int)
    p = (est * calibration).astype(int)
    comp = rng.integers(10, 60, n)
    service = a * p + b * comp + c
    service[:concurrency] += ramp_s
    free = np.zeros(concurrency)
    recs = []
    t0 = 1000.0
    for i in range(n):
        k = int(np.argmin(free))
        start = t0 + free[k]
        free[k] += service[i]
        recs.append({"status": "ok", "prompt_tokens": int(p[i]), "completion_tokens": int(comp[i]),
                     "est_prompt_tokens": int(est[i]), "latency_s": float(service[i]),
                     "started_at": float(start), "finished_at": float(start + service[i])})
    return recs, service, est


def test_fit_recovers_the_cost_model_and_rate():
    recs, service, est = synthetic_pilot()
    f = es.fit(recs, job_started_at=1000.0 - 30)
    assert f.calibration == pytest.approx(1.1, rel=0.01)
    assert f.a_per_prompt_token == pytest.approx(2e-4, rel=0.02)
    assert f.b_per_completion_token == pytest.approx(0.02, rel=0.05)
    assert f.c_per_request == pytest.approx(0.5, rel=0.1)
    assert f.rate == pytest.approx(8, rel=0.05)  # 8 requests served at once
    assert f.startup_s == pytest.approx(30)
    # Cost of a request from its estimate reproduces its service time on average.
    assert f.cost(est).sum() == pytest.approx(service.sum(), rel=0.02)


def test_fit_needs_successes():
    with pytest.raises(ValueError, match="at least 3"):
        es.fit([{"status": "error", "error_kind": "timeout"}] * 5)


def test_projection_schedules_shards_and_costs():
    cfg = cfgmod.validate({"posts": "p", "media_root": "/m", "planning": {"concurrent_jobs": 2},
                           "cost": {"gpu_hour_usd": 2.0, "gpus_per_job": 4}})
    f = es.Fit(requests=100, calibration=1.0, a_per_prompt_token=1e-3, b_per_completion_token=0.0,
               c_per_request=0.0, mean_completion_tokens=20, rate=1.0, steady_window_s=100, steady=True,
               peak_in_flight=8, prompt_tokens_per_s=1000, completion_tokens_per_s=20, requests_per_s=0.1,
               ramp_drain_s=50.0, wall_s=100, startup_s=100.0)
    # Shards of 3600, 3600 and 7200 cost-seconds (+100 s start-up, +50 s ramp-up and drain each) on 2 slots.
    shards = [np.full(10, 360_000), np.full(10, 360_000), np.full(20, 360_000)]
    p = es.project(cfg, f, shards)
    jobs = [3750, 3750, 7350]
    assert p["wall_hours"] == pytest.approx((3750 + 7350) / 3600)
    assert p["gpu_hours"] == pytest.approx(sum(jobs) * 4 / 3600)
    assert p["cost_usd"] == pytest.approx(sum(jobs) * 4 / 3600 * 2.0)
    assert p["requests"] == 40
    md = es.summary_md(cfg, f, p, 100)
    assert "GPU-hours" in md and "## Assumptions" in md
    assert "a request costs in proportion to its tokens, so throughput follows tokens" in md
    # The GPUs the job really holds, where known, replace cost.gpus_per_job.
    two = es.project(cfg, f, shards, gpus=2)
    assert two["gpu_hours"] == pytest.approx(sum(jobs) * 2 / 3600) and two["gpus_per_job"] == 2


def test_job_gpus_are_the_granted_ones():
    cfg = cfgmod.validate({"posts": "p", "media_root": "/m", "cost": {"gpus_per_job": 4}})
    assert es.job_gpus(cfg, {"CUDA_VISIBLE_DEVICES": "2,3"}) == (2, "granted to the pilot job (CUDA_VISIBLE_DEVICES)")
    n, source = es.job_gpus(cfg, {"CUDA_VISIBLE_DEVICES": ""})
    assert n == 4 and source.startswith("cost.gpus_per_job")


def test_steady_window_excludes_the_ramp_up():
    """A 30 s pipeline fill before the first wave: the steady rate is still the server's 32 slots,
    where the whole request phase (or a window of completion percentiles) reads it far lower."""
    n = es.REQUESTS_PER_SLOT * 32
    recs, service, est = synthetic_pilot(n=n, concurrency=32, ramp_s=30.0, seed=4)
    f = es.fit(recs)
    assert f.steady and f.peak_in_flight == 32
    # The cost model is the server's (fitted after the first wave), so 32 slots busy = rate 32.
    assert f.a_per_prompt_token == pytest.approx(2e-4, rel=0.05)
    assert f.rate == pytest.approx(32, rel=0.05)
    # Steady prompt tok/s = 32 slots x tokens per second of service.
    tokens = np.array([r["prompt_tokens"] for r in recs], dtype=float)
    steady_tok_s = 32 * tokens.sum() / (service.sum() - 30.0 * 32)
    assert f.prompt_tokens_per_s == pytest.approx(steady_tok_s, rel=0.05)
    phase = max(r["finished_at"] for r in recs) - min(r["started_at"] for r in recs)
    assert tokens.sum() / phase < 0.8 * steady_tok_s  # what a window including the ramp-up would report
    # The time lost once per job: at least the ramp-up.
    assert f.ramp_drain_s >= 30.0 * 0.9


def test_projection_of_a_full_job_from_a_pilot_with_ramp_up():
    """The pilot's projection of a 5x longer job on the same server is within 10 % of it (the rest is
    the luck of which requests come last: over 10 seeds the error stayed within 6 %)."""
    recs, _, _ = synthetic_pilot(n=es.REQUESTS_PER_SLOT * 32, concurrency=32, ramp_s=30.0, seed=5)
    f = es.fit(recs, job_started_at=1000.0 - 120)
    job, _, job_est = synthetic_pilot(n=640, concurrency=32, ramp_s=30.0, seed=6)
    request_phase = max(r["finished_at"] for r in job) - min(r["started_at"] for r in job)
    cfg = cfgmod.validate({"posts": "p", "media_root": "/m", "planning": {"concurrent_jobs": 1}})
    projected = es.project(cfg, f, [job_est])["wall_hours"] * 3600 - 120
    assert projected == pytest.approx(request_phase, rel=0.10)


def test_a_pilot_too_small_for_its_concurrency_says_so():
    """48 requests at 32 in flight (the issue's pilot): no steady window; the rate is the whole
    phase's and the summary says the pilot was too short."""
    recs, _, _ = synthetic_pilot(n=48, concurrency=32, ramp_s=30.0, seed=7)
    f = es.fit(recs)
    assert not f.steady and f.ramp_drain_s == pytest.approx(0.0, abs=1e-6)
    cfg = cfgmod.validate({"posts": "p", "media_root": "/m", "planning": {"pilot_size": 48}})
    md = es.summary_md(cfg, f, es.project(cfg, f, [np.full(10, 10_000)]), 48)
    assert "the pilot was\ntoo short" in md or "the pilot was too short" in md.replace("\n", " ")
    assert "set it to at least 128" in es.pilot_too_small(cfg, 32)
    assert es.pilot_too_small(cfg, 4) is None  # 48 for 4 in flight is enough


def test_the_default_pilot_holds_four_requests_per_slot_of_the_default_concurrency():
    """classify.concurrency's default rose from 32 to 64: planning.pilot_size's default rises with it,
    or every one-copy job would warn that its pilot is too small."""
    cfg = cfgmod.validate({"posts": "p", "media_root": "/m"})
    assert es.pilot_too_small(cfg, cfg["classify"]["concurrency"]) is None
    assert es.pilot_too_small(cfg, cfg["classify"]["concurrency"] + 1) is not None  # the default is the least


def test_summary_describes_a_per_request_model_when_tokens_get_no_weight():
    """Latency the same whatever the tokens (a saturated server): the summary must not claim that
    throughput follows tokens."""
    recs, _, _ = synthetic_pilot(n=128, a=0.0, b=0.0, c=43.0, concurrency=32, seed=8)
    f = es.fit(recs)
    assert f.a_per_prompt_token == 0 and f.c_per_request == pytest.approx(43.0)
    assert f.model == "a fixed cost per request"
    cfg = cfgmod.validate({"posts": "p", "media_root": "/m"})
    md = es.summary_md(cfg, f, es.project(cfg, f, [np.full(10, 10_000)]), 128)
    assert "throughput follows the number of requests, not their tokens" in md
    assert "in proportion to its tokens" not in md


def test_list_schedule():
    assert es.list_schedule([5, 3, 3, 3], 2) == 8
    assert es.list_schedule([5, 3], 4) == 5


def test_pilot_with_the_standin_server(tmp_path):
    """The estimate target end to end: sample, classify through the stand-in, fit, project, write."""
    import json

    from standin.shards import make_config, make_video, manifest_rows, write_manifest

    media = tmp_path / "media"
    posts = [{"post_id": f"p{i}", "media_path": str(make_video(media / f"p{i}.mp4", seconds=1 + i % 3)),
              "caption": "buy pizza" if i % 2 else "hello", "transcript": "words " * (i * 20)}
             for i in range(12)]
    # Service time proportional to tokens: the fit must find a positive per-token cost.
    cfg = make_config(tmp_path, media, faults=["--prefill-tokens-per-s", "20000", "--latency", "0.02"],
                      classify={"concurrency": 3})
    cfg["planning"]["pilot_size"] = 8
    cfg["planning"]["concurrent_jobs"] = 2
    rows = manifest_rows(cfg, posts)
    shards = [write_manifest(tmp_path / "m" / f"shard-{i}.parquet", rows[i::2]) for i in range(2)]
    out = tmp_path / "results"
    result = es.run(cfg, shards, out / "estimate.json", out / "estimate.md", out / "estimate",
                    tmp_path / "server-pilot.log")
    saved = json.loads((out / "estimate.json").read_text())
    assert saved["pilot"]["requests"] == 8 and saved["pilot"]["calibration"] > 0
    # 8 requests for 3 in flight is below 4 per slot: said in the summary, with the size to ask for.
    assert saved["config"]["request_slots"] == 3
    assert "set it to at least 12" in saved["config"]["pilot_warning"]
    assert "set it to at least 12" in (out / "estimate.md").read_text()
    assert saved["projection"]["requests"] == 12 and saved["projection"]["shards"] == 2
    assert saved["pilot"]["a_per_prompt_token"] > 0
    assert saved["projection"]["gpu_hours"] > 0 and saved["projection"]["cost_usd"] > 0
    assert result["projection"]["wall_hours"] == saved["projection"]["wall_hours"]
    assert "Assumptions" in (out / "estimate.md").read_text()
    # Re-running reuses the pilot's journal: nothing is classified twice.
    journal = (out / "estimate" / "pilot.jsonl").read_text().splitlines()
    es.run(cfg, shards, out / "estimate.json", out / "estimate.md", out / "estimate", tmp_path / "server-pilot.log")
    assert (out / "estimate" / "pilot.jsonl").read_text().splitlines() == journal


def test_a_larger_pilot_size_draws_a_new_pilot_and_reuses_what_is_still_in_it(tmp_path):
    """Raising planning.pilot_size used to reuse the old pilot shard: "8 requests sampled ... 4 succeeded".
    The pilot depends on what it was drawn under; the report counts what it measured."""
    import json

    from standin import is_probe, read_request_log
    from standin.shards import make_config, make_video, manifest_rows, write_manifest

    media = tmp_path / "media"
    posts = [{"post_id": f"p{i}", "media_path": str(make_video(media / f"p{i % 3}.mp4", seconds=1 + i % 3)),
              "caption": "buy" if i % 2 else "hi", "transcript": "words " * (i * 5)} for i in range(16)]
    log = tmp_path / "requests.jsonl"
    cfg = make_config(tmp_path, media, log, ["--latency", "0.02"], classify={"concurrency": 2})
    rows = manifest_rows(cfg, posts)
    shards = [write_manifest(tmp_path / "m" / f"shard-{i}.parquet", rows[i::2]) for i in range(2)]
    out = tmp_path / "results"

    def estimate(pilot_size: int) -> dict:
        cfg["planning"]["pilot_size"] = pilot_size
        es.run(cfg, shards, out / "estimate.json", out / "estimate.md", out / "estimate", tmp_path / "pilot.log")
        return json.loads((out / "estimate.json").read_text())

    def sent() -> list[str]:
        return [e["request_id"] for e in read_request_log(log)
                if e["event"] == "received" and not is_probe(e["request_id"])]

    small = estimate(4)
    first = set(sent())
    assert small["pilot"]["requests"] == 4 and len(first) == 4
    large = estimate(8)
    assert large["pilot"]["requests"] == 8
    assert "8 requests sampled" in (out / "estimate.md").read_text()
    assert "8 succeeded" in (out / "estimate.md").read_text()
    pilot = set(pq.read_table(out / "estimate" / "pilot-labels.parquet").column("request_id").to_pylist())
    assert len(pilot) == 8
    again = sent()[len(first):]
    assert set(again) == pilot - first  # answers of requests still in the pilot are reused
    assert len(again) == len(set(again))
    estimate(8)  # unchanged: nothing is drawn or sent again
    assert len(sent()) == len(first) + len(again)
