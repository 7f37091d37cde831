"""Prompt-token estimates per request, before any GPU time is spent.

Visual tokens come from a per-model-family rule in ``VISUAL_RULES`` (keyed by
``planning.model_family``); another model adds its own with ``@register("name")``. A rule takes
numpy arrays (duration, source fps, display width and height) and a ``Sampling`` and returns a
``VisualEstimate`` of arrays, so one call estimates a million posts.

Text tokens come from a tokenizer when ``planning.tokenizer`` names a local tokenizer, else from
a documented approximation (``approx_text_tokens``).

The Qwen2.5-VL rule, as served by vLLM 0.33 (see shared/notes/reference.md):

* frames: ``duration * fps`` (fps = ``planning.fps``, default 2, the server's ``--media-io-kwargs``
  fps), at least min_frames, at most max_frames and the frames the file has
  (``round(duration * source_fps)``), each bound taken down to an even count, and the result floored
  to an even count (vLLM's ``Qwen2VLVideoBackend``; a 40.8 s clip gives 80 frames, not 82);
* each frame is resized by ``smart_resize``: both sides to the nearest multiple of 28; if the area is
  above max_pixels, scale down by sqrt(area / max_pixels) and round each side *down* to a multiple of
  28; if below min_pixels, scale up and round *up* (the rule of Hugging Face's Qwen2-VL image
  processor, which vLLM calls with the ``--mm-processor-kwargs`` pixel bounds);
* one LLM token per 28x28 cell per frame pair (temporal patch 2): ``ceil(T/2) * (H/28) * (W/28)``.
  The two vision start/end marker tokens are counted in the chat-template overhead of the text.

Example: 720x1280, 32 frames, max_pixels 602,112 -> 560x1008 -> 16 pairs * 20 * 36 = 11,520.

Images (``image_tokens``): one frame, padded to a pair by the processor, so ``(H'/28)*(W'/28)`` cells
after ``smart_resize`` with the *image* pixel bounds (``ImageBounds``: ``planning.image_min_pixels`` /
``planning.image_max_pixels``, by default the Qwen2.5-VL preprocessor's 3,136 and 12,845,056), plus
``IMAGE_MARKER_TOKENS`` for its <|vision_start|>/<|vision_end|> pair, counted per image because a post
may carry many. A 1080x1920 photo: 1092x1932 -> 39*69 = 2,691 cells + 2. Audio items carry no visual
tokens (their transcript is text).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

FACTOR = 28  # pixels per LLM token side: ViT patch 14, 2x2 spatial merge
TEMPORAL_PATCH = 2  # frames per temporal patch
# Fewest frames a video file may hold: vLLM's Qwen2-VL sampler takes the file's frame count down to
# an even number and divides by it, so a 1-frame file fails with HTTP 500 "division by zero"
# (vLLM 0.26, measured). Files with fewer frames are transcoded (vidlabel.prepare.planning).
MIN_FILE_FRAMES = TEMPORAL_PATCH
FIXED_FRAMES = 32  # frames sampled uniformly by vLLM for models without their own sampling rule

# Text approximation: about 4 bytes of UTF-8 per token for English BPE vocabularies (Qwen's
# included); counting bytes rather than characters keeps CJK text (3 bytes, ~1 token per
# character) from being undercounted by 4x. CHAT_OVERHEAD_TOKENS covers the chat template around
# one user turn (system turn, role markers, the vision start/end tokens, the assistant header).
BYTES_PER_TOKEN = 4.0
CHAT_OVERHEAD_TOKENS = 32


@dataclass(frozen=True)
class Sampling:
    """How the server samples and resizes a video (must match the server's flags)."""

    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 768 * 28 * 28

    @classmethod
    def from_config(cls, config: dict) -> "Sampling":
        p = config["planning"]
        return cls(fps=float(p["fps"]), min_frames=int(p["min_frames"]), max_frames=int(p["max_frames"]),
                   min_pixels=int(p["min_pixels"]), max_pixels=int(p["max_pixels"]))

    def with_(self, **changes) -> "Sampling":
        return replace(self, **changes)


@dataclass(frozen=True)
class ImageBounds:
    """The pixel bounds the server resizes each image within (the HF preprocessor's by default)."""

    min_pixels: int = 3136  # 56*56, Qwen2.5-VL preprocessor_config.json
    max_pixels: int = 12845056  # 16384*28*28, same file

    @classmethod
    def from_config(cls, config: dict) -> "ImageBounds":
        p = config["planning"]
        return cls(min_pixels=int(p["image_min_pixels"]), max_pixels=int(p["image_max_pixels"]))


@dataclass
class VisualEstimate:
    """Per-video arrays: sampled frames, resized height/width and visual tokens."""

    frames: np.ndarray
    height: np.ndarray
    width: np.ndarray
    tokens: np.ndarray


VisualRule = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray, Sampling], VisualEstimate]
VISUAL_RULES: dict[str, VisualRule] = {}


