"""Where the server decodes videos: ``planning.decode`` -> a vLLM 0.26 video codec backend.

vLLM's API server decodes each video in its media thread pool with the codec backend named in
``--media-io-kwargs '{"video": {"fps": 2, "backend": B}}'`` (``vllm/multimodal/video.py``:
``VideoBackend.load_bytes``); the Qwen2-VL frame sampler stays whatever B is. (The
``VLLM_VIDEO_LOADER_BACKEND`` variable or a ``video_backend`` key would instead replace the loader
class, and with it Qwen2-VL's fps sampler by the uniform one: other frames, other tokens. vidlabel
never sets them.)

=============  ===================  ==================================================================
choice         vLLM backend         what it needs where the server runs
=============  ===================  ==================================================================
``cpu``        ``opencv`` (default)  nothing: OpenCV is a vLLM dependency
``gpu``        ``pynvvideocodec``   NVDEC on the server's GPU: PyPI ``pynvvideocodec``, importable by the
                                    server's own Python (vLLM answers every request with HTTP 500 "No
                                    module named 'PyNvVideoCodec'" otherwise)
``torchcodec`` ``torchcodec``       PyPI ``torchcodec`` built for the server's torch, and FFmpeg 4-9
                                    shared libraries it can load
``auto``       ``AUTO_DECODE``      the choice measured to keep the GPU busiest (docs/serving.md)
=============  ===================  ==================================================================

The choice is part of what an answer depends on: it goes into the server command (the planning
settings are in the classify fingerprint; ``auto`` is resolved before any fingerprint is taken,
``vidlabel.core.config.resolve_derived``). The default decoder adds nothing to the command, so a
config that leaves it at ``cpu`` runs the very command it ran before the choice existed.

What a decoder cannot read, or would sample differently from the default decoder, is planned for
the transcode (``unreadable``), which writes constant-rate 8-bit 4:2:0 H.264 that every backend
reads alike: see ``NVDEC_READS`` and ``SCAN_COUNTS`` and docs/planning.md.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from vidlabel.core.launcher import launcher_python

log = logging.getLogger(__name__)

CHOICES = ("cpu", "gpu", "torchcodec")
# What `auto` means. Chosen from the steady-state measurement on one H200 (benchmarks/gpu_steady.py,
# docs/serving.md "Steady state"): the choice that keeps the GPU busiest on raw camera-like media at
# the profile's CPUs per GPU. Until it is measured, the decoder measured to read every format.
# Changing it changes the server command of every `auto` config, and so reruns their classify jobs.
AUTO_DECODE = "cpu"
BACKENDS = {"cpu": "opencv", "gpu": "pynvvideocodec", "torchcodec": "torchcodec"}
DEFAULT_BACKEND = "opencv"  # vLLM's own default: nothing to add to the command
MEDIA_IO_FLAG = "--media-io-kwargs"


def resolve_choice(value: str) -> str:
    """``auto`` -> ``AUTO_DECODE``; any other choice as it is."""
    return AUTO_DECODE if value == "auto" else value


def choice(config: Mapping) -> str:
    return resolve_choice(config["planning"].get("decode", "auto"))


def backend(config: Mapping) -> str:
    """The vLLM codec backend of the config's decode choice."""
    return BACKENDS[choice(config)]


# ----------------------------------------------------------------------------------- the command

def flag_value(argv: list[str], *names: str) -> tuple[int, str | None, bool]:
    """Where the last of ``names`` stands in a command line: (its position, its value, whether written
    ``name=value``); (-1, None, False) when absent."""
    found = (-1, None, False)
    for i, word in enumerate(argv):
        for name in names:
            if word == name and i + 1 < len(argv):
                found = (i, argv[i + 1], False)
            elif word.startswith(name + "="):
                found = (i, word.split("=", 1)[1], True)
    return found


