"""The calibration videos every job probes its servers with (vidlabel.serve.probe), and the visual
tokens the plan expects of them.

Two small H.264 files, made once with PyAV and kept where the server may read them (``results/
calibration/`` when that is inside the server's allowed media directory, else a hidden folder in it):

- *pixels*: 4 frames at 4 fps of frames twice the area of ``planning.max_pixels`` (16:9): the server
  shrinks them to its upper pixel bound, so their tokens follow it and nothing else;
- *fps*: 64 frames at 8 fps of 32x32 frames: the server samples 8 s at its fps (up to 8) and grows each
  frame to its lower pixel bound, so their tokens follow both.

The expected tokens come from the plan's own rule (vidlabel.prepare.tokens, ``planning.model_family``)
plus the two vision start/end markers a video adds to the prompt.
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
from vidlabel.serve.probe import Calibration, CalibrationVideo
from vidlabel.serve.settings import ServeSettings

log = logging.getLogger(__name__)

VIDEO_MARKERS = 2  # <|vision_start|> and <|vision_end|>
MAX_SIDE = 3840


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


def expected_tokens(settings: ServeSettings, spec: Spec) -> int:
    plan = settings.plan
    rule = tk.VISUAL_RULES[plan.model_family]
    estimate = rule(np.array([spec.frames / spec.fps]), np.array([float(spec.fps)]), np.array([spec.width]),
                    np.array([spec.height]), plan.sampling)
    return int(estimate.tokens[0]) + VIDEO_MARKERS


def calibration(settings: ServeSettings) -> Calibration | None:
    """The job's calibration videos (made if missing); None, logged, where they cannot be written."""
    folder = directory(settings)
    videos = []
    for spec in specs(settings.plan.sampling.max_pixels):
        path = folder / spec.name
        try:
            if not path.is_file():
                write_video(path, spec)
        except OSError as exc:
            log.warning("cannot write the calibration video %s (%s): the servers' fps and pixel bounds are not "
                        "checked", path, exc)
            return None
        videos.append(CalibrationVideo(str(path), expected_tokens(settings, spec), spec.what))
    return Calibration(tuple(videos))
