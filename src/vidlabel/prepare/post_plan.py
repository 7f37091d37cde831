"""Planning a post of several media items: tokens per item and per kind, and the context gate per post.

A post is an ordered list of items (``Item``: a video, an image or an audio file) plus its text.
``item_tokens`` estimates every item of a whole dataset at once (numpy arrays); ``plan_post`` decides
one post; ``post_type`` names its shape. All are pure functions of the (model- or plan-) resolved
config and the probed items.

Tokens per item are the model family's (vidlabel.families): a video by its loader and processor (frames
at ``planning.fps``, resized within ``planning.min_pixels``/``max_pixels``), an image within
``planning.image_min_pixels``/``image_max_pixels``, each with its markers (and, for Qwen3-VL, its
timestamps). An audio item is heard by a family that hears audio when the plan's ``classify.audio`` is
native or both (``Family.audio_tokens`` of its 16 kHz samples); otherwise it has no tokens of its own: its
transcript is text (in ``text_tokens``).

The gate (``plan_post``). The post's media tokens must fit the context left after its text and the
answer (less ``planning.ESTIMATE_MARGIN``), and each item's own tokens the server's encoder cache
(vLLM refuses a bigger item with a 400). A post that fits is planned ``as-is``. Otherwise, with
``planning.over_limit: replan``, the plan with the *most* visual tokens that still fits is chosen
among: the videos as they are or on today's ladder (fps / 2^k, pixel bound / 2^j, the same for every
video of the post), each combined with the highest image pixel bound (one for all images of the
post, in steps of one cell of the family, never below ``planning.min_pixels``) that fits what the
videos leave. Ties go to the videos' original rate and size. The chosen images are written smaller
(``vidlabel.prepare.images.convert_image`` at ``ItemPlan.width``/``height``: multiples of the family's
cell, which the server's resize leaves as they are), the videos transcoded as today. Audio is never
re-planned: a post whose audio alone does not fit is ``too_long``. Nothing fits, or ``over_limit:
exclude``: ``too_long`` with the reason, as it goes to plan.csv.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from vidlabel import families
from vidlabel.core.io import write_text
from vidlabel.prepare import planning

KINDS = ("video", "image", "audio")


@dataclass(frozen=True)
class Item:
    """One usable (probed, readable) media item of a post, as the inventory describes it."""

    kind: str
    width: float = 0.0
    height: float = 0.0
    duration_s: float = 0.0
    fps: float = 0.0  # the file's own frame rate (videos)
    samples: int = 0  # 16 kHz samples of the sound the model hears (audio items heard natively)
    frames: int = 0  # the header's frame count (videos), 0 where unknown


@dataclass
class ItemPlan:
    kind: str
    tokens: int  # prompt tokens of the item, its markers included (0 for audio that goes as a transcript)
    embeds: int  # what the item takes in the server's encoder cache
    width: int = 0  # size the server's processor resizes it to (images and videos)
    height: int = 0
    fps: float = 0.0  # frame rate of the media the server reads (videos)
    max_pixels: int = 0  # pixel bound the item is planned at (images and videos)


@dataclass
class PostPlan:
    action: str  # 'as-is' | 'replan' | 'too_long'
    plan: str  # what plan.csv says: 'as-is', what changed, or why the post is excluded
    items: list[ItemPlan]
    text_tokens: int
    tokens_by_kind: dict[str, int] = field(default_factory=dict)
    items_by_kind: dict[str, int] = field(default_factory=dict)

    @property
    def visual_tokens(self) -> int:
        return sum(p.tokens for p in self.items)

    @property
    def prompt_tokens(self) -> int:
        return self.visual_tokens + self.text_tokens


# ------------------------------------------------------------------ tokens per item

def hears_audio(config: dict) -> bool:
    """Whether the plan sends audio items for the model to hear (``classify.audio`` native or both)."""
    return config["classify"].get("audio", "transcript") != "transcript"


def sent_kinds(config: dict) -> tuple[str, ...]:
    """Kinds sent to the server as media parts (audio only where the model hears it: else as its transcript)."""
    return ("image", "video", "audio") if hears_audio(config) else ("image", "video")


def item_tokens(config: dict, kind, width, height, duration_s, fps, samples=None,
                frames=None) -> tuple[np.ndarray, np.ndarray]:
    """(prompt tokens, encoder-cache tokens) per item, for arrays of items of any number of posts.
    ``samples``: the 16 kHz samples of each audio item (heard natively); ``frames``: the header's frame
    count of each video (0: unknown)."""
    family = families.of_config(config)
    kind = np.asarray(kind, dtype=object)
    w, h = (np.nan_to_num(np.asarray(x, dtype=np.float64), nan=0.0) for x in (width, height))
    d, f = (np.nan_to_num(np.asarray(x, dtype=np.float64), nan=0.0) for x in (duration_s, fps))
    tokens = np.zeros(len(kind), dtype=np.int64)
    embeds = np.zeros(len(kind), dtype=np.int64)
    video, image = kind == "video", kind == "image"
    if video.any():
        total = None
        if frames is not None:
            header = np.nan_to_num(np.asarray(frames, dtype=np.float64), nan=0.0)[video]
            total = np.where(header > 0, header, np.round(d[video] * f[video]))
        est = planning.video_estimate(config, d[video], f[video], w[video], h[video], total)
        tokens[video], embeds[video] = est.tokens, est.embeds
    if image.any():
        bounds = planning.image_bounds(config)
        embeds[image] = family.image_embeds(w[image], h[image], bounds)
        tokens[image] = embeds[image] + family.item_markers
    audio = kind == "audio"
    if audio.any() and hears_audio(config):
        n = np.asarray(samples if samples is not None else np.round(d * family.audio_rate), dtype=np.float64)[audio]
        embeds[audio] = family.audio_embeds(n)
        tokens[audio] = family.audio_tokens(n)
    return tokens, embeds


def post_type(kinds) -> str | None:
    """video, photo, slideshow, carousel or audio, from a post's usable item kinds (None: no item).

    One video alone is a ``video`` (its own sound is part of it); images with an audio item and no
    video are a ``slideshow`` (a TikTok photo post and its track, one photo or 35); one image alone a
    ``photo``; any other mix of two or more images and videos a ``carousel``; audio alone ``audio``.
    """
    count = Counter(kinds)
    visual = count["image"] + count["video"]
    if visual == 0:
        return "audio" if count["audio"] else None
    if count["video"] == 0 and count["audio"]:
        return "slideshow"
    if visual == 1:
        return "video" if count["video"] else "photo"
    return "carousel"


# ------------------------------------------------------------------ server flags

#: Beside the manifest's shards: what the data need of the server (``server_media_limits``).
MEDIA_LIMITS_FILE = "media_limits.json"


def write_media_limits(limits: dict[str, int], manifest_dir: str | Path) -> Path:
    """Write the data's figures the server is sized for: the most images, videos and audio items one
    post sends, and its largest item's tokens (``largest_item_tokens``)."""
    path = Path(manifest_dir) / MEDIA_LIMITS_FILE
    write_text(json.dumps(limits, sort_keys=True) + "\n", path)
    return path


