"""Qwen3-Omni (``model_type`` qwen3_omni_moe: 30B-A3B, its thinker), as vLLM 0.26 serves it
(``models/qwen3_omni_moe_thinker.py``; transformers 5.17's Qwen3-Omni processor). It hears audio.

- Cells: 16-pixel patches merged 2x2: one LLM token per 32x32 pixels.
- Videos: vLLM's ``Qwen2VLVideoBackend`` (its video processor is Qwen2-VL's: ``samplers.qwen2_vl_loader``),
  frames in pairs, each frame within its own bounds (the processor's defaults 128x32x32 to 768x32x32
  pixels: at most 768 tokens a pair) and NO cap on the video's total: 90 s of 720p is 64,800 tokens, at
  the thinker's 65,536-token context; the context gate re-plans (lower fps or pixels) what does not fit.
  Tokens: pairs x cells + 2.
- Images: ``smart_resize`` at 32-pixel cells within the preprocessor's 3,136 to 12,845,056 pixels:
  (H'/32)(W'/32) + 2.
- Audio: read at 16 kHz, padded to whole 10 ms hops; L = ceil(samples / 160) feature frames become
  ``13 x floor(L / 100)`` tokens plus those of the remainder (its three stride-2 convolutions), + 2
  markers: 13 tokens a second. A video's sound goes as an audio item of its own (vLLM 0.26.0 stops its
  engine on audio inside a video: docs/models.md).
- The chat template adds no system turn: 8 tokens around one user turn.
- Weights: the thinker's mixture-of-experts decoder (every expert in memory), its Qwen3-VL vision tower
  and its audio encoder; the talker and code2wav are not loaded by vLLM.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from vidlabel.families.base import Family, ImageBounds, ModelShape, Sampling, VideoEstimate, arr, dtype_bytes, \
    file_frames
from vidlabel.families.qwen3_vl import qwen3_decoder_parameters, qwen3_vision_parameters
from vidlabel.families.resize import smart_resize
from vidlabel.families.samplers import qwen2_vl_loader

CELL = 32  # ViT patch 16, 2x2 spatial merge
TEMPORAL_PATCH = 2
AUDIO_RATE = 16000
HOP = 160  # samples per feature frame (the Whisper feature extractor's hop)
CHUNK_FRAMES = 100  # feature frames per chunk of the audio encoder (2 x n_window)
TOKENS_PER_CHUNK = 13


def audio_embeds(samples) -> np.ndarray:
    """The audio encoder's output tokens for ``samples`` samples at 16 kHz (vLLM's
    ``_get_feat_extract_output_lengths`` of the padded feature length)."""
    frames = np.ceil(np.nan_to_num(arr(samples), nan=0.0) / HOP).astype(np.int64)
    rest = frames % CHUNK_FRAMES
    convolved = (((rest - 1) // 2 + 1 - 1) // 2 + 1 - 1) // 2 + 1
    return (np.where(rest > 0, convolved, 0) + (frames // CHUNK_FRAMES) * TOKENS_PER_CHUNK).astype(np.int64)


class Qwen3Omni(Family):
    name = "qwen3_omni"
    rule_version = 1
    model_types = ("qwen3_omni_moe",)
    known_names = ("qwen3-omni", "qwen3_omni")
    cell = CELL
    video_bounds = "frame"
    min_file_frames = TEMPORAL_PATCH
    hears_audio = True
    audio_rate = AUDIO_RATE
    chat_overhead_tokens = 8
    default_sampling = Sampling(fps=2.0, min_frames=4, max_frames=768, min_pixels=128 * CELL * CELL,
                                max_pixels=768 * CELL * CELL)
    default_image_bounds = ImageBounds(min_pixels=3136, max_pixels=12845056)

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

    def audio_embeds(self, samples) -> np.ndarray:
        return audio_embeds(samples)

    def model_shape(self, cfg: Mapping[str, Any]) -> ModelShape:
        thinker = cfg.get("thinker_config") or cfg
        text = thinker["text_config"]
        total, active = qwen3_decoder_parameters(text)
        vision = thinker.get("vision_config") or {}
        if vision and not vision.get("num_position_embeddings"):
            vision = {**vision, "num_position_embeddings": (vision.get("image_size", 768) // vision.get("patch_size", 16)) ** 2}
        towers = (qwen3_vision_parameters(vision) if vision else 0.0) + audio_parameters(thinker.get("audio_config") or {})
        heads = int(text["num_attention_heads"])
        head_dim = text.get("head_dim") or text["hidden_size"] // heads
        width = dtype_bytes(thinker) if (thinker.get("dtype") or thinker.get("torch_dtype")) else dtype_bytes(cfg)
        kv = 2 * text["num_hidden_layers"] * (text.get("num_key_value_heads") or heads) * head_dim * width
        return ModelShape(total + towers, float(kv), heads, width, active + towers)


def audio_parameters(ac: Mapping[str, Any]) -> float:
    """Parameters of the Qwen3-Omni audio encoder: three stride-2 convolutions, their projection, the
    Whisper-style transformer layers and the output projections."""
    if not ac:
        return 0.0
    d, ffn, layers = ac["d_model"], ac["encoder_ffn_dim"], ac["encoder_layers"]
    conv = ac.get("downsample_hidden_size", 480)
    mels = ac.get("num_mel_bins", 128)
    convs = (1 * conv * 9 + conv) + 2 * (conv * conv * 9 + conv)
    conv_out = conv * (mels // 8) * d
    layer = 4 * d * d + 4 * d + 2 * d * ffn + ffn + d + 4 * d
    out = ac.get("output_dim", d)
    head = 2 * d + (d * d + d) + (d * out + out)
    return float(convs + conv_out + layers * layer + head)


FAMILY = Qwen3Omni()
