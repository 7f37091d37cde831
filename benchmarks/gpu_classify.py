"""The classify stage on a real GPU with a real vLLM, exactly as the workflow runs it, measured.

Runs on any machine with a GPU and ``vllm`` on PATH (``--standin`` puts the test stand-in there
instead, to try the script without a GPU). Two steps:

``media``  makes a realistic set: ``--sources`` distinct videos (log-uniform 5-60 s, 30 fps, 720p and
           1080p, portrait and landscape, H.264; ffmpeg's testsrc2 pattern) used by ``--posts`` posts
           (several posts may share a source file: the default server flags turn vLLM's prefix and
           multimodal caches off, so every request is decoded, processed and prefilled in full), with
           captions, synthetic transcripts (~2.5 words per second of video) and a few broken files
           (empty, text, cut before and after the MP4 index, missing).
``run``    per media mode (raw, or every video pre-transcoded): inventory, transcode and manifest with
           vidlabel's stage functions and the default config (``config/config.yaml``), then per variant
           ``vidlabel.classify.run_shard`` with the configured server command, which starts, uses and
           stops its own server. Variants are dash-joined words: ``default``, ``transcoded``, ``apiN``
           (API servers), ``concN`` (client concurrency per copy), ``tpN`` / ``dpN`` (tensor or data
           parallel instead of ``auto``), ``dpvllm`` (copies served by vLLM's --data-parallel-size),
           ``eager`` (--enforce-eager), ``mbtN`` (--max-num-batched-tokens N); ``@anything`` at the end
           only names the run (``default-@72b-4gpu``). A rerun of the same workdir resumes unfinished variants
           from their journals and skips finished ones.

Printed per variant: requests by status and error kind; estimated / served prompt tokens (min,
median, max of the ratio); prompt and output tok/s, req/s and p50 latency over the request phase
(first start to last finish); server start time (launch to ready); the most requests the engine
ran at once (from vLLM's log); mean GPU utilisation (nvidia-smi).

Example (one H200, Qwen2.5-VL-7B; extra server flags such as --load-format dummy come from
``--server-args`` or the ``vllm`` on PATH, never from this script):
    python benchmarks/gpu_classify.py media --workdir /tmp/bench --sources 80 --posts 240
    python benchmarks/gpu_classify.py run --workdir /tmp/bench --model Qwen/Qwen2.5-VL-7B-Instruct \\
        --variants default,transcoded,api1,api1-transcoded
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import logging
import math
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
SIZES = [(720, 1280), (1280, 720), (1080, 1920), (1920, 1080)]
WORDS = ("today I want to show you this new product it is really good and you can buy it with my code "
         "we went to the beach and had pizza with friends the weather was great check the link in my bio "
         "this recipe takes ten minutes follow for more tips and tricks honestly I did not expect that").split()
CAPTIONS = ["New drop is live! Link in bio #ad", "Sunday vibes", "", "Recette facile: gâteau au chocolat 🍫",
            "Use code SAVE20 at checkout", "What do you think? Comment below 👇", "Not sponsored, just love it",
            "Day 12 of my fitness journey #gym #motivation"]


# ----------------------------------------------------------------------------------------- media

def make_source(path: Path, width: int, height: int, seconds: float) -> None:
    if path.exists():
        return
    tmp = path.with_suffix(".part.mp4")
    subprocess.run(["ffmpeg", "-v", "error", "-y", "-f", "lavfi", "-i",
                    f"testsrc2=size={width}x{height}:rate=30", "-t", f"{seconds:.2f}", "-c:v", "libx264",
                    "-preset", "ultrafast", "-crf", "30", "-pix_fmt", "yuv420p", "-threads", "2",
                    "-movflags", "+faststart", str(tmp)], check=True)
    tmp.rename(path)


def make_media(args) -> None:
    work = Path(args.workdir)
    media = work / "media"
    media.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    sources = []
    for i in range(args.sources):
        width, height = SIZES[i % len(SIZES)]
        seconds = round(math.exp(rng.uniform(math.log(5), math.log(60))), 2)
        sources.append((media / f"src{i:03d}-{width}x{height}-{seconds:g}s.mp4", width, height, seconds))
    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        list(pool.map(lambda s: make_source(*s), sources))
    print(f"media: {len(sources)} sources in {time.monotonic() - t0:.1f} s", flush=True)
    # Broken files: empty, text, an MP4 cut before its index, one cut after it, and a missing file.
    (media / "bad-empty.mp4").write_bytes(b"")
    (media / "bad-text.mp4").write_text("This is a text file, not a video.\n")
    whole = sources[0][0].read_bytes()
    (media / "bad-cut-after-index.mp4").write_bytes(whole[: int(len(whole) * 0.6)])
    subprocess.run(["ffmpeg", "-v", "error", "-y", "-i", str(sources[1][0]), "-c", "copy",
                    str(media / "nofaststart.mp4")], check=True)
    plain = (media / "nofaststart.mp4").read_bytes()
    (media / "bad-cut-before-index.mp4").write_bytes(plain[: len(plain) // 2])
    (media / "nofaststart.mp4").unlink()
    bad = ["bad-empty.mp4", "bad-text.mp4", "bad-cut-after-index.mp4", "bad-cut-before-index.mp4",
           "bad-missing.mp4"]
    # Posts: each source used by posts/sources posts (hard links: one file per post, as in a dataset).
    lines = ["post_id,video_path,caption"]
    transcripts = []
    for p in range(args.posts):
        src, _, _, seconds = sources[p % len(sources)]
        name = f"post{p:04d}.mp4"
        if not (media / name).exists():
            os.link(src, media / name)
        caption = CAPTIONS[p % len(CAPTIONS)].replace(",", " ")
        lines.append(f"post{p:04d},media/{name},{caption}")
        words = int(seconds * 2.5 * rng.uniform(0, 1.2))
        transcripts.append((f"post{p:04d}", " ".join(rng.choice(WORDS) for _ in range(words))))
    for j, name in enumerate(bad):
        lines.append(f"bad{j},media/{name},broken file")
    (work / "posts.csv").write_text("\n".join(lines) + "\n")
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({
        "post_id": [t[0] for t in transcripts], "text": [t[1] for t in transcripts],
        "language": ["en"] * len(transcripts), "segments": ["[]"] * len(transcripts),
        "status": ["ok" if t[1] else "no_speech" for t in transcripts], "error": [None] * len(transcripts),
        "audio_s": [None] * len(transcripts)}), work / "transcripts.parquet")
    print(f"media: {args.posts} posts + {len(bad)} broken in {work / 'posts.csv'}", flush=True)


# ------------------------------------------------------------------------------------ the stages

def base_config(args, mode: str) -> dict:
    from vidlabel import config as vconfig

    work = Path(args.workdir)
    overrides = {
        "posts": str(work / "posts.csv"), "media_root": str(work / "media"),
        "results": str(work / f"data-{mode}"),
        "classify": {"model": args.model, "shards": 1, "server_args": args.server_args,
                     "startup_timeout_s": args.startup_timeout},
        "planning": {"transcode": {"enabled": mode == "transcoded", "chunks": args.jobs,
                                   "media_dir": str(work / "transcoded-media")}},
    }
    return vconfig.load(REPO / "config" / "config.yaml", overrides)


def prepare(args, mode: str) -> Path:
    """Inventory, transcode chunks (in parallel, as SLURM would run them) and the manifest."""
    from vidlabel import manifest, transcode
    from vidlabel.inventory import build_inventory

    config = base_config(args, mode)
    results = Path(config["results"])
    shard = results / "manifest" / "shard-0.parquet"
    if shard.exists():
        return shard
    inventory = results / "inventory.parquet"
    t0 = time.monotonic()
    build_inventory(config, inventory, threads=args.jobs)
    t1 = time.monotonic()
    chunks = [results / "transcoded" / f"chunk-{i}.parquet" for i in range(args.jobs)]
    with cf.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        list(pool.map(lambda i: transcode.run_chunk(config, inventory, i, chunks[i],
                                                    config["planning"]["transcode"]["media_dir"]),
                      range(args.jobs)))
    t2 = time.monotonic()
    manifest.build(config, inventory, [Path(args.workdir) / "transcripts.parquet"], chunks, [shard],
                   results / "manifest" / "excluded.parquet", results / "manifest" / "plan.csv")
    print(f"{mode}: inventory {t1 - t0:.1f} s, transcode {t2 - t1:.1f} s, manifest {time.monotonic() - t2:.1f} s",
          flush=True)
    return shard


def variant_config(args, name: str) -> tuple[str, dict]:
    """(media mode, config) of a variant name such as ``api1-transcoded``."""
    words = name.split("@", 1)[0].split("-")  # what follows @ only names the run
    mode = "transcoded" if "transcoded" in words else "raw"
    config = base_config(args, mode)
    c = config["classify"]
    for word in words:
        if m := re.fullmatch(r"api(\d+)", word):
            c["api_server_count"] = int(m.group(1))
        elif m := re.fullmatch(r"conc(\d+)", word):
            c["concurrency"] = int(m.group(1))
        elif m := re.fullmatch(r"mbt(\d+)", word):
            c["max_num_batched_tokens"] = int(m.group(1))
        elif m := re.fullmatch(r"tp(\d+)", word):
            c["parallelism"] = {"tensor": int(m.group(1)), "data": 1}
        elif m := re.fullmatch(r"dp(\d+)", word):
            c["parallelism"] = {"tensor": 1, "data": int(m.group(1))}
        elif word == "dpvllm":
            c["data_parallel_backend"] = "vllm"
        elif word == "eager":
            c["server_args"] = f"{c['server_args']} --enforce-eager".strip()
        elif word not in ("default", "transcoded", "raw", ""):
            raise SystemExit(f"unknown variant word {word!r} in {name!r}")
    return mode, config


class _JobLog(logging.Handler):
    """Collects 'server N ready ... X s after its start' and the parallelism decision of the job."""

    def __init__(self):
        super().__init__()
        self.seconds: list[float] = []
        self.layout: str | None = None

    def emit(self, record):
        if "ready on port" in record.msg:
            self.seconds.append(float(record.args[-1]))
        elif "parallelism" in record.msg:
            self.layout = record.getMessage().split("parallelism ", 1)[-1][:120]


class _GpuSampler(threading.Thread):
    def __init__(self):
        super().__init__(daemon=True)
        self.samples: list[tuple[float, float]] = []
        self.stop = threading.Event()

    def run(self):
        exe = shutil.which("nvidia-smi")
        # nvidia-smi counts physical GPUs; this job's are those CUDA_VISIBLE_DEVICES names.
        ids = [f"--id={os.environ['CUDA_VISIBLE_DEVICES']}"] if os.environ.get("CUDA_VISIBLE_DEVICES") else []
        while exe and not self.stop.wait(1.0):
            try:
                out = subprocess.run([exe, *ids, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=5).stdout
                values = [float(v) for v in out.split()]
                self.samples.append((time.time(), sum(values) / len(values)))
            except (OSError, ValueError, subprocess.SubprocessError):
                continue


def run_variant(args, name: str) -> dict:
    import pyarrow.parquet as pq

    from vidlabel.classify import run_shard

    mode, config = variant_config(args, name)
    shard = prepare(args, mode)
    out = Path(args.workdir) / "runs" / name
    out.mkdir(parents=True, exist_ok=True)
    labels_path = out / "labels.parquet"
    ready = _JobLog()
    for name_ in ("vidlabel.server", "vidlabel.classify"):
        logging.getLogger(name_).addHandler(ready)
    gpu = _GpuSampler()
    gpu.start()
    t0 = time.monotonic()
    error = None
    try:
        if not labels_path.exists():
            run_shard(config, shard, labels_path, out / "journal.jsonl", out / "server.log", 0)
    except Exception as exc:  # reported, and the journal keeps what finished
        error = f"{type(exc).__name__}: {exc}"[:500]
    finally:
        wall = time.monotonic() - t0
        gpu.stop.set()
        for name_ in ("vidlabel.server", "vidlabel.classify"):
            logging.getLogger(name_).removeHandler(ready)
    records = (pq.read_table(labels_path).to_pylist() if labels_path.exists()
               else [json.loads(x) for x in (out / "journal.jsonl").read_text().splitlines() if x.strip()])
    excluded = pq.read_table(Path(config["results"]) / "manifest" / "excluded.parquet").to_pylist()
    row = summarise(name, config, records, excluded, wall, ready.seconds, gpu.samples,
                    sorted(out.glob("server*.log")), error)
    row["layout"] = ready.layout
    return row


def summarise(name, config, records, excluded, wall, ready_s, gpu_samples, server_logs: list[Path], error) -> dict:
    ok = [r for r in records if r["status"] == "ok"]
    kinds: dict[str, int] = {}
    for r in records:
        key = "ok" if r["status"] == "ok" else r.get("error_kind") or "error"
        kinds[key] = kinds.get(key, 0) + 1
    ratios = sorted(r["est_prompt_tokens"] / r["prompt_tokens"] for r in ok if r.get("prompt_tokens"))
    started = [r["started_at"] for r in records if r.get("started_at")]
    finished = [r["finished_at"] for r in records if r.get("finished_at")]
    window = (max(finished) - min(started)) if started and finished else float("nan")
    prompt = sum(r["prompt_tokens"] or 0 for r in ok)
    output = sum(r["completion_tokens"] or 0 for r in ok)
    # vLLM logs the requests it runs every few seconds, per copy.
    running = [int(x) for log in server_logs for x in re.findall(r"Running: (\d+) reqs", log.read_text(errors="replace"))]
    in_window = [u for t, u in gpu_samples if started and min(started) <= t <= max(finished)]
    c = config["classify"]
    return {
        "variant": name, "requests": len(records), "excluded": len(excluded),
        "excluded_reasons": sorted({e["reason"] for e in excluded}), "by_kind": kinds,
        "est_over_served": {"min": ratios[0], "median": statistics.median(ratios), "max": ratios[-1]}
        if ratios else None,
        "within_2pct": sum(abs(x - 1) <= 0.02 for x in ratios),
        "prompt_tokens": {"min": min(r["prompt_tokens"] for r in ok), "median": statistics.median(
            r["prompt_tokens"] for r in ok), "max": max(r["prompt_tokens"] for r in ok)} if ok else None,
        "window_s": window, "prompt_tok_s": prompt / window if ok else 0.0,
        "output_tok_s": output / window if ok else 0.0, "req_s": len(ok) / window if ok else 0.0,
        "p50_latency_s": statistics.median(r["latency_s"] for r in ok) if ok else None,
        "server_start_s": max(ready_s) if ready_s else None, "wall_s": wall,
        "engine_running_max": max(running) if running else None,
        "engine_running_median": statistics.median(running) if running else None,
        "gpu_util_mean": statistics.mean(in_window) if in_window else None,
        "model": c["model"], "gpus": os.environ.get("CUDA_VISIBLE_DEVICES", "all"), "cpus": len(os.sched_getaffinity(0)),
        "concurrency": c["concurrency"], "api_server_count": c["api_server_count"],
        "max_num_batched_tokens": c["max_num_batched_tokens"], "max_tokens": c["max_tokens"],
        "server_args": c["server_args"], "error": error,
    }


def table(rows: list[dict]) -> str:
    head = ("| variant | requests: status | est/served tokens (min / median / max) | served prompt tokens "
            "(min / median / max) | prompt tok/s | output tok/s | req/s | p50 latency | server start | "
            "engine running (max / median) | GPU util | layout |\n" + "|---" * 12 + "|")
    lines = [head]
    for r in rows:
        ratio = r["est_over_served"]
        pt = r["prompt_tokens"]
        lines.append(
            f"| {r['variant']} | {r['requests']}: {r['by_kind']} (+{r['excluded']} excluded) | "
            + (f"{ratio['min']:.3f} / {ratio['median']:.3f} / {ratio['max']:.3f} ({r['within_2pct']} within ±2 %)"
               if ratio else "-")
            + " | " + (f"{pt['min']:,} / {pt['median']:,.0f} / {pt['max']:,}" if pt else "-")
            + f" | {r['prompt_tok_s']:,.0f} | {r['output_tok_s']:,.0f} | {r['req_s']:.2f} | "
            + (f"{r['p50_latency_s']:.1f} s" if r["p50_latency_s"] is not None else "-") + " | "
            + (f"{r['server_start_s']:.0f} s" if r["server_start_s"] is not None else "-") + " | "
            + (f"{r['engine_running_max']} / {r['engine_running_median']:g}" if r["engine_running_max"] else "-")
            + " | " + (f"{r['gpu_util_mean']:.0f} %" if r["gpu_util_mean"] is not None else "-")
            + f" | {r.get('layout') or '-'} |")
    return "\n".join(lines)


def run(args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.standin:
        sys.path.insert(0, str(REPO / "tests"))
        from standin import vllm_shim

        shim = vllm_shim(Path(args.workdir) / "standin-bin", "--random-weights", "--slots", "16",
                         "--prefill-tokens-per-s", "200000", "--latency", "0.05")
        os.environ["PATH"] = f"{shim.parent}{os.pathsep}{os.environ['PATH']}"
    rows = []
    results = Path(args.out) if args.out else Path(args.workdir) / "gpu_classify.json"
    previous = json.loads(results.read_text()) if results.exists() else []
    for name in args.variants.split(","):
        row = run_variant(args, name)
        rows.append(row)
        print(json.dumps(row), flush=True)
        previous = [r for r in previous if r["variant"] != name] + [row]
        results.write_text(json.dumps(previous, indent=1))
    print(table(previous))
    return 0 if all(r["error"] is None for r in rows) else 1


def main() -> int:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="step", required=True)
    m = sub.add_parser("media")
    r = sub.add_parser("run")
    for p in (m, r):
        p.add_argument("--workdir", default="/tmp/vidlabel-gpu")
        p.add_argument("--jobs", type=int, default=os.cpu_count() or 4)
    m.add_argument("--sources", type=int, default=80)
    m.add_argument("--posts", type=int, default=240)
    m.add_argument("--seed", type=int, default=0)
    r.add_argument("--model", default="Qwen/Qwen2.5-VL-7B-Instruct")
    r.add_argument("--variants", default="default,transcoded,api1,api1-transcoded")
    r.add_argument("--server-args", default="", help="classify.server_args for every variant")
    r.add_argument("--startup-timeout", type=float, default=900)
    r.add_argument("--out", default=None, help="JSON results (default WORKDIR/gpu_classify.json)")
    r.add_argument("--standin", action="store_true", help="the test stand-in as `vllm` (no GPU needed)")
    args = ap.parse_args()
    if args.step == "media":
        make_media(args)
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
