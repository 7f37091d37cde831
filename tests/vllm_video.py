"""How vLLM 0.26.0 reads a video file's frame count and rate with each decode backend, and which
frames the Qwen2-VL sampler then takes: re-implemented for the tests from vLLM's source
(``vllm/multimodal/video.py`` of the vllm 0.26.0 wheel), running the real decoders where this machine
has them.

What the server does with ``--media-io-kwargs '{"video":{"fps":2,"backend":B}}'``: the media
connector (``vllm/multimodal/media/connector.py: fetch_video_async``) picks the loader of the model's
video processor (Qwen2VLVideoProcessor -> ``Qwen2VLVideoBackend``, ``video.py``) and calls its
``load_bytes(data, fps=2, backend=B)`` (``VideoBackend.load_bytes``). That reads the source metadata
with B's own reader, asks the sampler for indices, and decodes those frames with B:

- ``opencv``: ``OpenCVVideoBackendMixin.get_video_metadata``: ``CAP_PROP_FRAME_COUNT``,
  ``CAP_PROP_FPS``; frames by grabbing every frame up to the last index
  (``_read_frames_no_recovery``). Real OpenCV here (opencv-python-headless).
- ``pyav``: ``PyAVVideoBackendMixin.get_metadata``: ``stream.frames`` (else
  ``int(duration * fps)``), ``stream.average_rate``, ``stream.duration * time_base``; frames by
  seeking to ``index / fps`` seconds (``decode_frames``). Real PyAV here.
- ``torchcodec``: ``TorchCodecVideoBackendMixin.get_torchcodec_metadata`` on a
  ``VideoDecoder(seek_mode="exact")``, whose metadata comes from a scan of every packet
  (torchcodec ``SingleStreamDecoder::scanFileAndUpdateMetadataAndIndex`` and
  ``StreamMetadata::getNumFrames/getAverageFps/getDurationSeconds`` in ``Metadata.cpp``): frames =
  packets of the stream not flagged discard, begin = min(pts, else dts), end = max(pts + duration),
  fps = frames / (end - begin). torchcodec's PyPI wheels need a CUDA build of torch
  (libtorch_cuda.so, libnvrtc.so.13), which this machine's CPU torch lacks, so the scan is redone
  here with PyAV's demuxer (the same libavformat calls).
- ``pynvvideocodec`` (NVDEC): ``len(SimpleDecoder)`` and its stream metadata; needs a GPU, not here
  (``benchmarks/decode_indices.py`` runs vLLM's own loaders on the GPU machine).

The sampler (``Qwen2VLVideoBackend.compute_frames_index_to_sample``): n = total / fps * 2, clamped
to [4, min(768, total) floored to even] and to total, floored to even; indices =
``torch.arange(0, total, total / n).int()`` clamped to total - 1 (float32, as transformers does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path

import av
import numpy as np

TEMPORAL_PATCH = 2
MIN_FRAMES = 4
MAX_FRAMES = 768


@dataclass(frozen=True)
class Source:
    """vLLM's ``VideoSourceMetadata``: what a backend read about the file."""

    total_frames: int
    fps: float
    duration: float


class SamplerError(ValueError):
    """The sampler refuses the metadata (vLLM answers the request with an error)."""


def qwen2_vl_indices(source: Source, fps: float = 2.0) -> list[int]:
    """``Qwen2VLVideoBackend.compute_frames_index_to_sample`` (vLLM 0.26.0)."""
    import torch

    total, original_fps = source.total_frames, source.fps
    if original_fps <= 0:
        raise SamplerError("Qwen2-VL video sampling needs a known source fps, but the container reported 0")
    most = math.floor(min(MAX_FRAMES, total) / TEMPORAL_PATCH) * TEMPORAL_PATCH
    n = total / original_fps * fps
    n = min(max(n, MIN_FRAMES), most, total)
    n = math.floor(n / TEMPORAL_PATCH) * TEMPORAL_PATCH
    if n == 0:
        raise SamplerError("division by zero")  # what the server answers for a file of < 2 frames
    indices = torch.arange(0, total, total / n).int()
    return torch.clamp(indices, max=total - 1).tolist()


# ------------------------------------------------------------------------------------------ opencv

def opencv_capture(data: bytes):
    """``OpenCVVideoBackendMixin.open_video_capture``: a stream-buffered backend over the bytes. The
    buffer is returned with the capture: releasing a capture whose buffer is gone crashes OpenCV."""
    import cv2
    import cv2.videoio_registry as vr

    api = None
    for backend in vr.getStreamBufferedBackends():
        if not vr.hasBackend(backend):
            continue
        if not vr.isBackendBuiltIn(backend):
            _, abi, api_version = vr.getStreamBufferedBackendPluginVersion(backend)
            if abi < 1 or (abi == 1 and api_version < 2):
                continue
        api = backend
        break
    buffer = BytesIO(data)
    cap = cv2.VideoCapture(buffer, api, [])
    if not cap.isOpened():
        raise ValueError("Could not open video stream")
    return cap, buffer


def opencv_source(cap) -> Source:
    import cv2

    total = int(cap.get(cv2.CAP_PROP_FRAME_COUNT))
    fps = cap.get(cv2.CAP_PROP_FPS)
    return Source(total, fps, total / fps if fps > 0 else 0)


