"""The resize rules of the Hugging Face Qwen processors, vectorised, for any cell size.

Each family module passes its own cell (``factor``) and bounds; nothing here is a family's constant.
Rounding follows the processors: nearest multiple first (numpy and Python both round halves to even),
floor when shrinking, ceil when growing.
"""

from __future__ import annotations

import numpy as np

from vidlabel.families.base import arr


def smart_resize(height, width, factor: int, min_pixels, max_pixels) -> tuple[np.ndarray, np.ndarray]:
    """(height, width), multiples of ``factor``, area within [min_pixels, max_pixels]: the image rule of
    ``transformers.models.qwen2_vl.image_processing_qwen2_vl.smart_resize`` (and of Qwen2-VL's video frames)."""
    h, w = arr(height), arr(width)
    lo, hi = np.asarray(min_pixels, dtype=np.float64), np.asarray(max_pixels, dtype=np.float64)
    h_bar = np.maximum(factor, np.round(h / factor) * factor)
    w_bar = np.maximum(factor, np.round(w / factor) * factor)
    area = h * w
    too_big = h_bar * w_bar > hi
    too_small = (h_bar * w_bar < lo) & ~too_big
    with np.errstate(divide="ignore", invalid="ignore"):
        beta_down = np.sqrt(area / hi)
        beta_up = np.sqrt(lo / area)
        h_down = np.maximum(factor, np.floor(h / beta_down / factor) * factor)
        w_down = np.maximum(factor, np.floor(w / beta_down / factor) * factor)
        h_up = np.ceil(h * beta_up / factor) * factor
        w_up = np.ceil(w * beta_up / factor) * factor
    h_out = np.where(too_big, h_down, np.where(too_small, h_up, h_bar))
    w_out = np.where(too_big, w_down, np.where(too_small, w_up, w_bar))
    return h_out.astype(np.int64), w_out.astype(np.int64)


def video_smart_resize(frames, height, width, factor: int, temporal: int, min_pixels,
                       max_pixels) -> tuple[np.ndarray, np.ndarray]:
    """(height, width) of every frame under ONE pixel budget for the whole video: the rule of
    ``transformers.models.qwen3_vl.video_processing_qwen3_vl.smart_resize``. A side below ``factor`` is
    first scaled up (the other with it); the frame count is rounded to the temporal patch (halves to
    even) for the bounds test, while the scale uses the frames as they are."""
    n, h, w = arr(frames), arr(height), arr(width)
    lo, hi = np.asarray(min_pixels, dtype=np.float64), np.asarray(max_pixels, dtype=np.float64)
    small = (h < factor) | (w < factor)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.maximum(factor / h, factor / w)
        h = np.where(small, np.floor(h * scale), h)
        w = np.where(small, np.floor(w * scale), w)
    h_bar = np.round(h / factor) * factor
    w_bar = np.round(w / factor) * factor
    t_bar = np.round(n / temporal) * temporal
    volume = t_bar * h_bar * w_bar
    too_big = volume > hi
    too_small = (volume < lo) & ~too_big
    with np.errstate(divide="ignore", invalid="ignore"):
        beta_down = np.sqrt(n * h * w / hi)
        beta_up = np.sqrt(lo / (n * h * w))
        h_down = np.maximum(factor, np.floor(h / beta_down / factor) * factor)
        w_down = np.maximum(factor, np.floor(w / beta_down / factor) * factor)
        h_up = np.ceil(h * beta_up / factor) * factor
        w_up = np.ceil(w * beta_up / factor) * factor
    h_out = np.where(too_big, h_down, np.where(too_small, h_up, h_bar))
    w_out = np.where(too_big, w_down, np.where(too_small, w_up, w_bar))
    return h_out.astype(np.int64), w_out.astype(np.int64)
