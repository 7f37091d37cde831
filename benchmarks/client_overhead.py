"""Client overhead: completed requests/s against a zero-latency stand-in at several concurrencies.

    .venv/bin/python benchmarks/client_overhead.py [--requests 4000] [--concurrency 16 64 256]

The stand-in answers at once, so the figure is what the client (and the stand-in, on the same
cores) can push; the goal is >= 1,000 req/s on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import resource
import tempfile
import time
from pathlib import Path

from _common import setup

from vidlabel.serve.client import ClassifyClient, ClientSettings, run
from vidlabel.serve.server import VLLMServer
from vidlabel.serve.settings import ServeSettings


def _cpu_of(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _own_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


async def one_round(cfg, rows, concurrency: int) -> tuple[float, int, float, float]:
    settings = dataclasses.replace(ServeSettings.from_config(cfg).client, concurrency=concurrency)
    with VLLMServer(ServeSettings.from_config(cfg), Path(cfg["results"]) / f"server-{concurrency}.log") as server:
        await server.wait_ready()
        async with ClassifyClient([(server.base_url, server.api_key)], settings) as client:
            await asyncio.gather(*(client.classify(r) for r in rows[:200]))  # warm-up
            t0, c0, s0 = time.perf_counter(), _own_cpu(), _cpu_of(server.proc.pid)
            recs = await asyncio.gather(*(client.classify(r) for r in rows))
            elapsed = time.perf_counter() - t0
            client_cpu, server_cpu = _own_cpu() - c0, _cpu_of(server.proc.pid) - s0
    n = len(rows)
    return n / elapsed, sum(r["status"] == "ok" for r in recs), 1000 * client_cpu / n, 1000 * server_cpu / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64, 256])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg, rows = setup(Path(tmp), args.requests)
        print(f"client_overhead: {args.requests} requests, zero-latency stand-in")
        for c in args.concurrency:
            rate, ok, client_ms, server_ms = run(one_round(cfg, rows, c))
            print(f"  concurrency {c:4d}: {rate:8.0f} completed req/s ({ok}/{len(rows)} ok); CPU per request: "
                  f"client {client_ms:.2f} ms, stand-in {server_ms:.2f} ms -> client alone could do "
                  f"{1000 / client_ms:.0f} req/s per core")


if __name__ == "__main__":
    main()
