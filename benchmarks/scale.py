"""Scale: 1,000,000 synthetic posts through the data stages, and `snakemake -n` on that plan.

    .venv/bin/python benchmarks/scale.py [--posts 1000000] [--shards 512] [--chunks 64] [--models 1]
                                         [--dir /tmp/vidlabel-scale]

Stages, in order, each in its own Python process (so wall time and peak memory, ru_maxrss, are its own):
  data         synthetic posts table, inventory (heavy-tailed durations, mixed resolutions, 0.5% probe
               errors) and transcript chunks, laid out as the workflow does (docs/outputs.md); setup, not timed
               against the goal
  manifest     vidlabel.prepare.manifest.build: token estimates, context gate, token-balanced shards
  labels       synthetic classify output of each of ``--models`` models (classify.models) that follows the
               manifest shards (same request ids, posts and estimates; 2% failed requests, each model biased
               its own way, log-probabilities for the first); stands in for the GPU jobs, not timed
  merge        vidlabel.analyze.merge.merge -> labels.parquet, per model
  aggregate    vidlabel.analyze.aggregate.run with 150 human labels per question -> summary/, per model
  compare      vidlabel.analyze.compare.run on every model -> compare/ (skipped with one model, as `all` does)
  posts_check  vidlabel.prepare.posts.load_posts on the posts table: what the Snakefile runs at parse time
  dryrun       `snakemake -n` with the real Snakefile (config/config.yaml plus an overlay: the posts table,
               classify.shards, transcribe.chunks) before a run: empty results, every job of the plan listed;
               its peak is the snakemake process's
  dryrun_done  the same on the work dir the data stages filled (every output present: nothing to be done)
Goals (issue 5): manifest + merge + aggregate (+ compare) <= 60 s and each <= 4 GB; the dry run <= 15 s.
Add a stage by writing ``stage_<name>(workdir, config, args) -> dict`` and adding its name to STAGES.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from vidlabel.core import config as cfgmod  # noqa: E402
from vidlabel.core import models  # noqa: E402
from vidlabel.core.stage_settings import for_job  # noqa: E402
from vidlabel.serve.record import LABEL_SCHEMA  # noqa: E402

STAGES = ["data", "manifest", "labels", "merge", "aggregate", "compare", "posts_check", "dryrun", "dryrun_done"]
GOAL_STAGES = ("manifest", "merge", "aggregate", "compare")
GOAL_DATA_S, GOAL_DATA_MB, GOAL_DRYRUN_S = 60.0, 4096, 15.0
QUESTIONS = [{"id": "promotes_product", "text": "Is a product promoted?"},
             {"id": "mentions_price", "text": "Is a price mentioned?"},
             {"id": "shows_person", "text": "Does a person appear?"}]
RESOLUTIONS = np.array([(720, 1280), (1080, 1920), (1280, 720), (1920, 1080), (480, 854), (360, 640)])
WORDS = np.array("the a product buy great shoes today check link bio love this video new sale".split())


def model_names(n: int) -> list[str]:
    return [f"model-{k}" for k in range(n)]


def overlay(workdir: Path, args, results: Path | None = None) -> dict:
    """The config over config/config.yaml, for the stages here and for the dry runs alike."""
    return {"posts": str(workdir / "posts.parquet"), "media_root": str(workdir / "media"),
            "results": str(results or workdir / "results"), "human_labels": str(workdir / "human_labels.csv"),
            "transcribe": {"chunks": args.chunks},
            # The synthetic model names are not real ones: the family is named, not looked up.
            "planning": {"model_family": "qwen2_5_vl"},
            # Qwen2.5-VL-72B serves 128k; seed 000 saw prompts up to ~123k tokens.
            "classify": {"shards": args.shards, "max_model_len": 131072, "questions": QUESTIONS,
                         "models": model_names(args.models)}}


def make_config(workdir: Path, args) -> dict:
    return cfgmod.validate(overlay(workdir, args))


def paths(workdir: Path, config: dict) -> dict:
    """Every file a stage reads or writes, where the Snakefile puts it (the manifest per plan:
    vidlabel.core.models.plans, workflow/rules/common.smk)."""
    res = Path(config["results"])
    shards = range(config["classify"]["shards"])
    plan_of = {m: plan for plan, names in models.plans(config).items() for m in names}
    manifest = {plan: res / "manifest" / plan for plan in models.plans(config)}
    return {
        "posts": Path(config["posts"]), "media": Path(config["media_root"]),
        "inventory": res / "inventory.parquet",
        "transcripts": [res / "transcripts" / f"chunk-{i}.parquet" for i in range(config["transcribe"]["chunks"])],
        "plans": list(manifest), "plan_of": plan_of,
        # Per plan (results/manifest/<plan>/); the synthetic inventory needs no transcode (none is re-planned
        # into the transcoded/<plan>/ chunks: the transcode stage is not timed here).
        "manifest": {plan: [d / f"shard-{i}.parquet" for i in shards] for plan, d in manifest.items()},
        "excluded": {plan: d / "excluded.parquet" for plan, d in manifest.items()},
        "plan": {plan: d / "plan.csv" for plan, d in manifest.items()},
        "human": Path(config["human_labels"]), "compare": res / "compare",
        # Per model (results/models/<name>/, vidlabel.core.models).
        "label_shards": {m: [res / "models" / m / "labels" / f"shard-{i}.parquet" for i in shards]
                         for m in models.names(config)},
        "labels": {m: res / "models" / m / "labels.parquet" for m in models.names(config)},
        "summary": {m: res / "models" / m / "summary" for m in models.names(config)},
    }


def stage_data(workdir: Path, config: dict, args) -> dict:
    """Posts table, inventory and transcript chunks (the files of docs/outputs.md) for ``args.posts`` posts."""
    p = paths(workdir, config)
    n = args.posts
    rng = np.random.default_rng(0)
    ids = np.char.add("p", np.arange(n).astype(str))
    dur = np.clip(rng.lognormal(np.log(30), 1.0, n), 1, 3600)
    res = RESOLUTIONS[rng.integers(0, len(RESOLUTIONS), n)]
    bad = rng.random(n) < 0.005
    # The videos need not exist: the Snakefile's parse-time check reads only the table, and the
    # inventory here is synthetic (a missing file would be a probe_error, not a parse error).
    p["media"].mkdir(parents=True, exist_ok=True)
    video = np.char.add(np.char.add(str(p["media"]) + "/", ids), ".mp4")
    # Captions/transcripts: a few repeated snippets (the content does not matter, the length does).
    snippets = np.array([" ".join(rng.choice(WORDS, k)) for k in (3, 8, 20, 60, 150)], dtype=object)
    cap = snippets[rng.integers(0, len(snippets), n)]
    pq.write_table(pa.table({"post_id": ids, "video_path": video, "caption": cap}), p["posts"])
    p["inventory"].parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({
        "post_id": ids, "source_path": video, "video_path": video, "caption": cap,
        "size_bytes": (dur * 250_000).astype(np.int64), "duration_s": np.where(bad, np.nan, dur),
        "fps": np.where(bad, np.nan, 30.0), "width": res[:, 1], "height": res[:, 0],
        "video_codec": np.full(n, "h264"), "has_audio": rng.random(n) < 0.9,
        "probe_error": pa.array(np.where(bad, "moov atom not found", None), pa.string()),
    }), p["inventory"])
    ok = ~bad
    tr_ids = ids[ok]
    text = snippets[rng.integers(0, len(snippets), tr_ids.size)]
    status = np.where(rng.random(tr_ids.size) < 0.9, "ok", "no_audio")
    chunk = rng.integers(0, len(p["transcripts"]), tr_ids.size)
    p["transcripts"][0].parent.mkdir(parents=True, exist_ok=True)
    for i, path in enumerate(p["transcripts"]):
        m = chunk == i
        pq.write_table(pa.table({
            "post_id": tr_ids[m], "text": pa.array(np.where(status[m] == "ok", text[m], None), pa.string()),
            "language": np.full(m.sum(), "en"), "segments": np.full(m.sum(), "[]"), "status": status[m],
            "error": pa.nulls(m.sum(), pa.string()), "audio_s": dur[ok][m]}), path)
    return {"posts": n, "probe_errors": int(bad.sum()), "transcript_chunks": len(p["transcripts"])}


def stage_manifest(workdir: Path, config: dict, args) -> dict:
    """One manifest per plan, as rule manifest builds it (scripts/manifest.py)."""
    from vidlabel.prepare import manifest

    p = paths(workdir, config)
    out = {}
    for plan in p["plans"]:
        p["manifest"][plan][0].parent.mkdir(parents=True, exist_ok=True)
        manifest.build(for_job(config, "manifest", plan=plan), p["inventory"], p["transcripts"], [],
                       p["manifest"][plan], p["excluded"][plan], p["plan"][plan])
        loads = [int(r["est_prompt_tokens"]) for r in csv.DictReader(open(p["plan"][plan]))]
        out[plan] = {"requests": sum(pq.read_metadata(s).num_rows for s in p["manifest"][plan]),
                     "excluded": pq.read_metadata(p["excluded"][plan]).num_rows,
                     "shard_max_over_mean": round(max(loads) / (sum(loads) / len(loads)), 4)}
    return out if len(out) > 1 else next(iter(out.values()))


def stage_labels(workdir: Path, config: dict, args) -> dict:
    """Label shards per model that follow the manifest shards: 2% failed requests, each model biased its own
    way (recall 0.69 -> 0.9, false "yes" 0.09 -> 0.25 from the first model to the last), plausible tokens/times."""
    p = paths(workdir, config)
    rng = np.random.default_rng(1)
    names = models.names(config)
    for shards in p["label_shards"].values():
        shards[0].parent.mkdir(parents=True, exist_ok=True)
    nq = len(QUESTIONS)
    answer_text = np.array([json.dumps({q["id"]: ("yes" if bits >> k & 1 else "no") for k, q in enumerate(QUESTIONS)})
                            for bits in range(2 ** nq)], dtype=object)
    truth_all, ids_all = [], []
    if len(p["plans"]) != 1:  # one truth per post: the models must label the same requests
        raise SystemExit(f"the labels stage needs the models of one plan, not {p['plans']}")
    for s, src in enumerate(p["manifest"][p["plans"][0]]):
        req = pq.read_table(src, columns=["request_id", "post_id", "est_prompt_tokens"])
        ids = req.column("post_id").to_numpy(zero_copy_only=False)
        truth = rng.random((ids.size, nq)) < np.array([0.53, 0.2, 0.7])
        truth_all.append(truth)
        ids_all.append(ids)
        for k, name in enumerate(names):
            write_label_shard(config, rng, req, s, k, name, truth, answer_text, p["label_shards"][name][s])
    # 150 human labels per question on a uniform random sample of classified posts.
    ids = np.concatenate(ids_all)
    truth = np.concatenate(truth_all)
    pick = rng.choice(ids.size, 150, replace=False)
    with open(p["human"], "w") as fh:
        fh.write("post_id,question,label\n")
        for k, q in enumerate(QUESTIONS):
            for i in pick:
                fh.write(f"{ids[i]},{q['id']},{'yes' if truth[i, k] else 'no'}\n")
    return {"requests": int(ids.size), "models": len(names),
            "true_share": [round(float(x), 4) for x in truth.mean(axis=0)]}


def write_label_shard(config: dict, rng, req: pa.Table, s: int, k: int, name: str, truth: np.ndarray,
                      answer_text: np.ndarray, dst: Path) -> None:
    """What model ``k``'s classify job of shard ``s`` writes for the manifest rows ``req``."""
    m, nq = truth.shape
    est = req.column("est_prompt_tokens").to_numpy()
    spread = k / max(1, len(config["classify"]["models"]) - 1)
    says = np.where(truth, rng.random(truth.shape) < 0.69 + 0.21 * spread,
                    rng.random(truth.shape) < 0.09 + 0.16 * spread)
    answers = answer_text[(says * (1 << np.arange(nq))).sum(axis=1)]
    failed = rng.random(m) < 0.02
    answers[failed] = None
    prompt = np.rint(est * rng.uniform(0.97, 1.03, m)).astype(np.int64)  # the estimate is close, not exact
    completion = np.clip(rng.normal(250, 60, m), 20, 512).astype(np.int64)
    service = 16 * 2.95 * rng.uniform(0.5, 1.5, m)  # 16 in flight, ~2.95 s per request per instance
    started = 1.7e9 + np.arange(m) * 2.95
    columns = {
        "request_id": req.column("request_id"), "post_id": req.column("post_id"),
        "shard": np.full(m, s, np.int64), "status": np.where(failed, "error", "ok").astype(object),
        "error_kind": np.where(failed, "timeout", None).astype(object),
        "error": np.where(failed, "deadline exceeded", None).astype(object),
        "http_status": pa.nulls(m, pa.int64()), "attempts": np.ones(m, np.int64), "latency_s": service,
        "started_at": started, "finished_at": started + service,
        "finish_reason": np.where(failed, None, "stop").astype(object),
        "prompt_tokens": pa.array(np.where(failed, 0, prompt), mask=failed),
        "completion_tokens": pa.array(np.where(failed, 0, completion), mask=failed),
        "est_prompt_tokens": est, "raw_text": answers, "answers": answers,
        "model": np.full(m, name, object), "server": np.full(m, "synthetic", object),
        "sends": np.ones(m, np.int64), "gpus": np.full(m, 4, np.int64)}
    if k == 0:  # the first model's server gave log-probabilities: P(yes) on the side of its answer
        p_yes = np.where(says, rng.uniform(0.5, 1, says.shape), rng.uniform(0, 0.5, says.shape)).round(4)
        columns["answer_probs"] = np.array(
            [None if bad else json.dumps({q["id"]: {"yes": py, "no": 1 - py} for q, py in zip(QUESTIONS, row)})
             for row, bad in zip(p_yes.tolist(), failed)], dtype=object)
    # The rest of what a classify job writes (no fingerprints): nulls.
    pq.write_table(pa.table({f.name: columns.get(f.name, pa.nulls(m, f.type)) for f in LABEL_SCHEMA},
                            schema=LABEL_SCHEMA), dst)


