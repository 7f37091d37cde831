"""The breaker on a real vLLM: a server that fails every video request stops the job within seconds with
the server's message and journals nothing terminal; the fixed server then labels every post.

Runs ``vidlabel.serve.classify.run_shard`` as a shard job does (its own server, the default server command)
on a small generated set (``gpu_classify.py``'s ``media`` and ``prepare``, in WORKDIR; kept for reruns):

1. three broken runs, as the user and the SLURM profile's ``retries: 1`` would make them: the ``vllm``
   on PATH is wrapped so that the server also gets ``--media-io-kwargs '{"video":{"fps":F,"backend":
   "pynvvideocodec"}}'``, a video backend whose module (PyNvVideoCodec) the server's Python cannot
   import: vLLM 0.26 answers every video request 500 "No module named 'PyNvVideoCodec'". The wrapper
   reads the extra argument from a file, so the job's server command, and so its request fingerprints,
   are the same in every run, as when a user fixes the server's environment and reruns;
2. the fixed run: the same command, without the extra argument.

Printed per broken run: the error (its type and message), seconds from the server's readiness (the
first request is sent at once) to the breaker's stop, the job's wall time (server start and stop
included), and the records journaled and how many of them are terminal (must be 0). Then the fixed
run's records by status and error kind; all of it also in WORKDIR/gpu_breaker.json.
Exit status 0 when every broken run stopped with the server's message within ``--stop-within`` seconds
and journaled nothing terminal, and the fixed run labelled every request ``ok``.

On the GPU machine (after staging ../shared/gpu-kit: ``vllm`` on PATH) and here with the stand-in:
    python benchmarks/gpu_breaker.py --workdir /tmp/vidlabel-breaker --jobs 16
    python benchmarks/gpu_breaker.py --workdir /tmp/vidlabel-breaker --jobs 2 --standin
Each run starts its own server (70-150 s with random weights): ``--phase broken`` and then ``--phase
fixed`` split the four runs over two calls where one call may not last that long.

``--shared-run-dir`` (with ``--phase broken``) journals the broken runs into the run folder of a
``gpu_steady.py`` variant, WORKDIR/runs/VARIANT (the same journal, labels and server log), so that the
steady-state run of that variant that follows is the fixed run: it prints how many records the journal
held before it and whether every request ended ``ok`` (benchmarks/gpu_session.sh does this on the GPU
machine). Give both the same ``--jobs``, ``--cpus``, ``--tokenizer`` and ``--model``, so that the
variant's config, and with it every request's identity, is the same in both:
    python benchmarks/gpu_breaker.py --workdir W --jobs 16 --cpus 0-15 --variant default-@mixed \
        --shared-run-dir --phase broken --broken-runs 1 --tokenizer /tmp/models/Qwen2.5-VL-7B-Instruct
    python benchmarks/gpu_steady.py --workdir W --jobs 16 --cpus 0-15 --variants default-@mixed \
        --tokenizer /tmp/models/Qwen2.5-VL-7B-Instruct
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_classify  # noqa: E402  (the media set, the manifest, the stand-in and the variants)

BROKEN_RUNS = 3  # as the user and the SLURM profile's retries would make them


class _Times(logging.Handler):
    """Wall-clock times of the job's log lines that mark the server's readiness and the breaker's stop."""

    def __init__(self):
        super().__init__()
        self.ready: float | None = None
        self.stopped: float | None = None

    def emit(self, record):
        if "ready on port" in record.msg:
            self.ready = record.created
        elif "stopping:" in record.msg:
            self.stopped = record.created


def wrap_vllm(work: Path, fault_file: Path) -> None:
    """Put a ``vllm`` first on PATH that runs the one found now with the arguments in ``fault_file`` (if
    any) appended to ``vllm serve``: the extra ``--media-io-kwargs`` comes last, and vLLM keeps the last
    one. Other subcommands (the job's ``vllm --version``, which identifies the server program) run as
    they are."""
    real = shutil.which("vllm")
    if real is None:
        raise SystemExit("no `vllm` on PATH: stage ../shared/gpu-kit (or pass --standin)")
    wrapper = work / "breaker-bin" / "vllm"
    if Path(real).resolve() == wrapper.resolve():  # a second wrap_vllm in this process
        return
    wrapper.parent.mkdir(parents=True, exist_ok=True)
    wrapper.write_text("#!/bin/sh\n"
                       "# vllm serve with the arguments of FAULT_FILE appended (benchmarks/gpu_breaker.py)\n"
                       f"FAULT_FILE={shlex.quote(str(fault_file))}\n"
                       'if [ "$1" = serve ] && [ -s "$FAULT_FILE" ]; then\n'
                       f'  exec {shlex.quote(real)} "$@" --media-io-kwargs "$(cat "$FAULT_FILE")"\n'
                       "fi\n"
                       f'exec {shlex.quote(real)} "$@"\n')
    wrapper.chmod(0o755)
    os.environ["PATH"] = f"{wrapper.parent}{os.pathsep}{os.environ['PATH']}"


