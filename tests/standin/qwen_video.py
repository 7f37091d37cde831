"""How vLLM (0.26-0.33) turns a video into Qwen2.5-VL prompt tokens, for the stand-in server.

Written from vLLM's source (``multimodal/video.py: Qwen2VLVideoBackend``,
``models/qwen2_vl.py``) and the Hugging Face processor's ``smart_resize``, independently of
vidlabel's own estimator (``vidlabel.prepare.tokens``), so that the tests compare two implementations:

- frames: ``n = total_frames / source_fps * fps``, clamped to [min_frames, max_frames] (and the
  file's frames, floored to even), then floored to a multiple of the temporal patch (2); the indices are
  ``torch.arange(0, total, total / n)``, whose length can be n + 1 (359 frames, n 22: 23), the processor
  padding an odd count to a pair;
- each frame resized to multiples of 28 with its area within [min_pixels, max_pixels];
- one token per 28x28 cell per frame pair (the encoder cache: ``qwen_image.encoder_cache_size``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import av
import numpy as np

FACTOR = 28
TEMPORAL_PATCH = 2
PROFILER_MAX_FRAMES = 14  # vLLM models/qwen2_vl.py: _MAX_FRAMES_PER_VIDEO


class CannotOpen(Exception):
    """vLLM's OpenCV loader: 'Could not open video stream' (empty or non-video file)."""


class NoFrames(Exception):
    """The container opens but no frame decodes (an MP4 cut after its index)."""


@dataclass
class VideoInfo:
    total_frames: int
    fps: float
    width: int
    height: int


def probe(path: str) -> VideoInfo:
    """Frame count, frame rate and display size of the first video stream; decodes one frame."""
    try:
        container = av.open(path)
    except (av.error.FFmpegError, OSError) as exc:
        raise CannotOpen(str(exc)) from None
    with container:
        if not container.streams.video:
            raise CannotOpen("no video stream")
        stream = container.streams.video[0]
        fps = float(stream.average_rate or 0)
        # OpenCV's FFmpeg reader (vLLM's default decoder): the header's count, else the duration times the rate,
        # the container's duration first (Matroska and WebM streams carry none of their own).
        if container.duration:
            seconds = container.duration / av.time_base
        else:
            seconds = float(stream.duration * stream.time_base) if stream.duration else 0.0
        frames = stream.frames or int(math.floor(seconds * fps + 0.5))
        try:
            first = next(container.decode(stream), None)
        except av.error.FFmpegError:
            first = None
        if first is None:
            raise NoFrames(path)
        width, height = first.width, first.height
        rotation = getattr(first, "rotation", 0) or 0
        if int(rotation) % 180:
            width, height = height, width
    return VideoInfo(frames, fps, width, height)


def sampled_frames(info: VideoInfo, fps: float, min_frames: int = 4, max_frames: int = 768) -> int:
    """Frames the processor gets: the length of vLLM's ``torch.arange(0, total, total / n)``."""
    most = math.floor(min(max_frames, info.total_frames) / TEMPORAL_PATCH) * TEMPORAL_PATCH
    n = info.total_frames / info.fps * fps if info.fps > 0 else 0
    n = min(max(n, min_frames), most, info.total_frames)
    n = math.floor(n / TEMPORAL_PATCH) * TEMPORAL_PATCH
    return len(np.arange(0, info.total_frames, info.total_frames / n)) if n > 0 else 0


def resize(height: int, width: int, min_pixels: int, max_pixels: int, factor: int = FACTOR) -> tuple[int, int]:
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def video_tokens(info: VideoInfo, fps: float, min_pixels: int, max_pixels: int, factor: int = FACTOR) -> int:
    frames = sampled_frames(info, fps)
    h, w = resize(info.height, info.width, min_pixels, max_pixels, factor)
    return math.ceil(frames / TEMPORAL_PATCH) * (h // factor) * (w // factor)
