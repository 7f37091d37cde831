"""Scale: 1,000,000 synthetic posts through the data stages (manifest with estimates and balancing).

    .venv/bin/python benchmarks/scale.py [--posts 1000000] [--shards 512] [--dir /tmp/vidlabel-scale]

Each stage runs in its own Python process, so its wall time and peak memory (ru_maxrss) are its
own. Goal (issue 5): <= 60 s and <= 4 GB for the data stages. Add a stage by writing a function
``stage_<name>(workdir, config, args)`` and appending its name to ``STAGES`` (merge and aggregate
follow the manifest: their inputs are the manifest's outputs plus synthetic label shards).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from vidlabel import config as cfgmod  # noqa: E402

STAGES = ["manifest"]
RESOLUTIONS = np.array([(720, 1280), (1080, 1920), (1280, 720), (1920, 1080), (480, 854), (360, 640)])
WORDS = np.array("the a product buy great shoes today check link bio love this video new sale".split())


def make_config(workdir: Path, shards: int) -> dict:
    return cfgmod.validate({"posts": str(workdir / "posts.parquet"), "media_root": str(workdir / "media"),
                            "results": str(workdir / "results"),
                            # Qwen2.5-VL-72B serves 128k; seed 000 saw prompts up to ~123k tokens.
                            "classify": {"shards": shards, "max_model_len": 131072}})


def make_data(workdir: Path, n: int, seed: int = 0, transcript_chunks: int = 4) -> None:
    """Synthetic inventory (heavy-tailed durations, mixed resolutions) and transcript chunks."""
    rng = np.random.default_rng(seed)
    ids = np.char.add("p", np.arange(n).astype(str))
    dur = np.clip(rng.lognormal(np.log(30), 1.0, n), 1, 3600)
    res = RESOLUTIONS[rng.integers(0, len(RESOLUTIONS), n)]
    bad = rng.random(n) < 0.005
    paths = np.char.add(np.char.add(str(workdir / "media") + "/", ids), ".mp4")
    # Captions/transcripts: a few repeated snippets (the content does not matter, the length does).
    snippets = [" ".join(rng.choice(WORDS, k)) for k in (3, 8, 20, 60, 150)]
    cap = np.array(snippets, dtype=object)[rng.integers(0, 5, n)]
    inv = pa.table({
        "post_id": ids, "source_path": paths, "video_path": paths, "caption": cap,
        "size_bytes": (dur * 250_000).astype(np.int64), "duration_s": np.where(bad, np.nan, dur),
        "fps": np.where(bad, np.nan, 30.0), "width": res[:, 1], "height": res[:, 0],
        "video_codec": np.full(n, "h264"), "has_audio": rng.random(n) < 0.9,
        "probe_error": pa.array(np.where(bad, "moov atom not found", None), pa.string()),
    })
    (workdir / "transcripts").mkdir(parents=True, exist_ok=True)
    pq.write_table(inv, workdir / "inventory.parquet")
    ok = ~bad
    tr_ids = ids[ok]
    text = np.array(snippets, dtype=object)[rng.integers(0, 5, len(tr_ids))]
    status = np.where(rng.random(len(tr_ids)) < 0.9, "ok", "no_audio")
    chunk = rng.integers(0, transcript_chunks, len(tr_ids))
    for i in range(transcript_chunks):
        m = chunk == i
        pq.write_table(pa.table({
            "post_id": tr_ids[m], "text": pa.array(np.where(status[m] == "ok", text[m], None), pa.string()),
            "language": np.full(m.sum(), "en"), "segments": np.full(m.sum(), "[]"), "status": status[m],
            "error": pa.nulls(m.sum(), pa.string()), "audio_s": dur[ok][m]}),
            workdir / "transcripts" / f"chunk-{i}.parquet")


def stage_manifest(workdir: Path, config: dict, args) -> dict:
    from vidlabel import manifest

    out = workdir / "results" / "manifest"
    shards = [out / f"shard-{i}.parquet" for i in range(args.shards)]
    manifest.build(config, workdir / "inventory.parquet", sorted((workdir / "transcripts").glob("chunk-*.parquet")),
                   [], shards, out / "excluded.parquet", out / "plan.csv")
    import csv
    loads = [int(r["est_prompt_tokens"]) for r in csv.DictReader(open(out / "plan.csv"))]
    return {"requests": sum(pq.read_metadata(p).num_rows for p in shards),
            "excluded": pq.read_metadata(out / "excluded.parquet").num_rows,
            "shard_max_over_mean": round(max(loads) / (sum(loads) / len(loads)), 4)}


def run_stage(name: str, args) -> dict:
    """In this (child) process: run one stage, report its time and peak memory as JSON."""
    workdir = Path(args.dir)
    config = make_config(workdir, args.shards)
    t0 = time.perf_counter()
    extra = globals()[f"stage_{name}"](workdir, config, args)
    wall = time.perf_counter() - t0
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"stage": name, "wall_s": round(wall, 2), "peak_rss_mb": round(peak_mb), **extra}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--posts", type=int, default=1_000_000)
    ap.add_argument("--shards", type=int, default=512)
    ap.add_argument("--dir", default="/tmp/vidlabel-scale")
    ap.add_argument("--stage", help=argparse.SUPPRESS)  # internal: run one stage in this process
    ap.add_argument("--stages", default=",".join(STAGES), help="comma-separated stages to run")
    args = ap.parse_args()
    if args.stage:
        print(json.dumps(run_stage(args.stage, args)))
        return 0
    workdir = Path(args.dir)
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    make_data(workdir, args.posts)
    print(f"synthetic data: {args.posts:,} posts in {time.perf_counter() - t0:.1f} s ({workdir})")
    for name in args.stages.split(","):
        proc = subprocess.run([sys.executable, __file__, "--stage", name, "--dir", str(workdir),
                               "--posts", str(args.posts), "--shards", str(args.shards)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{name}: FAILED\n{proc.stderr[-3000:]}")
            return 1
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"{name}: {r['wall_s']} s, peak RSS {r['peak_rss_mb']} MB  "
              + "  ".join(f"{k}={v}" for k, v in r.items() if k not in ("stage", "wall_s", "peak_rss_mb")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
