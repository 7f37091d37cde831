"""benchmarks/gpu_steady.py end to end on the stand-in: the job, the samplers, the steady window, the
decode replay, the table; then gpu_classify.py estimate set against the measured job."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from format_zoo import BENCHMARKS
from standin.shards import make_video

sys.path.insert(0, str(BENCHMARKS))
import gpu_breaker  # noqa: E402
import gpu_classify  # noqa: E402
import gpu_steady  # noqa: E402


def posts(tmp_path: Path, n: int) -> tuple[Path, Path]:
    media = tmp_path / "media"
    sources = [make_video(media / f"src{i}.mp4", seconds=2.0 + i, size="320x240") for i in range(2)]
    lines = ["post_id,video_path,caption"]
    for p in range(n):
        target = media / f"post{p:03d}.mp4"
        os.link(sources[p % 2], target)  # posts share sources, as the benchmark's media step makes them
        lines.append(f"post{p:03d},media/{target.name},caption {p}")
    table = tmp_path / "posts.csv"
    table.write_text("\n".join(lines) + "\n")
    return table, media


def test_steady_state_benchmark_on_the_standin(tmp_path, capsys):
    table, media = posts(tmp_path, 60)
    work = tmp_path / "work"
    common = ["--workdir", str(work), "--posts", str(table), "--media-root", str(media), "--standin"]
    # 2 running, the rest waiting: a queue forms; ~12 s of window, sends in its first half (the first 32
    # go at once, one more per answer after them).
    slow = ["--standin-args", "--slots 2 --latency 0.5"]
    # deccpu: OpenCV whatever `auto` stands for (the stand-in cannot import a GPU decoder); conc32: 32 in flight
    # whatever the default (at 64 all 60 would go at the start, none in the window); fixed: no adaptive
    # concurrency, which would lower the 32 toward its floor behind the 2 slots' queue.
    variant = "deccpu-conc32-fixed"
    assert gpu_steady.main([*common, *slow, "--variants", variant, "--min-requests", "20"]) == 0
    printed = capsys.readouterr().out
    row = next(r for r in json.loads((work / "gpu_classify.json").read_text()) if r["variant"] == variant)
    s = row["steady"]
    assert row["requests"] == 60 and row["by_kind"] == {"ok": 60} and not row["stopped_by_time_limit"]
    # The middle 80 % of completions, with the ramp and drain apart.
    assert s["window"]["answers"] + s["ramp"]["answers"] + s["drain"]["answers"] == 60
    assert 44 <= s["window"]["answers"] <= 50 and s["window"]["prompt_tok_s"] > 0 and s["window"]["req_s"] > 0
    # The evidence: the engine ran its 2 slots with a queue behind them, the client kept 32 in flight.
    assert s["engine_running_median"] == 2 and s["engine_waiting_median"] >= 1
    assert s["client_in_flight_median"] >= 10
    # /proc counts CPU in 10 ms ticks: the stand-in's main thread may spend less than one in the window (CI
    # saw 0.0), so only the whole process is asked to show; the split itself is checked on recorded samples below.
    cpu = s["cpu_s_per_answer"]
    assert cpu["api"] > 0 and 0 <= cpu["api_main_thread"] <= cpu["api"]
    # Every request passed the stand-in's waiting queue (2 slots, 32 at once): vLLM's queue-time histogram
    # counted them (and the job's calibration requests) up to its last 1 s reading before the server stopped,
    # the later ones after several others' service.
    q = s["engine_queue"]
    assert 40 <= q["requests"] <= 70 and q["over_60_s"] == 0
    assert 0.3 <= q["p90_at_most_s"] <= q["longest_at_most_s"] and q["longest_at_most_s"] >= 2.5
    assert (f"{variant}: engine queue (vllm:request_queue_time_seconds, whole job): {q['requests']} requests, "
            "0 waited over 60 s") in printed
    # The KV cache the server reports (the stand-in's info gauge: 65,536 blocks of 16), in mean requests.
    assert s["kv_cache_tokens"] == 2 ** 20 and s["kv_cache_requests"] > 1
    assert f"{variant}: KV cache 1,048,576 tokens (vllm:cache_config_info): " in printed
    # ... set against the setting and what the client kept (the two differ where the fit lowers the count).
    assert (f"against classify.concurrency 32 (the client kept {s['client_in_flight_median']:g} in flight, "
            "median)") in printed
    rep = s["replay"]
    # The window's decodes are those of the requests sent in it: the 32 sent at the start were decoded
    # before it, so fewer videos than answers (one video per request here), and each distinct file among
    # them (post N links source N % 2) decoded once.
    records = [json.loads(line) for line in (work / "runs" / variant / "journal.jsonl").read_text().splitlines()]
    lo, hi = gpu_steady.window_bounds([r["finished_at"] for r in records])
    sent = [r for r in records if lo < r["started_at"] <= hi]
    sent_in_window = len(sent)
    assert 0 < sent_in_window < s["window"]["answers"]
    assert rep["decoded_files"] == len({int(r["post_id"][4:]) % 2 for r in sent}) and rep["decode_cpu_s_per_answer"] > 0
    assert abs(rep["videos_per_answer"] - sent_in_window / s["window"]["answers"]) < 1e-9
    assert abs(rep["decode_cpu_s_per_answer"] - rep["decode_cpu_s_per_video"] * rep["videos_per_answer"]) < 1e-9
    assert s["cpus"] == len(os.sched_getaffinity(0)) and s["decode"] == "cpu"
    # The 1 s series behind the figures are kept for reading the run again (no GPU here: no utilization).
    series = json.loads((work / "runs" / variant / "samples.json").read_text())
    assert series["gpu_util"] == [] and len(series["engine_running_waiting"]) >= 5
    assert max(r for _, r, _ in series["engine_running_waiting"]) == 2
    assert f"| {variant} |" in printed and f"{variant}: " in printed
    # The pilot's projection next to this measured job, in the same workdir.
    assert gpu_classify.main(["estimate", *common, "--variant", variant, "--pilot-size", "8"]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith(f"estimate ({variant})")][-1]
    assert f"measured job ({variant}, 60 requests)" in line and "projected / measured" in line


def test_window_cpu_split_and_verdict_on_recorded_samples():
    records = [{"request_id": str(i), "status": "ok", "started_at": float(i), "finished_at": i + 10.0,
                "prompt_tokens": 1000} for i in range(100)]
    lo, hi = gpu_steady.window_bounds([r["finished_at"] for r in records])
    assert (lo, hi) == (20.0, 99.0)
    assert gpu_steady.phase(records, lo, hi)["answers"] == 79
    assert list(gpu_steady.in_flight(records, [5.5, 50.5])) == [6, 10]
    proc = gpu_steady.ProcSampler(root=1)
    proc.cmdlines = {10: "VLLM::APIServer_0", 20: "VLLM::EngineCore_DP0"}
    # Each process's total (key (pid, None): /proc/<pid>/stat, threads that exited included) and its main
    # thread's; the API server's pool threads used 7.9 + 0.9 s, and 1.5 s more on a thread that exited
    # before the last sample (a sum over the live threads would miss it).
    proc.samples = [(20.0, {(10, None): 6.0, (10, 10): 1.0, (20, None): 2.0, (20, 20): 2.0}),
                    (99.0, {(10, None): 6.0 + 2.0 + 7.9 + 0.9 + 1.5, (10, 10): 3.0, (20, None): 81.0, (20, 20): 80.0}),
                    (120.0, {(10, None): 99.0, (10, 10): 99.0})]  # after the window: not counted
    split = gpu_steady.cpu_split(proc, lo, hi, 79)
    assert abs(split["api"] - (2.0 + 7.9 + 0.9 + 1.5) / 79) < 1e-9 and abs(split["engine"] - 1.0) < 1e-9
    assert abs(split["api_main_thread"] - 2.0 / 79) < 1e-9
    assert abs(split["api_pool_threads"] - (7.9 + 0.9 + 1.5) / 79) < 1e-9
    assert "API servers" in gpu_steady.verdict({"gpu_busy": 70, "engine_waiting_median": 0, "engine_running_median": 9})
    assert "GPU sets the pace" in gpu_steady.verdict({"gpu_busy": 95, "engine_waiting_median": 3,
                                                      "engine_running_median": 32})
    assert gpu_steady.parse_cpus("0-3,8") == {0, 1, 2, 3, 8}


def test_mixed_posts_are_measured_per_post_type(tmp_path, capsys):
    """The GPU check's mixed set on the stand-in: photo posts and carousels of real photos (phone sizes,
    JPEG and WebP, some sideways) and clips beside the video posts, planned into one shard grouped by
    post type; every request answered, its estimate within 2 % of the served prompt tokens, and each
    post type's steady window in the JSON and the table."""
    work = tmp_path / "work"
    assert gpu_classify.main(["media", "--workdir", str(work), "--kind", "testsrc2", "--sources", "3", "--posts", "24",
                              "--photo-posts", "4", "--carousels", "14", "--jobs", "2"]) == 0
    slow = ["--standin-args", "--slots 2 --latency 0.1"]
    assert gpu_steady.main(["--workdir", str(work), "--standin", *slow, "--variants", "default", "--min-requests", "10",
                            "--no-replay", "--jobs", "2"]) == 0
    printed = capsys.readouterr().out
    row = next(r for r in json.loads((work / "gpu_classify.json").read_text()) if r["variant"] == "default")
    assert set(row["by_kind"]) == {"ok"}  # the broken files are excluded by the manifest, the rest answered
    types = row["steady"]["by_post_type"]
    assert {"video", "carousel"} <= set(types) and set(types) & {"slideshow", "photo"}
    assert sum(t["requests"] for t in types.values()) == row["requests"]
    for post_type, entry in types.items():
        assert entry["within_2pct"] == entry["requests"] == entry["by_status"]["ok"], (post_type, entry)
    for post_type in ("video", "carousel"):
        assert types[post_type]["window"]["prompt_tok_s"] > 0 and types[post_type]["window"]["answers"] >= 8
    assert "| default | carousel |" in printed
    # The shard sends each type in a phase of its own.
    import pyarrow.parquet as pq

    sent = pq.read_table(work / "data-raw" / "manifest" / "shard-0.parquet", columns=["post_type"]).column(
        "post_type").to_pylist()
    assert sent == sorted(sent, key=gpu_classify.POST_TYPE_ORDER.index)


