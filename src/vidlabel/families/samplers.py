"""vLLM's video loaders (``vllm/multimodal/video.py``, 0.26): which frames of a file reach the processor.

The loader is chosen by the model's video processor, not by vidlabel: Qwen2-VL's (``Qwen2VLVideoBackend``,
used by Qwen2.5-VL and Qwen3-Omni) and Qwen3-VL's (``Qwen3VLVideoBackend``). Both read the file's frame
count and rate from its header (OpenCV's ``CAP_PROP_FRAME_COUNT`` / ``CAP_PROP_FPS``). Vectorised; the
float arithmetic is the servers' own, so that the counts are exact.
"""

from __future__ import annotations

import numpy as np

from vidlabel.families.base import Sampling, arr


def _wanted(total_frames, source_fps, duration_s, s: Sampling):
    """(the file's frames, whether its rate is known, the frames the sampling rate asks for)."""
    n_total = arr(total_frames)
    f = np.nan_to_num(arr(source_fps), nan=0.0)
    known = (f > 0) & (n_total > 0) & (n_total < 2 ** 61)
    with np.errstate(divide="ignore", invalid="ignore"):
        wanted = np.where(known, n_total / np.where(known, f, 1.0), np.nan_to_num(arr(duration_s), nan=0.0)) * s.fps
    return n_total, known, wanted


def qwen2_vl_loader(total_frames, source_fps, duration_s, s: Sampling, temporal: int) -> np.ndarray:
    """Frames ``Qwen2VLVideoBackend`` hands the processor: ``total / source_fps * fps`` clamped to
    [min_frames, max_frames] and the file's frames (the upper bounds taken down to a multiple of the temporal
    patch), floored to that multiple, then the indices ``torch.arange(0, total, total / n)``: their count is
    ``ceil(total / (total / n))`` in double precision, which is ``n + 1`` for some files (359 frames, n 22:
    23 indices, the processor pads them to 24).

    A file of unknown rate (0 or NaN) is planned as ``duration_s`` of frames at ``fps``."""
    n_total, known, wanted = _wanted(total_frames, source_fps, duration_s, s)
    most = np.floor(np.minimum(s.max_frames, n_total) / temporal) * temporal
    n = np.minimum(np.minimum(np.maximum(wanted, s.min_frames), most), n_total)
    n = np.maximum(temporal, np.floor(n / temporal) * temporal)
    with np.errstate(divide="ignore", invalid="ignore"):
        count = np.where(known, np.ceil(n_total / (n_total / n)), n)
    return count.astype(np.int64)


def qwen3_vl_loader(total_frames, source_fps, duration_s, s: Sampling) -> np.ndarray:
    """Frames ``Qwen3VLVideoBackend`` hands the processor: ``int(total / source_fps * fps)`` clamped to
    [min_frames, max_frames] and the file's frames, sampled at ``linspace(0, total - 1, n).round()``."""
    n_total, _, wanted = _wanted(total_frames, source_fps, duration_s, s)
    n = np.minimum(np.minimum(np.maximum(np.trunc(wanted), s.min_frames), s.max_frames), n_total)
    return n.astype(np.int64)


def qwen3_vl_group_times(total_frames, source_fps, frames, temporal: int, group: int) -> np.ndarray:
    """The timestamp (seconds) of group ``group`` of each video, as vLLM's Qwen3-VL processor computes it:
    the indices ``linspace(0, total - 1, frames).round()`` (the last index repeated to fill the last group),
    each over the source rate, and the mean of the group's first and last."""
    n_total, f, n = arr(total_frames), arr(source_fps), arr(frames)
    g = arr(group)
    first = np.minimum(g * temporal, n - 1)
    last = np.minimum(g * temporal + temporal - 1, n - 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        step = np.where(n > 1, (n_total - 1) / np.maximum(n - 1, 1), 0.0)

        def index(k):
            # numpy's linspace: k * step + start, its last element set to stop exactly; then .round().
            return np.where(k >= n - 1, n_total - 1, np.round(k * step))

        return (index(first) / f + index(last) / f) / 2
