"""The request for a post of several items: each item introduced in order, then the prompt text.

``item_labels`` names every item so that a question can refer to it: "Photo 3 of 12", "Video 1 of 2"
(counted per kind, in the post's order) and, for audio, "Soundtrack transcript" ("Audio 2 of 3
transcript" where a post has several). ``message_content`` builds the user message's content list:
per item its label as text, then the image as ``image_url`` or the video as ``video_url`` (both
``file://`` URLs, percent-encoded as vLLM's media connector decodes them), a video's speech transcript
after it, an audio item as its transcript alone (Qwen2.5-VL takes no audio); the rendered prompt
(caption, questions) last. Transcripts sit in ``<transcript>`` blocks, neutralised like today's.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from vidlabel.prepare.prompt import neutralise

_NAMES = {"image": "Photo", "video": "Video", "audio": "Audio"}


@dataclass(frozen=True)
class PromptItem:
    kind: str  # video | image | audio
    path: str  # absolute path of the file the server reads (a converted one where planned)
    transcript: str | None = None  # the item's speech or soundtrack, where transcribed


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


def _block(text: str | None) -> str:
    return f"<transcript>{neutralise(text) or '(no speech)'}</transcript>"


def message_content(items: list[PromptItem], prompt: str) -> list[dict]:
    """The content list of the post's user message (module docstring)."""
    content: list[dict] = []
    for item, label in zip(items, item_labels(i.kind for i in items)):
        if item.kind == "audio":
            content.append({"type": "text", "text": f"{label}: {_block(item.transcript)}"})
            continue
        content.append({"type": "text", "text": f"{label}:"})
        url = Path(item.path).as_uri()  # as_uri() percent-encodes; vLLM decodes with url2pathname
        part = "image_url" if item.kind == "image" else "video_url"
        content.append({"type": part, part: {"url": url}})
        if item.kind == "video" and item.transcript:
            content.append({"type": "text", "text": f"{label} speech transcript: {_block(item.transcript)}"})
    content.append({"type": "text", "text": prompt})
    return content
