"""Queue waits where the KV cache holds few requests (a 72B on one GPU): fixed concurrency against adaptive
and against the count fitted to the KV cache (classify.in_flight_from_kv_cache), alone and moved by adaptive
concurrency from there (the default).

    .venv/bin/python benchmarks/queue_wait.py [--requests 400] [--kv-tokens 8000] [--concurrency 32]

vLLM admits a waiting request only when its whole prompt fits the free KV cache, first come first
served (docs/serving.md, "How long a request waits in the engine"), so with more requests in flight
than the cache holds the rest wait, and by Little's law each waits about (in flight - running) x mean
prompt / throughput. The stand-in runs that admission (``--kv-capacity-tokens``) with a service time
of 20 ms + prompt tokens / ``--prefill`` per request: a scaled-down 72B FP8 on one H200 (its KV cache
held 162,512 tokens, about 10 requests of the mixed set's 16k; here ``--kv-tokens`` / the median
prompt, the same ratio by default). From the stand-in's request log each request's admission is its
completion less its service time; its queue wait is admission less arrival.

Per run: prompt tok/s while the client still had requests to send, the engine queue's median, 90th
percentile and longest wait, each also in service times of a median request (what carries over to the
GPU, where a median request of the mixed set is ~3 s of a 72B's prefill at 5,000 tok/s), and the
client's in-flight limit (adaptive; fitted: the count read from the server's KV cache at the start).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from _common import run_client, setup

from vidlabel.serve.settings import ServeSettings

LATENCY = 0.02


def waits(log: Path, prefill: float) -> tuple[list[float], float, float]:
    """(each answered request's queue wait, prompt tok/s while requests were still arriving, that window's s)."""
    events = [json.loads(line) for line in log.read_text().splitlines()]
    events = [e for e in events if not (e.get("request_id") or "smoke").startswith(("smoke", "calib"))]
    arrived = {e["request_id"]: e["t"] for e in events if e["event"] == "received"}
    done = [e for e in events if e["event"] == "completed" and e.get("status") == 200 and e["request_id"] in arrived]
    queued = [max(0.0, e["t"] - (LATENCY + e["prompt_tokens"] / prefill) - arrived[e["request_id"]]) for e in done]
    start, end = min(arrived.values()) + 0.5, max(arrived.values())
    tokens = sum(e["prompt_tokens"] for e in done if start < e["t"] <= end)
    return queued, tokens / (end - start) if end > start else 0.0, end - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--kv-tokens", type=int, default=8000, help="the KV cache, tokens (~10 median requests)")
    ap.add_argument("--prefill", type=float, default=800.0, help="prompt tok/s of one running request")
    ap.add_argument("--concurrency", type=int, default=32, help="classify.concurrency (vidlabel's default)")
    args = ap.parse_args()
    rng = random.Random(7)
    # Prompt text: log-normal, median ~3,200 chars (~800 tokens at the stand-in's 4 chars a token), a long tail.
    lengths = [min(12_000, int(rng.lognormvariate(8.07, 0.5))) for _ in range(args.requests)]
    c = args.concurrency
    # (name, classify.concurrency, adaptive, fitted to the KV cache as a shard job fits it)
    runs = [(f"fixed, concurrency {c}", c, False, False), (f"adaptive (floor 4, ceiling {c})", c, True, False),
            ("fixed, concurrency 12 (what the KV cache holds, + 2)", 12, False, False),
            (f"fitted to the KV cache, at most {c}, fixed", c, False, True),
            (f"fitted, then adaptive (floor 4, ceiling {c}; the default)", c, True, True)]
    with tempfile.TemporaryDirectory() as tmp:
        print(f"queue_wait: {args.requests} requests, KV cache {args.kv_tokens:,} tokens, service 20 ms + prompt / "
              f"{args.prefill:.0f} tok/s; prompt text log-normal (median {sorted(lengths)[len(lengths) // 2]:,} "
              "chars)")
        for i, (name, concurrency, adaptive, fit) in enumerate(runs):
            work = Path(tmp) / f"run{i}"
            work.mkdir()
            log = work / "requests.jsonl"
            cfg, rows = setup(work, args.requests, request_log=log, caption_len=lambda k: lengths[k],
                              faults=("--slots", "64", "--kv-capacity-tokens", str(args.kv_tokens),
                                      "--latency", str(LATENCY), "--prefill-tokens-per-s", str(args.prefill)),
                              classify={"concurrency": concurrency, "max_tokens": 64, "request_timeout_s": 600,
                                        "adaptive_concurrency": {"enabled": adaptive, "floor": 4, "ceiling": c}})
            settings = dataclasses.replace(ServeSettings.from_config(cfg).client, adaptive_interval_s=0.5)
            t0 = time.perf_counter()
            limits = asyncio.run(run_client(cfg, rows, settings, work / "server.log", fit=fit))
            wall = time.perf_counter() - t0
            queued, tok_s, window = waits(log, args.prefill)
            done = [json.loads(x) for x in log.read_text().splitlines()]
            prompts = sorted(e["prompt_tokens"] for e in done if e["event"] == "completed" and e.get("status") == 200)
            service = LATENCY + prompts[len(prompts) // 2] / args.prefill  # a median request's
            q = sorted(queued)
            p50, p90, top = statistics.median(q), q[int(0.9 * (len(q) - 1))], q[-1]
            limit = f"; in-flight limit {min(limits)}..{max(limits)} (last {limits[-1]})" if limits else ""
            print(f"  {name:52s}: {tok_s:,.0f} prompt tok/s over {window:.0f} s; queue wait median {p50:.1f} s, "
                  f"p90 {p90:.1f} s, longest {top:.1f} s = {p50 / service:.1f} / {p90 / service:.1f} / "
                  f"{top / service:.1f} median services ({wall:.0f} s wall{limit})")


if __name__ == "__main__":
    main()
