"""Media items: what each file of a post is (video, image or audio), read from its content.

A post is a caption plus an ordered list of media items. ``probe_item`` decides the kind from the
file itself, never from its name: Pillow identifies still and animated images (an animated GIF,
WebP or PNG is a ``video``), PyAV everything else (a video stream that is not a cover picture is a
``video``; audio streams alone, with or without a cover, are ``audio``). A JPEG used to pass the video
probe as a 0.04 s, one-frame ``mjpeg`` video; here it is an image. Never raises: a missing, empty,
corrupt or unrecognised file gets a ``probe_error`` of its own, so a post keeps its other items.

A video item carries every field of the video probe (``vidlabel.prepare.media.PROBE_FIELDS``: the
planner and the decoder choice read them), an image its format, pixel mode and EXIF orientation (what
decides whether the server may be sent it as it is: ``images.item_image_problem``).
"""

from __future__ import annotations

import os
from typing import Any

import av

from vidlabel.prepare import images
from vidlabel.prepare.inventory_schema import ITEM_FIELDS, PROBE_FIELDS
from vidlabel.prepare.media import _codec_name, _file_problem, _open_media, probe

KINDS = ("video", "image", "audio")


def probe_item(path: str | os.PathLike) -> dict[str, Any]:
    """Probe one media item: ``ITEM_FIELDS``, ``kind`` one of ``KINDS`` (None with a probe_error).

    width/height are the display size (EXIF orientation or a video's display matrix applied);
    media_format is Pillow's image format or FFmpeg's container name, lower case; video_codec is the
    codec's own name (``gif``/``webp``/``png``/``avif`` for an animated image); frames is known for
    images and animations.
    """
    path = os.fspath(path)
    info: dict[str, Any] = dict.fromkeys(ITEM_FIELDS)
    info["size_bytes"], info["probe_error"] = _file_problem(path)
    if info["probe_error"]:
        return info
    still = images.probe_image(path)
    if still is not None:
        return _from_image(info, still)
    container, info["probe_error"] = _open_media(path)
    if container is None:
        return info
    with container:
        media_format = (container.format.name or "").split(",")[0] or None
        pictures = [s for s in container.streams.video if not s.disposition & av.stream.Disposition.attached_pic]
        audio = list(container.streams.audio)
        if not pictures and audio:
            return _from_audio(info, container, audio[0], media_format)
        kinds = sorted({s.type for s in container.streams}) or ["no streams"]
        audio_codec = _codec_name(audio[0]) if audio else None
    if not pictures:
        info["probe_error"] = f"not a video, image or audio file (contains: {', '.join(kinds)})"
        return info
    video = probe(path)
    info.update({k: video[k] for k in PROBE_FIELDS})
    info["media_format"] = media_format
    info["kind"] = "video" if not video["probe_error"] else None
    info["audio_codec"] = audio_codec
    return info


def _from_image(info: dict[str, Any], still: dict[str, Any]) -> dict[str, Any]:
    if still["probe_error"]:
        info["probe_error"] = still["probe_error"]
        return info
    info.update(kind=still["kind"], media_format=still["image_format"].lower(), image_mode=still["mode"],
                width=still["width"],
                height=still["height"], orientation=still["orientation"], frames=still["frames"],
                duration_s=still["duration_s"], fps=still["fps"], has_audio=False)
    if still["kind"] == "video":
        info["video_codec"] = info["media_format"]
    return info


def _from_audio(info: dict[str, Any], container, stream, media_format: str | None) -> dict[str, Any]:
    info.update(media_format=media_format, audio_codec=_codec_name(stream), has_audio=True)
    if container.duration is not None:
        info["duration_s"] = container.duration / av.time_base
    elif stream.duration is not None and stream.time_base is not None:
        info["duration_s"] = float(stream.duration * stream.time_base)
    try:  # the audio must decode, not only open
        decoded = next(iter(container.decode(stream)), None)
    except (av.error.FFmpegError, ValueError) as exc:
        info["probe_error"] = f"corrupt audio: {exc}"
        return info
    if decoded is None:
        info["probe_error"] = "corrupt audio: no frame could be decoded"
        return info
    info["kind"] = "audio"
    return info


