"""Journal cost: append-and-flush per record with fsync per record vs fsync at most once a second; and
the cost of a durable atomic write (temp file, fsync, rename, fsync of the folder) against the same
write without the two fsyncs.

    .venv/bin/python benchmarks/journal_fsync.py [--records 5000] [--files 200] [--dir results/]

Records are the size of a real classify record (~1 KB with raw text); files the size of a label shard
of 500 rows. Run it on the filesystem the results live on (a network filesystem costs far more per
fsync than a local disk).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from vidlabel.core import io  # noqa: E402
from vidlabel.core.journal import Journal  # noqa: E402


def record(i: int) -> dict:
    return {"request_id": f"{i:024x}", "post_id": f"post{i}", "status": "ok", "error_kind": None, "error": None,
            "http_status": 200, "attempts": 1, "latency_s": 12.3, "started_at": 1.7e9, "finished_at": 1.7e9 + 12.3,
            "finish_reason": "stop", "prompt_tokens": 15800, "completion_tokens": 40, "est_prompt_tokens": 15500,
            "raw_text": '{"promotes_product": "yes", "mentions_food": "no"}' * 8,
            "answers": {"promotes_product": "yes", "mentions_food": "no"}, "retryable": False}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=5000)
    ap.add_argument("--files", type=int, default=200)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    base = Path(args.dir) if args.dir else None
    if base:
        base.mkdir(parents=True, exist_ok=True)
    print(f"journal_fsync: {args.records} records of ~{len(str(record(0)))} bytes in {base or tempfile.gettempdir()}")
    for policy in ("batch", "record"):
        with tempfile.TemporaryDirectory(dir=base) as tmp:
            path = Path(tmp) / "shard.jsonl"
            recs = [record(i) for i in range(args.records)]
            with Journal(path, key="request_id", fsync=policy) as journal:
                t0 = time.perf_counter()
                for rec in recs:
                    journal.append(rec)
                elapsed = time.perf_counter() - t0
            print(f"  fsync={policy:6s}: {args.records / elapsed:9.0f} records/s, {1e6 * elapsed / args.records:7.1f} us/record")
    atomic_writes(base, args.files)


def atomic_writes(base: Path | None, n: int) -> None:
    """A label shard's worth of rows written n times by io.write_parquet, durable and without the fsyncs."""
    import pyarrow as pa

    table = pa.table({"request_id": [f"{i:024x}" for i in range(500)],
                      "raw_text": ['{"promotes_product": "yes", "mentions_food": "no"}' * 8] * 500})
    for durable in (True, False):
        with tempfile.TemporaryDirectory(dir=base) as tmp:
            saved = io.fsync_file, io.fsync_directory
            if not durable:
                io.fsync_file = io.fsync_directory = lambda path: None
            try:
                t0 = time.perf_counter()
                for i in range(n):
                    io.write_parquet(table, Path(tmp) / f"shard-{i}.parquet")
                elapsed = time.perf_counter() - t0
                size_kb = (Path(tmp) / "shard-0.parquet").stat().st_size / 1024
            finally:
                io.fsync_file, io.fsync_directory = saved
        print(f"  atomic write of a {size_kb:.0f} KB Parquet file (500 rows), {'durable' if durable else 'no fsync'}: "
              f"{1e3 * elapsed / n:6.2f} ms/file")


if __name__ == "__main__":
    main()
