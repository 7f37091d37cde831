"""A pool of speech recordings for making camera-like media where espeak-ng is missing (the GPU machine):
``gpu_classify.py media`` takes them from the folder ``VIDLABEL_SPEECH_POOL`` names.

    python benchmarks/speech_pool.py .gpu/speech --count 24

Each file is espeak-ng reading random words of the media step's vocabulary (6 to 20 s), as mono AAC at
16 kHz and 24 kb/s: about 3 kB a second, so that a pool of a few minutes travels with a device call.
"""

from __future__ import annotations

import argparse
import random
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_classify import WORDS  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--count", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    exe = shutil.which("espeak-ng") or shutil.which("espeak")
    if not exe:
        raise SystemExit("espeak-ng is not installed")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    total = 0
    for i in range(args.count):
        words = " ".join(rng.choice(WORDS) for _ in range(int(rng.uniform(6, 20) * 2.5)))
        wav, m4a = out / f"speech{i:03d}.wav", out / f"speech{i:03d}.m4a"
        subprocess.run([exe, "-s", str(rng.randint(140, 185)), "-w", str(wav), words], check=True, capture_output=True)
        subprocess.run(["ffmpeg", "-nostdin", "-v", "error", "-y", "-i", str(wav), "-ac", "1", "-ar", "16000", "-c:a",
                        "aac", "-b:a", "24k", str(m4a)], check=True, capture_output=True)
        wav.unlink()
        total += m4a.stat().st_size
    print(f"{args.count} recordings in {out}, {total / 2 ** 20:.2f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