def with_backend(argv: list[str], name: str) -> list[str]:
    """``argv`` with ``name`` merged into the video part of its ``--media-io-kwargs`` (fps and any other
    key kept), or the flag added when there is none. The default backend leaves ``argv`` as it is."""
    i, value, joined = flag_value(argv, MEDIA_IO_FLAG)
    try:
        kwargs = json.loads(value) if value is not None else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"the server command's {MEDIA_IO_FLAG} is not JSON ({exc}): {value!r}") from None
    video = dict((kwargs.get("video") if isinstance(kwargs, dict) else None) or {})
    if "video_backend" in video:  # would swap Qwen2-VL's frame sampler (and so the token estimates)
        raise ValueError(f"the server command's {MEDIA_IO_FLAG} sets video.video_backend: that replaces the "
                         "model's frame sampler; remove it and choose the decoder with planning.decode")
    if name == DEFAULT_BACKEND:
        return list(argv)
    video["backend"] = name
    text = json.dumps({**kwargs, "video": video}, separators=(",", ":"))
    out = list(argv)
    if i < 0:
        return out + [MEDIA_IO_FLAG, text]
    if joined:
        out[i] = f"{MEDIA_IO_FLAG}={text}"
    else:
        out[i + 1] = text
    return out


def command_backend(argv: list[str]) -> str:
    """The codec backend a server command asks for (vLLM's default when it names none)."""
    _, value, _ = flag_value(argv, MEDIA_IO_FLAG)
    try:
        video = (json.loads(value) if value else {}).get("video") or {}
    except (json.JSONDecodeError, AttributeError):
        return DEFAULT_BACKEND
    return str(video.get("backend") or DEFAULT_BACKEND)


# ---------------------------------------------------------------------- what each decoder can read

# NVDEC on the data-centre GPUs vidlabel targets (Hopper H100/H200, Ampere A100: NVIDIA Video Codec SDK
# 13.0, "NVDEC Application Note", hardware capabilities, column Turing/GA100/Hopper; "NVDEC Video
# Decoder API Programming Guide", decoder capabilities): H.264 Baseline/Main/High only (no High10,
# High422 or High444 before Blackwell), at most 4096x4096, at least 48x16; HEVC Main and Main10 (and
# 4:4:4) up to 8192x8192, at least 144x144; VP9 profile 0 up to 8192x8192, at least 128x128; no AV1
# (GA10x, Ada and Blackwell only). Measured on vLLM 0.26 with PyPI pynvvideocodec 2.2.4 (one H200):
# H.264 8-bit 4:2:0, HEVC 8 and 10 bit, VP9 in WebM read; H.264 4:4:4 and 10-bit H.264 refused
# ("ReconfigureDecoder ... Error code 801 ... Reconfigure Not supported for chroma format change /
# bit depth change"). Only what is both documented and measured is sent as it is: codec -> (pixel
# formats, smallest width/height, largest width/height).
NVDEC_READS = {
    "h264": (("yuv420p", "yuvj420p", "nv12"), (48, 16), (4096, 4096)),
    "hevc": (("yuv420p", "yuvj420p", "nv12", "yuv420p10le", "p010le"), (144, 144), (8192, 8192)),
    "vp9": (("yuv420p", "yuvj420p", "nv12"), (128, 128), (8192, 8192)),
}
# Backends that count a file's frames by scanning its packets (torchcodec's exact mode;
# PyNvVideoCodec's SimpleDecoder with need_scanned_stream_metadata) where the default OpenCV reads the
# container header. The Qwen2-VL sampler picks frames from that count and the rate, so wherever the
# two disagree they sample other frames and other tokens than the default
# (tests/test_decode_indices.py, on the format zoo): Matroska/WebM and AVI (no exact count in the
# header), variable frame rate (the scan's rate is frames over the time span, the header's the
# average), edit lists (the header counts frames the decoder drops). Only MP4/QuickTime files at a
# constant rate whose header count matches their duration are sent as they are.
SCAN_COUNTS = frozenset({"pynvvideocodec", "torchcodec"})
HEADER_COUNTED_CONTAINERS = ("mov", "mp4")  # PyAV/FFmpeg format name "mov,mp4,m4a,3gp,3g2,mj2"
RATE_TOLERANCE = 0.01  # average vs base frame rate: more apart than this is a variable frame rate
# Backends not shown to turn frames by the container's display rotation (OpenCV does, vLLM's default):
# the model would see the video on its side. torchcodec 0.17 documents that it does; not measured in
# vLLM, so both are transcoded (ffmpeg applies the rotation) until benchmarks/decode_indices.py shows it.
KEEPS_ROTATION = frozenset({"opencv"})
# Codecs whose FFmpeg decoder is part of every FFmpeg build (torchcodec decodes with the server's own
# FFmpeg libraries; AV1 needs libdav1d or libaom in that build, which is not known here).
FFMPEG_NATIVE = frozenset({"h264", "hevc", "vp9"})