def stage_merge(workdir: Path, config: dict, args) -> dict:
    from vidlabel.analyze import merge

    p = paths(workdir, config)
    for name, labels in p["labels"].items():
        plan = p["plan_of"][name]
        merge.merge(for_job(config, "merge", name), p["inventory"], p["excluded"][plan], p["label_shards"][name],
                    labels, manifest_paths=p["manifest"][plan])
    first = next(iter(p["labels"].values()))
    return {"rows": pq.read_metadata(first).num_rows, "mb": round(first.stat().st_size / 2**20, 1),
            "models": len(p["labels"])}


def stage_aggregate(workdir: Path, config: dict, args) -> dict:
    from vidlabel.analyze import aggregate

    p = paths(workdir, config)
    corrected = []
    for name, labels in p["labels"].items():
        aggregate.run(for_job(config, "aggregate", name), labels, p["human"], p["summary"][name])
        prev = list(csv.DictReader(open(p["summary"][name] / "prevalence.csv")))
        corrected += [f"{name}:{r['question']}={float(r['corrected']):.3f}"
                      f"[{float(r['corrected_lo']):.3f},{float(r['corrected_hi']):.3f}]" for r in prev]
    return {"corrected": corrected}


def stage_compare(workdir: Path, config: dict, args) -> dict:
    """The models side by side; with one model `all` has no compare job, so neither has this."""
    from vidlabel.analyze import compare

    p = paths(workdir, config)
    if len(p["labels"]) < 2:
        return {"skipped": "one model"}
    compare.run(for_job(config, "compare"), [(name, str(labels), str(p["summary"][name])) for name, labels in p["labels"].items()],
                str(p["inventory"]), str(p["human"]), str(p["compare"]))
    with open(p["compare"] / "disagreements.csv") as fh:
        return {"disagreement_rows": sum(1 for _ in fh) - 1}


