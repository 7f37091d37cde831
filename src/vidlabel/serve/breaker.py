"""When a failure is the server's and not the request's: stop the job once, with the server's own message
and the probable cause, and journal nothing terminal for the requests it hit.

Failures are judged by what they share, not only by their order: the same error (status and message,
paths and numbers aside), on the same server (endpoint), for requests of the same media kind (a
request's kinds are those of the items it sends: ``video``, ``image``, or ``text`` for none). A
server whose video decoder cannot load answers every photo post and fails every video post with the
same 500; photo answers in between say nothing about the videos, so they do not reset the videos'
count. What the server answered is the evidence (``Evidence``): a kind is *proven* on a server once it
answered a request with that kind there.

The client reports every HTTP attempt (``Breaker.attempt``); the job asks ``turn`` before it starts a
request and hands every record to ``settle`` before journaling it. The rules:

- **limits below the plan**: a refusal for vLLM 0.33's cap on a request's decoded media (the plan has
  none), or an encoder-cache, context or items-per-prompt refusal whose figure, read
  from vLLM's message, is below the plan's (``classify.max_num_batched_tokens`` raised to the data's
  largest item, ``classify.max_model_len``, the most images or videos a post of the data sends) trips
  at once: the server was started with other limits than the manifest was planned for (an external
  endpoint with vLLM's default flags, a server command that allows no images), and every request over
  its figure would fail the same way. A refusal at or above the planned figure is the request's own (a
  post the estimate got wrong).
- **a kind the server has not shown it handles**: FIRST_CONTACT_RUN distinct requests of one kind
  failing the same way on a server that has answered no request of that kind trip, whatever it
  answered of other kinds and in whatever order the kinds come (a video decoder that cannot load, an
  engine that died, a server that drops the connection of every video). Before any answer at all this
  is the first contact: requests go one at a time then (the next one starts once every request in
  flight has failed at least once; vLLM opens its port only once the engine is up). The first request
  alone cannot decide: its video may be the one that breaks the server's decoder.
- **a run**: on a server that has answered a kind, FAILURE_RUN distinct requests of that kind failing
  the same way with no answer of that kind there in between trip (a codec the server stopped reading,
  media that vanished mid-shard).
- **the media check**: the server saying that a file which exists here is not there
  (``media_unreachable``: another mount, another ``--allowed-local-media-path``) before it answered a
  request of that kind trips at once.
- **dropped connections**: a connection dropped mid-request counts as that request's failure once the
  same server answers another request afterwards, or is still up (its health checks pass) when the job
  ends (``confirm_drops``): it is up, so the drop was about the request. A server that went away
  answers nothing more, and the endpoints' health checks decide about it.
- not counted: 429/503 (busy: the in-flight limit's business), refused connections (the endpoints'
  health checks) and attempts the stall detector cut (it cuts every one in flight at once).

Trips are ``media`` when the shared error is about the media (``bad_media``, ``media_unreachable``),
else ``server``, or ``limits`` (above).

Records: every error record is held until the server answered a request of each of its kinds after it
(``settle``) and is journaled then; a job that ends without tripping journals the held ones (fewer
than a run: the requests' own errors, or undecided and so retryable); once tripped no error is
journaled, so the rerun sends those requests again (an answer still is). Whether a failure may be
charged to the request (``classify.RERUN_ATTEMPT_FACTOR``, the client's same-5xx rule) is decided on
the same evidence: only where a server answered requests of its kinds (``Evidence.proven``,
``Evidence.peers``).
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable

if TYPE_CHECKING:
    from vidlabel.serve.items import MediaLimits
    from vidlabel.serve.settings import PlanSettings

from vidlabel.core import decode
from vidlabel.serve.error_kinds import decode_cap_refusal, too_many_items
from vidlabel.serve.items import sent_items

# This many distinct requests of one kind in a row failing with the same error on a server, no answer of
# that kind there in between: the server's failure, not theirs.
FAILURE_RUN = 12
# Before a server answered a request of a kind (before any answer: the first contact): the first request
# of that kind and one more, failing the same way.
FIRST_CONTACT_RUN = 2
MEDIA_KINDS = frozenset({"bad_media", "media_unreachable"})
TEXT_ONLY = frozenset({"text"})
ANY_KIND = "any"  # the group of every request, whatever its kinds, before the job's first answer
KIND_WORDS = {"video": "requests with a video", "image": "requests with an image", "text": "requests without media",
              ANY_KIND: "requests"}
LIMIT_KINDS = frozenset({"too_long", "encoder_cache", "too_many_items", "decode_cap"})

# The figures in vLLM's refusals (error_kinds.py lists the wordings).
_ENCODER_CACHE_SIZE = re.compile(r"encoder cache size \(?(\d[\d,]*)", re.IGNORECASE)
_CONTEXT = re.compile(r"maximum context length is (\d[\d,]*)|maximum context length \((\d[\d,]*)\)"
                      r"|maximum model length of (\d[\d,]*)|\(context length (\d[\d,]*)\)", re.IGNORECASE)
_NO_MODULE = re.compile(r"No module named '([\w.]+)'")
# Python module -> the package that provides it (pip), where they differ; the decoders' own modules are
# vidlabel.core.decode's (install_hint).
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
    if kind == "decode_cap":  # the plan has no such cap: it bounds each request by tokens, not decoded bytes
        return decode_cap_refusal(message)
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


def request_kinds(items) -> frozenset[str]:
    """The media kinds a request sends (``video``, ``image``), or ``text`` for a request without media:
    what its failures are compared by."""
    return frozenset(i["kind"] for i in sent_items(items)) or TEXT_ONLY


def kinds_in_words(kind: str) -> str:
    return KIND_WORDS.get(kind, f"requests with {kind}")


class Evidence:
    """What each server answered, by media kind: the evidence that a failure may be a request's own."""

    def __init__(self) -> None:
        self._answers: Counter[tuple[str | None, str]] = Counter()
        self._anywhere: Counter[str] = Counter()

    def answered(self, server: str | None, kinds: frozenset[str]) -> None:
        for kind in kinds:
            self._answers[(server, kind)] += 1
            self._anywhere[kind] += 1

    def peers(self, server: str | None, kinds: frozenset[str]) -> int:
        """Requests answered on ``server`` for the kind of ``kinds`` it answered least."""
        return min(self._answers[(server, k)] for k in kinds) if kinds else 0

    def proven(self, kinds: frozenset[str], server: str | None = None) -> bool:
        """Every kind of ``kinds`` was answered (on ``server``; None: on any server of the job)."""
        if server is None:
            return all(self._anywhere[k] for k in kinds)
        return all(self._answers[(server, k)] for k in kinds)

    def others(self, server: str | None, kind: str) -> int:
        """Answers on ``server`` for requests of other kinds."""
        return sum(n for (s, k), n in self._answers.items() if s == server and k != kind)