def opencv_frames(cap, indices: list[int]) -> tuple[np.ndarray, list[int]]:
    """``_read_frames_no_recovery``: grab up to the last index, retrieve (BGR -> RGB) the wanted ones."""
    import cv2

    wanted = set(indices)
    frames, valid = [], []
    for idx in range(max(indices) + 1):
        if not cap.grab():
            continue
        if idx in wanted:
            ok, frame = cap.retrieve()
            if ok:
                frames.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
                valid.append(idx)
    return (np.stack(frames) if frames else np.empty((0,), np.uint8)), valid


# -------------------------------------------------------------------------------------------- pyav

def pyav_source(container) -> Source:
    """``PyAVVideoBackendMixin.get_metadata``."""
    if not container.streams.video:
        raise ValueError("No video streams found in container")
    stream = container.streams.video[0]
    total = stream.frames or 0
    fps = float(stream.average_rate) if stream.average_rate else 0.0
    duration = float(stream.duration * stream.time_base) if stream.duration else 0.0
    if total == 0 and duration > 0 and fps > 0:
        total = int(duration * fps)
    return Source(total, fps, duration)


def pyav_frames(container, indices: list[int], source: Source) -> tuple[np.ndarray, list[int]]:
    """``PyAVVideoBackendMixin.decode_frames``: seek to index / fps, decode forward to that pts."""
    stream = container.streams.video[0]
    stream.thread_type = "SLICE"
    time_base = stream.time_base
    fps, duration = source.fps, source.duration
    interval = 1.0 / fps if fps > 0 else 0.1
    max_ts = max(0.0, duration - interval) if duration > 0 else float("inf")
    frames, valid = [], []
    decoder, last_pts = None, None
    for idx in indices:
        ts = min(idx / fps, max_ts) if fps > 0 else 0.0
        pts = int(ts / time_base)
        if decoder is None or last_pts is None or pts <= last_pts:
            container.seek(pts, stream=stream)
            decoder = container.decode(video=0)
        chosen = None
        for frame in decoder:
            if frame.pts is not None and frame.pts >= pts:
                chosen, last_pts = frame, frame.pts
                break
        if chosen is not None:
            frames.append(chosen.to_ndarray(format="rgb24"))
            valid.append(idx)
        else:
            decoder = None
    return (np.stack(frames) if frames else np.empty((0,), np.uint8)), valid


# -------------------------------------------------------------------------------------- torchcodec

def torchcodec_source(data: bytes) -> Source:
    """``get_torchcodec_metadata`` over torchcodec's exact-mode scan (see the module docstring)."""
    with av.open(BytesIO(data)) as container:
        if not container.streams.video:
            raise ValueError("No video streams found in container")
        stream = container.streams.video[0]
        count, begin, end = 0, None, None
        for packet in container.demux(stream):
            if packet.size == 0 and packet.pts is None and packet.dts is None:
                continue  # PyAV's flush packet at the end of the demux, not one av_read_frame returns
            if packet.is_discard:
                continue
            ts = packet.pts if packet.pts is not None else packet.dts
            count += 1
            begin = ts if begin is None else min(begin, ts)
            end = ts + packet.duration if end is None else max(end, ts + packet.duration)
        tb = float(stream.time_base)
        header_fps = float(stream.average_rate) if stream.average_rate else 0.0
    if count == 0 or begin is None:
        return Source(0, header_fps, 0.0)
    begin_s, end_s = begin * tb, end * tb
    fps = count / (end_s - begin_s) if end_s != begin_s else header_fps
    duration = end_s - begin_s
    return Source(count, fps, duration)


# ---------------------------------------------------------------------------------------- together

@dataclass
class Loaded:
    backend: str
    source: Source | None
    indices: list[int] | None
    valid: list[int] | None
    shape: tuple[int, ...] | None  # (frames, height, width, 3) of what was decoded
    frames: np.ndarray | None
    error: str | None


def load(path: str | Path, backend: str, decode: bool = True) -> Loaded:
    """What ``Qwen2VLVideoBackend.load_bytes(data, fps=2, backend=backend)`` reads and samples."""
    data = Path(path).read_bytes()
    source = indices = None
    try:
        if backend == "opencv":
            cap, _buffer = opencv_capture(data)
            try:
                source = opencv_source(cap)
                indices = qwen2_vl_indices(source)
                frames, valid = opencv_frames(cap, indices) if decode else (None, None)
            finally:
                cap.release()
        elif backend == "pyav":
            with av.open(BytesIO(data)) as container:
                source = pyav_source(container)
                indices = qwen2_vl_indices(source)
                frames, valid = pyav_frames(container, indices, source) if decode else (None, None)
        elif backend == "torchcodec":
            source = torchcodec_source(data)
            indices = qwen2_vl_indices(source)
            frames, valid = None, None  # no torchcodec here to decode with
        else:
            raise ValueError(f"backend {backend!r} cannot run here")
    except Exception as exc:  # the server answers such a request with an error: recorded, compared
        return Loaded(backend, source, indices, None, None, None, f"{type(exc).__name__}: {exc}")
    shape = tuple(frames.shape) if frames is not None and frames.ndim == 4 else None
    return Loaded(backend, source, indices, valid, shape, frames, None)
