"""ETA accuracy: pilot on 5 % of a heterogeneous set, projected vs actual wall time.

    .venv/bin/python benchmarks/eta_accuracy.py [--requests 2000] [--pilot-share 0.05] [--dir /tmp/vidlabel-eta]

The stand-in server (tests/standin/server.py) serves ``--slots`` requests at once with a service
time proportional to tokens (``--prefill-tokens-per-s``, ``--decode-tokens-per-s``, plus a fixed
``--latency``); its video tokens come from the file size, so sparse files of log-normal sizes make a
heavy-tailed set. The manifest's estimates are the true counts with 15 % log-normal noise. The
pilot (``vidlabel.serve.pilot.run``) classifies a stratified 5 % and projects the whole shard; then
the whole shard is classified by ``vidlabel.serve.classify.run_shard`` and timed. Goal (issue 5): within +-15 %.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests"))

from standin.shards import make_config, manifest_rows, write_manifest  # noqa: E402

from vidlabel.serve import pilot  # noqa: E402
from vidlabel.serve import classify


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--pilot-share", type=float, default=0.05)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prefill-tokens-per-s", type=float, default=60000)
    ap.add_argument("--dir", default="/tmp/vidlabel-eta")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    work = Path(args.dir)
    shutil.rmtree(work, ignore_errors=True)
    media = work / "media"
    media.mkdir(parents=True)
    rng = np.random.default_rng(args.seed)
    n = args.requests
    tokens = np.clip(rng.lognormal(np.log(12000), 0.8, n), 500, 120000).astype(int)
    posts = []
    for i, t in enumerate(tokens):
        path = media / f"v{i:05d}.mp4"
        with open(path, "wb") as fh:  # sparse: only the size matters to the stand-in
            fh.truncate(int(t))
        posts.append({"post_id": f"v{i:05d}", "media_path": str(path), "caption": "buy" if i % 3 else "pizza",
                      "transcript": "word " * int(rng.integers(0, 200))})
    faults = ["--video-tokens", "bytes", "--bytes-per-video-token", "1",
              "--slots", str(args.slots), "--max-model-len", "200000",
              "--prefill-tokens-per-s", str(args.prefill_tokens_per_s), "--decode-tokens-per-s", "2000",
              "--latency", "0.01"]
    cfg = make_config(work, media, faults=faults,
                      classify={"concurrency": args.concurrency, "request_timeout_s": 600, "max_tokens": 64,
                                "progress_interval_s": 30})
    cfg["planning"]["pilot_size"] = max(3, int(round(n * args.pilot_share)))
    cfg["planning"]["concurrent_jobs"] = 1
    rows = manifest_rows(cfg, posts)
    noise = rng.lognormal(0, 0.15, n)
    for r, t, e in zip(rows, tokens, noise):
        text = len(r["prompt"]) // 4
        r["est_visual_tokens"] = int(t * e)
        r["est_text_tokens"] = text
        r["est_prompt_tokens"] = int(t * e) + text
    shard = write_manifest(work / "manifest" / "shard-0.parquet", rows)

    t0 = time.perf_counter()
    result = pilot.run(cfg, [shard], work / "estimate.json", work / "estimate.md", work / "estimate",
                          work / "server-pilot.log", seed=args.seed)
    t_pilot = time.perf_counter() - t0
    projected_s = result["projection"]["wall_hours"] * 3600
    naive_s = result["projection"]["naive_wall_hours_per_item_mean"] * 3600

    t0 = time.perf_counter()
    classify.run_shard(cfg, shard, work / "labels.parquet", work / "journal.jsonl", work / "server.log", 0)
    actual_s = time.perf_counter() - t0
    err = projected_s / actual_s - 1
    print(f"requests {n}, pilot {cfg['planning']['pilot_size']} ({args.pilot_share:.0%}, {t_pilot:.1f} s); "
          f"prompt tokens p50 {np.median(tokens):,.0f}, p99 {np.percentile(tokens, 99):,.0f}")
    print(f"projected {projected_s:.1f} s, actual {actual_s:.1f} s: error {err:+.1%} (goal within +-15%)")
    print(f"naive per-item projection from the pilot's wall time: {naive_s:.1f} s ({naive_s / actual_s - 1:+.1%})")
    print(json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in result["pilot"].items()}))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
