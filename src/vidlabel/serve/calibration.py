"""The calibration videos (and, for data with photos, images) every job probes its servers with
(vidlabel.serve.probe), and the visual tokens the plan expects of them.

Two small H.264 files, made once with PyAV and kept where the server may read them (``results/
calibration/`` when that is inside the server's allowed media directory, else a hidden folder in it):

- *pixels*: 4 frames at 4 fps of frames twice the area of ``planning.max_pixels`` (16:9): the server
  shrinks them to its upper pixel bound, so their tokens follow it and nothing else;
- *fps*: 64 frames at 8 fps of 32x32 frames: the server samples 8 s at its fps (up to 8) and grows each
  frame to its lower pixel bound, so their tokens follow both.

Where the job's posts send images, two JPEG images as well (Pillow): *image pixel bounds*, a gradient
of twice the area of ``planning.image_max_pixels`` (16:9, sides at most ``MAX_IMAGE_SIDE``, tokens at
most half the context), which the server shrinks to its upper image bound, and *image lower pixel bound*, 28x28 pixels, which it
grows to its lower one.

The expected tokens come from the plan's own rule (vidlabel.prepare.tokens, ``planning.model_family``;
images: ``tokens.image_tokens``) plus the two vision start/end markers an item adds to the prompt.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vidlabel.core.io import atomic_path
from vidlabel.prepare import tokens as tk
from vidlabel.serve.probe import Calibration, CalibrationItem
from vidlabel.serve.settings import ServeSettings

log = logging.getLogger(__name__)

VIDEO_MARKERS = 2  # <|vision_start|> and <|vision_end|>
MAX_SIDE = 3840
MAX_IMAGE_SIDE = 8192
TINY_IMAGE_SIDE = 28


@dataclass(frozen=True)
class Spec:
    what: str
    width: int
    height: int
    frames: int
    fps: int

    @property
    def name(self) -> str:
        return f"calibration-{self.width}x{self.height}-{self.frames}f-{self.fps}fps.mp4"


def specs(max_pixels: int) -> list[Spec]:
    width = min(MAX_SIDE, 2 * math.ceil(math.sqrt(2 * max_pixels * 16 / 9) / 2))
    height = 2 * math.ceil(width * 9 / 16 / 2)
    return [Spec("pixel bounds", width, height, 4, 4), Spec("fps and lower pixel bound", 32, 32, 64, 8)]


@dataclass(frozen=True)
class ImageSpec:
    what: str
    width: int
    height: int

    @property
    def name(self) -> str:
        return f"calibration-image-{self.width}x{self.height}.jpg"


def image_specs(image_max_pixels: int, max_model_len: int) -> list[ImageSpec]:
    # Twice the bound's area, but never more tokens than half the context (a small max_model_len).
    area = 2 * min(image_max_pixels, max_model_len // 2 * tk.FACTOR * tk.FACTOR)
    width = min(MAX_IMAGE_SIDE, 2 * math.ceil(math.sqrt(area * 16 / 9) / 2))
    height = min(MAX_IMAGE_SIDE, 2 * math.ceil(width * 9 / 16 / 2))
    return [ImageSpec("image pixel bounds", width, height),
            ImageSpec("image lower pixel bound", TINY_IMAGE_SIDE, TINY_IMAGE_SIDE)]


def directory(settings: ServeSettings) -> Path:
    allowed = Path(settings.server.allowed_media_path)
    results = Path(settings.results).resolve()
    inside = os.path.commonpath([allowed, results]) == str(allowed)
    return results / "calibration" if inside else allowed / ".vidlabel-calibration"


def write_video(path: Path, spec: Spec) -> None:
    """A moving gradient, ``spec.frames`` frames at ``spec.fps`` (H.264, yuv420p), written atomically."""
    import av

    ramp = np.linspace(0, 255, spec.width, dtype=np.float32)[None, :, None]
    with atomic_path(path) as tmp:
        with av.open(str(tmp), "w", format="mp4") as container:
            stream = container.add_stream("libx264", rate=spec.fps)
            stream.width, stream.height, stream.pix_fmt = spec.width, spec.height, "yuv420p"
            for i in range(spec.frames):
                image = np.broadcast_to((ramp + 8 * i) % 256, (spec.height, spec.width, 3)).astype(np.uint8)
                for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)


def write_image(path: Path, spec: ImageSpec) -> None:
    """A horizontal gradient of ``spec``'s size as a JPEG (no orientation tag), written atomically."""
    from PIL import Image

    ramp = np.linspace(0, 255, spec.width, dtype=np.float32).astype(np.uint8)
    pixels = np.broadcast_to(ramp[None, :, None], (spec.height, spec.width, 3))
    with atomic_path(path) as tmp:
        Image.fromarray(np.ascontiguousarray(pixels)).save(tmp, format="JPEG", quality=80)


def expected_image_tokens(settings: ServeSettings, spec: ImageSpec) -> int:
    return int(tk.image_tokens([spec.width], [spec.height], settings.plan.image_bounds)[0])


def expected_tokens(settings: ServeSettings, spec: Spec) -> int:
    plan = settings.plan
    rule = tk.VISUAL_RULES[plan.model_family]
    estimate = rule(np.array([spec.frames / spec.fps]), np.array([float(spec.fps)]), np.array([spec.width]),
                    np.array([spec.height]), plan.sampling)
    return int(estimate.tokens[0]) + VIDEO_MARKERS


def calibration(settings: ServeSettings) -> Calibration | None:
    """The job's calibration videos, and images where its posts send images (made if missing); None,
    logged, where they cannot be written."""
    folder = directory(settings)
    videos, images = [], []
    wanted = [(spec, write_video, expected_tokens, videos, "video") for spec in specs(settings.plan.sampling.max_pixels)]
    if settings.server.media_limits.image > 0:
        wanted += [(spec, write_image, expected_image_tokens, images, "image")
                   for spec in image_specs(settings.plan.image_bounds.max_pixels, settings.plan.max_model_len)]
    for spec, write, expect, found, kind in wanted:
        path = folder / spec.name
        try:
            if not path.is_file():
                write(path, spec)
        except OSError as exc:
            log.warning("cannot write the calibration %s %s (%s): the servers' fps and pixel bounds are not "
                        "checked", kind, path, exc)
            return None
        found.append(CalibrationItem(str(path), expect(settings, spec), spec.what, kind))
    return Calibration(tuple(videos), tuple(images))
