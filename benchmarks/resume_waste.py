"""Resume waste: SIGKILL a classify job at about half its shard, rerun it, count the paid-twice requests.

    .venv/bin/python benchmarks/resume_waste.py [--requests 600] [--concurrency 16]

A request is "sent twice" when the stand-in received it in the killed run and again in the rerun.
Only requests in flight at the kill may be sent again: goal <= the concurrency, and 0 duplicate rows.
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--latency", type=float, default=0.05)
    args = ap.parse_args()
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
