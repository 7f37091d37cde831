"""A post's media items as the classify job sends them, and the server limits the data need.

A manifest row's ``items`` (docs/outputs.md) is the post's ordered list of media items, each with its
``index``, ``kind`` (video, image or audio), ``path`` (the original file), ``media_path`` (the file
the server reads; null for audio that goes as its transcript), ``label`` ("Photo 3 of 12"), ``est_tokens``
(its prompt tokens, markers included), ``est_embeds`` (what vLLM's encoder cache holds of it), ``part``
(``sound``: the sound of video ``index``, heard as an item of its own) and ``transcript_id``. It decides
what is sent and what the answer depends on (vidlabel.serve.request). A manifest of one-video posts
(``media_path`` and no ``items``) is read as one unlabelled video item, so that such a post is sent as
it always was.

``named_item`` says which item a server error is about, where vLLM's message allows: a message that
names the file (a missing file, a path outside the allowed directory), or one about "a(n) image item
with N embedding tokens" (the encoder cache), or about the one item of its kind.

``MediaLimits`` is what the job's server must accept: the most images, videos and audio items any post
sends (``--limit-mm-per-prompt``) and the largest single item (``--max-num-batched-tokens``, from which vLLM
sizes its encoder cache). ``job_limits`` takes them from the manifest's own figures
(``vidlabel.prepare.post_plan.server_media_limits``, over the whole data set) and the job's rows.
"""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vidlabel.prepare import post_plan
from vidlabel.serve.error_kinds import named_paths

log = logging.getLogger(__name__)

# vLLM 0.26 (v1/engine/input_processor.py): "The decoder prompt contains a(n) image item with N embedding tokens"
_ITEM_EMBEDS = re.compile(r"a\(n\) (image|video|audio) item with (\d+) embedding tokens", re.IGNORECASE)
_MODALITY = re.compile(r"\b(image|video|audio)", re.IGNORECASE)
# The keys of server_media_limits that size the server (the manifest's contract).
LIMIT_KEYS = ("image", "video", "largest_item_tokens")  # and "audio", from manifests that send audio


def post_items(row: Mapping[str, Any]) -> list[dict]:
    """The row's items; a one-video manifest row (``media_path`` only) as one unlabelled video item."""
    items = row.get("items")
    if items is not None:
        return items
    path = row["media_path"]
    return [{"index": 0, "kind": "video", "path": path, "media_path": path, "label": None,
             "est_tokens": None, "est_embeds": None, "transcript_id": row.get("transcript_id")}]


def sent_items(items: Iterable[Mapping]) -> list[Mapping]:
    """The items whose file the server reads, in order: those the manifest gave a ``media_path``
    (vidlabel.prepare.post_plan.sent_kinds decides which kinds are sent: audio only to a model that hears it)."""
    return [i for i in items if i.get("media_path")]


def named_item(message: str | None, items: list[Mapping]) -> Mapping | None:
    """The item a server error is about (module docstring), else None."""
    message = message or ""
    sent = sent_items(items)
    for item in sent:  # verbatim first: a path with spaces is cut short by the path pattern
        if item["media_path"] in message:
            return item
    for named in named_paths(message):
        for item in sent:
            if item["media_path"].endswith(named) or named.endswith(item["media_path"]):
                return item
    match = _ITEM_EMBEDS.search(message)
    if match:
        kind, embeds = match.group(1).lower(), int(match.group(2))
        same = [i for i in sent if i["kind"] == kind]
        sized = [i for i in same if i.get("est_embeds") is not None and int(i["est_embeds"]) == embeds]
        if len(sized) == 1 or (sized and len({int(i["est_embeds"]) for i in sized}) == 1):
            return sized[0]
        return same[0] if len(same) == 1 else None
    kinds = {m.lower() for m in _MODALITY.findall(message)}
    candidates = [i for i in sent if i["kind"] in kinds] if len(kinds) == 1 else sent
    return candidates[0] if len(candidates) == 1 else None


@dataclass(frozen=True)
class MediaLimits:
    """What a server must accept for the data: items per kind in one prompt, and the largest item."""
    image: int = 0
    video: int = 1  # the calibration videos need one, whatever the data
    largest_item_tokens: int = 0
    audio: int = 0

    def __post_init__(self):
        object.__setattr__(self, "video", max(1, int(self.video)))

    @classmethod
    def of_rows(cls, rows: Iterable[Mapping]) -> "MediaLimits":
        image = video = audio = largest = 0
        for row in rows:
            items = post_items(row)
            counts = Counter(i["kind"] for i in sent_items(items))
            image, video, audio = max(image, counts["image"]), max(video, counts["video"]), max(audio, counts["audio"])
            largest = max([largest, *(int(i["est_tokens"]) for i in items if i.get("est_tokens") is not None)])
        return cls(image=image, video=video, largest_item_tokens=largest, audio=audio)

    def union(self, other: "MediaLimits") -> "MediaLimits":
        return MediaLimits(max(self.image, other.image), max(self.video, other.video),
                           max(self.largest_item_tokens, other.largest_item_tokens), max(self.audio, other.audio))

    @property
    def flag(self) -> str:
        """``--limit-mm-per-prompt``'s JSON (audio only where the data send it, as before audio was heard)."""
        limits = {"image": self.image, "video": self.video, **({"audio": self.audio} if self.audio else {})}
        return json.dumps(limits, separators=(",", ":"))

    def count(self, modality: str) -> int:
        return {"image": self.image, "video": self.video, "audio": self.audio}.get(modality, 0)


def manifest_limits(manifest_dir: str | Path) -> MediaLimits | None:
    """The whole data set's limits as the manifest wrote them, or None where this manifest has none."""
    try:
        found = post_plan.server_media_limits(manifest_dir)
    except FileNotFoundError:
        return None
    missing = [k for k in LIMIT_KEYS if k not in found]
    if missing:
        raise ValueError(f"server_media_limits({manifest_dir}) lacks {missing} (has {sorted(found)}): the "
                         "manifest and the classify stage disagree on its contract")
    return MediaLimits(int(found["image"]), int(found["video"]), int(found["largest_item_tokens"]),
                       int(found.get("audio", 0)))


def job_limits(rows: list[Mapping], manifest_dir: str | Path) -> MediaLimits:
    """The limits the job's server is sized for: the data set's (the manifest's), and at least what the
    job's own rows need (an older manifest wrote none)."""
    own = MediaLimits.of_rows(rows)
    data = manifest_limits(manifest_dir)
    limits = own if data is None else data.union(own)
    log.info("media limits: up to %d image(s), %d video(s) and %d audio item(s) per post, the largest item %d "
             "tokens (%s)", limits.image, limits.video, limits.audio, limits.largest_item_tokens,
             "the job's rows" if data is None else "the manifest's figures for the whole data set")
    return limits
