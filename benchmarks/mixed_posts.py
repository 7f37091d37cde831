"""Mixed posts for the GPU check (benchmarks/gpu_classify.py ``media --photo-posts N --carousels M``):
photo posts of 1 to 35 camera-like photos (JPEG and WebP at phone sizes, some stored sideways with an
EXIF orientation tag, half of them with a soundtrack: slideshows) and carousels of 2 to 10 images and
clips, beside the video set.

``make`` writes the photos (a pool, hard-linked per post as the videos are), the soundtracks, the
posts' rows for posts.csv (a ``media`` column: the JSON array of each post's files, in order) and
``mixed.json`` (each post's files, caption and transcripts by item).

The workflow's own stages plan them (``gpu_classify.py prepare``: inventory, transcode, manifest).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import math
import os
import random
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# (width, height) stored, share: phone cameras (12 MP 3:4), screenshots and feeds (9:16, 4:5, square).
PHOTO_SIZES = [((3024, 4032), 0.25), ((4032, 3024), 0.15), ((1080, 1920), 0.2), ((1080, 1350), 0.15),
               ((1440, 1920), 0.1), ((2160, 3840), 0.05), ((1080, 1080), 0.1)]
SIDEWAYS_SHARE = 0.25  # of the 4032x3024 stored photos: a portrait shot, EXIF orientation 6
WEBP_SHARE = 0.3
PHOTOS_PER_POST = (1, 35)
CAROUSEL_ITEMS = (2, 10)
SONG_SECONDS = (8.0, 30.0)
CAROUSEL_CLIP_MAX_S = 15.0  # a carousel's clips are short (the longest of the set would fill the context alone)
CAROUSEL_CLIPS_S = 24.0  # and hold this much video at most, so that the gate keeps them as they are


def _photo(args) -> Path:
    from vidlabel.demo_mixed import camera_photo

    path, size, seed, orientation, fmt = args
    if not path.exists():
        tmp = path.with_name(f".part-{path.name}")
        camera_photo(tmp, size, seed, orientation, fmt)
        tmp.rename(path)
    return path


def _song(path: Path, seconds: float, seed: int) -> Path:
    if not path.exists():
        tmp = path.with_name(f".part-{path.name}")
        subprocess.run(["ffmpeg", "-nostdin", "-v", "error", "-y", "-f", "lavfi", "-i",
                        f"anoisesrc=color=pink:amplitude=0.1:sample_rate=44100:duration={seconds:.2f}:seed={seed}",
                        "-c:a", "aac", "-b:a", "96k", "-f", "mp4", str(tmp)], check=True, capture_output=True)
        tmp.rename(path)
    return path


def _voice(path: Path, clip: Path) -> Path:
    """A clip's sound alone (its AAC track copied), as a voice note or podcast post holds it."""
    if not path.exists():
        tmp = path.with_name(f".part-{path.name}")
        subprocess.run(["ffmpeg", "-nostdin", "-v", "error", "-y", "-i", str(clip), "-vn", "-c:a", "copy", "-f", "mp4",
                        str(tmp)], check=True, capture_output=True)
        tmp.rename(path)
    return path


def make(work: Path, media: Path, photo_posts: int, carousels: int, clips: list[tuple[Path, float]], seed: int,
         jobs: int, words: list[str], captions: list[str], audio_posts: int = 0) -> tuple[list[str], list[dict]]:
    """Photos, soundtracks, voice notes and posts; returns (posts.csv lines, mixed.json's posts)."""
    rng = random.Random(seed)
    pool_dir = media / "photos"
    pool_dir.mkdir(parents=True, exist_ok=True)
    sizes, weights = zip(*PHOTO_SIZES)
    pool = []
    for i in range(max(8, min(80, (photo_posts + carousels) // 2))):
        size = rng.choices(sizes, weights)[0]
        orientation = 6 if size == (4032, 3024) and rng.random() < SIDEWAYS_SHARE else None
        fmt = "WEBP" if rng.random() < WEBP_SHARE else "JPEG"
        pool.append((pool_dir / f"photo{i:03d}-{size[0]}x{size[1]}{'-rot6' if orientation else ''}."
                     f"{'webp' if fmt == 'WEBP' else 'jpg'}", size, seed * 1000 + i, orientation, fmt))
    with cf.ThreadPoolExecutor(max_workers=max(1, jobs)) as workers:
        photos = list(workers.map(_photo, pool))
    lines, posts = [], []

    def linked(src: Path, name: str) -> Path:
        dst = media / "mixed" / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        if not dst.exists():
            os.link(src, dst)
        return dst

    def say(seconds: float) -> str:
        return " ".join(rng.choice(words) for _ in range(max(3, int(seconds * 2.5 * rng.uniform(0.3, 1.2)))))

    for p in range(photo_posts):
        n = round(math.exp(rng.uniform(math.log(PHOTOS_PER_POST[0]), math.log(PHOTOS_PER_POST[1]))))
        pid = f"photos{p:04d}"
        files = [linked(src, f"{pid}-{j:02d}{src.suffix}") for j, src in enumerate(rng.choice(photos) for _ in range(n))]
        transcripts = {}
        if rng.random() < 0.5:  # a TikTok photo post: its photos and a music track (a slideshow)
            seconds = rng.uniform(*SONG_SECONDS)
            files.append(_song(media / "mixed" / f"{pid}-song.m4a", seconds, seed * 1000 + p))
            transcripts[len(files) - 1] = say(seconds)
        posts.append({"post_id": pid, "files": [str(f) for f in files], "caption": captions[p % len(captions)],
                      "transcripts": transcripts})
    short = [c for c in clips if c[1] <= CAROUSEL_CLIP_MAX_S] or sorted(clips, key=lambda c: c[1])[:1]
    for c in range(carousels):
        n = rng.randint(*CAROUSEL_ITEMS)
        pid = f"carousel{c:04d}"
        files, transcripts, video_s = [], {}, 0.0
        for j in range(n):
            clip = rng.choice(short) if short and rng.random() < 0.35 else None
            if clip and video_s + clip[1] <= CAROUSEL_CLIPS_S:
                src, seconds = clip
                video_s += seconds
                transcripts[j] = say(seconds)
            else:
                src = rng.choice(photos)
            files.append(linked(src, f"{pid}-{j:02d}{src.suffix}"))
        posts.append({"post_id": pid, "files": [str(f) for f in files], "caption": captions[c % len(captions)],
                      "transcripts": transcripts})
    for a in range(audio_posts if clips else 0):  # the sound of a clip alone: speech, as the model hears it
        clip, seconds = clips[rng.randrange(len(clips))]
        pid = f"audio{a:04d}"
        files = [_voice(media / "mixed" / f"{pid}.m4a", clip)]
        posts.append({"post_id": pid, "files": [str(f) for f in files], "caption": captions[a % len(captions)],
                      "transcripts": {0: say(seconds)}})
    for post in posts:
        relative = [os.path.relpath(f, media.parent) for f in post["files"]]
        lines.append(f"{post['post_id']},,\"{json.dumps(relative).replace(chr(34), chr(34) * 2)}\","
                     f"{post['caption'].replace(',', ' ')}")
    (work / "mixed.json").write_text(json.dumps(posts, indent=1))
    return lines, posts
