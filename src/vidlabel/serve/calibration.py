"""The calibration videos (and, for data with photos or heard audio, images and a sound) every job probes
its servers with (vidlabel.serve.probe), and the tokens the plan expects of them.

Two small H.264 files, made once with PyAV and kept where the server may read them (``results/
calibration/`` when that is inside the server's allowed media directory, else a hidden folder in it),
sized by the model family (``Family.calibration_videos``):

- *pixel bounds*: 4 frames at 4 fps of frames larger than the family's upper bound (a frame's, or a
  quarter of the video's): the server shrinks them to it, so their tokens follow it and nothing else;
- *fps and lower pixel bound*: 64 frames at 8 fps of 32x32 frames: the server samples 8 s at its fps (up
  to 8) and grows each frame to its lower bound, so their tokens follow both.

Where the job's posts send images, two JPEG images as well (Pillow): *image pixel bounds*, a gradient
of twice the area of ``planning.image_max_pixels`` (16:9, sides at most ``MAX_IMAGE_SIDE``, tokens at
most half the context), which the server shrinks to its upper image bound, and *image lower pixel bound*,
one cell of the family, which it grows to its lower one. Where they send audio for the model to hear, a
WAV of ``CALIBRATION_AUDIO_S`` seconds at the family's rate (*audio*), whose tokens follow the samples.

The expected tokens come from the family's own rules (vidlabel.families), markers included: what each
family would count is also what tells a server of another family (``expected_by_family``).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vidlabel import families
from vidlabel.core.io import atomic_path
from vidlabel.serve.probe import Calibration, CalibrationItem
from vidlabel.serve.settings import ServeSettings

log = logging.getLogger(__name__)

MAX_IMAGE_SIDE = 8192
CALIBRATION_AUDIO_S = 3


def video_name(spec: families.CalibrationVideo) -> str:
    return f"calibration-{spec.width}x{spec.height}-{spec.frames}f-{spec.fps}fps.mp4"


@dataclass(frozen=True)
class ImageSpec:
    what: str
    width: int
    height: int

    @property
    def name(self) -> str:
        return f"calibration-image-{self.width}x{self.height}.jpg"


def image_specs(family: families.Family, image_max_pixels: int, max_model_len: int) -> list[ImageSpec]:
    # Twice the bound's area, but never more tokens than half the context (a small max_model_len).
    area = 2 * min(image_max_pixels, max_model_len // 2 * family.cell * family.cell)
    width = min(MAX_IMAGE_SIDE, 2 * math.ceil(math.sqrt(area * 16 / 9) / 2))
    height = min(MAX_IMAGE_SIDE, 2 * math.ceil(width * 9 / 16 / 2))
    return [ImageSpec("image pixel bounds", width, height),
            ImageSpec("image lower pixel bound", family.cell, family.cell)]


def directory(settings: ServeSettings) -> Path:
    allowed = Path(settings.server.allowed_media_path)
    results = Path(settings.results).resolve()
    inside = os.path.commonpath([allowed, results]) == str(allowed)
    return results / "calibration" if inside else allowed / ".vidlabel-calibration"


def write_video(path: Path, spec: families.CalibrationVideo) -> None:
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


@dataclass(frozen=True)
class AudioSpec:
    what: str
    seconds: int
    rate: int

    @property
    def name(self) -> str:
        return f"calibration-audio-{self.seconds}s-{self.rate}hz.wav"

    @property
    def samples(self) -> int:
        return self.seconds * self.rate


def write_audio(path: Path, spec: AudioSpec) -> None:
    """A rising tone of ``spec.seconds`` at ``spec.rate`` Hz, mono 16-bit PCM, written atomically."""
    import wave

    t = np.arange(spec.samples) / spec.rate
    tone = (0.3 * np.sin(2 * np.pi * (220 + 110 * t) * t) * 32767).astype("<i2")
    with atomic_path(path) as tmp:
        with wave.open(str(tmp), "wb") as wav:
            wav.setnchannels(1)
            wav.setsampwidth(2)
            wav.setframerate(spec.rate)
            wav.writeframes(tone.tobytes())


def expected_video_tokens(family: families.Family, sampling: families.Sampling,
                          spec: families.CalibrationVideo) -> int:
    estimate = family.video_tokens([spec.frames / spec.fps], [float(spec.fps)], [spec.width], [spec.height], sampling,
                                   total_frames=[spec.frames])
    return int(estimate.tokens[0])


def by_family(spec: families.CalibrationVideo) -> tuple[tuple[str, int], ...]:
    """What each family counts of a calibration video under its own defaults: the one that matches a
    server's count names the family that server serves."""
    return tuple((name, expected_video_tokens(f, f.default_sampling, spec)) for name, f in families.FAMILIES.items())


def calibration(settings: ServeSettings) -> Calibration | None:
    """The job's calibration videos, and images and a sound where its posts send them (made if missing);
    None, logged, where they cannot be written."""
    family, plan = settings.plan.family, settings.plan
    folder = directory(settings)
    videos, images, sounds = [], [], []
    for spec in family.calibration_videos(plan.sampling):
        found = _made(folder / video_name(spec), spec, write_video, "video")
        if found is None:
            return None
        videos.append(CalibrationItem(str(found), expected_video_tokens(family, plan.sampling, spec), spec.what,
                                      "video", by_family(spec), family.name))
    if settings.server.media_limits.image > 0:
        for spec in image_specs(family, plan.image_bounds.max_pixels, plan.max_model_len):
            found = _made(folder / spec.name, spec, write_image, "image")
            if found is None:
                return None
            tokens = int(family.image_tokens([spec.width], [spec.height], plan.image_bounds)[0])
            images.append(CalibrationItem(str(found), tokens, spec.what, "image", family=family.name))
    if settings.server.media_limits.audio > 0:
        spec = AudioSpec("audio", CALIBRATION_AUDIO_S, family.audio_rate)
        found = _made(folder / spec.name, spec, write_audio, "audio")
        if found is None:
            return None
        sounds.append(CalibrationItem(str(found), int(family.audio_tokens([spec.samples])[0]), spec.what, "audio",
                                      family=family.name))
    return Calibration(tuple(videos), tuple(images), tuple(sounds))


def _made(path: Path, spec, write, kind: str) -> Path | None:
    """``path``, written from ``spec`` if missing; None, logged, where it cannot be."""
    try:
        if not path.is_file():
            write(path, spec)
    except OSError as exc:
        log.warning("cannot write the calibration %s %s (%s): the servers' settings are not checked", kind, path, exc)
        return None
    return path