@dataclass(frozen=True)
class Formats:
    """Per-post arrays from the inventory (``vidlabel.prepare.media.probe``); None where the column
    is missing (an inventory made before it existed)."""

    codec: np.ndarray
    pix_fmt: np.ndarray | None = None
    width: np.ndarray | None = None
    height: np.ndarray | None = None
    rotation: np.ndarray | None = None
    container: np.ndarray | None = None
    header_frames: np.ndarray | None = None
    fps: np.ndarray | None = None
    base_fps: np.ndarray | None = None
    duration_s: np.ndarray | None = None

    # Columns each backend's judgement reads.
    NEEDED = {"pynvvideocodec": ("pix_fmt", "rotation", "container", "header_frames", "base_fps"),
              "torchcodec": ("rotation", "container", "header_frames", "base_fps")}

    def missing(self, name: str) -> list[str]:
        return [c for c in self.NEEDED.get(name, ()) if getattr(self, c) is None]


class InventoryTooOld(ValueError):
    """The inventory lacks a column the chosen decoder's planning needs."""


def _num(a, i) -> float:
    try:
        v = float(a[i])
    except (TypeError, ValueError):
        return float("nan")
    return v


def _scan_problem(f: Formats, i: int, name: str) -> str | None:
    """Why ``name``'s scanned frame count and rate would differ from the header's, or None."""
    container = str(f.container[i] or "")
    if not any(c in container.split(",") for c in HEADER_COUNTED_CONTAINERS):
        return (f"{name} counts frames by scanning the file and the default decoder reads them from a "
                f"container header that holds no exact count ({container or 'unknown container'}): "
                "they would sample other frames")
    frames, fps, base = _num(f.header_frames, i), _num(f.fps, i), _num(f.base_fps, i)
    duration = _num(f.duration_s, i)
    if not (fps > 0 and base > 0) or abs(fps - base) > RATE_TOLERANCE * base:
        return (f"variable frame rate (average {fps:.3f} against {base:.3f} fps): {name}'s scanned rate "
                "differs from the header's, so it would sample other frames")
    if not frames > 0 or not duration > 0 or abs(frames / fps - duration) > 1.5 / fps:
        return (f"the header's {frames:.0f} frames do not match {duration:.2f} s at {fps:.3f} fps (an edit list "
                f"or a cut file): {name} would count other frames than the default decoder")
    return None


def unreadable(config: Mapping, formats: Formats) -> np.ndarray:
    """Per post, why the chosen decoder must not get the original file (None: send it as it is).

    Only the chosen backend's own limits are judged here; what the default decoder cannot read
    (``vidlabel.prepare.planning.SERVER_CODECS``) is judged by the planner for every choice.
    Raises InventoryTooOld when the inventory lacks a column this needs.
    """
    name = backend(config)
    n = len(formats.codec)
    out = np.full(n, None, dtype=object)
    if name == DEFAULT_BACKEND:
        return out
    missing = formats.missing(name)
    if missing:
        raise InventoryTooOld(
            f"planning.decode: {choice(config)} needs the inventory columns {missing}, which this inventory "
            "predates: make it again (snakemake --forcerun inventory) and rerun")
    for i in range(n):
        codec = str(formats.codec[i] or "")
        rotation = _num(formats.rotation, i)
        if name == "pynvvideocodec":
            if codec not in NVDEC_READS:
                out[i] = f"NVDEC on the server's GPU is not measured to decode {codec or 'this codec'}"
                continue
            pix_fmts, (min_w, min_h), (max_w, max_h) = NVDEC_READS[codec]
            pix = str(formats.pix_fmt[i] or "")
            w, h = _num(formats.width, i), _num(formats.height, i)
            if pix not in pix_fmts:
                out[i] = (f"NVDEC cannot decode {codec} {pix or 'of unknown pixel format'} (it reads "
                          f"{', '.join(pix_fmts)})")
                continue
            if not (min_w <= w <= max_w and min_h <= h <= max_h):
                out[i] = f"NVDEC decodes {codec} from {min_w}x{min_h} to {max_w}x{max_h}; this is {w:.0f}x{h:.0f}"
                continue
        elif name == "torchcodec" and codec not in FFMPEG_NATIVE:
            out[i] = f"torchcodec is not known to decode {codec or 'this codec'} with the server's FFmpeg"
            continue
        if name not in KEEPS_ROTATION and rotation in (90.0, -90.0, 270.0, -270.0, 180.0, -180.0):
            out[i] = (f"a {rotation:.0f} degree rotation flag: {name} is not shown to turn the frames, and the "
                      "model would see the video turned")
            continue
        if name in SCAN_COUNTS:
            out[i] = _scan_problem(formats, i, name)
    return out


