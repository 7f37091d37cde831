"""How vLLM (0.26) turns images into Qwen2.5-VL prompt tokens, for the stand-in server.

Written from vLLM's source, independently of vidlabel's estimator (``vidlabel.prepare.tokens``):

- loading (``multimodal/media/image.py: ImageMediaIO.load_bytes``): ``Image.open`` of the file's
  bytes, then ``multimodal/image.py: normalize_image`` (``ImageOps.exif_transpose``: a photo stored
  sideways with an orientation tag is turned upright, which swaps its sides but not its token count);
  a file Pillow cannot open is a ValueError "Failed to load image: ...", a 400;
- tokens: the grid the HF processor returns (``models/qwen2_vl.py: _get_prompt_updates``): one frame
  padded to the temporal patch, (H'/28)(W'/28) tokens after ``smart_resize`` with the image
  processor's bounds, plus <|vision_start|> and <|vision_end|>;
- the bounds at each request (transformers 5.23 ``processing_utils.py: ProcessorMixin._merge_kwargs``,
  called with vLLM's ``--mm-processor-kwargs`` as they are: ``multimodal/processing/context.py:
  call_hf_processor``): an ``images_kwargs`` / ``videos_kwargs`` dict sets its own modality
  (``min_pixels``/``max_pixels``, or ``size`` with ``shortest_edge``/``longest_edge``), a flat
  ``min_pixels``/``max_pixels`` every modality that takes it, images *and* videos; otherwise the
  model's ``preprocessor_config.json`` (3,136 and 12,845,056 for images) and the video processor's
  defaults (``video_processing_qwen2_vl.py``: 100,352 and 602,112);
- the profiler's bounds (``models/qwen2_vl.py: get_image_size_with_most_features``): the image
  processor's own size (the checkpoint's, or a flat min/max_pixels given at its construction) with
  flat overrides only: the per-modality dicts do not reach it, and it sizes the profiler's *video*
  frames by the image bound too;
- ``--limit-mm-per-prompt`` (``multimodal/processing/context.py: validate_num_items``; Qwen2-VL
  supports unlimited items, so no hint is added): "At most N image(s) may be provided in one
  prompt."; a modality not given is allowed 999 items (``config/multimodal.py``);
- the encoder cache (``multimodal/encoder_budget.py``, ``v1/core/encoder_cache_manager.py:
  compute_mm_encoder_budget``): max of ``--max-num-batched-tokens`` and the profiler's largest item of
  every modality allowed (limit above 0), each profiled as one item of its kind: the image is the
  largest cell grid the bound allows (``closest_factor_pair``, aspect at most 200), the video as many
  such frames as ``--max-model-len`` holds, at most 14 (``get_num_frames_with_most_features``).
"""

from __future__ import annotations

import math

from PIL import Image, ImageOps, UnidentifiedImageError
from qwen_video import FACTOR, PROFILER_MAX_FRAMES, TEMPORAL_PATCH, resize

IMAGE_MIN_PIXELS = 3136  # Qwen2.5-VL preprocessor_config.json
IMAGE_MAX_PIXELS = 12845056
VIDEO_MIN_PIXELS = 128 * 28 * 28  # the Qwen2-VL video processor's defaults
VIDEO_MAX_PIXELS = 768 * 28 * 28
DEFAULT_LIMIT = 999
MARKERS = 2
MAX_ASPECT = 200  # the profiler's largest aspect ratio (models/qwen2_vl.py)


class CannotLoad(Exception):
    """What vLLM's image loader raises for a file Pillow cannot open."""


def _own(kwargs: dict) -> dict:
    """min/max_pixels of one modality's dict, in either of transformers' spellings."""
    size = kwargs.get("size") or {}
    found = {"min_pixels": size.get("shortest_edge"), "max_pixels": size.get("longest_edge")}
    found.update({k: kwargs[k] for k in ("min_pixels", "max_pixels") if k in kwargs})
    return {k: v for k, v in found.items() if v is not None}


