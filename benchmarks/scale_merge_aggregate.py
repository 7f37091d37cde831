"""Scale: merge + aggregate on 1,000,000 synthetic posts (time and peak memory per stage).

    .venv/bin/python benchmarks/scale_merge_aggregate.py [--posts 1000000] [--shards 512] [--dir /tmp/vidlabel-scale-ma]

Stages, each in its own Python process (wall time and ru_maxrss are its own):
  labels     synthetic classify output: label shards per docs/outputs.md (not a measured stage)
  merge      vidlabel.merge.merge -> labels.parquet
  aggregate  vidlabel.aggregate.run with 150 human labels per question -> summary/ (CSVs, plots, summary.md)
Goal (issue 5): <= 60 s and <= 4 GB for the data stages.

benchmarks/scale.py can run these after its manifest stage: import ``stage_labels``, ``stage_merge``
and ``stage_aggregate`` (signature ``stage_<name>(workdir, config, args)``) and add their names to
its STAGES. When ``results/manifest/shard-*.parquet`` exist, the label shards follow them
(same requests and post ids); otherwise this script makes its own inventory and exclusions.
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

QUESTIONS = [{"id": "promotes_product", "text": "Is a product promoted?"},
             {"id": "mentions_price", "text": "Is a price mentioned?"},
             {"id": "shows_person", "text": "Does a person appear?"}]
STAGES = ["labels", "merge", "aggregate"]


def make_config(workdir: Path, shards: int) -> dict:
    return cfgmod.validate({"posts": str(workdir / "posts.parquet"), "media_root": str(workdir / "media"),
                            "results": str(workdir / "results"),
                            "classify": {"shards": shards, "questions": QUESTIONS}})


def _paths(workdir: Path, shards: int):
    res = workdir / "results"
    return (workdir / "inventory.parquet", res / "manifest" / "excluded.parquet",
            [res / "labels" / f"shard-{i}.parquet" for i in range(shards)], res / "labels.parquet",
            workdir / "human_labels.csv", res / "summary")


def _own_inventory(workdir: Path, n: int, shards: int, rng) -> list[np.ndarray]:
    """Inventory with 0.5% excluded posts; returns the post ids of each shard."""
    inventory, excluded, _, _, _, _ = _paths(workdir, shards)
    ids = np.char.add("p", np.arange(n).astype(str)).astype(object)
    paths = np.char.add(np.char.add(str(workdir / "media") + "/", ids.astype(str)), ".mp4").astype(object)
    pq.write_table(pa.table({"post_id": ids, "video_path": paths}), inventory)
    bad = rng.random(n) < 0.005
    excluded.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"post_id": ids[bad], "video_path": paths[bad],
                             "reason": np.full(bad.sum(), "probe_error", dtype=object),
                             "detail": np.full(bad.sum(), "moov atom not found", dtype=object)}), excluded)
    good = ids[~bad]
    shard = rng.integers(0, shards, good.size)
    return [good[shard == i] for i in range(shards)]


def stage_labels(workdir: Path, config: dict, args) -> dict:
    """Synthetic label shards: 2% failed requests, a biased model, realistic token counts and times."""
    rng = np.random.default_rng(1)
    shards = config["classify"]["shards"]
    _, _, label_paths, _, human_path, _ = _paths(workdir, shards)
    manifest_shards = [workdir / "results" / "manifest" / f"shard-{i}.parquet" for i in range(shards)]
    if all(p.exists() for p in manifest_shards):  # after benchmarks/scale.py's manifest stage
        per_shard = [pq.read_table(p, columns=["post_id"]).column(0).to_numpy(zero_copy_only=False)
                     for p in manifest_shards]
    else:
        per_shard = _own_inventory(workdir, args.posts, shards, rng)
    label_paths[0].parent.mkdir(parents=True, exist_ok=True)
    answer_text = {}
    for bits in range(8):
        answer_text[bits] = json.dumps({q["id"]: ("yes" if bits >> k & 1 else "no") for k, q in enumerate(QUESTIONS)})
    truth_all, ids_all = [], []
    for s, ids in enumerate(per_shard):
        m = ids.size
        truth = rng.random((m, len(QUESTIONS))) < np.array([0.53, 0.2, 0.7])
        says = np.where(truth, rng.random(truth.shape) < 0.69, rng.random(truth.shape) < 0.09)
        bits = (says * (1 << np.arange(len(QUESTIONS)))).sum(axis=1)
        failed = rng.random(m) < 0.02
        answers = np.array([answer_text[b] for b in range(8)], dtype=object)[bits]
        answers[failed] = None
        prompt = np.clip(rng.lognormal(np.log(14_000), 0.6, m), 1_500, 125_000).astype(np.int64)
        completion = np.clip(rng.normal(250, 60, m), 20, 512).astype(np.int64)
        service = 16 * 2.95 * rng.uniform(0.5, 1.5, m)  # 16 in flight, ~2.95 s per request per instance
        started = 1.7e9 + np.arange(m) * 2.95
        status = np.where(failed, "error", "ok").astype(object)
        kind = np.where(failed, "timeout", None).astype(object)
        pq.write_table(pa.table({
            "request_id": np.char.add("r", ids.astype(str)).astype(object), "post_id": ids,
            "shard": np.full(m, s, np.int64), "status": status, "error_kind": kind,
            "error": np.where(failed, "deadline exceeded", None).astype(object),
            "http_status": pa.nulls(m, pa.int64()), "attempts": np.ones(m, np.int64), "latency_s": service,
            "started_at": started, "finished_at": started + service,
            "finish_reason": np.where(failed, None, "stop").astype(object),
            "prompt_tokens": pa.array(np.where(failed, 0, prompt), mask=failed),
            "completion_tokens": pa.array(np.where(failed, 0, completion), mask=failed),
            "est_prompt_tokens": prompt, "raw_text": answers, "answers": answers}), label_paths[s])
        truth_all.append(truth)
        ids_all.append(ids)
    # 150 human labels per question on a uniform random sample of classified posts
    ids = np.concatenate(ids_all)
    truth = np.concatenate(truth_all)
    pick = rng.choice(ids.size, 150, replace=False)
    with open(human_path, "w") as fh:
        fh.write("post_id,question,label\n")
        for k, q in enumerate(QUESTIONS):
            for i in pick:
                fh.write(f"{ids[i]},{q['id']},{'yes' if truth[i, k] else 'no'}\n")
    return {"requests": int(ids.size), "true_share": [round(float(x), 4) for x in truth.mean(axis=0)]}


def stage_merge(workdir: Path, config: dict, args) -> dict:
    from vidlabel import merge

    inventory, excluded, label_paths, labels, _, _ = _paths(workdir, config["classify"]["shards"])
    merge.merge(config, inventory, excluded, label_paths, labels)
    return {"rows": pq.read_metadata(labels).num_rows, "mb": round(labels.stat().st_size / 2**20, 1)}


def stage_aggregate(workdir: Path, config: dict, args) -> dict:
    import csv

    from vidlabel import aggregate

    _, _, _, labels, human, summary = _paths(workdir, config["classify"]["shards"])
    aggregate.run(config, labels, human, summary)
    prev = list(csv.DictReader(open(summary / "prevalence.csv")))
    return {"corrected": [f"{r['question']}={float(r['corrected']):.3f}"
                          f"[{float(r['corrected_lo']):.3f},{float(r['corrected_hi']):.3f}]" for r in prev]}


def run_stage(name: str, args) -> dict:
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
    ap.add_argument("--dir", default="/tmp/vidlabel-scale-ma")
    ap.add_argument("--stage", help=argparse.SUPPRESS)
    ap.add_argument("--stages", default=",".join(STAGES))
    args = ap.parse_args()
    if args.stage:
        print(json.dumps(run_stage(args.stage, args)))
        return 0
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    for name in args.stages.split(","):
        proc = subprocess.run([sys.executable, __file__, "--stage", name, "--dir", args.dir,
                               "--posts", str(args.posts), "--shards", str(args.shards)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{name}: FAILED\n{proc.stderr[-3000:]}")
            return 1
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"{name}: {r['wall_s']} s, peak RSS {r['peak_rss_mb']} MB  "
              + "  ".join(f"{k}={v}" for k, v in r.items() if k not in ("stage", "wall_s", "peak_rss_mb")),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