def test_the_steady_run_after_the_breakers_broken_run_is_its_fixed_run(tmp_path):
    """gpu_breaker.py --shared-run-dir journals its broken runs into the variant's run folder: the steady run
    that follows reports what the journal held before it, whether every request of the shard ended ok, and
    the breaker's acceptance with itself as the fixed run."""
    run_dir = tmp_path / "runs" / "default-@mixed"
    run_dir.mkdir(parents=True)
    journal = run_dir / "journal.jsonl"
    retryable = {"request_id": "a", "status": "error", "error_kind": "server", "retryable": True}
    journal.write_text(json.dumps(retryable) + "\n" + json.dumps({**retryable, "request_id": "b"}) + "\n")
    before = gpu_steady.journal_state(journal)
    assert before == {"records": 2, "by_status": {"server": 2}, "terminal": 0}
    assert gpu_steady.journal_state(tmp_path / "none.jsonl") == {"records": 0, "by_status": {}, "terminal": 0}
    records = [{"request_id": str(i), "status": "ok", "est_prompt_tokens": 1010 if i else 1100, "prompt_tokens": 1000}
               for i in range(3)]
    row = {"variant": "default-@mixed", "error": None, "by_kind": {"ok": 3}, "journal_before": before}
    row["check"] = gpu_steady.check(row, records, 3)
    assert row["check"] == {"shard_requests": 3, "records": 3, "ok": 3, "within_2pct": 2, "all_ok": True,
                            "all_within_2pct": False}
    (tmp_path / "gpu_breaker.json").write_text(json.dumps({
        "run_dir": str(run_dir), "broken_passed": True,
        "broken_runs": [{"ready_to_stop_s": 2.5, "error": "... No module named 'PyNvVideoCodec' ..."}]}))
    lines = gpu_steady.check_lines(row, tmp_path)
    assert lines[0].startswith("default-@mixed: the journal held 2 records before this run (0 terminal")
    assert "3 of the shard's 3 requests ended ok; 2 of 3 estimates within ±2 %" in lines[1]
    assert lines[2].startswith("breaker acceptance (default-@mixed is the fixed run): 1 broken run(s) stopped 2.5 s")
    assert lines[2].endswith("-> PASSED") and row["breaker_acceptance"] is True
    # A run cut short is no fixed run that labelled every post.
    short = {**row, "error": "KeyboardInterrupt: ", "by_kind": {"ok": 2}, "stopped_by_time_limit": True}
    short["check"] = gpu_steady.check(short, records[:2], 3)
    lines = gpu_steady.check_lines(short, tmp_path)
    assert "2 of the shard's 3 requests ended ok (NOT every request" in lines[1] and "--max-request-phase-s" in lines[1]
    assert lines[2].endswith("-> FAILED")
    # Every request answered before the cut, the job stopped before its labels: no "NOT every request".
    cut = {**row, "error": "JobInterrupted: shard 0: stopped by SIGINT", "stopped_by_time_limit": True}
    cut["check"] = gpu_steady.check(cut, records, 3)
    line = gpu_steady.check_lines(cut, tmp_path)[1]
    assert "3 of the shard's 3 requests ended ok (every request answered, but the job ended before it wrote" in line
    assert "NOT" not in line and cut["check"]["all_ok"] is False


