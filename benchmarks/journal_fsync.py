"""Journal cost: append-and-flush per record with fsync per record vs fsync at most once a second.

    .venv/bin/python benchmarks/journal_fsync.py [--records 5000] [--dir results/]

Records are the size of a real classify record (~1 KB with raw text). Run it on the filesystem
the results live on (a network filesystem costs far more per fsync than a local disk).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

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


if __name__ == "__main__":
    main()
