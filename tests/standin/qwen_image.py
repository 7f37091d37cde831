"""How vLLM (0.26) turns images into Qwen2.5-VL prompt tokens, for the stand-in server.

Written from vLLM's source, independently of vidlabel's estimator (``vidlabel.prepare.tokens``):

- loading (``vllm/multimodal/image.py``: the ``pil`` loader, ``media/image.py: ImageMediaIO``):
  ``Image.open`` of the file's bytes, no EXIF transpose, so the size is the *stored* size; a file
  Pillow cannot open is a ValueError "Failed to load image: ...", a 400;
- tokens (``models/qwen2_vl.py: Qwen2VLProcessingInfo._get_vision_info``): one frame padded to the
  temporal patch, so grid (1, H'/14, W'/14) and (H'/14)(W'/14)/4 tokens after ``smart_resize``
  with the image processor's min/max pixels, plus <|vision_start|> and <|vision_end|>;
- the bounds (``transformers/processing_utils.py: ProcessorMixin._merge_kwargs``): a flat
  ``min_pixels``/``max_pixels`` in ``--mm-processor-kwargs`` applies to every modality that takes it,
  images *and* videos ("modality-specific processors can have overlapping kwargs"); an
  ``images_kwargs`` / ``videos_kwargs`` dict sets one modality; otherwise the model's
  ``preprocessor_config.json`` (3,136 and 12,845,056 for images) and the video processor's defaults;
- ``--limit-mm-per-prompt`` (``multimodal/processing``: ``BaseProcessingInfo.validate_num_items``;
  Qwen2-VL supports unlimited items, so no hint is added): "At most N image(s) may be provided in
  one prompt."; a modality not given is allowed 999 items;
- the encoder cache (``v1/core/encoder_cache_manager.py: compute_mm_encoder_budget``): max of
  ``--max-num-batched-tokens`` and the largest item of every modality allowed (limit above 0); the
  profiler's image is the largest square the image bound allows.
"""

from __future__ import annotations

import math

from PIL import Image, UnidentifiedImageError
from qwen_video import FACTOR, resize

IMAGE_MIN_PIXELS = 3136  # Qwen2.5-VL preprocessor_config.json
IMAGE_MAX_PIXELS = 12845056
VIDEO_MIN_PIXELS = 128 * 28 * 28  # the Qwen2-VL video processor's defaults
VIDEO_MAX_PIXELS = 768 * 28 * 28
DEFAULT_LIMIT = 999
MARKERS = 2


class CannotLoad(Exception):
    """What vLLM's image loader raises for a file Pillow cannot open."""


def bounds(mm_processor_kwargs: dict, modality: str) -> tuple[int, int]:
    """(min_pixels, max_pixels) the processor uses for ``modality`` ('image' or 'video')."""
    low, high = (IMAGE_MIN_PIXELS, IMAGE_MAX_PIXELS) if modality == "image" else (VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS)
    own = mm_processor_kwargs.get(f"{modality}s_kwargs") or {}
    low = int(own.get("min_pixels", mm_processor_kwargs.get("min_pixels", low)))
    high = int(own.get("max_pixels", mm_processor_kwargs.get("max_pixels", high)))
    return low, high


def stored_size(path: str) -> tuple[int, int]:
    """(width, height) as Pillow opens the file: the stored pixels, EXIF orientation not applied."""
    try:
        with Image.open(path) as image:
            image.load()
            return image.width, image.height
    except (UnidentifiedImageError, OSError) as exc:
        raise CannotLoad(f"Failed to load image: {exc}") from None


def image_embeds(path: str, min_pixels: int, max_pixels: int) -> int:
    width, height = stored_size(path)
    h, w = resize(height, width, min_pixels, max_pixels)
    return (h // FACTOR) * (w // FACTOR)


def limit(limits: dict | None, modality: str) -> int:
    value = (limits or {}).get(modality, DEFAULT_LIMIT)
    return int(value["count"]) if isinstance(value, dict) else int(value)


def too_many(limits: dict | None, counts: dict[str, int]) -> str | None:
    for modality in ("image", "video"):
        allowed = limit(limits, modality)
        if counts.get(modality, 0) > allowed:
            return f"At most {allowed} {modality}(s) may be provided in one prompt."
    return None


def profiled_image_embeds(max_pixels: int) -> int:
    side = math.floor(math.sqrt(max_pixels) / FACTOR)
    return side * side