def records(journal: Path) -> list[dict]:
    if not journal.exists():
        return []
    return [json.loads(line) for line in journal.read_text().splitlines() if line.strip()]


def one_run(config: dict, shard: Path, out: Path) -> dict:
    from vidlabel.serve.classify import run_shard

    times = _Times()
    for name in ("vidlabel.serve.server", "vidlabel.serve.classify"):
        logging.getLogger(name).addHandler(times)
    t0 = time.time()
    error = None
    try:
        run_shard(config, shard, out / "labels.parquet", out / "journal.jsonl", out / "server.log", 0)
    except Exception as exc:  # the job's failure is what is measured
        error = exc
    finally:
        for name in ("vidlabel.serve.server", "vidlabel.serve.classify"):
            logging.getLogger(name).removeHandler(times)
    journaled = records(out / "journal.jsonl")
    return {
        "error_type": type(error).__name__ if error else None,
        "error": str(error) if error else None,
        "ready_to_stop_s": (times.stopped - times.ready) if times.ready and times.stopped else None,
        "wall_s": time.time() - t0,
        "journaled": len(journaled),
        "terminal_errors": sum(r["status"] != "ok" and not r.get("retryable") for r in journaled),
    }


def main() -> int:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="/tmp/vidlabel-breaker")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 4)
    ap.add_argument("--sources", type=int, default=8, help="generated videos (gpu_classify.py media)")
    ap.add_argument("--posts", type=int, default=40, help="generated posts using them")
    ap.add_argument("--kind", choices=("camera", "testsrc2"), default="testsrc2")
    ap.add_argument("--model", default="Qwen/Qwen2.5-VL-7B-Instruct")
    ap.add_argument("--audio", choices=("transcript", "native", "both"), default="transcript",
                    help="classify.audio, as gpu_classify.py and gpu_steady.py take it")
    ap.add_argument("--interleave", action="store_true",
                    help="send the broken runs' posts interleaved: the other post types first, then one video post "
                         "after each of them (the shard gpu_classify.py prepares is grouped by post type, videos "
                         "first); the fixed run's shard keeps its order: the same requests, the same journal")
    ap.add_argument("--variant", default="default", help="a gpu_classify.py variant (server and client settings)")
    ap.add_argument("--server-args", default="", help="classify.server_args")
    ap.add_argument("--startup-timeout", type=float, default=900)
    ap.add_argument("--stop-within", type=float, default=60.0, help="seconds from readiness to the stop, at most")
    ap.add_argument("--standin", action="store_true", help="the test stand-in as `vllm` (no GPU needed)")
    ap.add_argument("--broken-runs", type=int, default=BROKEN_RUNS,
                    help="broken runs before the fixed one (each starts a server: 1 on a short GPU lease)")
    ap.add_argument("--phase", choices=("all", "broken", "fixed"), default="all",
                    help="broken: the broken runs on a fresh journal; fixed: the fixed run on that journal")
    ap.add_argument("--shared-run-dir", action="store_true",
                    help="journal into WORKDIR/runs/VARIANT, the run folder of gpu_steady.py's variant, whose next "
                         "run is then the fixed run (needs --phase broken; the folder is kept, not emptied)")
    ap.add_argument("--tokenizer", default=None, help="planning.tokenizer, as gpu_classify.py and gpu_steady.py take it")
    ap.add_argument("--cpus", default=None, help="pin the job and its server to these cores first, e.g. 0-15 (as "
                                                  "gpu_steady.py --cpus)")
    args = ap.parse_args()
    if args.shared_run_dir and args.phase != "broken":
        ap.error("--shared-run-dir needs --phase broken: the fixed run is the gpu_steady.py run of the variant")
    if args.cpus:
        import gpu_steady

        os.sched_setaffinity(0, gpu_steady.parse_cpus(args.cpus))  # inherited by the server the job starts
    work = Path(args.workdir)
    # gpu_classify's steps read these names; `posts` there is your own table (None: the generated set).
    kit = argparse.Namespace(workdir=str(work), jobs=args.jobs, kind=args.kind, sources=args.sources,
                             posts=args.posts, formats=False, photo_posts=0, carousels=0, seed=0,
                             standin=args.standin)
    stage = argparse.Namespace(**{**vars(kit), "posts": None, "media_root": None, "transcripts": [],
                                  "model": args.model, "audio": args.audio, "tokenizer": args.tokenizer,
                                  "server_args": args.server_args,
                                  "startup_timeout": args.startup_timeout})
    gpu_classify.use_standin(kit)
    if not (work / "posts.csv").exists():
        gpu_classify.make_media(kit)
    mode, config = gpu_classify.variant_config(stage, args.variant)
    shard = gpu_classify.prepare(stage, mode)
    broken_shard = interleaved(shard) if args.interleave else shard
    fault_file = work / "breaker-fault.json"
    wrap_vllm(work, fault_file)
    out = work / "runs" / (args.variant if args.shared_run_dir else f"breaker-{args.variant}")
    summary_path = work / "gpu_breaker.json"
    summary = json.loads(summary_path.read_text()) if args.phase == "fixed" and summary_path.exists() else {}
    if args.shared_run_dir and (out / "labels.parquet").exists():
        raise SystemExit(f"{out} holds a finished run (labels.parquet): gpu_steady.py would not run that variant "
                         "again; use a fresh --workdir or another --variant name (default-@another)")
    if args.phase != "fixed":
        print(f"broken runs send: {post_type_order(broken_shard)}", flush=True)
        if not args.shared_run_dir:
            shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True, exist_ok=True)
        summary["run_dir"] = str(out)
        summary["variant"] = args.variant
        summary["order"] = post_type_order(broken_shard)
        summary["journal_before"] = len(records(out / "journal.jsonl"))
        fault = {"video": {"fps": config["planning"]["fps"], "backend": "pynvvideocodec"}}
        fault_file.write_text(json.dumps(fault, separators=(",", ":")))
        summary["broken_runs"] = []
        try:
            for i in range(args.broken_runs):
                row = one_run(config, broken_shard, out)
                summary["broken_runs"].append(row)
                print(f"broken run {i + 1}: {row['error_type']} after {row['ready_to_stop_s'] or float('nan'):.1f} s "
                      f"from the server's readiness (job {row['wall_s']:.0f} s); journaled {row['journaled']} records, "
                      f"{row['terminal_errors']} terminal; error: {row['error']}", flush=True)
        finally:
            fault_file.unlink(missing_ok=True)
        summary["broken_passed"] = _broken_passed(summary["broken_runs"], args.stop_within)
        summary_path.write_text(json.dumps(summary, indent=1))
        if args.phase == "broken":
            print(f"broken phase {'PASSED' if summary['broken_passed'] else 'FAILED'} (each run stopped within "
                  f"{args.stop_within:g} s of the server's readiness with the server's message, nothing terminal "
                  f"journaled in {out}); summary in {summary_path}", flush=True)
            return 0 if summary["broken_passed"] else 1
    fixed = one_run(config, shard, out)
    labels = []
    if (out / "labels.parquet").exists():
        import pyarrow.parquet as pq
        labels = pq.read_table(out / "labels.parquet").to_pylist()
    by_status: dict[str, int] = {}
    for r in labels:
        key = "ok" if r["status"] == "ok" else f"error:{r['error_kind']}"
        by_status[key] = by_status.get(key, 0) + 1
    print(f"fixed run: {fixed['error_type'] or 'completed'} in {fixed['wall_s']:.0f} s; {len(labels)} requests "
          f"labelled: {by_status}" + (f"; error: {fixed['error']}" if fixed["error"] else ""), flush=True)
    passed = (_broken_passed(summary.get("broken_runs") or [], args.stop_within)
              and fixed["error"] is None
              and bool(labels) and by_status == {"ok": len(labels)})
    summary.update(fixed_run={**fixed, "by_status": by_status}, passed=passed)
    summary_path.write_text(json.dumps(summary, indent=1))
    print(f"{'PASSED' if passed else 'FAILED'}: summary in {summary_path}", flush=True)
    return 0 if passed else 1