# ------------------------------------------------------------------------------- what to install

@dataclass(frozen=True)
class Requirement:
    module: str  # what vLLM imports in its API server
    install: str  # what to tell the user


REQUIREMENTS = {
    "pynvvideocodec": Requirement(
        "PyNvVideoCodec",
        "install PyPI `pynvvideocodec` into the server's own Python (the interpreter that runs `vllm serve`: "
        "`<that python> -m pip install pynvvideocodec`; it needs an NVIDIA driver with NVDEC), or set "
        "planning.decode: cpu"),
    "torchcodec": Requirement(
        "torchcodec",
        "install PyPI `torchcodec` built for the server's torch into the server's own Python, and FFmpeg 4-9 "
        "shared libraries (libavcodec, libavformat, ...) where it can load them (e.g. the distribution's "
        "ffmpeg package, or `conda install ffmpeg`), or set planning.decode: cpu"),
}
def install_hint(message: str) -> str | None:
    """What to install, for a server error message that says a decoder's module is missing (the
    probable cause of a job whose every request fails with it), or None for any other message.

    >>> install_hint("No module named 'PyNvVideoCodec'").startswith("install PyPI `pynvvideocodec`")
    True
    """
    text = (message or "").lower()
    missing = "no module named" in text
    if missing and "pynvvideocodec" in text:
        return REQUIREMENTS["pynvvideocodec"].install
    if (missing and "torchcodec" in text) or "could not load libtorchcodec" in text:
        return REQUIREMENTS["torchcodec"].install
    if "please install vllm[" in text:  # vLLM's placeholder module names the optional extra itself
        return (f"the server lacks an optional dependency: {message.strip()[:200]} (install it into the "
                "server's own Python, or set planning.decode: cpu)")
    return None


PREFLIGHT_TIMEOUT_S = 120.0


def preflight(argv: list[str], environ: Mapping[str, str]) -> str | None:
    """Before the server starts: whether the server's own Python can import the decoder its command
    asks for. A message (the job's failure) when it cannot; None when it can or when that cannot be
    told here (the server is not a Python console script, e.g. a shell wrapper or a container): the
    job's first request then proves it."""
    name = command_backend(argv)
    need = REQUIREMENTS.get(name)
    if need is None or not argv:
        return None
    python = argv[0] if os.path.basename(argv[0]).startswith("python") else launcher_python(argv[0], environ)
    if python is None:
        log.info("decoder %s: cannot tell whether %s can import %s (not a Python console script); the first "
                 "request will", name, argv[0], need.module)
        return None
    probe = f"import {need.module}" + (".decoders" if name == "torchcodec" else "")
    try:
        proc = subprocess.run([python, "-c", probe], env=dict(environ), capture_output=True, text=True,
                              timeout=PREFLIGHT_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("decoder %s: could not run %s to check it (%s); the first request will", name, python, exc)
        return None
    if proc.returncode == 0:
        return None
    last = (proc.stderr.strip().splitlines() or ["(no message)"])[-1]
    return (f"the server's Python ({python}) cannot import {need.module}, which planning.decode: "
            f"{next(k for k, v in BACKENDS.items() if v == name)} (vLLM backend {name}) needs: {last[:300]}. "
            f"To fix: {need.install}")


# ------------------------------------------------------------------------------- GPU memory

# What vLLM 0.26 takes from each GPU's KV cache for GPU decoding (vllm/v1/worker/gpu_worker.py:
# _reserve_mm_ipc_gpu_memory): per API server process, one retained decoder's surfaces (128 MiB) and
# its CUDA context (1.8 GiB, measured by vLLM with PyNvVideoCodec 2.0.4 on an H100).
GPU_DECODE_GIB_PER_API_SERVER = 0.125 + 1.8


def gpu_reserve_gib(video_backend: str, api_servers: int) -> float:
    """GPU memory per GPU that the decoder (a vLLM video backend, ``backend``) takes from the server (0
    unless it decodes on the GPU)."""
    return GPU_DECODE_GIB_PER_API_SERVER * max(1, api_servers) if video_backend == "pynvvideocodec" else 0.0
