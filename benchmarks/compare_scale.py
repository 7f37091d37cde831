"""Scale of the compare stage: N synthetic posts labelled by M models, compared.

    .venv/bin/python benchmarks/compare_scale.py [--posts 1000000] [--models 2] [--dir /tmp/vidlabel-compare]

Stages, each in its own Python process (wall time, CPU seconds and peak memory, ru_maxrss, are its own):
  labels     per model a labels.parquet as vidlabel.merge writes it (3 questions, 0.5 % of posts excluded,
             2 % failed requests, each model with its own error rates, log-probabilities for the first
             model), the inventory and 150 human labels per question; setup, not timed against anything
  aggregate  vidlabel.aggregate.run per model (what the compare stage reads)
  compare    vidlabel.compare.run on every model -> compare/ (the figure of this script)
"""

from __future__ import annotations

import argparse
import json
import os
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

STAGES = ["labels", "aggregate", "compare"]
QUESTIONS = [{"id": "promotes_product", "text": "Is a product promoted?"},
             {"id": "mentions_price", "text": "Is a price mentioned?"},
             {"id": "shows_person", "text": "Does a person appear?"}]
PREVALENCE = np.array([0.53, 0.2, 0.7])


def make_config() -> dict:
    return cfgmod.validate({"posts": "posts.parquet", "media_root": "/data",
                            "classify": {"shards": 64, "questions": QUESTIONS}})


def model_names(args) -> list[str]:
    return [f"model-{k}" for k in range(args.models)]


def stage_labels(workdir: Path, config: dict, args) -> dict:
    rng = np.random.default_rng(1)
    n, nq = args.posts, len(QUESTIONS)
    ids = np.array([f"p{i:08d}" for i in range(n)], dtype=object)
    pq.write_table(pa.table({"post_id": ids, "video_path": np.array([f"/data/{p}.mp4" for p in ids], dtype=object)}),
                   workdir / "inventory.parquet")
    truth = rng.random((n, nq)) < PREVALENCE
    excluded = rng.random(n) < 0.005
    for k, name in enumerate(model_names(args)):
        recall, false_yes = 0.6 + 0.3 * k / max(1, args.models - 1), 0.05 + 0.2 * k / max(1, args.models - 1)
        says = np.where(truth, rng.random(truth.shape) < recall, rng.random(truth.shape) < false_yes)
        failed = ~excluded & (rng.random(n) < 0.02)
        answered = ~excluded & ~failed
        status = np.where(excluded, "excluded", np.where(failed, "error", "ok")).astype(object)
        table = {"post_id": ids, "shard": pa.array(np.arange(n) % 64, mask=excluded),
                 "status": status, "error_kind": np.where(answered, None, np.where(excluded, "probe_error",
                                                                                 "timeout")).astype(object),
                 "error": np.where(answered, None, "synthetic").astype(object)}
        for q, question in enumerate(QUESTIONS):
            table[question["id"]] = np.where(answered, np.where(says[:, q], "yes", "no"), None).astype(object)
        started = 1.7e9 + (np.arange(n) // 64) * 2.0 * (1 + k)
        table.update({"prompt_tokens": pa.array(rng.integers(2_000, 40_000, n), mask=~answered),
                      "completion_tokens": pa.array(rng.integers(20, 400, n), mask=~answered),
                      "latency_s": pa.array(np.full(n, 2.0 * (1 + k)), mask=excluded),
                      "started_at": pa.array(started, mask=excluded),
                      "finished_at": pa.array(started + 2.0 * (1 + k), mask=excluded)})
        if k == 0:
            p_yes = np.clip(np.where(says, rng.uniform(0.5, 1, says.shape), rng.uniform(0, 0.5, says.shape)), 0, 1)
            table["answer_probs"] = np.array(
                [json.dumps({question["id"]: {"yes": p, "no": 1 - p} for question, p in zip(QUESTIONS, row)})
                 if ok else None for row, ok in zip(p_yes.round(4).tolist(), answered)], dtype=object)
        else:
            table["answer_probs"] = pa.nulls(n, pa.string())
        for column, value in (("model", f"Org/{name}"), ("server", "vLLM synthetic"), ("settings_fingerprint", "s"),
                              ("prompt_hash", "p"), ("request_fingerprint", "r")):
            table[column] = np.where(excluded, None, value).astype(object)
        (workdir / name).mkdir(exist_ok=True)
        pq.write_table(pa.table(table), workdir / name / "labels.parquet")
    pick = rng.choice(np.flatnonzero(~excluded), 150, replace=False)
    with open(workdir / "human_labels.csv", "w") as fh:
        fh.write("post_id,question,label\n")
        for q, question in enumerate(QUESTIONS):
            for i in pick:
                fh.write(f"{ids[i]},{question['id']},{'yes' if truth[i, q] else 'no'}\n")
    return {"models": args.models}


def stage_aggregate(workdir: Path, config: dict, args) -> dict:
    from vidlabel import aggregate

    for name in model_names(args):
        aggregate.run(config, workdir / name / "labels.parquet", workdir / "human_labels.csv",
                      workdir / name / "summary")
    return {}


def stage_compare(workdir: Path, config: dict, args) -> dict:
    from vidlabel import compare

    models = [(name, str(workdir / name / "labels.parquet"), str(workdir / name / "summary"))
              for name in model_names(args)]
    compare.run(config, models, str(workdir / "inventory.parquet"), str(workdir / "human_labels.csv"),
                str(workdir / "compare"))
    return {"disagreement_rows": sum(1 for _ in open(workdir / "compare" / "disagreements.csv")) - 1}


def run_stage(name: str, args) -> dict:
    workdir = Path(args.dir)
    t0 = time.perf_counter()
    extra = globals()[f"stage_{name}"](workdir, make_config(), args)
    wall = time.perf_counter() - t0
    own = resource.getrusage(resource.RUSAGE_SELF)
    return {"stage": name, "wall_s": round(wall, 2), "cpu_s": round(own.ru_utime + own.ru_stime, 2),
            "peak_rss_mb": round(own.ru_maxrss / 1024), **extra}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--posts", type=int, default=1_000_000)
    ap.add_argument("--models", type=int, default=2)
    ap.add_argument("--dir", default="/tmp/vidlabel-compare")
    ap.add_argument("--stage", help=argparse.SUPPRESS)  # internal: run one stage in this process
    args = ap.parse_args()
    if args.stage:
        print(json.dumps(run_stage(args.stage, args)))
        return 0
    workdir = Path(args.dir).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"{args.posts:,} posts, {args.models} models in {workdir}; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs", flush=True)
    for name in STAGES:
        proc = subprocess.run([sys.executable, __file__, "--stage", name, "--dir", str(workdir), "--posts",
                               str(args.posts), "--models", str(args.models)], capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{name}: FAILED\n{proc.stderr[-3000:]}")
            return 1
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"{name:<10} {r.pop('wall_s'):>8.2f} s wall {r.pop('cpu_s'):>8.2f} s CPU  peak RSS "
              f"{r.pop('peak_rss_mb'):>6} MB  " + "  ".join(f"{k}={v}" for k, v in r.items() if k != "stage"),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
