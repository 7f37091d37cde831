"""Resume waste: SIGKILL a classify job at about half its shard, rerun it, count the paid-twice requests.

    .venv/bin/python benchmarks/resume_waste.py [--requests 600] [--concurrency 16]
    .venv/bin/python benchmarks/resume_waste.py --reshard 2,3,6,2 [--requests 600]

A request is "sent twice" when the stand-in received it in the killed run and again in the rerun.
Only requests in flight at the kill may be sent again: goal <= the concurrency, and 0 duplicate rows.

``--reshard``: the same posts dealt to each shard count in turn (post i to shard i % n), every shard's
job run in the same journal folder; the first run against a server that leaves half of the posts
unanswered (busy), the others against another server, which answers them and, being another server,
every post again (its answers replace the first server's). Printed per run: requests sent, and labels
that are not the request's newest answer. Goal: after the second run 0 sent, 0 stale.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
from _common import ROOT, setup
from standin import is_probe
from standin.shards import write_manifest

from vidlabel.core.journal import iter_records


def reshard(args, counts: list[int]) -> None:
    from vidlabel.serve.classify import ShardIncomplete, run_shard

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        log = work / "requests.jsonl"
        latest: dict[str, tuple[float, str]] = {}  # request -> (finished_at, server) of its newest record
        for run, n in enumerate(counts):
            busy = ("--error-on", "buy=503:The engine is currently busy and cannot accept new requests.")
            faults = ("--latency", str(args.latency)) + (("--standin-version", "0.26.1") if run else busy)
            cfg, rows = setup(work, args.requests, request_log=log, faults=faults,
                              classify={"concurrency": args.concurrency, "max_attempts": 2})
            before = len(_received(log))
            t0 = time.monotonic()
            labels = []
            for shard in range(n):
                manifest = write_manifest(work / f"manifest-{run}" / f"shard-{shard}.parquet", rows[shard::n])
                out = work / f"labels-{run}" / f"shard-{shard}.parquet"
                try:
                    run_shard(cfg, manifest, out, work / "journal" / f"shard-{shard}.jsonl", work / "server.log",
                              shard)
                except ShardIncomplete:
                    continue
                labels += pq.read_table(out, columns=["request_id", "finished_at", "server"]).to_pylist()
            sent = _received(log)[before:]
            for row in labels:
                if row["finished_at"] > latest.get(row["request_id"], (float("-inf"), ""))[0]:
                    latest[row["request_id"]] = (row["finished_at"], row["server"])
            stale = sum(1 for row in labels if (row["finished_at"], row["server"]) != latest[row["request_id"]])
            print(f"run {run + 1}: {n} shards, {time.monotonic() - t0:.1f} s: {len(sent)} requests sent "
                  f"({len(set(sent))} distinct) for {len(rows)}; labels: {len(labels)} rows, {stale} not the newest "
                  f"answer; servers {sorted({row['server'] for row in labels})}")


def _received(log: Path) -> list[str]:
    if not log.exists():
        return []
    events = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return [e["request_id"] for e in events if e["event"] == "received" and not is_probe(e["request_id"])]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--latency", type=float, default=0.05)
    ap.add_argument("--reshard", default=None, metavar="N,N,...", help="shard counts, one run each (module docstring)")
    args = ap.parse_args()
    if args.reshard:
        reshard(args, [int(n) for n in args.reshard.split(",")])
        return
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        log = work / "requests.jsonl"
        cfg, rows = setup(work, args.requests, request_log=log, faults=("--latency", str(args.latency)),
                          classify={"concurrency": args.concurrency})
        manifest, labels, journal = work / "shard.parquet", work / "labels.parquet", work / "journal.jsonl"
        write_manifest(manifest, rows)
        (work / "cfg.json").write_text(json.dumps(cfg))
        argv = [sys.executable, str(ROOT / "tests" / "standin" / "job.py"), str(work / "cfg.json"), str(manifest),
                str(labels), str(journal), str(work / "server.log"), "0"]
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        job = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while not journal.exists() or sum(1 for _ in iter_records(journal)) < args.requests // 2:
            if job.poll() is not None:
                raise SystemExit(f"the job ended before the kill (exit status {job.returncode})")
            time.sleep(0.01)
        job.send_signal(signal.SIGKILL)
        job.wait()
        killed_at = time.time()
        done_first = sum(1 for _ in iter_records(journal))
        rc = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
        events = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        events = [e for e in events if e["event"] == "received" and not is_probe(e["request_id"])]
        first = {e["request_id"] for e in events if e["t"] < killed_at}
        second = [e["request_id"] for e in events if e["t"] >= killed_at]
        twice = first & set(second)
        table = pq.read_table(labels)
        ids = table.column("request_id").to_pylist()
        print(f"resume_waste: {args.requests} requests, concurrency {args.concurrency}, SIGKILL after "
              f"{done_first} journaled; rerun exit status {rc}")
        print(f"  sent twice: {len(twice)} (goal <= {args.concurrency}); rerun sent {len(second)} requests "
              f"for {args.requests - done_first} unfinished")
        print(f"  labels: {len(ids)} rows, {len(ids) - len(set(ids))} duplicate request_ids, "
              f"{args.requests - len(set(ids))} missing, {sum(s == 'ok' for s in table.column('status').to_pylist())} ok")


if __name__ == "__main__":
    main()
