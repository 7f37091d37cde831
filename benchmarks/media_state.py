"""Cost of the media's state in the Snakefile: one stat per media path of the posts table, threaded
(vidlabel.core.identity.media_state), computed by every `snakemake` invocation before any job.

    .venv/bin/python benchmarks/media_state.py [--paths 35000 1000000] [--dir /data/media] [--threads 16]

Makes N empty files in a temporary directory under --dir (1,000 per sub-directory, as media trees
are), then times the digest cold (right after the files were made, page cache warm) and again, and
once over N paths that do not exist. Run it on the filesystem the media live on: a network file system
answers a stat in a round trip, and the threads are what hides it.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from vidlabel.core.identity import media_state  # noqa: E402


def make_files(root: Path, n: int) -> list[str]:
    paths = []
    for i in range(n):
        folder = root / f"d{i // 1000:04d}"
        if i % 1000 == 0:
            folder.mkdir()
        path = folder / f"post-{i:07d}.mp4"
        path.touch()
        paths.append(str(path))
    return paths


def timed(paths: list[str], threads: int) -> tuple[float, str]:
    t0 = time.perf_counter()
    digest = media_state(paths, threads=threads)
    return time.perf_counter() - t0, digest


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--paths", type=int, nargs="+", default=[35_000, 1_000_000])
    ap.add_argument("--dir", default=None)
    ap.add_argument("--threads", type=int, default=16)
    args = ap.parse_args()
    where = args.dir or tempfile.gettempdir()
    print(f"media_state: {os.cpu_count()} CPUs, {args.threads} threads, files under {where}")
    for n in args.paths:
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            t0 = time.perf_counter()
            paths = make_files(Path(tmp), n)
            made = time.perf_counter() - t0
            first, digest = timed(paths, args.threads)
            second, again = timed(paths, args.threads)
            assert digest == again
            missing, _ = timed([p + ".missing" for p in paths], args.threads)
            one, _ = timed(paths, 1)
        print(f"  {n:>9,} paths: {first:6.2f} s, again {second:6.2f} s ({n / second:,.0f} paths/s); one thread "
              f"{one:6.2f} s; {n:,} missing paths {missing:6.2f} s   (making the files took {made:.1f} s)")


if __name__ == "__main__":
    main()
