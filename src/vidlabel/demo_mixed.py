"""Demo posts of several media items: a photo post, a slideshow with a soundtrack, a carousel.

``make_mixed_set(outdir)`` writes ``outdir/media/mixed/...`` and ``outdir/posts-mixed.csv`` (columns
post_id, media as a JSON array, caption, author) and returns what each post should become: its
post type, its items' kinds in order, and the words spoken on its soundtrack. The photos are
camera-like (sensor noise over smooth gradients, JPEG at phone sizes, one stored sideways with an
EXIF orientation, one WebP); the soundtrack is espeak-ng speech (Whisper tiny.en transcribes it);
the clip is the test-pattern speech video of ``vidlabel.demo``. Part of ``make demo`` (``vidlabel.cli``).
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any

import ffmpeg
import numpy as np
from PIL import Image

from vidlabel.demo import DemoError, make_video, speak

EXIF_ORIENTATION = 0x0112
SOUNDTRACK = "Use my code to buy these running shoes at half price."


def camera_photo(path: Path, size: tuple[int, int], seed: int, orientation: int | None = None,
                 fmt: str = "JPEG") -> Path:
    """A photo-like picture: a colour gradient with a bright disc and sensor noise, ``size`` (w, h) stored."""
    rng = np.random.default_rng(seed)
    w, h = size
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    base = np.stack([x / w * 180 + 40, y / h * 160 + 50, (x + y) / (w + h) * 120 + 60], axis=-1)
    cx, cy, r = rng.uniform(0.3, 0.7) * w, rng.uniform(0.3, 0.7) * h, min(w, h) / 5
    base[(x - cx) ** 2 + (y - cy) ** 2 < r * r] += 60
    noisy = np.clip(base + rng.normal(0, 9, base.shape), 0, 255).astype(np.uint8)
    save: dict[str, Any] = {"format": fmt, "quality": 88}
    if orientation is not None:
        exif = Image.Exif()
        exif[EXIF_ORIENTATION] = orientation
        save["exif"] = exif
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(noisy).save(path, **save)
    return path


def soundtrack(path: Path, text: str) -> float:
    """``text`` spoken by espeak-ng, encoded as AAC in an .m4a (a TikTok photo post's music track)."""
    wav = speak(text)
    try:
        (ffmpeg.input("pipe:", f="wav").output(os.fspath(path), acodec="aac", ac=1)
         .global_args("-nostdin", "-hide_banner", "-loglevel", "error").overwrite_output()
         .run(input=wav, capture_stdout=True, capture_stderr=True))
    except ffmpeg.Error as exc:
        raise DemoError(f"ffmpeg failed for {path}: {exc.stderr.decode(errors='replace').strip()}") from None
    return float(ffmpeg.probe(os.fspath(path))["format"]["duration"])


def make_mixed_set(outdir: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """Write the three mixed posts and their posts table; return the expectations per post_id."""
    outdir = Path(outdir)
    media = outdir / "media" / "mixed"
    posts: dict[str, dict[str, Any]] = {}

    photo = camera_photo(media / "photo-01.jpg", (1080, 1920), seed=1)
    posts["photo-01"] = {"post_type": "photo", "kinds": ["image"], "media": [photo], "caption": "golden hour",
                         "author": "ana", "text": None}

    slides = [camera_photo(media / "slideshow" / f"slide-{i}.jpg", (1080, 1920), seed=10 + i) for i in (1, 2, 3)]
    slides.append(camera_photo(media / "slideshow" / "slide-4.webp", (1080, 1440), seed=14, fmt="WEBP"))
    # A phone photo stored sideways with an orientation tag: shown portrait, stored landscape.
    slides.append(camera_photo(media / "slideshow" / "slide-5.jpg", (1920, 1080), seed=15, orientation=6))
    track = media / "slideshow" / "soundtrack.m4a"
    soundtrack(track, SOUNDTRACK)
    posts["slideshow-01"] = {"post_type": "slideshow", "kinds": ["image"] * 5 + ["audio"], "media": [*slides, track],
                             "caption": "new drop, link in bio", "author": "ben", "text": SOUNDTRACK}

    clip = media / "carousel" / "clip.mp4"
    make_video(clip, text="We cooked pasta with fresh tomatoes for dinner tonight.", size=(360, 640), fps=15)
    items = [camera_photo(media / "carousel" / "a.jpg", (1440, 1080), seed=21), clip,
             camera_photo(media / "carousel" / "b.jpg", (1080, 1350), seed=22)]
    posts["carousel-01"] = {"post_type": "carousel", "kinds": ["image", "video", "image"], "media": items,
                            "caption": "dinner, three ways", "author": "chloé",
                            "text": "We cooked pasta with fresh tomatoes for dinner tonight."}

    with open(outdir / "posts-mixed.csv", "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(["post_id", "media", "caption", "author"])
        for post_id, post in posts.items():
            rel = [p.relative_to(outdir).as_posix() for p in post["media"]]
            post["media"] = rel
            writer.writerow([post_id, json.dumps(rel, ensure_ascii=False), post["caption"], post["author"]])
    return posts
