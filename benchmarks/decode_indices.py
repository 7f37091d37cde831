"""Which frames each of vLLM's decode backends samples from each file, next to the default's.

Runs vLLM's own loader on every file exactly as the server does for Qwen2.5-VL with
``--media-io-kwargs '{"video":{"fps":2,"backend":B}}'`` (``vllm.multimodal.media.VideoMediaIO`` with the
Qwen2-VL loader, ``vllm/multimodal/video.py: Qwen2VLVideoBackend.load_bytes``), for each backend B, and
prints per file and backend: the frame count, rate and duration B read, the frame indices the sampler
took, whether they equal the default's (``opencv``), the decoded frames' shape (a backend that ignores
the rotation flag hands the model landscape frames of a portrait video), how far its frames are from
the default's (mean absolute difference, 0-255), and the CPU and wall time of the load. On the GPU
machine (the kit's ``PYTHONPATH=/tmp/vsite:/tmp/site`` makes vLLM, torch and PyNvVideoCodec importable)::

    python benchmarks/decode_indices.py --workdir /tmp/zoo --backends opencv,pyav,torchcodec,pynvvideocodec

The files: ``--media DIR`` (every video in it), else the format zoo of ``gpu_classify.py media --formats``
made in ``WORKDIR/media`` (ffmpeg needed; a zoo made elsewhere can be copied there first), plus
``--camera N`` camera-like sources from a ``gpu_classify.py media`` workdir (``--camera-dir``).
``--reference`` uses the re-implementation in ``tests/vllm_video.py`` instead of vLLM (machines without
it; no NVDEC). A backend that cannot load here (module missing) is reported once and skipped.
Results also go to ``WORKDIR/decode_indices.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DEFAULT = "opencv"
VIDEO_SUFFIXES = {".mp4", ".mov", ".mkv", ".webm", ".avi", ".m4v", ".3gp"}


@dataclass
class Result:
    file: str
    backend: str
    total_frames: int | None = None
    fps: float | None = None
    duration: float | None = None
    indices: list[int] | None = None  # what the sampler asked for
    valid: list[int] | None = None  # what was decoded
    shape: list[int] | None = None
    cpu_s: float | None = None
    wall_s: float | None = None
    error: str | None = None
    same_indices: bool | None = None  # as the default's
    frame_diff: float | None = None  # mean |frame - default frame| over the frames both decoded


# ----------------------------------------------------------------------------------------- loaders

def vllm_loader(backend: str, fps: float):
    """A function bytes -> (frames, metadata, requested indices) that is vLLM's own path."""
    try:  # the GPU machine's vLLM; not a dependency of vidlabel
        from vllm.multimodal.media import ImageMediaIO, VideoMediaIO
        from vllm.multimodal.video import VIDEO_LOADER_REGISTRY, VideoSourceMetadata, VideoTargetMetadata
    except ImportError as exc:
        raise RuntimeError(f"vLLM is not importable here ({exc}); --reference uses tests/vllm_video.py") from None

    io = VideoMediaIO(ImageMediaIO(), video_backend="qwen2_vl", fps=fps, backend=backend)
    sampler = VIDEO_LOADER_REGISTRY.load("qwen2_vl")

    def load(data: bytes):
        frames, meta = io.load_bytes(data)
        source = VideoSourceMetadata(int(meta["total_num_frames"]), float(meta["fps"]), float(meta["duration"]))
        requested = sampler.compute_frames_index_to_sample(source, VideoTargetMetadata(io.num_frames, fps, 300))
        return frames, meta, list(requested)

    return load


def reference_loader(backend: str, fps: float):
    """The same from tests/vllm_video.py (no vLLM needed; opencv, pyav and torchcodec's metadata)."""
    sys.path.insert(0, str(REPO / "tests"))
    import vllm_video as vv

    def load(data: bytes):
        tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"decode-indices-{os.getpid()}.bin"
        tmp.write_bytes(data)
        try:
            got = vv.load(tmp, backend, decode=backend != "torchcodec")
        finally:
            tmp.unlink(missing_ok=True)
        if got.error:
            raise RuntimeError(got.error)
        meta = {"total_num_frames": got.source.total_frames, "fps": got.source.fps, "duration": got.source.duration,
                "frames_indices": got.valid if got.valid is not None else got.indices}
        return got.frames, meta, got.indices

    return load


def measure(path: Path, backend: str, load) -> tuple[Result, np.ndarray | None]:
    res = Result(str(path), backend)
    data = path.read_bytes()
    c0, t0 = time.process_time(), time.perf_counter()
    try:
        frames, meta, requested = load(data)
    except Exception as exc:  # the server answers such a request with an error: recorded
        res.error = f"{type(exc).__name__}: {exc}"[:300]
        return res, None
    res.cpu_s, res.wall_s = time.process_time() - c0, time.perf_counter() - t0
    res.total_frames, res.fps, res.duration = int(meta["total_num_frames"]), float(meta["fps"]), float(meta["duration"])
    res.indices = [int(i) for i in requested]
    res.valid = [int(i) for i in meta.get("frames_indices", requested)]
    arr = None if frames is None else np.asarray(frames)
    if arr is not None and arr.ndim == 4 and arr.shape[1] == 3 and arr.shape[-1] != 3:
        arr = arr.transpose(0, 2, 3, 1)  # NCHW (GPU decoders) -> NHWC, as the others give
    res.shape = list(arr.shape) if arr is not None and arr.ndim == 4 else None
    return res, arr


