"""Saturation: does the client keep every slot of the server busy?

    .venv/bin/python benchmarks/saturation.py [--requests 800] [--slots 16]

The stand-in runs its capacity model: ``--slots`` running requests, a FIFO waiting queue, service
time = 20 ms + prompt tokens / 5,000 tok/s + output tokens / 50 tok/s, and a heavy-tailed
(log-normal) prompt length. From the stand-in's request log the script rebuilds each request's
service interval and reports slot utilisation (achieved / ideal throughput) over the window in
which the client still had requests to send (the drain at the end is not the client's doing).
Runs: fixed concurrency equal to the slots, fixed concurrency with a small queue, adaptive on.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import tempfile
import time
from pathlib import Path

from _common import run_client, setup

from vidlabel.serve.settings import ServeSettings

LATENCY, PREFILL, DECODE = 0.02, 5000.0, 50.0


def utilisation(log: Path, slots: int) -> tuple[float, float, int]:
    events = [json.loads(line) for line in log.read_text().splitlines()]
    events = [e for e in events if not (e.get("request_id") or "smoke").startswith("smoke")]
    received = sorted(e["t"] for e in events if e["event"] == "received")
    done = [e for e in events if e["event"] == "completed" and e.get("status") == 200]
    start, end = received[0] + 0.5, received[-1]  # warm-up excluded; until the last request was sent
    busy = 0.0
    for e in done:
        service = LATENCY + e["prompt_tokens"] / PREFILL + e["completion_tokens"] / DECODE
        lo, hi = max(start, e["t"] - service), min(end, e["t"])
        busy += max(0.0, hi - lo)
    return busy / (slots * (end - start)), end - start, len(done)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=800)
    ap.add_argument("--slots", type=int, default=16)
    args = ap.parse_args()
    rng = random.Random(1)
    lengths = [min(200_000, int(rng.lognormvariate(7.6, 1.0))) for _ in range(args.requests)]  # chars
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        s = args.slots
        runs = [("fixed, concurrency = slots", s, False), ("fixed, concurrency = slots + 1/4", s + s // 4, False),
                ("adaptive (floor 4, ceiling 64)", s, True)]
        print(f"saturation: {args.requests} requests, {s} slots, service = {LATENCY * 1000:.0f} ms + "
              f"prompt/{PREFILL:.0f} + output/{DECODE:.0f} tok/s; prompt text chars log-normal "
              f"(median {sorted(lengths)[len(lengths) // 2]}, max {max(lengths)})")
        for i, (name, conc, adaptive) in enumerate(runs):
            log = work / f"run{i}.jsonl"
            cfg, rows = setup(work, args.requests, request_log=log, caption_len=lambda k: lengths[k],
                              faults=("--slots", str(s), "--latency", str(LATENCY), "--prefill-tokens-per-s",
                                      str(PREFILL), "--decode-tokens-per-s", str(DECODE)),
                              classify={"concurrency": conc, "max_tokens": 64, "request_timeout_s": 300,
                                        "adaptive_concurrency": {"enabled": adaptive, "floor": 4, "ceiling": 64}})
            settings = dataclasses.replace(ServeSettings.from_config(cfg).client, adaptive_interval_s=0.5)
            t0 = time.perf_counter()
            limits = asyncio.run(run_client(cfg, rows, settings, log.with_suffix(".server.log")))
            wall = time.perf_counter() - t0
            util, window, n = utilisation(log, s)
            extra = f", in-flight limit {min(limits)}..{max(limits)} (last {limits[-1]})" if limits else ""
            print(f"  {name:34s}: achieved/ideal = {util:.3f} over {window:.1f} s ({n} done, {wall:.1f} s wall){extra}")


if __name__ == "__main__":
    main()
