"""Posts of several media items: each post's plan, and the file the server reads for each item.

Shared by the transcode stage (which writes the files) and the manifest (which sends them), so that
both plan a post the same way. A post whose usable items are one video alone goes the one-video way
(``vidlabel.prepare.planning.plan_posts``, vectorised over millions of posts); every other post (a
photo, a slideshow, a carousel, several clips, audio alone) is planned here, post by post, with
``post_plan.plan_post``.

For each item the plan says what the server is sent (``ItemWork.action``):

- ``as-is``: the original file;
- ``transcode`` (a video): re-encoded at the planned frame rate and pixel bound
  (``transcode.transcode_file``) when the plan lowered them, when the server's decoder cannot read the
  original (``planning.server_media_problem`` and ``vidlabel.core.decode.unreadable``, the one-video
  rules applied to every video item), or always with ``planning.transcode.enabled``;
- ``animation`` (an animated GIF, WebP, PNG or AVIF: a video item): its frames as H.264
  (``images.convert_animation``; FFmpeg 5 cannot decode animated WebP);
- ``convert`` (an image): an upright 8-bit RGB JPEG (``images.convert_image``) where the server would
  misread the original (``images.item_image_problem``), at the planned size where the plan lowered the
  image pixel bound (multiples of the family's cell, which the server's resize keeps as they are);
- ``audio`` (an audio item, or a video's sound: part ``sound``), where the model hears audio (``classify.audio``
  native or both): 16 kHz mono 16-bit WAV (``audio.to_wav``), whose samples the model's tokens follow
  exactly. A video's sound goes as its own item after its video (vLLM 0.26 cannot take a video's audio
  within it: docs/models.md).

Items are keyed by (post_id, index, part): ``part`` is "" for the post's own items and ``sound`` for the
sound of its video ``index``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from vidlabel import families
from vidlabel.prepare import planning, post_plan
from vidlabel.prepare import tokens as tk
from vidlabel.prepare.images import ANIMATED_FORMATS, item_image_problem
from vidlabel.prepare.inventory_schema import SOUND_KINDS
from vidlabel.prepare.post_prompt import item_labels, sound_label
from vidlabel.core.prompt import TRANSCRIPT_UNAVAILABLE, render_prompt
from vidlabel.core import decode

ANIMATION_CODECS = frozenset(f.lower() for f in ANIMATED_FORMATS)
#: Transcript statuses whose text is known (``no_audio``: known to be none).
KNOWN_TRANSCRIPT = ("ok", "no_audio")
#: The part of a video item that is its sound, heard as an item of its own.
SOUND_PART = "sound"


def item_key(post_id: str, item: dict) -> tuple[str, int, str]:
    """An item's key in the transcode stage's rows: (post_id, index, part)."""
    return post_id, int(item["index"]), item.get("part") or ""


@dataclass
class MixedPost:
    """A post planned here: its usable items (inventory item rows), in order, with their labels."""

    post_id: str
    caption: str | None
    items: list[dict[str, Any]]
    labels: list[str]

    @property
    def kinds(self) -> list[str]:
        """The kinds of the post's own items (a video's sound, heard as an item, is part of its video)."""
        return [i["kind"] for i in self.items if not i.get("part")]


@dataclass(frozen=True)
class ItemWork:
    """What the transcode stage writes for one item, and why."""

    post_id: str
    index: int
    kind: str
    path: str
    action: str  # transcode | animation | convert | audio
    why: str
    fps: float = 0.0  # video targets
    width: int = 0  # video and resized image targets (0: the image keeps its size)
    height: int = 0
    trim_s: float | None = None  # a one-video post's plan may cut the video short
    plan_action: str = "replan"  # the post's plan: as-is (the file alone is the problem) or replan
    required: bool = True  # False: only planning.transcode.enabled asks for it (the original may be sent)
    part: str = ""  # SOUND_PART: the sound of video ``index``
    sample_rate: int = 0  # audio targets: the rate the model's processor reads


def split_posts(items: pa.Table, hears_audio: bool = False) -> tuple[np.ndarray, list[MixedPost]]:
    """(the item rows, among ``items`` (``inventory.items_table``), of the posts that are one usable video
    alone, the other posts with usable items). Items with a probe error are left out of both. Where the
    model hears audio (``hears_audio``), a video with sound is followed by its sound as an item of its own
    (part ``sound``), so that such a post is never one video alone."""
    # Vectorised: at a million one-video posts only the others become Python objects.
    usable = pc.and_(pc.is_valid(items.column("kind")), pc.is_null(items.column("probe_error")))
    positions = np.flatnonzero(usable.to_numpy(zero_copy_only=False))
    post_codes = pc.dictionary_encode(items.column("post_id").take(positions)).combine_chunks().indices
    codes = post_codes.to_numpy(zero_copy_only=False)
    alone = np.bincount(codes)[codes] == 1 if len(codes) else np.zeros(0, bool)
    video = (pc.equal(items.column("kind").take(positions), "video").to_numpy(zero_copy_only=False)
             if len(positions) else np.zeros(0, bool))
    if hears_audio and len(positions):
        sound = pc.fill_null(items.column("has_audio").take(positions), False).to_numpy(zero_copy_only=False)
        video = video & ~sound
    one_video = positions[alone & video]
    by_post: dict[str, list[dict]] = {}
    for row in items.take(pa.array(positions[~(alone & video)], pa.int64())).to_pylist():
        by_post.setdefault(row["post_id"], []).append(row)
    mixed = [_post(post_id, rows, hears_audio) for post_id, rows in by_post.items()]
    return one_video.astype(np.int64), mixed


def _post(post_id: str, rows: list[dict], hears_audio: bool) -> MixedPost:
    """A post of its item rows, labelled; with each video's sound after it where the model hears audio."""
    labels = item_labels(i["kind"] for i in rows)
    if not hears_audio:
        return MixedPost(post_id, rows[0]["caption"], rows, labels)
    items, named = [], []
    for row, label in zip(rows, labels):
        items.append(row)
        named.append(label)
        if row["kind"] == "video" and row.get("has_audio"):
            items.append({**row, "kind": "audio", "part": SOUND_PART})
            named.append(sound_label(label))
    return MixedPost(post_id, rows[0]["caption"], items, named)


