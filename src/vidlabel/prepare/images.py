"""Images: probe them as the server's loader will read them, and convert those it would misread.

vLLM's image loader (``vllm/multimodal/image.py``, the default ``pil`` backend, and
``vllm/multimodal/media/image.py: ImageMediaIO``) does ``Image.open(BytesIO(data))`` and
``convert("RGB")`` (RGBA over white), then hands the picture to the Hugging Face processor. So:

* it reads whatever the server's Pillow opens: no HEIF plugin is installed with vLLM, and AVIF needs
  a Pillow built with libavif (wheels from 11.3 on); neither is measured on the server
  (``SERVER_IMAGE_FORMATS`` lists those that are safe);
* it never applies the EXIF orientation: a phone photo stored sideways with an orientation tag
  reaches the model sideways (the token count is the same: ``smart_resize`` is symmetric);
* ``convert("RGB")`` of a 16-bit greyscale image (Pillow mode ``I;16``) clips every value above 255,
  so the model sees a white picture (48-bit RGB PNGs open as 8-bit ``RGB`` and are fine; CMYK JPEGs
  convert with Pillow's plain CMYK->RGB formula, which the server applies too);
* an animated GIF or WebP is read as its first frame only: it is a video (``kind`` ``video``), made
  into an H.264 file by ``convert_animation``.

``probe_image`` never raises (a bad file is a ``probe_error``); ``server_image_problem`` says why a
probed image must be converted; ``convert_image`` writes the upright 8-bit RGB JPEG the server reads
as the user sees it, optionally at a smaller size (a slideshow planned below the image pixel bound).
"""

from __future__ import annotations

import bisect
import os
from fractions import Fraction
from typing import Any

import av
import numpy as np
import pillow_heif
from PIL import Image, ImageOps, ImageSequence, UnidentifiedImageError

from vidlabel.core.io import atomic_path

pillow_heif.register_heif_opener()  # HEIC/HEIF photos from iPhones; Pillow opens AVIF itself

#: Formats the server's Pillow opens whatever its version (Pillow's own core formats).
SERVER_IMAGE_FORMATS = frozenset({"JPEG", "PNG", "WEBP", "GIF", "BMP"})
#: Pillow modes whose conversion to RGB clips instead of scaling (more than 8 bits per sample).
DEEP_MODES = frozenset({"I;16", "I;16B", "I;16L", "I;16N", "I", "F"})
#: Formats that can hold an animation, which the model must see as a video.
ANIMATED_FORMATS = frozenset({"GIF", "WEBP", "PNG", "AVIF"})
#: EXIF orientations that swap width and height (rotations by 90 or 270 degrees, with or without a flip).
SWAPPING_ORIENTATIONS = frozenset({5, 6, 7, 8})
EXIF_ORIENTATION = 0x0112
DEFAULT_FRAME_MS = 100  # browsers show a GIF frame of 0 or no duration for 100 ms
MAX_ANIMATION_FPS = 30.0
JPEG_QUALITY = 95


