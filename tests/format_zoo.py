"""The format zoo of ``benchmarks/gpu_classify.py media --formats`` (one file per format users download),
made here with ffmpeg at 3 s per clip so that the decoder tests stay quick."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
ZOO_SECONDS = 3.0


def gpu_classify():
    sys.path.insert(0, str(BENCHMARKS))
    import gpu_classify as module

    return module


def make_zoo(work: Path) -> dict[str, Path]:
    """name -> file, for every format this ffmpeg can write (the AV1 one needs an AV1 encoder)."""
    gc = gpu_classify()
    media = work / "media"
    media.mkdir(parents=True, exist_ok=True)
    made = {}
    for name, spec in gc.format_specs().items():
        spec = dict(spec, seconds=min(spec.get("seconds", ZOO_SECONDS), ZOO_SECONDS))
        made[name] = gc.make_format(work, media, name, spec, seed=len(name))
    return made