def server_media_limits(manifest_dir: str | Path) -> dict[str, int]:
    """The figures ``write_media_limits`` wrote for this manifest (FileNotFoundError: none)."""
    return json.loads((Path(manifest_dir) / MEDIA_LIMITS_FILE).read_text())


# ------------------------------------------------------------------ the gate

def _video_plans(config: dict, videos: list[Item], cache: int):
    """Candidate (tokens, item plans, description) for the post's videos: as they are, then the ladder."""
    s = planning.sampling(config)
    family = families.of_config(config)
    if not videos:
        yield 0, [], None
        return
    d = np.array([v.duration_s for v in videos], dtype=np.float64)
    sf = np.array([v.fps for v in videos], dtype=np.float64)
    w = np.array([v.width for v in videos], dtype=np.float64)
    h = np.array([v.height for v in videos], dtype=np.float64)
    header = np.array([v.frames for v in videos], dtype=np.float64)
    pixels, px = [], s.max_pixels
    for _ in range(planning.PIXEL_LADDER_STEPS):
        if px <= s.min_pixels:
            break
        pixels.append(int(px))
        px //= 2
    pixels.append(int(s.min_pixels))
    for k in range(planning.FPS_LADDER_STEPS):
        for px in pixels:
            f = s.fps / 2 ** k
            cf = np.where(sf > 0, np.minimum(f, sf), f)
            as_is = (k, px) == (0, s.max_pixels)
            if as_is:
                est = planning.video_estimate(config, d, sf, w, h, np.where(header > 0, header, np.round(d * sf)))
                margin = np.zeros(len(videos), np.int64)
            else:
                est = planning.media_estimate(config, d, cf, w, h, np.full(len(videos), px))
                # One frame group of margin for a transcoded file, whose frame count can round up by one.
                margin = family.group_tokens(est.height, est.width)
            embeds, tokens = est.embeds + margin, est.tokens + margin
            if (embeds > cache).any():
                continue
            plans = [ItemPlan("video", int(t), int(e), int(ew), int(eh), float(fr), px)
                     for t, e, ew, eh, fr in zip(tokens, embeds, est.width, est.height, cf)]
            change = None if as_is else f"videos fps {s.fps:g}->{f:g}, max_pixels {px}"
            yield int(tokens.sum()), plans, change


