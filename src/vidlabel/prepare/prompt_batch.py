"""Prompts and request ids for a whole column of posts at once (the manifest's one-video posts).

``render_prompts`` is ``vidlabel.core.prompt.render_prompt`` vectorised with Arrow kernels, checked
against it on a sample; ``request_ids`` is ``prompt.request_id`` with the constant part of the hashed
payload encoded once. At a million posts the per-row versions would dominate the manifest's time.
"""

from __future__ import annotations

import hashlib
import json
import re
import string

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from vidlabel.prepare import tokens as tk
from vidlabel.core.prompt import (
    _BLOCK_TAGS,
    NO_CAPTION,
    NO_SPEECH,
    TRANSCRIPT_UNAVAILABLE,
    render_prompt,
    render_questions,
    request_id,
)

TEXT_BATCH = 131072


def request_ids(post_ids, template: str, questions) -> list[str]:
    """``vidlabel.core.prompt.request_id`` for many posts: the constant part of the payload is encoded once.

    The payload is ``json.dumps([post_id, template, questions], sort_keys=True,
    ensure_ascii=False)``; only the post id varies. Checked against ``request_id`` on the first id
    (and any id JSON must escape goes through ``json.dumps``); a mismatch falls back to the slow path.
    """
    post_ids = [str(p) for p in post_ids]
    if not post_ids:
        return []
    tail = (", " + json.dumps([template, questions], sort_keys=True, ensure_ascii=False)[1:]).encode()
    sha = hashlib.sha256
    needs_escape = re.compile(r'["\\\x00-\x1f\u2028\u2029\x7f]').search

    def fast(pid: str) -> str:
        if needs_escape(pid):
            head = ("[" + json.dumps(pid, ensure_ascii=False)).encode()
        else:
            head = b'["' + pid.encode() + b'"'
        return sha(head + tail).hexdigest()[:24]

    probe = [post_ids[0]] + [p for p in post_ids[:1000] if needs_escape(p)][:3]
    if any(fast(p) != request_id(p, template, questions) for p in probe):
        return [request_id(p, template, questions) for p in post_ids]
    return [fast(p) for p in post_ids]


# Python's str.strip() whitespace, so that the vectorised neutralise strips exactly the same characters.
_PY_WHITESPACE = "".join(chr(i) for i in range(0x110000) if chr(i).isspace())
_FIELDS = {"caption", "transcript", "questions"}


def _neutralise(arr: pa.Array, empty: str) -> pa.Array:
    text = pc.utf8_trim(pc.fill_null(arr, ""), characters=_PY_WHITESPACE)
    for tag in _BLOCK_TAGS:
        text = pc.replace_substring(text, tag, tag.replace("<", "\u2039").replace(">", "\u203a"))
    return pc.if_else(pc.equal(pc.utf8_length(text), 0), pa.scalar(empty), text)


def render_prompts(template: str, captions: pa.Array, transcripts: pa.Array, questions,
                   available: pa.Array | None = None) -> pa.Array:
    """``vidlabel.core.prompt.render_prompt`` for a whole column, vectorised with Arrow kernels
    (``available``: False where the transcript is unavailable; default all available).

    Falls back to per-row ``render_prompt`` when the template uses anything but plain
    {caption}/{transcript}/{questions} fields, or when a sample of rows (including every kind of
    text that neutralising changes) does not match ``render_prompt`` exactly.
    """
    n = len(captions)
    captions, transcripts = captions.cast(pa.string()), transcripts.cast(pa.string())
    available = pa.array(np.ones(n, bool)) if available is None else available

    def rendered(rows) -> list[str]:
        caps, trs, avail = captions.take(rows).to_pylist(), transcripts.take(rows).to_pylist(), available.take(rows)
        return [render_prompt(template, c, t, questions, a) for c, t, a in zip(caps, trs, avail.to_pylist())]

    def per_row() -> pa.Array:
        return pa.array(rendered(pa.array(np.arange(n))), pa.string())

    try:
        parts = list(string.Formatter().parse(template))
    except ValueError:
        return per_row()
    if any(f is not None and (f not in _FIELDS or spec or conv) for _, f, spec, conv in parts) or n == 0:
        return per_row()
    values = {"caption": _neutralise(captions, NO_CAPTION),
              "transcript": pc.if_else(available, _neutralise(transcripts, NO_SPEECH), TRANSCRIPT_UNAVAILABLE),
              "questions": pa.scalar(render_questions(questions))}
    pieces = []
    for literal, field, _, _ in parts:
        if literal:
            pieces.append(pa.scalar(literal))
        if field is not None:
            pieces.append(values[field])
    if not any(isinstance(x, pa.Array) for x in pieces):
        pieces.append(pc.cast(pa.nulls(n), pa.string()).fill_null(""))
    out = pc.binary_join_element_wise(*pieces, "") if len(pieces) > 1 else pieces[0]
    # Check a sample: the first rows, and rows whose text neutralising changes (tags, edge whitespace).
    odd = pc.or_(pc.match_substring_regex(pc.fill_null(captions, ""), r"[<>]|^\s|\s$"),
                 pc.match_substring_regex(pc.fill_null(transcripts, ""), r"[<>]|^\s|\s$"))
    missing = pc.invert(available).to_numpy(zero_copy_only=False)
    sample = pa.array(list(range(min(n, 32))) + np.flatnonzero(odd.to_numpy(zero_copy_only=False))[:32].tolist()
                      + np.flatnonzero(missing)[:8].tolist(), pa.int64())
    if out.take(sample).to_pylist() != rendered(sample):
        return per_row()
    return out


def prompt_text_tokens(config: dict, captions: pa.Array, transcripts: pa.Array, available: pa.Array) -> np.ndarray:
    """Text tokens of each rendered prompt, rendered in batches and not kept."""
    c = config["classify"]
    out = [tk.estimate_text(config, render_prompts(c["prompt_template"], captions.slice(i, TEXT_BATCH),
                                                   transcripts.slice(i, TEXT_BATCH), c["questions"],
                                                   available.slice(i, TEXT_BATCH)))
           for i in range(0, len(captions), TEXT_BATCH)]
    return np.concatenate(out) if out else np.zeros(0, np.int64)