def spoken_text(post: MixedPost, transcripts: dict[tuple[str, int], dict] | None) -> tuple[str, str]:
    """(the post's transcripts, each on a line under its item's label, the post's transcript_status).

    ``transcripts``: (post_id, item_index) -> the transcript row; None before transcription (no text).
    An item whose transcript is missing or failed says so on its line ("(transcript unavailable)");
    the post's status is then ``unavailable``, else ``ok`` where any item has a transcript, else
    ``no_audio``.
    """
    lines, statuses = [], []
    for item, label in zip(post.items, post.labels):
        if item["kind"] not in SOUND_KINDS or item.get("part") or transcripts is None:
            continue
        row = transcripts.get((post.post_id, item["index"]))
        status = row["status"] if row else None
        statuses.append(status if status in KNOWN_TRANSCRIPT else "unavailable")
        if status == "ok" and (row["text"] or "").strip():
            lines.append(f"{label}: {row['text'].strip()}")
        elif status not in KNOWN_TRANSCRIPT:
            lines.append(f"{label}: {TRANSCRIPT_UNAVAILABLE}")
    status = ("unavailable" if "unavailable" in statuses else "ok" if "ok" in statuses else "no_audio")
    return "\n".join(lines), status


def prompt_and_text_tokens(config: dict, post: MixedPost, spoken: str, allowance_s: float = 0.0) -> tuple[str, int]:
    """(the rendered prompt, the request's text tokens): the labels sent before each media item and the
    prompt, with the family's chat template (each item counts its own markers in its tokens);
    ``allowance_s`` seconds of speech stand in for transcripts not yet made. Where the model hears the
    audio and has no transcript, the prompt says the audio is attached."""
    c = config["classify"]
    prompt = render_prompt(c["prompt_template"], post.caption, spoken, c["questions"],
                           audio_attached=post_plan.hears_audio(config))
    kinds = post_plan.sent_kinds(config)
    sent = [label for item, label in zip(post.items, post.labels) if item["kind"] in kinds]
    text = int(tk.estimate_text(config, ["".join(f"{label}:" for label in sent) + prompt])[0])
    return prompt, text + int(np.ceil(allowance_s * planning.SPEECH_TOKENS_PER_S))


