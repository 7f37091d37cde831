"""The request for a post of several items: each item introduced in order, then the prompt text.

``item_labels`` names every item so that a question can refer to it: "Photo 3 of 12", "Video 1 of 2"
(counted per kind, in the post's order) and, for audio, "Soundtrack transcript" ("Audio 2 of 3
transcript" where a post has several). ``message_content`` builds the user message's content list
from the manifest's ``items`` (each a mapping with ``kind``, ``media_path`` and ``label``, in the
post's order) and its ``prompt``: per image or video item its label as text, then the file as
``image_url`` or ``video_url`` (both ``file://`` URLs of ``media_path``, percent-encoded as vLLM's
media connector decodes them); the prompt (caption, the transcripts under their items' labels,
questions) last. An audio item is sent as ``audio_url`` where the model hears it (its ``media_path``, a
WAV); else it sends no part of its own (its transcript is in the prompt). An item without a label (a
manifest of one-video posts) is sent without one. A video's sound heard as its own item is labelled
after its video ("Sound of video 1 of 2").
Transcripts sit in ``<transcript>`` blocks, neutralised like today's (``transcript_block``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path

from vidlabel.core.prompt import neutralise

_NAMES = {"image": "Photo", "video": "Video", "audio": "Audio"}


def item_labels(kinds) -> list[str]:
    """A label per item, numbered within its kind in the post's order."""
    kinds = list(kinds)
    totals = Counter(kinds)
    seen: Counter = Counter()
    labels = []
    for kind in kinds:
        seen[kind] += 1
        if kind == "audio":
            labels.append("Soundtrack transcript" if totals["audio"] == 1 else
                          f"Audio {seen[kind]} of {totals[kind]} transcript")
        else:
            labels.append(f"{_NAMES[kind]} {seen[kind]} of {totals[kind]}")
    return labels


def sound_label(video_label: str) -> str:
    """The label of a video's sound, heard as an item of its own."""
    return f"Sound of {video_label[:1].lower()}{video_label[1:]}"


def transcript_block(text: str | None) -> str:
    """A transcript in its ``<transcript>`` block, neutralised so that its text cannot close it."""
    return f"<transcript>{neutralise(text) or '(no speech)'}</transcript>"


#: The content part each kind of item is sent as (an audio item only where the model hears it: a file to
#: send; else its transcript is text).
PARTS = {"image": "image_url", "video": "video_url", "audio": "audio_url"}


def message_content(items: Iterable[Mapping], prompt: str) -> list[dict]:
    """The content list of the post's user message (module docstring)."""
    content: list[dict] = []
    for item in items:
        part = PARTS.get(item["kind"])
        if part is None or not item.get("media_path"):
            continue
        if item.get("label"):
            content.append({"type": "text", "text": f"{item['label']}:"})
        # as_uri() percent-encodes spaces, quotes and non-ASCII; vLLM decodes with url2pathname.
        content.append({"type": part, part: {"url": Path(item["media_path"]).as_uri()}})
    content.append({"type": "text", "text": prompt})
    return content