def test_the_breakers_broken_runs_send_videos_between_other_posts(tmp_path):
    """--interleave: the shard prepared for the steady run is grouped by post type, videos first; the broken
    runs send its requests interleaved, the other types first and a video after each, nothing lost."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    types = ["video"] * 5 + ["photo", "slideshow", "carousel"]
    shard = tmp_path / "data-raw" / "manifest" / "shard-0.parquet"
    shard.parent.mkdir(parents=True)
    pq.write_table(pa.table({"request_id": [f"r{i}" for i in range(8)], "post_type": types}), shard)
    out = gpu_breaker.interleaved(shard)
    assert out.parent != shard.parent  # the manifest's folder globs shard-*.parquet
    sent = pq.read_table(out).to_pylist()
    assert [r["post_type"] for r in sent] == ["photo", "video", "slideshow", "video", "carousel", "video", "video",
                                              "video"]
    assert sorted(r["request_id"] for r in sent) == [f"r{i}" for i in range(8)]
    assert gpu_breaker.post_type_order(out, first=4) == "photo video slideshow video ..."


def test_what_the_engine_held_while_the_gpu_was_idle():
    gpu = [(10.0, 95.0), (11.0, 0.0), (12.0, 2.0), (13.0, 90.0), (14.0, 0.0), (30.0, 0.0)]  # 30 s: outside
    engine = [(10.1, 20.0, 0.0), (11.2, 0.0, 0.0), (11.9, 18.0, 1.0), (14.4, 22.0, 3.0)]
    idle = gpu_steady.idle_seconds(gpu, engine, 10.0, 20.0)
    assert idle == {"samples": 3, "engine_running_median": 18.0, "engine_empty": 1, "engine_waiting_median": 1.0}
    assert gpu_steady.idle_seconds([(10.0, 80.0)], engine, 10.0, 20.0) is None


def test_engine_queue_waits_from_vllm_s_histogram():
    # /metrics as vLLM 0.26 writes the histogram, two engines (data parallel): counts are cumulative per bound.
    def engine(i, counts):
        bounds = ["0.3", "1.0", "5.0", "60.0", "120.0", "240.0", "+Inf"]
        label = f'engine="{i}",model_name="m"'
        return [f'vllm:request_queue_time_seconds_bucket{{{label},le="{b}"}} {float(n)}'
                for b, n in zip(bounds, counts)]
    text = "\n".join(["# TYPE vllm:request_queue_time_seconds histogram", *engine(0, [10, 40, 80, 97, 99, 100, 100]),
                      *engine(1, [0, 0, 50, 90, 95, 100, 100]),
                      'vllm:request_queue_time_seconds_count{engine="0"} 100.0',
                      'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0'])
    buckets = gpu_steady.queue_time_buckets(text)
    assert buckets[0.3] == 10 and buckets[60.0] == 187 and buckets[float("inf")] == 200
    q = gpu_steady.queue_waits(buckets)
    # 13 waited over 60 s; 180 of 200 (90 %) are within 60 s (187), not within 5 s (130); the last 2 within 240 s.
    assert q == {"requests": 200, "over_60_s": 13, "p90_at_most_s": 60.0, "longest_at_most_s": 240.0}
    assert gpu_steady.queue_waits({}) is None


def test_variant_words_reach_the_job_s_settings(tmp_path):
    from argparse import Namespace

    from vidlabel.serve.settings import ServeSettings

    args = Namespace(workdir=str(tmp_path), posts=None, media_root=None, transcripts=[], jobs=2, tokenizer=None,
                     model="Qwen/Qwen2.5-VL-7B-Instruct", server_args="", startup_timeout=600, audio="transcript")
    client = ServeSettings.from_config(gpu_classify.variant_config(args, "adapt48-conc16-@x")[1]).client
    assert (client.adaptive, client.adaptive_ceiling, client.concurrency) == (True, 48, 16)
    client = ServeSettings.from_config(gpu_classify.variant_config(args, "adapt")[1]).client
    assert client.adaptive and client.adaptive_ceiling == 64 and client.adaptive_floor == 4  # the schema's
    assert ServeSettings.from_config(gpu_classify.variant_config(args, "default")[1]).client.adaptive
    fixed = ServeSettings.from_config(gpu_classify.variant_config(args, "fixed-conc16-@f")[1]).client
    assert (fixed.adaptive, fixed.concurrency) == (False, 16)
    more = ServeSettings.from_config(gpu_classify.variant_config(args, "conc64-seqs64-@more")[1])
    assert (more.client.concurrency, more.server.max_num_seqs) == (64, 64)
    fewer = ServeSettings.from_config(gpu_classify.variant_config(args, "conc32-seqs32-@fewer")[1])
    assert (fewer.client.concurrency, fewer.server.max_num_seqs) == (32, 32)
    # The 72B's FP8 attention: the flag reaches the server's words (and with them the answers' settings).
    kv = ServeSettings.from_config(gpu_classify.variant_config(args, "fp8-kvfp8-@72b")[1]).server
    assert "--kv-cache-dtype fp8" in kv.args and kv.quantization == "fp8"
