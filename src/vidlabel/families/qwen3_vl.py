"""Qwen3-VL, dense (``model_type`` qwen3_vl: 2B to 32B) and mixture of experts (qwen3_vl_moe: 30B-A3B,
235B-A22B), as vLLM 0.26 serves it (``models/qwen3_vl.py``; transformers 5.17's Qwen3-VL processors).

- Cells: 16-pixel patches merged 2x2: one LLM token per 32x32 pixels.
- Videos: vLLM's ``Qwen3VLVideoBackend`` (``samplers.qwen3_vl_loader``: ``int(total / source_fps * fps)``
  frames, 4 to 768 and at most the file's); ONE pixel budget for the whole video
  (``resize.video_smart_resize``: frames x H' x W' within [4,096, 25,165,824] pixels by default, i.e. at
  most 12,288 video tokens), so ``planning.min_pixels``/``max_pixels`` bound the video, not a frame. Frames
  go in groups of 2 (an odd count padded); each group is ``<t seconds>`` (its mean time, one decimal:
  5 tokens and one per integer digit) then <|vision_start|>, its cells, <|vision_end|>; the chat template's
  own start/end pair surrounds them. 720x1280, 12 s at 30 fps: 24 frames at 704x1280, 12 groups of 880
  cells: 10,560 + 26 markers + 74 timestamp tokens = 10,660.
- Images: ``smart_resize`` at 32-pixel cells within 65,536 to 16,777,216 pixels: (H'/32)(W'/32) + 2.
- No audio. The chat template adds no system turn: 8 tokens around one user turn.
- Weights: a decoder with q/k norms and no attention bias, dense or with experts (every expert is in
  memory), and the Qwen3-VL vision tower with its DeepStack mergers.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any, Mapping

import numpy as np

from vidlabel.families.base import Family, ImageBounds, ModelShape, Sampling, VideoEstimate, arr, dtype_bytes, \
    file_frames
from vidlabel.families.resize import smart_resize, video_smart_resize
from vidlabel.families.samplers import qwen3_vl_group_times, qwen3_vl_loader

CELL = 32  # ViT patch 16, 2x2 spatial merge
TEMPORAL_PATCH = 2
#: "<t seconds>": "<", the digits, ".", one decimal, " seconds", ">" with every digit its own token.
TIMESTAMP_BASE_TOKENS = 5
GROUP_MARKERS = 2  # <|vision_start|> and <|vision_end|> around each group's cells


def _rounds_to_at_least(value: str) -> float:
    """The smallest double that ``format(x, ".1f")`` shows as at least ``value`` (e.g. "10.0")."""
    half_below = Fraction(value) - Fraction(1, 20)
    d = float(half_below)
    return float(np.nextafter(d, np.inf)) if Fraction(d) <= half_below else d


#: Times from which "<t seconds>" has one more integer digit (2, 3, 4 digits).
MORE_DIGITS_FROM = tuple(_rounds_to_at_least(v) for v in ("10.0", "100.0", "1000.0"))


def timestamp_tokens(total_frames, source_fps, frames, groups) -> np.ndarray:
    """The tokens of every video's "<t seconds>" texts: 6 per group, plus one per group at 10 s or more,
    one more from 100 s, one more from 1000 s. The times grow with the group, so each threshold is
    crossed once: found from the index step, then checked exactly on its neighbours."""
    n_total, f, n, t_groups = arr(total_frames), arr(source_fps), arr(frames), arr(groups)
    out = (TIMESTAMP_BASE_TOKENS + 1) * t_groups
    with np.errstate(divide="ignore", invalid="ignore"):
        step = np.where(n > 1, (n_total - 1) / np.maximum(n - 1, 1), 0.0)
        per_group = TEMPORAL_PATCH * step / f
    for threshold in MORE_DIGITS_FROM:
        with np.errstate(divide="ignore", invalid="ignore"):
            guess = np.floor(np.nan_to_num((threshold - 0.5 * step / f) / per_group, nan=0.0, posinf=1e18,
                                           neginf=0.0))
        guess = np.clip(guess, 0, t_groups)
        first = t_groups.copy()  # no group reaches it
        for offset in (2, 1, 0, -1, -2):  # the earliest group at or over the threshold wins
            j = np.clip(guess + offset, 0, np.maximum(t_groups - 1, 0))
            over = (j < t_groups) & (qwen3_vl_group_times(n_total, f, n, TEMPORAL_PATCH, j) >= threshold)
            first = np.where(over, np.minimum(first, j), first)
        # A group before the guessed window may be over too only if the guess was far off; it never is
        # by more than the index rounding (one frame), which the window covers.
        out = out + (t_groups - first)
    return out.astype(np.int64)


class Qwen3VL(Family):
    name = "qwen3_vl"
    rule_version = 1
    model_types = ("qwen3_vl", "qwen3_vl_moe")
    known_names = ("qwen3-vl", "qwen3_vl")
    cell = CELL
    video_bounds = "video"
    min_file_frames = TEMPORAL_PATCH  # the processor's resize refuses fewer frames than a temporal patch
    chat_overhead_tokens = 8
    default_sampling = Sampling(fps=2.0, min_frames=4, max_frames=768, min_pixels=4096, max_pixels=25165824)
    default_image_bounds = ImageBounds(min_pixels=65536, max_pixels=16777216)

    def sampled_frames(self, total_frames, source_fps, sampling: Sampling, duration_s=None) -> np.ndarray:
        return qwen3_vl_loader(total_frames, source_fps, duration_s if duration_s is not None else 0.0, sampling)

    def frame_size(self, height, width, frames, sampling: Sampling):
        return video_smart_resize(frames, height, width, self.cell, TEMPORAL_PATCH, sampling.min_pixels,
                                  sampling.max_pixels)

    def video_tokens(self, duration_s, source_fps, width, height, sampling: Sampling, total_frames=None):
        total = file_frames(duration_s, source_fps) if total_frames is None else arr(total_frames)
        frames = self.sampled_frames(total, source_fps, sampling, duration_s)
        h, w = self.frame_size(height, width, np.maximum(frames, TEMPORAL_PATCH), sampling)
        groups = -(-frames // TEMPORAL_PATCH)
        cells = (h // self.cell) * (w // self.cell)
        f = np.nan_to_num(arr(source_fps), nan=0.0)
        # A file of unknown rate: its frames at the sampling rate (as the transcode will write it).
        rate = np.where(f > 0, f, sampling.fps)
        span = np.where(f > 0, total, np.maximum(frames, 1))
        stamps = timestamp_tokens(span, rate, frames, groups)
        embeds = (groups * (cells + GROUP_MARKERS) + stamps).astype(np.int64)  # the placeholder vLLM checks
        return VideoEstimate(frames=frames, height=h, width=w, tokens=embeds + self.item_markers, embeds=embeds)

    def group_tokens(self, height, width) -> np.ndarray:
        # its cells, its start/end markers, and "<t seconds>" at its longest (4 integer digits)
        return super().group_tokens(height, width) + GROUP_MARKERS + TIMESTAMP_BASE_TOKENS + 4

    def image_size(self, width, height, bounds: ImageBounds, max_pixels=None):
        top = bounds.max_pixels if max_pixels is None else np.asarray(max_pixels)
        return smart_resize(height, width, self.cell, bounds.min_pixels, top)

    def model_shape(self, cfg: Mapping[str, Any]) -> ModelShape:
        text = cfg.get("text_config") or cfg
        total, active = qwen3_decoder_parameters(text)
        vision = qwen3_vision_parameters(cfg["vision_config"]) if cfg.get("vision_config") else 0.0
        heads = int(text["num_attention_heads"])
        head_dim = text.get("head_dim") or text["hidden_size"] // heads
        kv = 2 * text["num_hidden_layers"] * (text.get("num_key_value_heads") or heads) * head_dim * dtype_bytes(cfg)
        return ModelShape(total + vision, float(kv), heads, dtype_bytes(cfg), active + vision)


def qwen3_decoder_parameters(text: Mapping[str, Any]) -> tuple[float, float]:
    """(all, active per token) parameters of a Qwen3 decoder: attention without biases and with q/k norms,
    a gated MLP or ``num_experts`` experts of ``moe_intermediate_size`` (``num_experts_per_tok`` active)
    and their router, norms and embeddings."""
    h, layers = text["hidden_size"], text["num_hidden_layers"]
    heads = text["num_attention_heads"]
    kv = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or h // heads
    attention = h * heads * head_dim + 2 * h * kv * head_dim + heads * head_dim * h + 2 * head_dim
    experts = int(text.get("num_experts") or 0)
    if experts:
        expert = 3 * h * text["moe_intermediate_size"]
        mlp_all = experts * expert + h * experts
        mlp_active = int(text.get("num_experts_per_tok") or experts) * expert + h * experts
    else:
        mlp_all = mlp_active = 3 * h * text["intermediate_size"]
    embeddings = text["vocab_size"] * h * (1 if text.get("tie_word_embeddings") else 2)
    return (float(layers * (attention + mlp_all + 2 * h) + embeddings + h),
            float(layers * (attention + mlp_active + 2 * h) + embeddings + h))


def qwen3_vision_parameters(vc: Mapping[str, Any]) -> float:
    """Parameters of the Qwen3-VL vision tower: patch and position embeddings, blocks with a plain MLP,
    the patch merger and one DeepStack merger per ``deepstack_visual_indexes`` entry."""
    hv, inter = vc["hidden_size"], vc["intermediate_size"]
    patch = vc.get("patch_size", 16)
    embed = vc.get("in_channels", 3) * vc.get("temporal_patch_size", 2) * patch * patch * hv + hv
    positions = vc.get("num_position_embeddings", 0) * hv
    block = (3 * hv * hv + 3 * hv) + (hv * hv + hv) + (hv * inter + inter) + (inter * hv + hv) + 4 * hv
    merged = hv * vc.get("spatial_merge_size", 2) ** 2
    out = vc.get("out_hidden_size", hv)
    fc = merged * merged + merged + merged * out + out
    merger = 2 * hv + fc
    deepstack = len(vc.get("deepstack_visual_indexes") or ()) * (2 * merged + fc)
    return float(embed + positions + vc["depth"] * block + merger + deepstack)


FAMILY = Qwen3VL()
