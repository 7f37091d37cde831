"""One frozen Request (vidlabel.serve.request) from which both the request fingerprint and the HTTP body
come: every field of the type, found by walking the type itself, changes the fingerprint, and the body holds
nothing the Request does not."""

from __future__ import annotations

import dataclasses

import pytest
from standin.shards import make_config, make_video, manifest_rows

from vidlabel.serve.request import Answering, Item, Request, fields_of


def _changed(value):
    """Another value of the same shape (a string, number, tuple or None changed)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "x"
    if value is None:
        return "set"
    if isinstance(value, tuple):
        return value + (("extra", 1),)
    raise TypeError(type(value))


def _replace(obj, dotted: str):
    head, _, rest = dotted.partition(".")
    inner = getattr(obj, head)
    if rest:
        return dataclasses.replace(obj, **{head: _replace(inner, rest)})
    if head == "items":  # each item's fields too (below); here: an item more
        return dataclasses.replace(obj, items=inner + (inner[0],))
    return dataclasses.replace(obj, **{head: _changed(inner)})


@pytest.fixture
def request_(tmp_path):
    media = tmp_path / "media"
    make_video(media / "clip.mp4")
    cfg = make_config(tmp_path, media)
    (row,) = manifest_rows(cfg, [{"post_id": "p", "media_path": str(media / "clip.mp4"), "caption": "c",
                                  "transcript": "t"}])
    return row["request"]


def test_the_walk_finds_every_field_of_the_type():
    names = set(fields_of(Request(prompt="", items=(), transcript=None, plan=None,
                                  answering=Answering("", (), (), (), (), ()))))
    assert {f.name for f in dataclasses.fields(Request)} - {"answering"} <= names
    assert {f"answering.{f.name}" for f in dataclasses.fields(Answering)} <= names


def test_every_field_changes_the_fingerprint(request_):
    first = request_.fingerprint()
    assert Request(**{f.name: getattr(request_, f.name) for f in dataclasses.fields(Request)}).fingerprint() == first
    for name in fields_of(request_):
        assert _replace(request_, name).fingerprint() != first, name
    item = request_.items[0]
    for f in dataclasses.fields(Item):
        other = dataclasses.replace(item, **{f.name: _changed(getattr(item, f.name))})
        assert dataclasses.replace(request_, items=(other,)).fingerprint() != first, f"items[].{f.name}"


def test_the_body_is_made_of_the_request_alone(request_):
    body = request_.body(40)
    # What reaches the server, and where each comes from.
    assert body["model"] == request_.answering.served_model
    assert body["messages"][0]["content"][-1]["text"] == request_.prompt
    assert body["messages"][0]["content"][0]["video_url"]["url"].endswith("clip.mp4")
    assert body["max_tokens"] == 40
    assert body["response_format"]["json_schema"]["schema"]["required"] == ["promotes_product", "mentions_food"]
    assert set(body) <= {"model", "messages", "response_format", "temperature", "max_tokens", "logprobs",
                         "top_logprobs"}
    # Changing what the body carries changes the fingerprint too (the items' files, the served model).
    moved = dataclasses.replace(request_, items=(dataclasses.replace(request_.items[0], media_path="/other.mp4"),))
    assert moved.body(40) != body and moved.fingerprint() != request_.fingerprint()