def stage_posts_check(workdir: Path, config: dict, args) -> dict:
    """The Snakefile's parse-time check alone, to tell its share of the dry run."""
    from vidlabel.prepare import posts as posts_table

    t0 = time.perf_counter()
    posts = posts_table.load_posts(config["posts"], config["media_root"])
    return {"rows": posts.num_rows, "load_posts_s": round(time.perf_counter() - t0, 2)}


def _dry_run(workdir: Path, rundir: Path, results: Path, args) -> dict:
    """`snakemake -n` with the real Snakefile in ``rundir``; the peak is the snakemake process's (RUSAGE_CHILDREN)."""
    rundir.mkdir(parents=True, exist_ok=True)
    overlay_path = rundir / "overlay.yaml"
    cfg = overlay(workdir, args, results)
    if not Path(cfg["human_labels"]).exists():  # the labels stage writes it; without it the plan has none
        cfg["human_labels"] = None
    overlay_path.write_text(json.dumps(cfg, indent=1))  # JSON is YAML
    shutil.rmtree(rundir / ".snakemake", ignore_errors=True)  # no metadata or caches from an earlier run
    cmd = [str(Path(sys.executable).parent / "snakemake"), "-n", "-s", str(REPO / "Snakefile"), "-d", str(rundir),
           "--configfile", str(REPO / "config" / "config.yaml"), str(overlay_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out[-3000:]}")
    total = re.search(r"^total\s+(\d+)", out, re.M)
    return {"jobs": int(total.group(1)) if total else 0,
            "snakemake_peak_rss_mb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)}


def stage_dryrun(workdir: Path, config: dict, args) -> dict:
    """The dry run before a run: nothing produced yet, every job of the plan is listed."""
    return _dry_run(workdir, workdir / "dryrun", workdir / "dryrun" / "results", args)


def stage_dryrun_done(workdir: Path, config: dict, args) -> dict:
    """The dry run on the work dir the stages above filled: every output is there (and stat'ed)."""
    return _dry_run(workdir, workdir, Path(config["results"]), args)


def run_stage(name: str, args) -> dict:
    """In this (child) process: run one stage, report its time and peak memory as JSON."""
    workdir = Path(args.dir)
    config = make_config(workdir, args)
    t0 = time.perf_counter()
    extra = globals()[f"stage_{name}"](workdir, config, args)
    wall = time.perf_counter() - t0
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    peak_mb = own.ru_maxrss / 1024
    if name.startswith("dryrun"):  # the work is snakemake's, not this process's
        peak_mb = extra.pop("snakemake_peak_rss_mb")
    # CPU seconds (user + system, threads included) tell the cost apart from the machine's load.
    cpu = own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
    return {"stage": name, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "peak_rss_mb": round(peak_mb), **extra}


def goal(r: dict) -> str:
    if r["stage"] in GOAL_STAGES:
        return f"<= {GOAL_DATA_MB} MB: {'ok' if r['peak_rss_mb'] <= GOAL_DATA_MB else 'MISSED'}"
    if r["stage"].startswith("dryrun"):
        return f"<= {GOAL_DRYRUN_S:g} s: {'ok' if r['wall_s'] <= GOAL_DRYRUN_S else 'MISSED'}"
    return "(setup)" if r["stage"] in ("data", "labels") else "(part of dryrun)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--posts", type=int, default=1_000_000)
    ap.add_argument("--shards", type=int, default=512, help="classify.shards")
    ap.add_argument("--chunks", type=int, default=64, help="transcribe.chunks")
    ap.add_argument("--models", type=int, default=1, help="models labelling the posts (classify.models)")
    ap.add_argument("--dir", default="/tmp/vidlabel-scale")
    ap.add_argument("--stage", help=argparse.SUPPRESS)  # internal: run one stage in this process
    ap.add_argument("--stages", default=",".join(STAGES), help="comma-separated stages to run (default: all)")
    args = ap.parse_args()
    if args.stage:
        print(json.dumps(run_stage(args.stage, args)))
        return 0
    workdir = Path(args.dir).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"{args.posts:,} posts, {args.shards} shards, {args.chunks} transcript chunks, {args.models} model(s) "
          f"in {workdir}; "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs", flush=True)
    rows = []
    for name in args.stages.split(","):
        proc = subprocess.run([sys.executable, __file__, "--stage", name, "--dir", str(workdir), "--posts",
                               str(args.posts), "--shards", str(args.shards), "--chunks", str(args.chunks),
                               "--models", str(args.models)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{name}: FAILED\n{proc.stderr[-3000:]}")
            return 1
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append(r)
        print(f"{name}: {r['wall_s']} s, peak RSS {r['peak_rss_mb']} MB  "
              + "  ".join(f"{k}={v}" for k, v in r.items() if k not in ("stage", "wall_s", "cpu_s", "peak_rss_mb")),
              flush=True)

    print(f"\n{'stage':<13} {'wall s':>8} {'cpu s':>8} {'peak RSS MB':>12}  goal")
    for r in rows:
        print(f"{r['stage']:<13} {r['wall_s']:>8.2f} {r['cpu_s']:>8.2f} {r['peak_rss_mb']:>12}  {goal(r)}")
    data = [r for r in rows if r["stage"] in GOAL_STAGES]
    if data:
        wall, peak = sum(r["wall_s"] for r in data), max(r["peak_rss_mb"] for r in data)
        cpu = sum(r["cpu_s"] for r in data)
        print(f"{'data stages':<13} {wall:>8.2f} {cpu:>8.2f} {peak:>12}  <= {GOAL_DATA_S:g} s, <= {GOAL_DATA_MB} MB: "
              f"{'ok' if wall <= GOAL_DATA_S and peak <= GOAL_DATA_MB else 'MISSED'}"
              f" ({'+'.join(r['stage'] for r in data)})")
    print(f"load average now {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
