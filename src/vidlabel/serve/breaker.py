"""When a failure is the server's and not the request's: stop the job once, with the server's own message
and the probable cause, and journal nothing terminal for the requests it hit.

The client reports every HTTP attempt (``Breaker.attempt``); the job asks ``turn`` before it starts a
request and hands every record to ``settle`` before journaling it. The rules:

- **limits below the plan**: an encoder-cache, context or items-per-prompt refusal whose figure, read
  from vLLM's message, is below the plan's (``classify.max_num_batched_tokens`` raised to the data's
  largest item, ``classify.max_model_len``, the most images or videos a post of the data sends) trips
  at once: the server was started with other limits than the manifest was planned for (an external
  endpoint with vLLM's default flags, a server command that allows no images), and every request over
  its figure would fail the same way. A refusal at or above the planned figure is the request's own (a
  post the estimate got wrong).
- **first contact**: until the job's first answer, requests go one at a time: the next one starts
  once every request in flight has failed at least once. The same 5xx, or no answer within the
  deadline, on FIRST_CONTACT_RUN distinct requests then trips (a video decoder the server cannot
  import, an engine that died; vLLM opens its port only once the engine is up). The first request
  alone cannot decide: its video may be the one that breaks the server's decoder.
- **the media check**: before any answer, the server saying that a file which exists here is not there
  (``media_unreachable``: another mount, another ``--allowed-local-media-path``) trips at once.
- **a run**: FAILURE_RUN distinct requests failing with the same error (status and message, paths and
  numbers aside) and no answer in between trip, media errors as ``media``, others as ``server``.
- not counted: 429/503 (busy: the in-flight limit's business), connection errors (the endpoints'
  health checks decide) and attempts the stall detector cut (it cuts every one in flight at once).

Records: every error record is held until an answer shows that the server works (``settle``) and is
journaled then; a job that ends without tripping journals the held ones (fewer than a run: the
requests' own errors); once tripped nothing more is journaled, so the rerun sends those requests again.
Whether attempts count towards a request's rerun limit (``classify.RERUN_ATTEMPT_FACTOR``) is the job's
business: only where this breaker saw an answer (``answered_any``), i.e. where the failure is the
request's own.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from vidlabel.serve.items import MediaLimits
    from vidlabel.serve.settings import PlanSettings

from vidlabel.serve import decode
from vidlabel.serve.error_kinds import too_many_items

# This many distinct requests in a row failing with the same error, no answer in between: the server's
# failure, not theirs.
FAILURE_RUN = 12
# Before the job's first answer: the first request and one more, failing with the same 5xx or timeout.
FIRST_CONTACT_RUN = 2
MEDIA_KINDS = frozenset({"bad_media", "media_unreachable"})
NOT_COUNTED = frozenset({"server_overloaded", "connection"})
LIMIT_KINDS = frozenset({"too_long", "encoder_cache", "too_many_items"})

# The figures in vLLM's refusals (error_kinds.py lists the wordings).
_ENCODER_CACHE_SIZE = re.compile(r"encoder cache size \(?(\d[\d,]*)", re.IGNORECASE)
_CONTEXT = re.compile(r"maximum context length is (\d[\d,]*)|maximum context length \((\d[\d,]*)\)"
                      r"|maximum model length of (\d[\d,]*)|\(context length (\d[\d,]*)\)", re.IGNORECASE)
_NO_MODULE = re.compile(r"No module named '([\w.]+)'")
# Python module -> the package that provides it (pip), where they differ; the decoders' own modules are
# vidlabel.serve.decode's (install_hint).
PACKAGES = {"cv2": "opencv-python-headless", "av": "av", "decord": "decord"}


@dataclass(frozen=True)
class PlannedLimits:
    """The server limits the manifest was planned for."""
    context: int  # classify.max_model_len
    encoder_cache: int  # --max-num-batched-tokens (vLLM sizes its encoder cache from it)
    images: int = 0  # the most images / videos one post of the data sends (--limit-mm-per-prompt)
    videos: int = 1

    @classmethod
    def of(cls, plan: PlanSettings, media: MediaLimits | None = None) -> "PlannedLimits":
        cache = max(int(plan.max_num_batched_tokens), media.largest_item_tokens if media else 0)
        return cls(context=int(plan.max_model_len), encoder_cache=cache,
                   images=media.image if media else 0, videos=media.video if media else 1)

    def items(self, modality: str) -> int:
        return {"image": self.images, "video": self.videos}.get(modality, 0)


@dataclass(frozen=True)
class Trip:
    """Why the job stops: ``kind`` is ``server``, ``limits`` or ``media``; ``message`` says what to do."""
    kind: str
    message: str


def signature(http_status: int | None, message: str | None) -> str:
    """What the same error on several requests has in common: the status and the message, with the
    paths and numbers (a video's name, a token count) left out."""
    return f"{http_status} " + re.sub(r"(/\S+|\d+)", "_", message or "")[:200]


def server_limit(kind: str, message: str | None) -> int | None:
    """The server's own figure in a context or encoder-cache refusal (vLLM's wording), else None."""
    pattern = _ENCODER_CACHE_SIZE if kind == "encoder_cache" else _CONTEXT
    m = pattern.search(message or "")
    if not m:
        return None
    return int(next(g for g in m.groups() if g).replace(",", ""))


def below_plan(kind: str, message: str | None, plan: PlannedLimits) -> str | None:
    """The job's error when a refusal shows a server limit below the plan's, else None."""
    if kind == "too_many_items":
        found = too_many_items(message)
        if found is None or found[1] >= plan.items(found[0]):
            return None
        return items_below_plan(found[0], found[1], plan.items(found[0]), message)
    figure = server_limit(kind, message)
    if kind == "encoder_cache" and figure is not None and figure < plan.encoder_cache:
        return (f"the server's encoder cache holds {figure} tokens, below the {plan.encoder_cache} the plan assumes "
                f"(classify.max_num_batched_tokens); it refused a video: {message} Those refusals describe the "
                f"server, not the posts. Either restart the server with `--max-num-batched-tokens "
                f"{plan.encoder_cache}` (vLLM sizes its encoder cache from it; for the job's own server, in "
                f"classify.server_command), or plan for the server's limit: set `classify.max_num_batched_tokens: "
                f"{figure}` (the manifest then re-plans or excludes the videos that do not fit); then rerun.")
    if kind == "too_long" and figure is not None and figure < plan.context:
        return (f"the server's context is {figure} tokens, below the {plan.context} the plan assumes "
                f"(classify.max_model_len); it refused a request: {message} Those refusals describe the server, "
                f"not the posts. Either restart the server with `--max-model-len {plan.context}` (for the job's "
                f"own server, in classify.server_command), or plan for the server's limit: set "
                f"`classify.max_model_len: {figure}` (the manifest then re-plans or excludes what does not fit); "
                "then rerun.")
    return None


def items_below_plan(modality: str, allowed: int, needed: int, message: str | None) -> str:
    """The job's error for a server that accepts fewer images or videos per prompt than a post sends."""
    return (f"the server accepts at most {allowed} {modality}(s) per prompt, below the {needed} a post of the data "
            f"sends: {message} Those refusals describe the server, not the posts. Restart it with "
            f"`--limit-mm-per-prompt` allowing {needed} {modality}(s) (for the job's own server, keep the "
            "{limit_mm_per_prompt} field of classify.server_command; docs/serving.md), then rerun.")


def probable_media_cause(message: str | None) -> str:
    message = message or ""
    if "subpath" in message:
        return ("the server may not read where the videos are: its --allowed-local-media-path differs from the "
                "job's media_root (or the transcoded media directory)")
    if "No such file" in message or "Errno 2" in message:
        return ("the server does not see the videos at the job's paths: mount the media at the same path on the "
                "server's node (or set media_root to where the server sees it)")
    return "the server cannot decode these videos (a codec or container it does not support; see docs/planning.md)"


def probable_cause(kind: str, http_status: int | None, message: str | None) -> str:
    """The probable cause of a failure that every request hits, and what to do about it."""
    message = message or ""
    if kind in MEDIA_KINDS:
        return probable_media_cause(message)
    if hint := decode.install_hint(message):  # a planning.decode backend the server's Python lacks
        return f"the server's Python lacks the chosen video decoder: {hint}"
    if m := _NO_MODULE.search(message):
        module = m.group(1).split(".")[0]
        package = PACKAGES.get(module)
        how = f"pip install {package}" if package else f"install the package that provides {module}"
        return (f"the server's Python cannot import {module}: {how} into the server's Python (the environment "
                "`vllm` runs in), or start the server without the option that needs it (e.g. a --media-io-kwargs "
                "video backend)")
    if kind == "timeout":
        return ("the server takes requests and answers none of them: see its log (a hung engine, a GPU fault) and "
                "restart it; if requests really take that long, raise classify.request_timeout_s")
    lower = message.lower()
    if "out of memory" in lower:
        return ("the server ran out of GPU memory: see its log; lower classify.max_num_seqs or "
                "classify.gpu_memory_utilization, or give the model more GPUs")
    if "enginecore" in lower or "engine dead" in lower or "enginedead" in lower:
        return "the server's engine died: see its log (out of memory, a GPU fault) and restart it"
    if http_status is not None and 400 <= http_status < 500:
        return ("the server refuses the requests vidlabel sends: another server or vLLM version than "
                "docs/serving.md describes, or flags it lacks")
    return ("the server fails every request: its log says why (the last lines follow for the job's own "
            "server; on the server's node for classify.endpoints)")


class Breaker:
    """One job's breaker (see the module docstring). ``on_trip(trip)`` is called once, when it trips."""

    def __init__(self, plan: PlannedLimits, on_trip: Callable[[Trip], None], run_length: int = FAILURE_RUN):
        self.plan = plan
        self.on_trip = on_trip
        self.run_length = run_length
        self.answers = 0
        self.tripped: Trip | None = None
        self.failing: set[str] = set()  # requests with a failed attempt (the first-contact gate)
        self.held: list = []  # records, in the order they finished
        self._runs: dict[str, set[str]] = {}  # error signature -> distinct requests since the last answer
        self._changed = asyncio.Event()
        self._stopping = False

    @property
    def answered_any(self) -> bool:
        """The server answered a request of this job: failures from now on may be the requests' own."""
        return self.answers > 0

    # ---- attempts (from the client) -----------------------------------------------------------------
    def attempt(self, request_id: str, kind: str | None, http_status: int | None, message: str | None,
                charged: bool = True) -> None:
        """One HTTP attempt: ``kind`` None (or HTTP 200) for an answer, else its error kind."""
        if self.tripped:
            return
        if kind is None or http_status == 200:
            self.answers += 1
            self._runs.clear()
            self.wake()
            return
        self.failing.add(request_id)
        self.wake()
        if kind in NOT_COUNTED or (kind == "timeout" and not charged and self.answers):
            return
        if kind in LIMIT_KINDS:
            why = below_plan(kind, message, self.plan)
            if why:
                self.trip(Trip("limits", why))
            return
        if kind == "media_unreachable" and not self.answers:
            self.trip(Trip("media", _media_message("the first request (the media check)", message)))
            return
        group = self._runs.setdefault("timeout" if kind == "timeout" else signature(http_status, message), set())
        group.add(request_id)
        if kind in MEDIA_KINDS:
            if len(group) >= self.run_length:
                self.trip(Trip("media", _media_message(f"{len(group)} videos in a row, with no answer in between",
                                                       message)))
            return
        first_contact = not self.answers and (kind == "timeout" or (http_status or 0) >= 500)
        if len(group) >= (FIRST_CONTACT_RUN if first_contact else self.run_length):
            self.trip(Trip("server", _server_message(kind, http_status, message, len(group), first_contact)))

    # ---- the first-contact gate (from the job) ------------------------------------------------------
    def may_start(self, in_flight: set[str]) -> bool:
        """A new request may start: the server answered, or every request in flight has failed once."""
        return self.answered_any or self.tripped is not None or self._stopping or in_flight <= self.failing

    async def turn(self, in_flight: set[str]) -> None:
        """Wait until ``may_start(in_flight)``; the caller adds its request to ``in_flight`` before its
        next await, so that two waiters woken together do not both start one."""
        while not self.may_start(in_flight):
            self._changed.clear()
            await self._changed.wait()

    def stop_waiting(self) -> None:
        """The job stops sending: let every ``turn`` return."""
        self._stopping = True
        self.wake()

    def wake(self) -> None:
        self._changed.set()

    # ---- records (from the job) ---------------------------------------------------------------------
    def settle(self, rec, answered: bool) -> list:
        """The records to journal now: ``rec`` (``answered``: it holds the server's answer) and those held
        before it, or nothing while ``rec`` is held back too (see the module docstring)."""
        if self.tripped:
            return []
        if answered:
            out, self.held = [*self.held, rec], []
            return out
        self.held.append(rec)
        return []

    def release(self) -> list:
        """At the end of the job: the held records, unless it tripped."""
        out, self.held = ([] if self.tripped else self.held), []
        return out

    def trip(self, trip: Trip) -> None:
        if self.tripped:
            return
        self.tripped = trip
        self.held = []
        self.wake()
        self.on_trip(trip)


def _media_message(where: str, message: str | None) -> str:
    return (f"{where} failed with: {message} — probable cause: {probable_media_cause(message)}. Nothing was "
            "journaled for them; fix it and rerun.")


def _server_message(kind: str, http_status: int | None, message: str | None, n: int, first_contact: bool) -> str:
    if kind == "timeout":
        what = f"the server answered nothing: {n} requests ran out of time ({message})"
    elif first_contact:
        what = f"{n} requests failed the same way before any answer (HTTP {http_status}: {message})"
    else:
        what = f"{n} requests in a row failed the same way with no answer in between (HTTP {http_status}: {message})"
    return (f"{what}. Probable cause: {probable_cause(kind, http_status, message)}. Nothing was journaled for "
            "them: fix the server and rerun the same command.")
