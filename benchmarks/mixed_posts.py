"""Mixed posts for the GPU check (benchmarks/gpu_classify.py ``media --photo-posts N --carousels M``):
photo posts of 1 to 35 camera-like photos (JPEG and WebP at phone sizes, some stored sideways with an
EXIF orientation tag, half of them with a soundtrack: slideshows) and carousels of 2 to 10 images and
clips, beside the video set.

``make`` writes the photos (a pool, hard-linked per post as the videos are), the soundtracks, the
posts' rows for posts.csv (a ``media`` column: the JSON array of each post's files, in order) and
``mixed.json`` (each post's files, caption and transcripts by item).

``manifest_rows`` plans them for a manifest shard in the manifest's contract (docs/outputs.md) where
the prepare stage cannot yet (no ``post_plan.server_media_limits``): each post through the per-post
gate (``post_plan.plan_post``), photos the server would misread or that the plan shrinks written by
``images.convert_image`` at the planned size (multiples of 28 that the server leaves as they are),
labels, prompt and estimates as tests/standin/mixed.py makes them.
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


def make(work: Path, media: Path, photo_posts: int, carousels: int, clips: list[tuple[Path, float]], seed: int,
         jobs: int, words: list[str], captions: list[str]) -> tuple[list[str], list[dict]]:
    """Photos, soundtracks and posts; returns (posts.csv lines, mixed.json's posts)."""
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
    for post in posts:
        relative = [os.path.relpath(f, media.parent) for f in post["files"]]
        lines.append(f"{post['post_id']},,\"{json.dumps(relative).replace(chr(34), chr(34) * 2)}\","
                     f"{post['caption'].replace(',', ' ')}")
    (work / "mixed.json").write_text(json.dumps(posts, indent=1))
    return lines, posts


def prepare_side_has_items() -> bool:
    """The prepare stage writes manifests with items (issue 26's phase 2, vidlabel.prepare.post_plan)."""
    from vidlabel.prepare import post_plan

    return hasattr(post_plan, "server_media_limits")


def manifest_rows(config: dict, posts: list[dict], converted: Path, jobs: int) -> list[dict]:
    """Manifest rows of ``posts`` (mixed.json's) in the contract (module docstring)."""
    import sys

    sys.path.insert(0, str(REPO / "tests"))
    from standin.mixed import post_row

    from vidlabel.prepare import images, post_plan
    from vidlabel.prepare.items import probe_item

    def plan(post: dict) -> dict:
        files, transcripts = post["files"], {int(k): v for k, v in post["transcripts"].items()}
        infos = [probe_item(f) for f in files]
        first = post_row(config, post["post_id"], files, post["caption"], transcripts)
        # The clips as they are (a smaller clip would need the transcode step's files): their tokens are
        # fixed, and the gate picks the highest image bound that fits beside them.
        fixed = first["est_text_tokens"] + first["est_video_tokens"]
        photos = [post_plan.Item("image", i["width"], i["height"]) for i in infos if i["kind"] == "image"]
        decided = post_plan.plan_post(config, photos, fixed)
        if decided.action == "too_long":
            return {**first, "plan": decided.plan, "excluded": True}
        image_plans = iter(decided.items)
        sent = []
        for j, (f, info) in enumerate(zip(files, infos)):
            if info["kind"] != "image":
                sent.append(f)
                continue
            item_plan = next(image_plans)
            smaller = item_plan.max_pixels < config["planning"]["image_max_pixels"]
            if images.server_image_problem(images.probe_image(f) or {}) or smaller:
                dst = converted / f"{post['post_id']}-{j:02d}.jpg"
                if not dst.exists():
                    images.convert_image(f, dst, (item_plan.width, item_plan.height) if smaller else None)
                sent.append(str(dst))
            else:
                sent.append(f)
        row = post_row(config, post["post_id"], sent, post["caption"], transcripts)
        for item, original in zip(row["items"], files):
            item["path"] = str(Path(original).resolve())
        return {**row, "plan": decided.plan}

    converted.mkdir(parents=True, exist_ok=True)
    with cf.ThreadPoolExecutor(max_workers=max(1, jobs)) as workers:
        return list(workers.map(plan, posts))


def one_video_rows(rows: list[dict]) -> list[dict]:
    """A one-video manifest's rows in the contract: each post one unlabelled video item."""
    out = []
    for r in rows:
        item = {"index": 0, "kind": "video", "path": r.get("video_path") or r["media_path"],
                "media_path": r["media_path"], "label": None,
                "est_tokens": int(r["est_visual_tokens"]) + 2 if r.get("est_visual_tokens") is not None else None,
                "transcript_id": r.get("transcript_id")}
        out.append({**r, "items": [item], "post_type": "video", "n_videos": 1, "n_images": 0, "n_audio": 0,
                    "est_video_tokens": item["est_tokens"], "est_image_tokens": 0, "items_dropped": None})
    return out
