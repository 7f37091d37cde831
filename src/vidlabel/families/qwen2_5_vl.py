"""Qwen2.5-VL (``model_type`` qwen2_5_vl; also Qwen2-VL), as vLLM 0.26 serves it.

- Cells: the vision tower's 14-pixel patches merged 2x2, so one LLM token per 28x28 pixels.
- Videos: vLLM's ``Qwen2VLVideoBackend`` (``samplers.qwen2_vl_loader``: ``total / source_fps * fps`` frames,
  4 to 768, an even count, then float32-style indices that can add one frame); frames go in pairs (temporal
  patch 2; an odd count is padded); each frame resized by ``smart_resize`` within the *per-frame* bounds
  (video processor defaults 128x28x28 and 768x28x28 pixels). Tokens: pairs x cells, plus
  <|vision_start|>/<|vision_end|>. Example: 720x1280, 32 frames -> 560x1008 -> 16 x 20 x 36 = 11,520 + 2.
- Images: ``smart_resize`` within the image bounds (the checkpoint's preprocessor_config.json: 3,136 and
  12,845,056 pixels), one frame padded to a pair: (H'/28)(W'/28) + 2. A 1080x1920 photo: 39 x 69 + 2 = 2,693.
- No audio: a transcript goes as text.
- The chat template adds a default system turn: 19 tokens around one user turn.
- ``--mm-processor-kwargs`` in the form measured on vLLM 0.26 (docs/serving.md, "Photos and video
  frames"): ``images_kwargs``/``videos_kwargs`` with ``min_pixels``/``max_pixels``.
- Weights: a dense decoder (q/k/v biases) and the vision tower of Qwen2.5-VL.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from vidlabel.families.base import Family, ImageBounds, ModelShape, Sampling, VideoEstimate, arr, dtype_bytes, \
    file_frames
from vidlabel.families.resize import smart_resize
from vidlabel.families.samplers import qwen2_vl_loader

CELL = 28  # ViT patch 14, 2x2 spatial merge
TEMPORAL_PATCH = 2


class Qwen25VL(Family):
    name = "qwen2_5_vl"
    # 2: the sampler counts the indices vLLM's float arithmetic makes (n + 1 for some files), item markers
    # in the item's tokens.
    rule_version = 2
    model_types = ("qwen2_5_vl", "qwen2_vl")
    known_names = ("qwen2.5-vl", "qwen2_5_vl", "qwen2-vl")
    cell = CELL
    video_bounds = "frame"
    min_file_frames = TEMPORAL_PATCH  # the sampler divides by the even count below the file's frames
    chat_overhead_tokens = 19
    default_sampling = Sampling(fps=2.0, min_frames=4, max_frames=768, min_pixels=128 * CELL * CELL,
                                max_pixels=768 * CELL * CELL)
    default_image_bounds = ImageBounds(min_pixels=56 * 56, max_pixels=16384 * CELL * CELL)

    def sampled_frames(self, total_frames, source_fps, sampling: Sampling, duration_s=None) -> np.ndarray:
        return qwen2_vl_loader(total_frames, source_fps, duration_s if duration_s is not None else 0.0, sampling,
                               TEMPORAL_PATCH)

    def frame_size(self, height, width, frames, sampling: Sampling):
        return smart_resize(height, width, self.cell, sampling.min_pixels, sampling.max_pixels)

    def video_tokens(self, duration_s, source_fps, width, height, sampling: Sampling, total_frames=None):
        total = file_frames(duration_s, source_fps) if total_frames is None else arr(total_frames)
        frames = self.sampled_frames(total, source_fps, sampling, duration_s)
        h, w = self.frame_size(height, width, frames, sampling)
        embeds = (-(-frames // TEMPORAL_PATCH) * (h // self.cell) * (w // self.cell)).astype(np.int64)
        return VideoEstimate(frames=frames, height=h, width=w, tokens=embeds + self.item_markers, embeds=embeds)

    def image_size(self, width, height, bounds: ImageBounds, max_pixels=None):
        top = bounds.max_pixels if max_pixels is None else np.asarray(max_pixels)
        return smart_resize(height, width, self.cell, bounds.min_pixels, top)

    def mm_processor_kwargs(self, sampling: Sampling, images: ImageBounds) -> dict[str, Any]:
        return {"images_kwargs": {"min_pixels": images.min_pixels, "max_pixels": images.max_pixels},
                "videos_kwargs": {"min_pixels": sampling.min_pixels, "max_pixels": sampling.max_pixels}}

    def model_shape(self, cfg: Mapping[str, Any]) -> ModelShape:
        text = cfg.get("text_config") or cfg
        params = dense_decoder_parameters(text, qkv_bias=True)
        if cfg.get("vision_config"):
            params += vision_parameters(cfg["vision_config"])
        return ModelShape(params, kv_bytes(text, dtype_bytes(cfg)), int(text["num_attention_heads"]), dtype_bytes(cfg))


def kv_bytes(text: Mapping[str, Any], dtype: float) -> float:
    """KV cache per token: keys and values of every layer's KV heads."""
    heads = text["num_attention_heads"]
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    return float(2 * text["num_hidden_layers"] * (text.get("num_key_value_heads") or heads) * head_dim * dtype)


def dense_decoder_parameters(text: Mapping[str, Any], qkv_bias: bool) -> float:
    """Parameters of a Qwen-style decoder (embeddings, attention, gated MLP, norms)."""
    h, layers = text["hidden_size"], text["num_hidden_layers"]
    heads = text["num_attention_heads"]
    kv = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or h // heads
    attention = h * heads * head_dim + 2 * h * kv * head_dim + heads * head_dim * h
    attention += (heads + 2 * kv) * head_dim if qkv_bias else 0
    per_layer = attention + 3 * h * text["intermediate_size"] + 2 * h
    embeddings = text["vocab_size"] * h * (1 if text.get("tie_word_embeddings") else 2)
    return float(layers * per_layer + embeddings + h)


def vision_parameters(vc: Mapping[str, Any]) -> float:
    """Parameters of the Qwen2.5-VL vision tower (patch embedding, gated-MLP blocks, patch merger)."""
    hv = vc["hidden_size"]
    inter = vc.get("intermediate_size") or 4 * hv
    patch = vc.get("patch_size", 14)
    embed = vc.get("in_chans", 3) * vc.get("temporal_patch_size", 2) * patch * patch * hv
    block = 4 * hv * hv + 4 * hv + 3 * hv * inter + 2 * inter + hv + 2 * hv
    merged = hv * vc.get("spatial_merge_size", 2) ** 2
    merger = hv + merged * merged + merged + merged * vc.get("out_hidden_size", hv) + vc.get("out_hidden_size", hv)
    return float(embed + vc["depth"] * block + merger)


FAMILY = Qwen25VL()