def register(name: str) -> Callable[[VisualRule], VisualRule]:
    """Register a visual-token rule under a ``planning.model_family`` name."""

    def wrap(fn: VisualRule) -> VisualRule:
        VISUAL_RULES[name] = fn
        return fn

    return wrap


def _arr(x, dtype=np.float64) -> np.ndarray:
    return np.atleast_1d(np.asarray(x, dtype=dtype))


def smart_resize(height, width, min_pixels: int, max_pixels: int, factor: int = FACTOR):
    """Resized (height, width), multiples of ``factor``, area within [min_pixels, max_pixels].

    Vectorised over numpy arrays. Rounding follows the Qwen2-VL processor: nearest multiple first
    (numpy and Python both round halves to even), floor when shrinking, ceil when growing.
    """
    h = _arr(height)
    w = _arr(width)
    h_bar = np.maximum(factor, np.round(h / factor) * factor)
    w_bar = np.maximum(factor, np.round(w / factor) * factor)
    area = h * w
    too_big = h_bar * w_bar > max_pixels
    too_small = (h_bar * w_bar < min_pixels) & ~too_big
    with np.errstate(divide="ignore", invalid="ignore"):
        beta_down = np.sqrt(area / max_pixels)
        beta_up = np.sqrt(min_pixels / area)
        h_down = np.maximum(factor, np.floor(h / beta_down / factor) * factor)
        w_down = np.maximum(factor, np.floor(w / beta_down / factor) * factor)
        h_up = np.ceil(h * beta_up / factor) * factor
        w_up = np.ceil(w * beta_up / factor) * factor
    h_out = np.where(too_big, h_down, np.where(too_small, h_up, h_bar))
    w_out = np.where(too_big, w_down, np.where(too_small, w_up, w_bar))
    return h_out.astype(np.int64), w_out.astype(np.int64)


def file_frames(duration_s, source_fps) -> np.ndarray:
    """Frames in the file; an unknown source fps (0 or NaN) counts as unlimited."""
    d = _arr(duration_s)
    f = _arr(source_fps)
    n = np.round(np.nan_to_num(d, nan=0.0) * np.nan_to_num(f, nan=0.0))
    unknown = ~(np.nan_to_num(f, nan=0.0) > 0)
    return np.where(unknown, float(2 ** 62), np.maximum(n, 1)).astype(np.int64)


def qwen_frames(duration_s, source_fps, s: Sampling) -> np.ndarray:
    """Frames vLLM samples for Qwen2/2.5-VL (its ``Qwen2VLVideoBackend``, a port of the Hugging Face
    processor): ``duration * fps``, at least min_frames, at most max_frames and the file's frames
    (both taken down to an even count), then floored to an even count; at least one pair."""
    d = np.nan_to_num(_arr(duration_s), nan=0.0)
    most = np.floor(np.minimum(s.max_frames, file_frames(d, source_fps)) / TEMPORAL_PATCH) * TEMPORAL_PATCH
    n = np.minimum(np.maximum(d * s.fps, s.min_frames), most)
    n = np.floor(n / TEMPORAL_PATCH) * TEMPORAL_PATCH
    return np.maximum(TEMPORAL_PATCH, n).astype(np.int64)


