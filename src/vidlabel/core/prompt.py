"""What the model is asked: the rendered prompt, the answer schema and the request identity."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Iterable

ANSWER_CHOICES = {"yes/no": ["yes", "no"]}

# Untrusted text must not be able to close its own block and smuggle instructions after it.
_BLOCK_TAGS = ("<caption>", "</caption>", "<transcript>", "</transcript>")


def neutralise(text: str | None) -> str:
    """Make author-written text safe to place inside a delimited block."""
    text = (text or "").strip()
    for tag in _BLOCK_TAGS:
        text = text.replace(tag, tag.replace("<", "‹").replace(">", "›"))
    return text


def render_questions(questions: Iterable[dict[str, Any]]) -> str:
    lines = []
    for q in questions:
        choices = "/".join(ANSWER_CHOICES[q.get("type", "yes/no")])
        lines.append(f"- {q['id']}: {q['text']} (answer: {choices})")
    return "\n".join(lines)


NO_CAPTION = "(no caption)"
NO_SPEECH = "(no speech)"
# A post whose transcription failed for good and is classified anyway (transcribe.on_error:
# classify_without): the model must not be told that a talking video is silent.
TRANSCRIPT_UNAVAILABLE = "(transcript unavailable)"
# A model that hears the post's audio itself (classify.audio: native): nothing is transcribed, and an
# empty block must not read as silence.
AUDIO_ATTACHED = "(not transcribed: listen to the post's audio, attached above)"


def render_prompt(template: str, caption: str | None, transcript: str | None,
                  questions: list[dict[str, Any]], transcript_available: bool = True,
                  audio_attached: bool = False) -> str:
    if not transcript_available:
        said = TRANSCRIPT_UNAVAILABLE
    else:
        said = neutralise(transcript) or (AUDIO_ATTACHED if audio_attached else NO_SPEECH)
    return template.format(caption=neutralise(caption) or NO_CAPTION, transcript=said,
                           questions=render_questions(questions))


def answer_schema(questions: list[dict[str, Any]]) -> dict[str, Any]:
    """JSON schema of the answer object: one enum-valued key per question, all required."""
    return {
        "type": "object",
        "properties": {q["id"]: {"type": "string", "enum": ANSWER_CHOICES[q.get("type", "yes/no")]}
                       for q in questions},
        "required": [q["id"] for q in questions],
        "additionalProperties": False,
    }


# Tokens a byte-level BPE answer can take beyond one per byte: the end-of-sequence token and slack.
ANSWER_TOKEN_SLACK = 8


def answer_max_tokens(questions: list[dict[str, Any]]) -> int:
    """Output budget that always fits a whole answer under the answer schema.

    Under a JSON-schema grammar without free whitespace the longest valid answer is the compact
    object with every question at its longest choice. A byte-level BPE model emits at least one byte
    per token, but may pick any token path the grammar allows (random or poorly fitted weights
    spell keys a byte at a time: 27 tokens for a 52-byte answer measured on vLLM), so the bound is
    the answer's UTF-8 length plus slack. A larger budget only buys room for a runaway answer.
    """
    longest = {q["id"]: max(ANSWER_CHOICES[q.get("type", "yes/no")], key=len) for q in questions}
    compact = json.dumps(longest, separators=(",", ":"), ensure_ascii=False)
    return len(compact.encode()) + ANSWER_TOKEN_SLACK


def response_format(questions: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "json_schema",
            "json_schema": {"name": "answers", "schema": answer_schema(questions), "strict": True}}


def request_id(post_id: str, template: str, questions: list[dict[str, Any]]) -> str:
    """Stable identity of one request: a changed prompt or question set is a new request. The same for
    every model (classify.models): which model answered is in each record's request fingerprint."""
    payload = json.dumps([str(post_id), template, questions], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


def parse_answers(text: str, questions: list[dict[str, Any]]) -> dict[str, str]:
    """Parse and check the model's JSON answer; ValueError says what is wrong."""
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, TypeError) as exc:
        raise ValueError(f"answer is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ValueError("answer is not a JSON object")
    answers = {}
    for q in questions:
        choices = ANSWER_CHOICES[q.get("type", "yes/no")]
        value = obj.get(q["id"])
        if isinstance(value, str):
            value = value.strip().lower()
        if value not in choices:
            raise ValueError(f"question {q['id']!r}: answer {obj.get(q['id'])!r} is not one of {choices}")
        answers[q["id"]] = value
    return answers