@dataclass
class _Group:
    """Distinct requests of one kind failing the same way on one server since its last answer of that kind."""
    requests: set[str]
    kind: str  # the error kind of the last failure
    http_status: int | None
    message: str | None


class Breaker:
    """One job's breaker (see the module docstring). ``on_trip(trip)`` is called once, when it trips.
    Without ``plan`` no limits are checked; without ``on_trip`` it only keeps the evidence (a client
    used outside a job)."""

    def __init__(self, plan: PlannedLimits | None = None, on_trip: Callable[[Trip], None] | None = None,
                 run_length: int = FAILURE_RUN):
        self.plan = plan
        self.on_trip = on_trip
        self.run_length = run_length
        self.answers = 0
        self.evidence = Evidence()
        self.tripped: Trip | None = None
        self.failing: set[str] = set()  # requests with a failed attempt (the first-contact gate)
        self.held: list[tuple[object, set[str]]] = []  # (record, kinds not answered since), in finishing order
        self._groups: dict[tuple[str | None, str, str], _Group] = {}  # (server, media kind, signature)
        self._dropped: dict[str | None, list[tuple[str, frozenset[str], str | None]]] = {}  # awaiting an answer
        self._changed = asyncio.Event()
        self._stopping = False

    @property
    def answered_any(self) -> bool:
        """The server answered a request of this job."""
        return self.answers > 0

    # ---- attempts (from the client) -----------------------------------------------------------------
    def attempt(self, request_id: str, kind: str | None, http_status: int | None, message: str | None,
                charged: bool = True, *, kinds: frozenset[str] = TEXT_ONLY, server: str | None = None) -> None:
        """One HTTP attempt of a request sending ``kinds``, to ``server``: ``kind`` None (or HTTP 200) for
        an answer, else its error kind."""
        if kind is None or http_status == 200:
            self.answers += 1
            self.evidence.answered(server, kinds)
            if self.tripped:
                return
            for key in [k for k in self._groups if k[0] == server and (k[1] in kinds or k[1] == ANY_KIND)]:
                del self._groups[key]
            for dropped_id, dropped_kinds, dropped_message in self._dropped.pop(server, []):
                if dropped_id != request_id:  # the server is up: the drop was about that request
                    self._count(dropped_id, dropped_kinds, server, "connection", None, dropped_message)
            self.wake()
            return
        if self.tripped:
            return
        self.failing.add(request_id)
        self.wake()
        if kind == "server_overloaded" or (kind == "timeout" and not charged and self.answers):
            return
        if kind == "connection":
            if charged:  # dropped mid-request (a refused connection is the endpoints' business)
                self._dropped.setdefault(server, []).append((request_id, kinds, message))
            return
        if kind in LIMIT_KINDS:
            why = below_plan(kind, message, self.plan) if self.plan is not None else None
            if why:
                self.trip(Trip("limits", why))
            return
        if kind == "media_unreachable" and not self.evidence.proven(kinds, server):
            self.trip(Trip("media", _media_message("the first request (the media check)", message)))
            return
        self._count(request_id, kinds, server, kind, http_status, message)

    def _count(self, request_id: str, kinds: frozenset[str], server: str | None, kind: str,
               http_status: int | None, message: str | None) -> None:
        sig = kind if kind in ("timeout", "connection") else signature(http_status, message)
        # Before any answer at all, requests of different kinds failing alike count together too.
        for media_kind in sorted(kinds) + ([ANY_KIND] if not self.answers else []):
            group = self._groups.setdefault((server, media_kind, sig), _Group(set(), kind, http_status, message))
            group.requests.add(request_id)
            group.kind, group.http_status, group.message = kind, http_status, message
            proven = self.evidence.proven(frozenset({media_kind}), server)
            if len(group.requests) >= (self.run_length if proven else FIRST_CONTACT_RUN):
                self.trip(self._trip_for(group, media_kind, server, proven))
                return

    def _trip_for(self, group: _Group, media_kind: str, server: str | None, proven: bool) -> Trip:
        n, kind, status, message = len(group.requests), group.kind, group.http_status, group.message
        what = kinds_in_words(media_kind)
        others = self.evidence.others(server, media_kind)
        where = f" on {server}" if server else ""
        if kind == "connection":
            up = f"it answered {others} other requests" if others else "it stayed up (its health checks pass)"
            return Trip("server", (
                f"the server{where} dropped the connection of {n} {what} while {up} ({message}). Probable "
                "cause: the server's process that loads them crashes or closes the connection: its log says why "
                "(the last lines follow for the job's own server). Nothing was journaled for them: fix the "
                "server and rerun the same command."))
        if kind in MEDIA_KINDS:
            when = (f"{n} {what} in a row, with no answer of theirs in between" if proven
                    else f"{n} {what}, none of which the server answered")
            return Trip("media", _media_message(when, message))
        if not self.answers:
            first = (f"the server answered nothing: {n} requests ran out of time ({message})" if kind == "timeout"
                     else f"{n} requests failed the same way before any answer (HTTP {status}: {message})")
        elif kind == "timeout":
            first = f"{n} {what} ran out of time{where} ({message}) while it answered {others} other requests"
        elif proven:
            first = (f"{n} {what} in a row failed the same way with no answer of theirs in between (HTTP {status}: "
                     f"{message})")
        else:
            first = (f"{n} {what} failed the same way{where} and none was answered, while it answered {others} "
                     f"other requests: it fails every request of that kind (HTTP {status}: {message})")
        return Trip("server", f"{first}. Probable cause: {probable_cause(kind, status, message)}. Nothing was "
                              "journaled for them: fix the server and rerun the same command.")

    def confirm_drops(self, live: Iterable[str | None]) -> None:
        """At the end of the job: the connections dropped by servers still up (``live``) count as their
        requests' failures, answered after or not (the last requests of a shard may all be videos)."""
        for server in live:
            for dropped_id, dropped_kinds, dropped_message in self._dropped.pop(server, []):
                if not self.tripped:
                    self._count(dropped_id, dropped_kinds, server, "connection", None, dropped_message)

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
    def settle(self, rec, kinds: frozenset[str], answered: bool) -> list:
        """The records to journal now: ``rec`` (``answered``: it holds the server's answer to a request
        sending ``kinds``) and those held before it whose kinds have all been answered since, or nothing
        while ``rec`` is held back too (see the module docstring). After a trip only answers are journaled
        (one that finished as the job stopped is not sent again)."""
        if self.tripped:
            return [rec] if answered else []
        if not answered:
            self.held.append((rec, set(kinds)))
            return []
        out, still = [], []
        for held, waiting in self.held:
            waiting -= kinds
            if waiting:
                still.append((held, waiting))
            else:
                out.append(held)
        self.held = still
        return [*out, rec]

    def release(self) -> list:
        """At the end of the job: the held records, unless it tripped."""
        out, self.held = ([] if self.tripped else [rec for rec, _ in self.held]), []
        return out

    def trip(self, trip: Trip) -> None:
        if self.tripped:
            return
        self.tripped = trip
        self.held = []
        self.wake()
        if self.on_trip is not None:
            self.on_trip(trip)


def _media_message(where: str, message: str | None) -> str:
    return (f"{where} failed with: {message} — probable cause: {probable_media_cause(message)}. Nothing was "
            "journaled for them; fix it and rerun.")
