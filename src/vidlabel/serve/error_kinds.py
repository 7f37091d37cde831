"""What an error answer means: its ``error_kind`` (docs/outputs.md) and whether a retry may help.

The HTTP status decides whether an error may be the request's own, the message only what kind it is:

- 408, 429, 503 and 504 say "not now" whatever their text (a 429 "too many tokens per minute" is a
  rate limit, not a long prompt; a 503 "Failed to open ..." an overloaded proxy);
- a 4xx is the server refusing this request: the message's kind (``too_long``, ``encoder_cache``,
  ``too_many_items``, ``bad_media``, else ``server_error``), for good. A 400 "Request id ... already
  running." (vLLM V1 before 0.26 randomised its internal ids: a send id still running there, e.g. a
  retry racing the abort of its previous attempt) is gone on the next send;
- a 5xx is the server's failure until the evidence says otherwise: always transient here, whatever
  the message. vLLM answers some of a request's own problems with a 500 (a missing media file: "[Errno
  2] No such file or directory"; an MP4 cut after its header: "Expected there to be 1 prompt
  placeholders corresponding to 1 video items, but instead found 0 ..."), and so it answers a broken
  server (a video decoder it cannot load fails every video the same way). Such a message keeps its
  kind (``bad_media``) but not a verdict: the request's record becomes terminal only on evidence, the
  same 5xx on every attempt from a server that answers the request's peers, requests with the same
  media kinds (the client's rule, ``vidlabel.serve.client``), or a file missing here too (the media
  check). A message that names a file is about the request's media only when the file it names is
  that media: "[Errno 2] ... /dev/shm/..." is the server's own trouble;
- no status (the connection failed or dropped): ``connection``, transient.

A refused API key is neither: every request would hit it, so the job stops. Whether an error is
shared by many requests (one media kind failing on a server, limits below the plan) is decided above
the single request: ``vidlabel.serve.breaker``.

The wordings, as vLLM 0.26 writes them (``renderers/params.py``, ``v1/engine/input_processor.py``,
``entrypoints/serve/utils/api_utils.py``) and as earlier V1 releases did (the bodies measured on a
real server are in docs/serving.md, "What vLLM answers"):

- context: "This model's maximum context length is M tokens. However, you requested ...", "Input length
  (N) exceeds model's maximum context length (M).", "The decoder prompt (length N) is longer than the
  maximum model length of M." and, before 0.26, "The prompt (total length N) is too long to fit into
  the model (context length M).";
- encoder cache: "... video item with N embedding tokens, which exceeds the pre-allocated encoder cache
  size M. ..."
- items per prompt (``multimodal/processing/context.py``): "At most N image(s) may be provided in one
  prompt." (a post with more images or videos than the server's ``--limit-mm-per-prompt``);
- admission (``--max-num-queued-reqs``, a 503): "The engine is currently busy and cannot accept new
  requests." (``admission_refusal``: the server's own word that it is full, which the in-flight limit
  weighs more than an anonymous 503's, ``vidlabel.serve.limit``);
- decoded media per request (vLLM 0.33, ``multimodal/media/base.py``; 0.26 has no such cap): "Request
  decoded media exceeds VLLM_MAX_MEDIA_REQUEST_DECODE_BYTES=N (M bytes)." (``decode_cap``: a server
  setting, which vidlabel lifts for the servers it starts, ``vidlabel.serve.command.server_environment``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

MAX_RETRY_AFTER_S = 600.0  # a longer Retry-After is treated as this

_BAD_MEDIA = re.compile(
    r"no such file or directory|errno 2\b|must be a subpath of|cannot open video|failed to (?:load|open|decode)"
    r"|could not (?:open|decode|read)|invalid (?:video|media)|unsupported (?:video|media)|not a video"
    # No frame could be decoded, so the prompt lost its video placeholder (vLLM, truncated MP4).
    r"|prompt (?:placeholders|updates) corresponding to \d+ (?:video|image) items?",
    re.IGNORECASE)
_TOO_LONG = re.compile(r"maximum context length|exceeds model's maximum context|input length .* exceeds"
                       r"|prompt is too long|too long to fit into the model|too many (?:input )?tokens"
                       r"|longer than the maximum model length",
                       re.IGNORECASE)
_ID_RUNNING = re.compile(r"request id \S+ already running", re.IGNORECASE)
_ENCODER_CACHE = re.compile(r"encoder cache", re.IGNORECASE)
_DECODE_CAP = re.compile(r"VLLM_MAX_MEDIA_REQUEST_DECODE_BYTES(?:=(\d+))?")
_TOO_MANY_ITEMS = re.compile(r"at most (\d+) (image|video|audio)\(s\) may be provided", re.IGNORECASE)
# The server looked for the file and did not find it, or may not read where it is.
_CANNOT_SEE = re.compile(r"no such file or directory|errno 2\b|must be a subpath of", re.IGNORECASE)


def server_cannot_see_media(message: str) -> bool:
    """The message says the server could not find or may not read the file (not that it is broken)."""
    return bool(_CANNOT_SEE.search(message or ""))


class FatalClientError(RuntimeError):
    """An error that every request would hit (bad API key, unknown model): stop the job, not the request."""


# Paths a message names: quoted, or after "file"/"path"/"open" (vLLM's and Python's wording).
_NAMED_PATH = re.compile(r"""['"`](/[^'"`]+)['"`]|(?:file|path|open)\s+(/\S+)""", re.IGNORECASE)
# vLLM's 503 over --max-num-queued-reqs.
_ADMISSION = re.compile(r"engine is currently busy and cannot accept new requests", re.IGNORECASE)
# Statuses that mean "not now", whatever the body says.
_OVERLOADED = frozenset({429, 503})
_TIMED_OUT = frozenset({408, 504})


def named_paths(message: str) -> list[str]:
    """The file paths an error message names (quoted, or after "file", "path" or "open")."""
    return [(a or b).rstrip(".,;:)") for a, b in _NAMED_PATH.findall(message or "")]


def names_other_file(message: str, media_paths: str | Sequence[str] | None) -> bool:
    """True when ``message`` names a file path and none of the paths it names is one of ``media_paths``
    (the files the request sent)."""
    paths = [media_paths] if isinstance(media_paths, str) else list(media_paths or ())
    if not paths:
        return False
    if any(p in message for p in paths):  # verbatim: a path with spaces is cut short by the pattern
        return False
    named = named_paths(message)
    return bool(named) and not any(n == p or n.endswith(p) or p.endswith(n) for n in named for p in paths)


def admission_refusal(http_status: int | None, message: str | None) -> bool:
    """The server refused the request because its queue is full (vLLM's admission 503), not for an
    unknown reason (a proxy, a fault)."""
    return http_status == 503 and bool(_ADMISSION.search(message or ""))


def too_many_items(message: str | None) -> tuple[str, int] | None:
    """(modality, the server's limit) of a refusal for more items of a kind than it accepts, else None."""
    m = _TOO_MANY_ITEMS.search(message or "")
    return (m.group(2).lower(), int(m.group(1))) if m else None


def decode_cap_refusal(message: str | None) -> str:
    """The job's error for a refusal under vLLM 0.33's cap on a request's decoded media: a server setting that
    every request over it meets, which the plan (it bounds requests by tokens) does not know."""
    m = _DECODE_CAP.search(message or "")
    figure = f"{int(m.group(1)):,} bytes" if m and m.group(1) else "a limit"
    return (f"the server caps the decoded media of one request at {figure} (vLLM 0.33's "
            "VLLM_MAX_MEDIA_REQUEST_DECODE_BYTES: every frame it samples at the file's size, 3 bytes a pixel; its "
            f"default is about 58 s of 1080p at 2 frames a second) and refused a request: {message} Those refusals "
            "describe the server, not the posts. Restart it with VLLM_MAX_MEDIA_REQUEST_DECODE_BYTES=0 in its "
            "environment (vidlabel does so for the servers it starts unless the variable is set in the job's "
            "environment: unset it there), or pre-transcode the videos smaller (planning.transcode.enabled), "
            "then rerun.")


def classify_error(http_status: int | None, message: str,
                   media_paths: str | Sequence[str] | None = None) -> tuple[str, bool]:
    """(error_kind, transient) from the HTTP status, the kind read from the message (module docstring);
    ``media_paths`` are the files the request sent (a message naming another file is not about this
    request's media)."""
    msg = message or ""
    if http_status in _OVERLOADED:
        return "server_overloaded", True
    if http_status in _TIMED_OUT:
        return "timeout", True
    if http_status is None:
        return "connection", True
    if _ID_RUNNING.search(msg):
        return "server_error", True
    media = bool(_BAD_MEDIA.search(msg)) and not names_other_file(msg, media_paths)
    if http_status >= 500:  # the server's failure until the evidence says it is the request's
        return ("bad_media" if media else "server_error"), True
    if _ENCODER_CACHE.search(msg):
        return "encoder_cache", False
    if _DECODE_CAP.search(msg):
        return "decode_cap", False
    if _TOO_MANY_ITEMS.search(msg):
        return "too_many_items", False
    if _TOO_LONG.search(msg):
        return "too_long", False
    if media:
        return "bad_media", False
    return "server_error", False  # another 4xx: the request itself is refused; retrying will not help


def fatal_error(url: str, http_status: int, message: str) -> FatalClientError | None:
    """The job-stopping error for an answer that every request would get, else None."""
    if http_status in (401, 403):
        return FatalClientError(
            f"{url} refused the API key (HTTP {http_status}: {message}): the key or the endpoint is wrong. "
            "With classify.endpoints the key is read from the variable named by classify.api_key_env; "
            "check it and classify.endpoints, then rerun.")
    if http_status == 404 and "model" in message.lower():
        return FatalClientError(f"{url} answered HTTP 404: {message} (check classify.model)")
    if http_status == 400 and "logprobs" in message.lower():
        return FatalClientError(f"{url} refused the log-probabilities every request asks for (HTTP 400: "
                                f"{message}): lower classify.top_logprobs to what the server allows "
                                "(its --max-logprobs), or set it to 0")
    return None


def response_message(body: bytes) -> str:
    """The error message of an error answer: vLLM's {"message": ...}, OpenAI's {"error": {"message":
    ...}}, a bare {"error": "..."}, or the body's text."""
    try:
        obj = json.loads(body)
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        msg = obj.get("message") or obj.get("error") or obj.get("detail")
        if isinstance(msg, dict):
            msg = msg.get("message")
        if msg:
            return str(msg)
    return body.decode(errors="replace")[:500]


def retry_after_s(headers) -> float | None:
    """Seconds from a Retry-After (or retry-after-ms) header, at most MAX_RETRY_AFTER_S; None when
    absent or unparsable."""
    if headers is None:
        return None
    try:
        ms = headers.get("retry-after-ms")
        if ms is not None:
            return min(MAX_RETRY_AFTER_S, max(0.0, float(ms) / 1000))
        value = headers.get("retry-after")
        if value is not None:
            return min(MAX_RETRY_AFTER_S, max(0.0, float(value)))
    except (TypeError, ValueError):
        pass
    return None
