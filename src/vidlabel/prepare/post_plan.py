"""Planning a post of several media items: tokens per item and per kind, and the context gate per post.

A post is an ordered list of items (``Item``: a video, an image or an audio file) plus its text.
``item_tokens`` estimates every item of a whole dataset at once (numpy arrays); ``plan_post`` decides
one post; ``post_type`` names its shape; ``mm_limits`` and ``encoder_cache_size`` give the server flags
the data need. All are pure functions of the validated config and the probed items.

Tokens per item (``vidlabel.prepare.tokens``): a video by the model family's rule (frames at
``planning.fps``, frames resized within ``planning.min_pixels``/``max_pixels``), an image
``(H'/28)*(W'/28)`` within ``planning.image_min_pixels``/``image_max_pixels``; each of them plus its two
vision marker tokens. An audio item has no visual tokens: its transcript is text (in ``text_tokens``).

The gate (``plan_post``). The post's visual tokens must fit the context left after its text and the
answer (less ``planning.ESTIMATE_MARGIN``), and each item's own tokens the server's encoder cache
(vLLM refuses a bigger item with a 400). A post that fits is planned ``as-is``. Otherwise, with
``planning.over_limit: replan``, the plan with the *most* visual tokens that still fits is chosen
among: the videos as they are or on today's ladder (fps / 2^k, pixel bound / 2^j, the same for every
video of the post), each combined with the highest image pixel bound (one for all images of the
post, in steps of one 28x28 cell, never below ``planning.min_pixels``, the least a video frame gets)
that fits what the videos leave. Ties go to the videos' original rate and size. The chosen images are
written smaller (``vidlabel.prepare.images.convert_image`` at ``ItemPlan.width``/``height``: multiples
of 28 that the server's resize leaves as they are), the videos transcoded as today. Nothing fits, or
``over_limit: exclude``: ``too_long`` with the reason, as it goes to plan.csv.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from vidlabel.core.io import write_text
from vidlabel.prepare import planning
from vidlabel.prepare import tokens as tk

KINDS = ("video", "image", "audio")
#: Kinds sent to the server as media parts (audio goes as its transcript).
SENT_KINDS = ("image", "video")
CELL = tk.FACTOR * tk.FACTOR  # pixels per token cell
PROFILER_VIDEO_FRAMES = 14  # vLLM models/qwen2_vl.py: _MAX_FRAMES_PER_VIDEO


@dataclass(frozen=True)
class Item:
    """One usable (probed, readable) media item of a post, as the inventory describes it."""

    kind: str
    width: float = 0.0
    height: float = 0.0
    duration_s: float = 0.0
    fps: float = 0.0  # the file's own frame rate (videos)


@dataclass
class ItemPlan:
    kind: str
    tokens: int  # prompt tokens of the item: cells plus its vision markers (0 for audio)
    cells: int  # what the item takes in the server's encoder cache
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

def item_tokens(config: dict, kind, width, height, duration_s, fps) -> tuple[np.ndarray, np.ndarray]:
    """(prompt tokens, encoder-cache cells) per item, for arrays of items of any number of posts."""
    kind = np.asarray(kind, dtype=object)
    w, h = (np.nan_to_num(np.asarray(x, dtype=np.float64), nan=0.0) for x in (width, height))
    d, f = (np.nan_to_num(np.asarray(x, dtype=np.float64), nan=0.0) for x in (duration_s, fps))
    cells = np.zeros(len(kind), dtype=np.int64)
    video, image = kind == "video", kind == "image"
    if video.any():
        cells[video] = tk.estimate_visual(config, d[video], f[video], w[video], h[video]).tokens
    if image.any():
        cells[image] = tk.image_cells(w[image], h[image], tk.ImageBounds.from_config(config))
    markers = np.where(video | image, tk.IMAGE_MARKER_TOKENS, 0)
    return cells + markers, cells


def tokens_per_post(post_index, kind, tokens, n_posts: int) -> dict[str, np.ndarray]:
    """Per post and kind, the sum of item tokens (``post_index``: the post of each item, 0..n_posts-1)."""
    kind = np.asarray(kind, dtype=object)
    post_index = np.asarray(post_index, dtype=np.int64)
    tokens = np.asarray(tokens, dtype=np.float64)
    return {k: np.bincount(post_index[kind == k], weights=tokens[kind == k], minlength=n_posts).astype(np.int64)
            for k in KINDS}


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

def mm_limits(kinds_per_post) -> dict[str, int]:
    """``--limit-mm-per-prompt``: the most images and the most videos any one post sends."""
    limits = {"image": 0, "video": 0}
    for kinds in kinds_per_post:
        count = Counter(kinds)
        for k in SENT_KINDS:
            limits[k] = max(limits[k], count[k])
    return limits


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


def profiled_item_cells(config: dict, limits: dict[str, int]) -> dict[str, int]:
    """The largest item per modality vLLM's profiler assumes (modalities with a limit above 0):
    an image of the largest square the image bound allows, a video of 14 such frames at the video
    bound (``models/qwen2_vl.py``: ``get_image_size_with_most_features``, ``_MAX_FRAMES_PER_VIDEO``)."""
    p = config["planning"]
    out = {}
    if limits.get("image", 0) > 0:
        side = int(np.sqrt(p["image_max_pixels"]) // tk.FACTOR)
        out["image"] = side * side
    if limits.get("video", 0) > 0:
        side = int(np.sqrt(p["max_pixels"]) // tk.FACTOR)
        out["video"] = (PROFILER_VIDEO_FRAMES // tk.TEMPORAL_PATCH) * side * side
    return out


def encoder_cache_size(config: dict, limits: dict[str, int]) -> int:
    """What vLLM allocates: max(``--max-num-batched-tokens``, the profiler's largest item)
    (``v1/core/encoder_cache_manager.py: compute_mm_encoder_budget``)."""
    return max([int(config["classify"]["max_num_batched_tokens"]), *profiled_item_cells(config, limits).values()])


def batched_tokens_for(config: dict, largest_item_cells: int) -> int:
    """``--max-num-batched-tokens`` that lets the encoder cache hold the data's largest planned item."""
    return max(int(config["classify"]["max_num_batched_tokens"]), int(largest_item_cells))


# ------------------------------------------------------------------ the gate

def _video_plans(config: dict, videos: list[Item], cache: int):
    """Candidate (tokens, item plans, description) for the post's videos: as they are, then the ladder."""
    s = tk.Sampling.from_config(config)
    if not videos:
        yield 0, [], None
        return
    d = np.array([v.duration_s for v in videos], dtype=np.float64)
    sf = np.array([v.fps for v in videos], dtype=np.float64)
    w = np.array([v.width for v in videos], dtype=np.float64)
    h = np.array([v.height for v in videos], dtype=np.float64)
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
            est = planning.media_estimate(config, d, cf, w, h, None if (k, px) == (0, s.max_pixels) else
                                          np.full(len(videos), px))
            # One frame pair of margin for a transcoded file, whose frame count can round up by one.
            pair = 0 if (k, px) == (0, s.max_pixels) else est.height // tk.FACTOR * (est.width // tk.FACTOR)
            cells = est.tokens + pair
            if (cells > cache).any():
                continue
            plans = [ItemPlan("video", int(c) + tk.IMAGE_MARKER_TOKENS, int(c), int(ew), int(eh), float(fr), px)
                     for c, ew, eh, fr in zip(cells, est.width, est.height, cf)]
            change = None if (k, px) == (0, s.max_pixels) else f"videos fps {s.fps:g}->{f:g}, max_pixels {px}"
            yield int(cells.sum()) + tk.IMAGE_MARKER_TOKENS * len(videos), plans, change


def _image_plan(config: dict, images: list[Item], room: int, cache: int):
    """The highest image pixel bound whose images fit ``room`` tokens and each the cache: (tokens, plans,
    bound), or None when even the lowest bound does not fit."""
    bounds = tk.ImageBounds.from_config(config)
    w = np.array([i.width for i in images], dtype=np.float64)
    h = np.array([i.height for i in images], dtype=np.float64)

    def at(n_cells: int):
        cells = tk.image_cells(w, h, bounds, n_cells * CELL)
        return cells, int(cells.sum()) + tk.IMAGE_MARKER_TOKENS * len(images)

    cells = tk.image_cells(w, h, bounds)
    total = int(cells.sum()) + tk.IMAGE_MARKER_TOKENS * len(images)
    bound = bounds.max_pixels  # as they are, unless that does not fit
    if not (total <= room and cells.max() <= cache):
        hi = bounds.max_pixels // CELL
        lo = max(1, -(-min(int(config["planning"]["min_pixels"]), bounds.max_pixels) // CELL))
        cells, total = at(lo)
        if not (total <= room and cells.max() <= cache):
            return None
        while hi - lo > 1:  # tokens never grow as the bound falls: bisect for the highest that fits
            mid = (lo + hi) // 2
            c, t = at(mid)
            lo, hi = (mid, hi) if (t <= room and c.max() <= cache) else (lo, mid)
        cells, total = at(lo)
        bound = lo * CELL
    rh, rw = tk.smart_resize(h, w, bounds.min_pixels, bound)
    plans = [ItemPlan("image", int(c) + tk.IMAGE_MARKER_TOKENS, int(c), int(x), int(y), 0.0, bound)
             for c, x, y in zip(cells, rw, rh)]
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
    budget = visual_budget(config, text_tokens)
    bounds = tk.ImageBounds.from_config(config)
    videos = [i for i in items if i.kind == "video"]
    images = [i for i in items if i.kind == "image"]
    best = None
    for v_tokens, v_plans, v_change in _video_plans(config, videos, cache):
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
    as_is_tokens, as_is_cells = item_tokens(config, [i.kind for i in items], [i.width for i in items],
                                            [i.height for i in items], [i.duration_s for i in items],
                                            [i.fps for i in items])
    counts = dict(Counter(i.kind for i in items))
    if best is None or config["planning"]["over_limit"] == "exclude" and not _unchanged(best, bounds):
        plans = [ItemPlan(i.kind, int(t), int(c)) for i, t, c in zip(items, as_is_tokens, as_is_cells)]
        return PostPlan("too_long", _too_long_text(config, items, plans, text_tokens, cache), plans, int(text_tokens),
                        _by_kind(plans), counts)
    total, v_plans, v_change, (i_tokens, i_plans, i_bound) = best
    it_v, it_i = iter(v_plans), iter(i_plans)
    plans = [next(it_v) if i.kind == "video" else next(it_i) if i.kind == "image" else ItemPlan("audio", 0, 0)
             for i in items]
    if _unchanged(best, bounds):
        return PostPlan("as-is", "as-is", plans, int(text_tokens), _by_kind(plans), counts)
    changes = [c for c in (v_change, None if i_bound == bounds.max_pixels else
                           f"images max_pixels {bounds.max_pixels}->{i_bound}") if c]
    text = f"replan: {', '.join(changes)} (visual tokens {int(as_is_tokens.sum())}->{total})"
    return PostPlan("replan", text, plans, int(text_tokens), _by_kind(plans), counts)


def _unchanged(best, bounds: tk.ImageBounds) -> bool:
    return best[2] is None and best[3][2] == bounds.max_pixels


def _by_kind(plans: list[ItemPlan]) -> dict[str, int]:
    out: dict[str, int] = {}
    for p in plans:
        out[p.kind] = out.get(p.kind, 0) + p.tokens
    return out


def _too_long_text(config: dict, items: list[Item], plans: list[ItemPlan], text_tokens: int, cache: int) -> str:
    by_kind = _by_kind(plans)
    parts = " + ".join(f"{by_kind[k]} {k}" for k in SENT_KINDS if k in by_kind) or "0 visual"
    counts = Counter(i.kind for i in items)
    shape = ", ".join(f"{counts[k]} {k}(s)" for k in KINDS if counts[k])
    over_item = [p for p in plans if p.cells > cache]
    why = (f"estimated {parts} + {int(text_tokens)} text tokens ({shape}) exceed the limits: "
           f"{planning.limits_text(config)}")
    if over_item:
        why += f"; largest item {max(p.cells for p in over_item)} tokens, encoder cache {cache}"
    if config["planning"]["over_limit"] == "exclude":
        return why
    floor = min(int(config["planning"]["min_pixels"]), tk.ImageBounds.from_config(config).max_pixels)
    return why + f"; no lower image pixel bound (down to {floor}) or video fps/pixel plan fits"