def sound_seconds(post: MixedPost) -> float:
    """Seconds of the post's items with sound: the speech allowance before transcription."""
    return float(sum(i["duration_s"] or 0.0 for i in post.items
                     if i["kind"] in SOUND_KINDS and not i.get("part") and i["has_audio"] is not False))


def plan_item(config: dict, item: dict) -> post_plan.Item:
    """An inventory item as the gate plans it (an audio item heard natively: its 16 kHz samples)."""
    rate = families.of_config(config).audio_rate
    return post_plan.Item(item["kind"], item["width"] or 0, item["height"] or 0, item["duration_s"] or 0,
                          item["fps"] or 0, int(round((item["duration_s"] or 0) * rate)),
                          int(item.get("header_frames") or 0))


def plan(config: dict, post: MixedPost, text_tokens: int) -> post_plan.PostPlan:
    return post_plan.plan_post(config, [plan_item(config, i) for i in post.items], text_tokens)


def video_problems(config: dict, posts: list[MixedPost]) -> dict[tuple[str, int], str]:
    """Why the server's decoder cannot be sent a video item of ``posts`` as it is, by (post_id, index)."""
    videos = [(p.post_id, i) for p in posts for i in p.items if i["kind"] == "video"]
    if not videos:
        return {}
    table = pa.Table.from_pylist([i for _, i in videos])
    formats = planning.formats_from_table(table)
    problem = planning.server_media_problem(families.of_config(config), formats.codec,
                                            table.column("duration_s").to_pylist(), table.column("fps").to_pylist())
    problem = np.where(problem == None, decode.unreadable(config, formats), problem)  # noqa: E711
    problem = np.where(problem == None, planning.sampler_frames_problem(config, formats), problem)  # noqa: E711
    return {(pid, item["index"]): why for (pid, item), why in zip(videos, problem) if why is not None}


def work(config: dict, post: MixedPost, post_plan_: post_plan.PostPlan,
         problems: dict[tuple[str, int], str]) -> list[ItemWork]:
    """The items of ``post`` that the server must not be sent as they are (module docstring)."""
    if post_plan_.action == "too_long":
        return []
    s = planning.sampling(config)
    bounds = planning.image_bounds(config)
    enabled = bool(config["planning"]["transcode"]["enabled"])
    heard = post_plan.hears_audio(config)
    out = []
    for item, planned in zip(post.items, post_plan_.items):
        key = (post.post_id, item["index"])
        if item["kind"] == "audio" and heard:
            # Always a WAV: its samples are exactly what the estimate counts, whatever the server's decoders.
            out.append(ItemWork(post.post_id, item["index"], "audio", item["path"], "audio",
                                "the video's sound, heard as an item of its own" if item.get("part") else
                                "audio heard by the model, as a WAV", plan_action=post_plan_.action,
                                part=item.get("part") or "", sample_rate=families.of_config(config).audio_rate))
        elif item["kind"] == "video":
            src_fps = item["fps"] or 0.0
            lowered = planned.max_pixels != s.max_pixels or planned.fps < min(s.fps, src_fps or s.fps) - 1e-9
            reasons = [w for w in (post_plan_.plan if lowered else None, problems.get(key)) if w]
            if not reasons and not enabled:
                continue
            fps, width, height = planning.transcode_target(config, [planned.fps], planned.max_pixels,
                                                           [item["width"] or 0], [item["height"] or 0], [src_fps],
                                                           [item["duration_s"] or 0])
            action = "animation" if (item["video_codec"] or "").lower() in ANIMATION_CODECS else "transcode"
            out.append(ItemWork(post.post_id, item["index"], "video", item["path"], action,
                                "; ".join(reasons) or "planning.transcode.enabled", float(fps[0]), int(width[0]),
                                int(height[0]), plan_action=post_plan_.action, required=bool(reasons)))
        elif item["kind"] == "image":
            lowered = planned.max_pixels < bounds.max_pixels
            why = "; ".join(w for w in (post_plan_.plan if lowered else None, item_image_problem(item)) if w)
            if why:
                out.append(ItemWork(post.post_id, item["index"], "image", item["path"], "convert", why, 0.0,
                                    planned.width if lowered else 0, planned.height if lowered else 0,
                                    plan_action=post_plan_.action))
    return out
