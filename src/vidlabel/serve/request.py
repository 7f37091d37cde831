"""One request to the server: what its answer depends on, and the body sent for it, from one frozen type.

``Request`` holds everything an answer depends on: the rendered prompt; the post's items in order (each
its kind, part, label, the file sent and that file's identity, its transcript's identity); the post's
transcript identity and its plan; and ``Answering`` (the job's part: the model served and its identity,
the server command and program, the generation settings, the answer schema, the plan's settings with the
model family and its rule version). Its ``fingerprint`` is made of every field, and its ``body`` of the
fields the server is sent, so that nothing can reach the server that the fingerprint does not cover
(tests/test_request.py changes every field of the type and sees the fingerprint change).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from vidlabel.core import identity
from vidlabel.prepare.post_prompt import message_content


def _frozen(value: Any) -> Any:
    """A JSON-like value as nested tuples (hashable, fixed order)."""
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _frozen(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


def _thawed(value: Any) -> Any:
    """The plain value of a ``_frozen`` one, pairs as dicts (for the fingerprint's JSON and the body)."""
    if isinstance(value, tuple) and value and all(isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], str)
                                                   for v in value):
        return {k: _thawed(v) for k, v in value}
    if isinstance(value, tuple):
        return [_thawed(v) for v in value]
    return value


@dataclass(frozen=True)
class Answering:
    """The job's part of every request: who answers, and how."""

    served_model: str  # the name the request asks for (the body's "model")
    model: tuple  # the model by content (vidlabel.core.identity.ModelIdentity)
    server: tuple  # the job's own server command, program and file arguments, or an external endpoint
    generation: tuple  # temperature, the answer budget, log-probabilities asked, generation config
    schema: tuple  # the response_format (the answer's JSON schema)
    plan: tuple  # the plan's settings: model family, rule version, audio, sampling, bounds, limits

    @classmethod
    def of(cls, served_model: str, model: Mapping, server: Mapping, generation: Mapping, schema: Mapping,
           plan: Mapping) -> "Answering":
        return cls(served_model, _frozen(model), _frozen(server), _frozen(generation), _frozen(schema),
                   _frozen(plan))


@dataclass(frozen=True)
class Item:
    """One item of the post as sent: what the server reads of it, and what identifies it."""

    index: int | None
    kind: str
    part: str | None
    label: str | None
    media_path: str | None  # the file sent (a file:// URL of it), None where nothing is sent (a transcript)
    media: tuple | None  # that file's identity (path, size, modification time; its SHA-256 with media_identity content)
    transcript: str | None  # the item's transcript's identity


@dataclass(frozen=True)
class Request:
    prompt: str
    items: tuple[Item, ...]
    transcript: str | None  # the post's transcript identity (a one-video post's)
    plan: str | None  # the post's plan: as-is, or what re-planning changed
    answering: Answering

    def fingerprint(self) -> str:
        """The request fingerprint (vidlabel.core.identity.answer_fingerprint) of every field."""
        a = self.answering
        media = [{"index": i.index, "kind": i.kind, "label": i.label, "media": _thawed(i.media),
                  "transcript": i.transcript, "sent": i.media_path, **({"part": i.part} if i.part else {})}
                 for i in self.items]
        return identity.answer_fingerprint(
            prompt=self.prompt, media=media, transcript=self.transcript,
            plan={"plan": self.plan, **_thawed(a.plan)},
            model={"served": a.served_model, **_thawed(a.model)}, server=_thawed(a.server),
            generation=_thawed(a.generation), schema=_thawed(a.schema))

    def messages(self) -> list[dict]:
        """The user message: each item sent introduced by its label, then the prompt."""
        items = [{"kind": i.kind, "media_path": i.media_path, "label": i.label} for i in self.items]
        return [{"role": "user", "content": message_content(items, self.prompt)}]

    def body(self, max_tokens: int) -> dict[str, Any]:
        """The chat-completion body of one attempt with ``max_tokens`` (the answer budget, or more for the
        one retry of a truncated answer)."""
        g = _thawed(self.answering.generation)
        body = {"model": self.answering.served_model, "response_format": _thawed(self.answering.schema),
                "temperature": g["temperature"], "max_tokens": int(max_tokens), "messages": self.messages()}
        body.update(g["logprobs"] or {})
        return body


def request_of(row: Mapping[str, Any], items: list[Mapping[str, Any]], media: Mapping[str, Any],
               answering: Answering) -> Request:
    """The request of a manifest row whose items are ``items`` (vidlabel.serve.items.post_items), with the
    identity of every file sent (``media``: vidlabel.core.identity.media_items)."""
    return Request(
        prompt=row["prompt"],
        items=tuple(Item(i.get("index"), i["kind"], i.get("part"), i.get("label"), i.get("media_path"),
                         _frozen(media[i["media_path"]]) if i.get("media_path") else None, i.get("transcript_id"))
                    for i in items),
        transcript=row.get("transcript_id"), plan=row.get("plan"), answering=answering)


def fields_of(value: Any) -> list[str]:
    """Every field of a Request, nested ones as dotted names (what tests/test_request.py changes one by one)."""
    out = []
    for f in dataclasses.fields(value):
        inner = getattr(value, f.name)
        if dataclasses.is_dataclass(inner):
            out += [f"{f.name}.{n}" for n in fields_of(inner)]
        else:
            out.append(f.name)
    return out
