"""How vLLM 0.26 turns media into prompt tokens for each model it serves, for the stand-in server.

Written from vLLM's source (``multimodal/video.py``: ``Qwen2VLVideoBackend``, ``Qwen3VLVideoBackend``;
``models/qwen2_vl.py``, ``qwen3_vl.py``, ``qwen3_omni_moe_thinker.py``) and transformers 5.17's processors,
per item and in plain Python, independently of vidlabel's estimators (``vidlabel.families``), so that the
tests compare two implementations:

- which model: the model folder's config.json ``model_type`` (as vLLM reads it), else the served name
  (``Qwen/Qwen3-VL-8B-Instruct``), else Qwen2.5-VL (``--standin-model-type`` forces one);
- Qwen2.5-VL (``qwen2_5_vl``, ``qwen2_vl``): ``qwen_video.video_tokens`` and ``qwen_image`` (28-pixel cells);
- Qwen3-VL (``qwen3_vl``, ``qwen3_vl_moe``): ``int(total / fps_src * fps)`` frames (4..768, at most the file's),
  indices ``linspace(0, total - 1, n).round()``; one resize for the whole video (``longest_edge`` 25,165,824
  pixels over all frames by default, 32-pixel cells); per pair of frames "<t seconds>" (each digit a
  token), <|vision_start|>, the pads, <|vision_end|>; images at 32-pixel cells within 65,536..16,777,216;
- Qwen3-Omni (``qwen3_omni_moe``): Qwen2-VL's frame sampler, 32-pixel cells, each frame within
  131,072..786,432 pixels; audio: 16 kHz samples padded to 160-sample hops, 13 tokens per 100 hops
  plus the remainder's, +2 markers. A request with ``mm_processor_kwargs.use_audio_in_video`` kills the
  engine on version 0.26.0 (vLLM 0.26.0's bug: every later request fails).
"""

from __future__ import annotations

import json
import math
import os
import wave

import numpy as np
import qwen_image
import qwen_video

FAMILIES = {"qwen2_5_vl": "qwen2_5_vl", "qwen2_vl": "qwen2_5_vl", "qwen3_vl": "qwen3_vl", "qwen3_vl_moe": "qwen3_vl",
            "qwen3_omni_moe": "qwen3_omni"}
NAMES = (("qwen3-omni", "qwen3_omni_moe"), ("qwen3-vl", "qwen3_vl"), ("qwen2.5-vl", "qwen2_5_vl"))
# Each family's processor defaults: (video min, video max, image min, image max) pixels, and its cell.
DEFAULTS = {"qwen2_5_vl": ((128 * 28 * 28, 768 * 28 * 28, 3136, 12845056), 28),
            "qwen3_vl": ((4096, 25165824, 65536, 16777216), 32),
            "qwen3_omni": ((128 * 32 * 32, 768 * 32 * 32, 3136, 12845056), 32)}
AUDIO_RATE, HOP = 16000, 160


def model_type(model: str, forced: str | None = None) -> str:
    if forced:
        return forced
    config = os.path.join(model, "config.json")
    if os.path.isfile(config):
        with open(config) as fh:
            return json.load(fh).get("model_type") or "qwen2_5_vl"
    lower = model.lower()
    return next((kind for name, kind in NAMES if name in lower), "qwen2_5_vl")


class Served:
    """The served model's processing: bounds from ``--mm-processor-kwargs`` over the family's defaults."""

    def __init__(self, kind: str, mm_processor_kwargs: dict, fps: float):
        self.model_type = kind
        self.family = FAMILIES.get(kind, "qwen2_5_vl")
        (vmin, vmax, imin, imax), self.cell = DEFAULTS[self.family]
        self.fps = fps
        self.video_min, self.video_max = qwen_image.bounds(mm_processor_kwargs, "video", (vmin, vmax))
        self.image_min, self.image_max = qwen_image.bounds(mm_processor_kwargs, "image", (imin, imax))

    @property
    def hears(self) -> bool:
        return self.family == "qwen3_omni"

    def video_tokens(self, info: "qwen_video.VideoInfo") -> tuple[int, int]:
        """(prompt tokens of the item, markers included; what the encoder-cache check counts)."""
        if self.family == "qwen3_vl":
            return qwen3_video_tokens(info, self.fps, self.video_min, self.video_max)
        embeds = qwen_video.video_tokens(info, self.fps, self.video_min, self.video_max, self.cell)
        return embeds + 2, embeds

    def decoded_frames(self, info: "qwen_video.VideoInfo") -> int:
        """Frames the loader decodes (each at the file's size)."""
        if self.family == "qwen3_vl":
            n = int(info.total_frames / info.fps * self.fps) if info.fps > 0 else 4
            return min(max(n, 4), 768, info.total_frames)
        return qwen_video.sampled_frames(info, self.fps)

    def image_tokens(self, path: str) -> tuple[int, int]:
        embeds = qwen_image.image_embeds(path, self.image_min, self.image_max, self.cell)
        return embeds + qwen_image.MARKERS, embeds

    @staticmethod
    def audio_samples(path: str) -> int:
        with wave.open(path, "rb") as wav:
            if wav.getframerate() != AUDIO_RATE:
                raise ValueError(f"the stand-in reads 16 kHz WAV only, not {wav.getframerate()} Hz")
            return wav.getnframes()

    def audio_tokens(self, path: str) -> tuple[int, int]:
        samples = self.audio_samples(path)
        hops = -(-samples // HOP)  # padded to whole hops
        tokens = (hops // 100) * 13
        rest = hops % 100
        if rest:
            length = (rest - 1) // 2 + 1
            for _ in range(2):
                length = (length - 1) // 2 + 1
            tokens += length
        return tokens + 2, tokens


def qwen3_video_tokens(info: "qwen_video.VideoInfo", fps: float, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    n = int(info.total_frames / info.fps * fps) if info.fps > 0 else 4
    n = min(max(n, 4), 768, info.total_frames)
    height, width = info.height, info.width
    h_bar, w_bar = round(height / 32) * 32, round(width / 32) * 32
    t_bar = round(n / 2) * 2
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt(n * height * width / max_pixels)
        h_bar, w_bar = max(32, math.floor(height / beta / 32) * 32), max(32, math.floor(width / beta / 32) * 32)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (n * height * width))
        h_bar, w_bar = math.ceil(height * beta / 32) * 32, math.ceil(width * beta / 32) * 32
    pads = (h_bar // 32) * (w_bar // 32)
    indices = np.linspace(0, info.total_frames - 1, n).round().astype(int).tolist()
    if len(indices) % 2:
        indices.append(indices[-1])
    times = [i / info.fps for i in indices]
    placeholder = 0
    for g in range(0, len(times), 2):
        stamp = f"<{(times[g] + times[g + 1]) / 2:.1f} seconds>"
        placeholder += sum(ch.isdigit() for ch in stamp) + 4 + 1 + pads + 1
    return placeholder + 2, placeholder
