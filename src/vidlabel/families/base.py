"""What every model family says about itself (``Family``), and the types its rules take and give.

A family is how one kind of model is served by vLLM: which frames its video loader samples, how its
processor resizes frames and images, how many prompt tokens each item becomes (markers, timestamps and
audio included), the ``--mm-processor-kwargs`` that carry its pixel bounds, the calibration media whose
token counts reveal a server's settings, and the shape of its weights for the layout planner. The rest
of vidlabel asks a ``Family``; none of it knows a family's constants (cell size, frame pairing,
processor defaults). Every rule is vectorised over numpy arrays: one call plans a million items.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Any, Mapping

import numpy as np


class FamilyError(ValueError):
    """A model's family cannot be told or used as asked; the message names the model and the choices."""


@dataclass(frozen=True)
class Sampling:
    """How the server samples and sizes a video. ``min_pixels``/``max_pixels`` bound what the family's
    ``video_bounds`` says: each frame, or the whole video."""

    fps: float
    min_frames: int
    max_frames: int
    min_pixels: int
    max_pixels: int

    def with_(self, **changes) -> "Sampling":
        return replace(self, **changes)


@dataclass(frozen=True)
class ImageBounds:
    """The pixel bounds the server resizes each image within."""

    min_pixels: int
    max_pixels: int


@dataclass(frozen=True)
class VideoEstimate:
    """Per video: frames the server decodes, the size it resizes them to, the item's prompt tokens
    (markers and timestamps included) and what vLLM's encoder-cache check counts of it."""

    frames: np.ndarray
    height: np.ndarray
    width: np.ndarray
    tokens: np.ndarray
    embeds: np.ndarray


@dataclass(frozen=True)
class ModelShape:
    """What the layout planner needs of a checkpoint: its parameters (every expert of a mixture of experts:
    all of them sit in memory), the KV cache per token, its attention heads (tensor parallel must divide
    them) and the bytes per parameter of its dtype."""

    parameters: float
    kv_bytes_per_token: float
    attention_heads: int
    dtype_bytes: float
    active_parameters: float | None = None  # per token, for a mixture of experts


@dataclass(frozen=True)
class CalibrationVideo:
    """A generated video whose token count reveals a server's settings (vidlabel.serve.calibration)."""

    what: str
    width: int
    height: int
    frames: int
    fps: int


def arr(x, dtype=np.float64) -> np.ndarray:
    return np.atleast_1d(np.asarray(x, dtype=dtype))


def file_frames(duration_s, source_fps) -> np.ndarray:
    """Frames in a file from its duration and rate; an unknown rate (0 or NaN) counts as unlimited."""
    d = np.nan_to_num(arr(duration_s), nan=0.0)
    f = np.nan_to_num(arr(source_fps), nan=0.0)
    n = np.round(d * f)
    return np.where(f > 0, np.maximum(n, 1), float(2 ** 62)).astype(np.int64)


DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4, "float8": 1, "int8": 1}


def dtype_bytes(cfg: Mapping[str, Any]) -> int:
    """Bytes per parameter of a checkpoint's dtype (its config.json, or its text config's)."""
    text = cfg.get("text_config") or {}
    name = str(cfg.get("torch_dtype") or cfg.get("dtype") or text.get("torch_dtype") or text.get("dtype")
               or "bfloat16")
    return DTYPE_BYTES.get(name.replace("torch.", ""), 2)