def _cells(height, width, s: Sampling):
    h, w = smart_resize(height, width, s.min_pixels, s.max_pixels)
    return h, w, (h // FACTOR) * (w // FACTOR)


IMAGE_MARKER_TOKENS = 2  # <|vision_start|> and <|vision_end|> around each image's pad tokens


def image_cells(width, height, bounds: ImageBounds, max_pixels=None) -> np.ndarray:
    """Visual (pad) tokens per image: the 28x28 cells after smart_resize; what the encoder cache holds.

    ``max_pixels`` (scalar or per image) replaces the bound where a plan lowers it for a post.
    """
    top = bounds.max_pixels if max_pixels is None else np.asarray(max_pixels)
    h, w = smart_resize(height, width, bounds.min_pixels, top)
    return ((h // FACTOR) * (w // FACTOR)).astype(np.int64)


def image_tokens(width, height, bounds: ImageBounds, max_pixels=None) -> np.ndarray:
    """Prompt tokens per image: its cells plus its two vision marker tokens."""
    return image_cells(width, height, bounds, max_pixels) + IMAGE_MARKER_TOKENS


@register("qwen2_5_vl")
def qwen2_5_vl(duration_s, source_fps, width, height, s: Sampling) -> VisualEstimate:
    frames = qwen_frames(duration_s, source_fps, s)
    h, w, cells = _cells(height, width, s)
    pairs = -(-frames // TEMPORAL_PATCH)
    return VisualEstimate(frames=frames, height=h, width=w, tokens=(pairs * cells).astype(np.int64))


@register("fixed_frames")
def fixed_frames(duration_s, source_fps, width, height, s: Sampling) -> VisualEstimate:
    """vLLM's generic video path: 32 frames sampled uniformly (all frames of a shorter file).

    Uses the same 28-pixel cell and frame-pair rule; ``planning.fps`` does not apply.
    """
    frames = np.minimum(np.int64(FIXED_FRAMES), file_frames(duration_s, source_fps))
    h, w, cells = _cells(height, width, s)
    pairs = -(-frames // TEMPORAL_PATCH)
    return VisualEstimate(frames=frames, height=h, width=w, tokens=(pairs * cells).astype(np.int64))


def visual_rule(config: dict) -> VisualRule:
    family = config["planning"]["model_family"]
    try:
        return VISUAL_RULES[family]
    except KeyError:
        raise ValueError(f"planning.model_family {family!r} has no token rule; known: {sorted(VISUAL_RULES)}") from None


def estimate_visual(config: dict, duration_s, source_fps, width, height,
                    sampling: Sampling | None = None) -> VisualEstimate:
    """Visual-token estimate per video with the configured model family's rule."""
    s = sampling or Sampling.from_config(config)
    return visual_rule(config)(_arr(duration_s), _arr(source_fps), _arr(width), _arr(height), s)


# ---------------------------------------------------------------- text tokens

def approx_text_tokens(texts: Sequence[str | None] | np.ndarray) -> np.ndarray:
    """ceil(UTF-8 bytes / 4) + chat-template overhead, per text (see module constants)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    arr = texts if isinstance(texts, (pa.Array, pa.ChunkedArray)) else pa.array(list(texts), type=pa.string())
    nbytes = pc.fill_null(pc.binary_length(arr), 0).to_numpy(zero_copy_only=False).astype(np.float64)
    return (np.ceil(nbytes / BYTES_PER_TOKEN) + CHAT_OVERHEAD_TOKENS).astype(np.int64)


class TokenizerUnavailable(RuntimeError):
    """planning.tokenizer is set but cannot be loaded."""


_TOKENIZERS: dict[str, object] = {}


def load_tokenizer(path: str):
    """A tokenizer from a local ``tokenizer.json`` (or a directory holding one).

    Uses the ``tokenizers`` library (installed with faster-whisper); falls back to
    ``transformers.AutoTokenizer`` for directories without tokenizer.json.
    """
    if path in _TOKENIZERS:
        return _TOKENIZERS[path]
    p = Path(path).expanduser()
    if not p.exists():
        raise TokenizerUnavailable(f"planning.tokenizer: {path!r} does not exist (give a local path to a "
                                   "tokenizer.json or a model directory, or null for the approximation)")
    file = p / "tokenizer.json" if p.is_dir() else p
    tok = None
    if file.is_file():
        try:
            from tokenizers import Tokenizer
        except ImportError:
            Tokenizer = None
        if Tokenizer is not None:
            tok = ("tokenizers", Tokenizer.from_file(str(file)))
    if tok is None:
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise TokenizerUnavailable(
                f"planning.tokenizer: cannot load {path!r}: neither the 'tokenizers' package (for a "
                "tokenizer.json) nor 'transformers' is installed; install one (pip install tokenizers) "
                "or set planning.tokenizer to null to use the approximation") from None
        tok = ("transformers", AutoTokenizer.from_pretrained(str(p), local_files_only=True))
    _TOKENIZERS[path] = tok
    return tok


def tokenizer_text_tokens(path: str, texts: Sequence[str | None]) -> np.ndarray:
    """Exact token counts of the texts + chat-template overhead."""
    kind, tok = load_tokenizer(path)
    texts = [t or "" for t in texts]
    if kind == "tokenizers":
        counts = [len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False)]
    else:
        counts = [len(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]]
    return np.asarray(counts, dtype=np.int64) + CHAT_OVERHEAD_TOKENS


def estimate_text(config: dict, texts) -> np.ndarray:
    """Text tokens per prompt: tokenizer when ``planning.tokenizer`` is set, else the approximation."""
    path = config["planning"].get("tokenizer")
    if path:
        if not isinstance(texts, list):
            texts = texts.to_pylist() if hasattr(texts, "to_pylist") else list(texts)
        return tokenizer_text_tokens(path, texts)
    return approx_text_tokens(texts)