def probe_image(path: str | os.PathLike) -> dict[str, Any] | None:
    """What an image (or animated image) file is, read from its content; None if Pillow cannot identify it.

    Returns kind (``image``, or ``video`` for an animation of two frames or more), image_format
    (Pillow's name: JPEG, PNG, WEBP, GIF, HEIF, AVIF, ...), mode, width and height as displayed (the
    EXIF orientation applied), orientation (the EXIF tag, None without one), frames, duration_s and
    fps (animations), and probe_error (a file that identifies but does not decode).
    """
    try:
        image = Image.open(path)
    except (UnidentifiedImageError, ValueError):
        return None
    except OSError as exc:
        return {"kind": None, "probe_error": f"unreadable: {exc.strerror or exc}"}
    info: dict[str, Any] = {"kind": "image", "image_format": image.format, "mode": image.mode,
                            "width": image.width, "height": image.height, "orientation": None,
                            "frames": 1, "duration_s": None, "fps": None, "probe_error": None}
    with image:
        try:
            orientation = image.getexif().get(EXIF_ORIENTATION)
            info["orientation"] = int(orientation) if orientation else None
            frames = getattr(image, "n_frames", 1)
            if frames > 1 and image.format in ANIMATED_FORMATS:
                durations = _frame_durations_ms(image)
                info.update(kind="video", frames=len(durations), duration_s=sum(durations) / 1000.0)
                info["fps"] = len(durations) / info["duration_s"]
                image.seek(0)
            if image.format == "JPEG":
                image.draft("RGB", (max(1, image.width // 8), max(1, image.height // 8)))  # decode at 1/8: fast
            image.load()
        except Image.DecompressionBombError as exc:
            info["probe_error"] = f"image too large to decode safely: {exc}"
        except (OSError, SyntaxError, ValueError, EOFError) as exc:
            info["probe_error"] = f"corrupt image: {exc}"
    if info["orientation"] in SWAPPING_ORIENTATIONS:
        info["width"], info["height"] = info["height"], info["width"]
    return info


def _frame_durations_ms(image: Image.Image) -> list[int]:
    durations = []
    for frame in ImageSequence.Iterator(image):
        if "duration" not in frame.info:
            frame.load()  # WebP sets a frame's duration once it is decoded
        ms = frame.info.get("duration") or 0
        durations.append(int(ms) if ms >= 20 else DEFAULT_FRAME_MS)
    return durations


def server_image_problem(info: dict[str, Any]) -> str | None:
    """Why the server must not be sent this (probed, still) image as it is; None when it may."""
    fmt, mode, orientation = info.get("image_format"), info.get("mode"), info.get("orientation")
    if fmt not in SERVER_IMAGE_FORMATS:
        return (f"{fmt} is not among the formats the server's image loader is known to open "
                f"({', '.join(sorted(SERVER_IMAGE_FORMATS))})")
    if mode in DEEP_MODES:
        return f"{mode} samples (more than 8 bits): the server's RGB conversion clips them to white"
    if orientation not in (None, 1):
        return f"EXIF orientation {orientation}: the server ignores it and would show the photo turned"
    return None


def item_image_problem(item: dict[str, Any]) -> str | None:
    """``server_image_problem`` of a probed item (``vidlabel.prepare.item_probe.probe_item``'s fields)."""
    return server_image_problem({"image_format": (item.get("media_format") or "").upper() or None,
                                 "mode": item.get("image_mode"), "orientation": item.get("orientation")})


def _to_rgb(image: Image.Image) -> Image.Image:
    """8-bit RGB as a viewer shows it: deep samples scaled (not clipped), transparency over white."""
    if image.mode in DEEP_MODES:
        values = np.asarray(image, dtype=np.float64)
        top = 65535.0 if image.mode != "F" else max(1.0, float(values.max()))
        image = Image.fromarray(np.clip(values * (255.0 / top), 0, 255).round().astype(np.uint8), "L")
    if image.mode in ("P", "PA"):
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA"):
        canvas = Image.new("RGB", image.size, (255, 255, 255))  # the server's background for RGBA
        canvas.paste(image.convert("RGBA"), mask=image.convert("RGBA").getchannel("A"))
        return canvas
    return image.convert("RGB")


def convert_image(src: str | os.PathLike, dst: str | os.PathLike,
                  size: tuple[int, int] | None = None) -> dict[str, int]:
    """Write ``src`` as an upright 8-bit RGB JPEG at ``dst`` (atomically), resized to ``size``
    (width, height) when given; returns its width and height. Raises OSError/ValueError on a bad file."""
    with Image.open(src) as image:
        image.seek(0)
        upright = ImageOps.exif_transpose(image)
        rgb = _to_rgb(upright)
    if size is not None and tuple(size) != rgb.size:
        rgb = rgb.resize((int(size[0]), int(size[1])), Image.Resampling.LANCZOS, reducing_gap=3.0)
    with atomic_path(dst) as tmp:
        rgb.save(tmp, format="JPEG", quality=JPEG_QUALITY)
    return {"width": rgb.width, "height": rgb.height}


def convert_animation(src: str | os.PathLike, dst: str | os.PathLike, fps: float | None = None,
                      size: tuple[int, int] | None = None, crf: int = 23) -> dict[str, Any]:
    """Write an animated GIF/WebP/PNG as an H.264 MP4 at a constant frame rate (atomically).

    FFmpeg 5 cannot decode animated WebP, so the frames come from Pillow and are encoded with PyAV.
    The rate is ``fps`` or the animation's own (at most ``MAX_ANIMATION_FPS``); each output frame shows
    the animation's frame at that instant. Returns fps, width, height, duration_s and frames.
    """
    with Image.open(src) as image:
        durations = _frame_durations_ms(image)
        frames = [_to_rgb(frame.copy()) for frame in ImageSequence.Iterator(image)]
    total_s = sum(durations) / 1000.0
    rate = Fraction(fps or min(MAX_ANIMATION_FPS, len(frames) / total_s)).limit_denominator(1000)
    count = max(2, int(round(total_s * rate)))
    starts = (np.cumsum([0, *durations[:-1]]) / 1000.0).tolist()
    width, height = size or frames[0].size
    width, height = width - width % 2, height - height % 2  # yuv420p needs even sides
    with atomic_path(dst) as tmp:
        with av.open(str(tmp), "w", format="mp4", options={"movflags": "+faststart"}) as out:
            stream = out.add_stream("libx264", rate=rate, options={"crf": str(crf), "preset": "veryfast"})
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            for k in range(count):
                shown = frames[max(0, bisect.bisect_right(starts, float(k / rate)) - 1)]
                if shown.size != (width, height):
                    shown = shown.resize((width, height), Image.Resampling.LANCZOS)
                out.mux(stream.encode(av.VideoFrame.from_image(shown)))
            out.mux(stream.encode(None))
    return {"fps": float(rate), "width": width, "height": height, "duration_s": count / float(rate),
            "frames": count}