class Family(ABC):
    """One model family (module docstring). Subclasses set the attributes and implement the rules."""

    #: ``planning.model_family`` name, and the stem of the plan folder.
    name: str
    #: Raised whenever a rule changes what it counts: part of every answer's identity.
    rule_version: int
    #: ``model_type`` values of config.json served by this family.
    model_types: tuple[str, ...] = ()
    #: Hub names (case-insensitive substrings) known to be this family, for a model with no config.json here.
    known_names: tuple[str, ...] = ()
    #: Pixels per token side: images and frames are resized to multiples of it.
    cell: int
    #: What ``planning.min_pixels``/``max_pixels`` bound: "frame" or "video" (all frames together).
    video_bounds: str = "frame"
    #: The fewest frames a video file may hold for the server's sampler (fewer: transcoded).
    min_file_frames: int = 2
    #: Whether the model hears audio items (``classify.audio: native``).
    hears_audio: bool = False
    #: Tokens the chat template adds to one user turn with its generation prompt, items' markers excluded.
    chat_overhead_tokens: int
    default_sampling: Sampling
    default_image_bounds: ImageBounds

    # ----------------------------------------------------------------------------- videos
    @abstractmethod
    def sampled_frames(self, total_frames, source_fps, sampling: Sampling, duration_s=None) -> np.ndarray:
        """Frames the server's video loader hands the processor for files of ``total_frames`` at
        ``source_fps`` (float arithmetic as the server does it); a file of unknown rate is planned as
        ``duration_s`` of frames at the sampling rate."""

    @abstractmethod
    def frame_size(self, height, width, frames, sampling: Sampling) -> tuple[np.ndarray, np.ndarray]:
        """The (height, width) the processor resizes ``frames`` frames of this size to."""

    @abstractmethod
    def video_tokens(self, duration_s, source_fps, width, height, sampling: Sampling,
                     total_frames=None) -> VideoEstimate:
        """Every video's frames, size and tokens; ``total_frames`` (the header's count, where known)
        replaces ``round(duration * fps)``."""

    def group_tokens(self, height, width) -> np.ndarray:
        """The tokens one more temporal group of frames of this (resized) size adds to a video."""
        return ((arr(height) // self.cell) * (arr(width) // self.cell)).astype(np.int64)

    # ----------------------------------------------------------------------------- images
    @abstractmethod
    def image_size(self, width, height, bounds: ImageBounds, max_pixels=None) -> tuple[np.ndarray, np.ndarray]:
        """The (height, width) each image is resized to; ``max_pixels`` (scalar or per image) replaces
        the bound where a plan lowers it."""

    def image_embeds(self, width, height, bounds: ImageBounds, max_pixels=None) -> np.ndarray:
        """The image's embedding tokens (what the encoder cache holds): its cells after the resize."""
        h, w = self.image_size(width, height, bounds, max_pixels)
        return ((h // self.cell) * (w // self.cell)).astype(np.int64)

    def image_tokens(self, width, height, bounds: ImageBounds, max_pixels=None) -> np.ndarray:
        """Prompt tokens of each image: its embeddings and its start/end markers."""
        return self.image_embeds(width, height, bounds, max_pixels) + self.item_markers

    #: Marker tokens around each image, video or audio item.
    item_markers: int = 2

    # ----------------------------------------------------------------------------- audio
    def audio_embeds(self, samples) -> np.ndarray:
        """Embedding tokens of audio items of ``samples`` samples at ``audio_rate`` Hz."""
        raise FamilyError(f"the {self.name} family does not hear audio: its transcripts go as text")

    def audio_tokens(self, samples) -> np.ndarray:
        return self.audio_embeds(samples) + self.item_markers

    #: Samples per second the processor reads audio at (families that hear).
    audio_rate: int = 0

    # ----------------------------------------------------------------------------- the server
    def mm_processor_kwargs(self, sampling: Sampling, images: ImageBounds) -> dict[str, Any]:
        """``--mm-processor-kwargs`` that make the server resize as planned: the bounds per modality in
        the processors' ``size`` form (``shortest_edge``/``longest_edge``), which transformers 5 hands each
        processor at every request."""
        return {"images_kwargs": {"size": {"shortest_edge": images.min_pixels, "longest_edge": images.max_pixels}},
                "videos_kwargs": {"size": {"shortest_edge": sampling.min_pixels, "longest_edge": sampling.max_pixels}}}

    def calibration_videos(self, sampling: Sampling) -> list[CalibrationVideo]:
        """Two small videos: *pixel bounds*, 4 frames at 4 fps twice the upper bound's area (16:9; its tokens
        follow the upper bound), and *fps and lower pixel bound*, 64 tiny frames at 8 fps (its tokens follow
        the sampling rate and the lower bound)."""
        per_frame = sampling.max_pixels if self.video_bounds == "frame" else sampling.max_pixels / 4
        width = min(3840, 2 * math.ceil(math.sqrt(2 * per_frame * 16 / 9) / 2))
        height = 2 * math.ceil(width * 9 / 16 / 2)
        return [CalibrationVideo("pixel bounds", width, height, 4, 4),
                CalibrationVideo("fps and lower pixel bound", 32, 32, 64, 8)]

    @abstractmethod
    def model_shape(self, cfg: Mapping[str, Any]) -> ModelShape:
        """The checkpoint's shape from its config.json."""

    # ----------------------------------------------------------------------------- identity
    def identity(self) -> dict[str, Any]:
        return {"family": self.name, "rule_version": self.rule_version}

    def __repr__(self) -> str:
        return f"<family {self.name} v{self.rule_version}>"