def bounds(mm_processor_kwargs: dict, modality: str, defaults: tuple[int, int] | None = None) -> tuple[int, int]:
    """(min_pixels, max_pixels) the processor uses for ``modality`` ('image' or 'video') at a request
    (``defaults``: the processor's own, Qwen2.5-VL's when not given)."""
    low, high = defaults or ((IMAGE_MIN_PIXELS, IMAGE_MAX_PIXELS) if modality == "image"
                             else (VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS))
    own = _own(mm_processor_kwargs.get(f"{modality}s_kwargs") or {})
    low = int(own.get("min_pixels", mm_processor_kwargs.get("min_pixels", low)))
    high = int(own.get("max_pixels", mm_processor_kwargs.get("max_pixels", high)))
    return low, high


def profiler_bounds(mm_processor_kwargs: dict) -> tuple[int, int]:
    """(min_pixels, max_pixels) vLLM's profiler uses for images and videos alike (module docstring)."""
    return (int(mm_processor_kwargs.get("min_pixels", IMAGE_MIN_PIXELS)),
            int(mm_processor_kwargs.get("max_pixels", IMAGE_MAX_PIXELS)))


def stored_size(path: str) -> tuple[int, int]:
    """(width, height) as vLLM's loader sees the file: upright (EXIF orientation applied)."""
    try:
        with Image.open(path) as image:
            image.load()
            upright = ImageOps.exif_transpose(image)
            return upright.width, upright.height
    except (UnidentifiedImageError, OSError) as exc:
        raise CannotLoad(f"Failed to load image: {exc}") from None


def image_embeds(path: str, min_pixels: int, max_pixels: int, cell: int = FACTOR) -> int:
    width, height = stored_size(path)
    h, w = resize(height, width, min_pixels, max_pixels, cell)
    return (h // cell) * (w // cell)


def limit(limits: dict | None, modality: str) -> int:
    value = (limits or {}).get(modality, DEFAULT_LIMIT)
    return int(value["count"]) if isinstance(value, dict) else int(value)


def too_many(limits: dict | None, counts: dict[str, int]) -> str | None:
    for modality in ("image", "video", "audio"):
        allowed = limit(limits, modality)
        if counts.get(modality, 0) > allowed:
            return f"At most {allowed} {modality}(s) may be provided in one prompt."
    return None


def _closest_factor_pair(n: int) -> tuple[int, int]:
    for d in range(math.isqrt(n), 0, -1):
        if n % d == 0:
            return d, n // d
    return 1, n


def profiled_frame_cells(max_pixels: int) -> int:
    """Cells of the profiler's largest image: the most cells the bound allows that form a grid of aspect
    at most MAX_ASPECT (``get_image_size_with_most_features``)."""
    for cells in range(max_pixels // (FACTOR * FACTOR), 0, -1):
        h, w = _closest_factor_pair(cells)
        if w / h <= MAX_ASPECT:
            return cells
    return 1


def profiled_video_tokens(max_pixels: int, max_model_len: int) -> int:
    """Tokens of the profiler's video: as many of its largest frames as the context holds (frames padded
    to pairs), at most PROFILER_MAX_FRAMES (``get_num_frames_with_most_features``)."""
    cells = profiled_frame_cells(max_pixels)
    frames = 1
    while math.ceil((frames + 1) / TEMPORAL_PATCH) * cells <= max_model_len:
        frames += 1
    frames = max(1, min(frames, PROFILER_MAX_FRAMES))
    return math.ceil(frames / TEMPORAL_PATCH) * cells


def encoder_cache_size(max_num_batched_tokens: int, mm_processor_kwargs: dict, limits: dict | None,
                       max_model_len: int) -> int:
    """max(--max-num-batched-tokens, the profiler's largest item of every modality allowed)."""
    _, high = profiler_bounds(mm_processor_kwargs)
    items = []
    if limit(limits, "image") > 0:
        items.append(profiled_frame_cells(high))
    if limit(limits, "video") > 0:
        items.append(profiled_video_tokens(high, max_model_len))
    return max([max_num_batched_tokens, *items])