def compare(default: Result, default_frames, other: Result, other_frames) -> None:
    """Fill ``other``'s comparison with the default's result in place."""
    if default.error or other.error:
        other.same_indices = bool(default.error and other.error)
        return
    other.same_indices = default.indices == other.indices and default.valid == other.valid
    if default_frames is None or other_frames is None or default.shape != other.shape:
        return
    common = [i for i in other.valid if i in default.valid]
    if not common:
        return
    a = default_frames[[default.valid.index(i) for i in common]].astype(np.int16)
    b = other_frames[[other.valid.index(i) for i in common]].astype(np.int16)
    other.frame_diff = float(np.abs(a - b).mean())


# ------------------------------------------------------------------------------------------- files

def zoo_files(work: Path) -> list[Path]:
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_classify as gc

    media = work / "media"
    media.mkdir(parents=True, exist_ok=True)
    out = []
    for name, spec in gc.format_specs().items():
        path = next(iter(sorted(media.glob(f"fmt-{name}.*"))), None)
        if path is None:
            try:
                path = gc.make_format(work, media, name, spec, seed=len(name))
            except (RuntimeError, FileNotFoundError) as exc:
                print(f"zoo: {name} not made: {exc}", flush=True)
                continue
        out.append(path)
    return out


def files_for(args) -> list[Path]:
    if args.media:
        files = sorted(p for p in Path(args.media).iterdir() if p.suffix.lower() in VIDEO_SUFFIXES)
    else:
        files = zoo_files(Path(args.workdir))
    if args.camera:
        cams = sorted(Path(args.camera_dir).glob("media/cam*.mp4"))[: args.camera]
        files += cams
    return files


# ------------------------------------------------------------------------------------------ report

def table(results: list[Result]) -> str:
    lines = ["| file | backend | frames / fps / s read | frames sampled | same as default | H x W | frame diff "
             "| CPU ms | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        name = Path(r.file).name
        if r.error:
            lines.append(f"| {name} | {r.backend} | - | - | {'-' if r.same_indices is None else r.same_indices} "
                         f"| - | - | - | {r.error[:80]} |")
            continue
        short = len(r.valid) < len(r.indices)
        lines.append(
            f"| {name} | {r.backend} | {r.total_frames} / {r.fps:.3f} / {r.duration:.2f} | {len(r.indices)}"
            + (f" ({len(r.valid)} decoded)" if short else "")
            + f" | {'-' if r.same_indices is None else ('yes' if r.same_indices else '**no**')} | "
            + ("x".join(map(str, r.shape[1:3])) if r.shape else "-") + " | "
            + (f"{r.frame_diff:.1f}" if r.frame_diff is not None else "-")
            + f" | {r.cpu_s * 1000:.0f} | {'' if r.indices == r.valid else 'indices ' + str(r.valid)[:40]} |")
    return "\n".join(lines)


def run(args) -> list[Result]:
    backends = [b for b in args.backends.split(",") if b]
    if DEFAULT in backends:
        backends.remove(DEFAULT)
    backends.insert(0, DEFAULT)
    make = reference_loader if args.reference else vllm_loader
    loaders, results = {}, []
    for b in backends:
        try:
            loaders[b] = make(b, args.fps)
        except Exception as exc:  # e.g. vLLM not importable
            print(f"{b}: cannot load ({type(exc).__name__}: {exc}); skipped", flush=True)
    if DEFAULT not in loaders:
        raise SystemExit("the default backend cannot load here: nothing to compare with")
    unavailable: set[str] = set()
    for path in files_for(args):
        default, default_frames = measure(path, DEFAULT, loaders[DEFAULT])
        results.append(default)
        for b in backends[1:]:
            if b not in loaders or b in unavailable:
                continue
            other, frames = measure(path, b, loaders[b])
            if other.error and ("No module named" in other.error or "Could not load" in other.error):
                print(f"{b}: {other.error}; not measured (install it where this runs)", flush=True)
                unavailable.add(b)
                continue
            compare(default, default_frames, other, frames)
            results.append(other)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="/tmp/vidlabel-zoo")
    ap.add_argument("--media", default=None, help="measure every video in this directory instead of the zoo")
    ap.add_argument("--camera", type=int, default=0, help="also this many camera-like sources of --camera-dir")
    ap.add_argument("--camera-dir", default="/tmp/bench", help="a gpu_classify.py media workdir")
    ap.add_argument("--backends", default="opencv,pyav,torchcodec,pynvvideocodec")
    ap.add_argument("--fps", type=float, default=2.0, help="planning.fps (the server's --media-io-kwargs fps)")
    ap.add_argument("--reference", action="store_true", help="tests/vllm_video.py instead of vLLM")
    ap.add_argument("--out", default=None, help="JSON results (default WORKDIR/decode_indices.json)")
    args = ap.parse_args(argv)
    results = run(args)
    out = Path(args.out or Path(args.workdir) / "decode_indices.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps([asdict(r) for r in results], indent=1))
    print(table(results))
    differing = sorted({(Path(r.file).name, r.backend) for r in results if r.same_indices is False})
    print(f"{len(differing)} file/backend pairs sample other frames than {DEFAULT}: "
          + (", ".join(f"{f} ({b})" for f, b in differing) or "none"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