def interleaved(shard: Path) -> Path:
    """A copy of ``shard`` (in a folder beside the manifest's, which globs its shards) whose requests
    alternate: a post of another type, then a video post, the other types first; what is left of either
    kind follows in its order."""
    import pyarrow.parquet as pq

    from vidlabel.core.io import write_parquet

    table = pq.read_table(shard)
    types = [t or "video" for t in table.column("post_type").to_pylist()]
    videos = [i for i, t in enumerate(types) if t == "video"]
    others = [i for i, t in enumerate(types) if t != "video"]
    order = [i for pair in zip(others, videos) for i in pair]
    order += others[len(videos):] + videos[len(others):]
    out = shard.parent.parent / "breaker-shard" / f"{shard.stem}-interleaved.parquet"
    write_parquet(table.take(order), out)
    return out


def post_type_order(shard: Path, first: int = 12) -> str:
    """The first post types the shard sends, e.g. ``carousel video photo video ...``."""
    import pyarrow.parquet as pq

    types = [t or "video" for t in pq.read_table(shard, columns=["post_type"]).column("post_type").to_pylist()]
    return " ".join(types[:first]) + (" ..." if len(types) > first else "")


def _broken_passed(runs: list[dict], stop_within: float) -> bool:
    """Each broken run stopped with the server's message within ``stop_within`` s, nothing terminal journaled."""
    return bool(runs) and all(
        r["error"] and "No module named 'PyNvVideoCodec'" in r["error"] and r["terminal_errors"] == 0
        and r["ready_to_stop_s"] is not None and r["ready_to_stop_s"] <= stop_within for r in runs)


if __name__ == "__main__":
    sys.exit(main())