def _image_plan(config: dict, images: list[Item], room: int, cache: int):
    """The highest image pixel bound whose images fit ``room`` tokens and each the cache: (tokens, plans,
    bound), or None when even the lowest bound does not fit."""
    family = families.of_config(config)
    bounds = planning.image_bounds(config)
    cell = family.cell * family.cell  # pixels per token
    w = np.array([i.width for i in images], dtype=np.float64)
    h = np.array([i.height for i in images], dtype=np.float64)

    def at(bound):
        embeds = family.image_embeds(w, h, bounds, bound)
        return embeds, int(embeds.sum()) + family.item_markers * len(images)

    bound = bounds.max_pixels  # as they are, unless that does not fit
    embeds, total = at(bound)
    if not (total <= room and embeds.max() <= cache):
        hi = bounds.max_pixels // cell
        lo = max(1, -(-min(int(config["planning"]["min_pixels"]), bounds.max_pixels) // cell))
        embeds, total = at(lo * cell)
        if not (total <= room and embeds.max() <= cache):
            return None
        while hi - lo > 1:  # tokens never grow as the bound falls: bisect for the highest that fits
            mid = (lo + hi) // 2
            e, t = at(mid * cell)
            lo, hi = (mid, hi) if (t <= room and e.max() <= cache) else (lo, mid)
        embeds, total = at(lo * cell)
        bound = lo * cell
    rh, rw = family.image_size(w, h, bounds, bound)
    plans = [ItemPlan("image", int(e) + family.item_markers, int(e), int(x), int(y), 0.0, bound)
             for e, x, y in zip(embeds, rw, rh)]
    return total, plans, bound


def visual_budget(config: dict, text_tokens: int) -> int:
    """Most visual tokens a post may carry: the context left after its text and answer, less the margin.
    Unlike one video (``planning.visual_token_budget``), a post's items need not fit the encoder cache
    together: vLLM encodes them item by item as the prefill advances; each item must fit it alone."""
    c = config["classify"]
    return int(np.floor((c["max_model_len"] - c["max_tokens"] - int(text_tokens)) / (1 + planning.ESTIMATE_MARGIN)))


def plan_post(config: dict, items: list[Item], text_tokens: int, encoder_cache: int | None = None) -> PostPlan:
    """The context gate for one post (module docstring). ``encoder_cache``: the server's, by default
    ``classify.max_num_batched_tokens`` (the least vLLM allocates)."""
    cache = int(config["classify"]["max_num_batched_tokens"] if encoder_cache is None else encoder_cache)
    bounds = planning.image_bounds(config)
    as_is_tokens, as_is_embeds = item_tokens(config, [i.kind for i in items], [i.width for i in items],
                                             [i.height for i in items], [i.duration_s for i in items],
                                             [i.fps for i in items], [i.samples for i in items],
                                             [i.frames for i in items])
    audio = [(int(t), int(e)) for i, t, e in zip(items, as_is_tokens, as_is_embeds) if i.kind == "audio"]
    # Audio is never re-planned: what it takes comes off the room the videos and images share.
    budget = visual_budget(config, text_tokens) - sum(t for t, _ in audio)
    audio_fits = all(e <= cache for _, e in audio)
    videos = [i for i in items if i.kind == "video"]
    images = [i for i in items if i.kind == "image"]
    best = None
    for v_tokens, v_plans, v_change in (_video_plans(config, videos, cache) if audio_fits else ()):
        room = budget - v_tokens
        if room < 0:
            continue
        image = _image_plan(config, images, room, cache) if images else (0, [], bounds.max_pixels)
        if image is None:
            continue
        total = v_tokens + image[0]
        if best is None or total > best[0]:
            best = (total, v_plans, v_change, image)
        if v_change is None and image[2] == bounds.max_pixels:
            break  # fits as it is: nothing can carry more
    counts = dict(Counter(i.kind for i in items))
    if best is None or config["planning"]["over_limit"] == "exclude" and not _unchanged(best, bounds):
        plans = [ItemPlan(i.kind, int(t), int(c)) for i, t, c in zip(items, as_is_tokens, as_is_embeds)]
        return PostPlan("too_long", _too_long_text(config, items, plans, text_tokens, cache), plans, int(text_tokens),
                        _by_kind(plans), counts)
    total, v_plans, v_change, (i_tokens, i_plans, i_bound) = best
    it_v, it_i, it_a = iter(v_plans), iter(i_plans), iter(audio)
    plans = [next(it_v) if i.kind == "video" else next(it_i) if i.kind == "image" else ItemPlan("audio", *next(it_a))
             for i in items]
    if _unchanged(best, bounds):
        return PostPlan("as-is", "as-is", plans, int(text_tokens), _by_kind(plans), counts)
    changes = [c for c in (v_change, None if i_bound == bounds.max_pixels else
                           f"images max_pixels {bounds.max_pixels}->{i_bound}") if c]
    text = f"replan: {', '.join(changes)} (visual tokens {int(as_is_tokens.sum())}->{total})"
    return PostPlan("replan", text, plans, int(text_tokens), _by_kind(plans), counts)


def _unchanged(best, bounds: families.ImageBounds) -> bool:
    return best[2] is None and best[3][2] == bounds.max_pixels


def _by_kind(plans: list[ItemPlan]) -> dict[str, int]:
    out: dict[str, int] = {}
    for p in plans:
        out[p.kind] = out.get(p.kind, 0) + p.tokens
    return out


def _too_long_text(config: dict, items: list[Item], plans: list[ItemPlan], text_tokens: int, cache: int) -> str:
    by_kind = _by_kind(plans)
    parts = " + ".join(f"{by_kind[k]} {k}" for k in KINDS if by_kind.get(k)) or "0 media"
    counts = Counter(i.kind for i in items)
    shape = ", ".join(f"{counts[k]} {k}(s)" for k in KINDS if counts[k])
    over_item = [p for p in plans if p.embeds > cache]
    why = (f"estimated {parts} + {int(text_tokens)} text tokens ({shape}) exceed the limits: "
           f"{planning.limits_text(config)}")
    if over_item:
        why += f"; largest item {max(p.embeds for p in over_item)} tokens, encoder cache {cache}"
    if config["planning"]["over_limit"] == "exclude":
        return why
    floor = min(int(config["planning"]["min_pixels"]), planning.image_bounds(config).max_pixels)
    return why + f"; no lower image pixel bound (down to {floor}) or video fps/pixel plan fits"
