"""Asynchronous classification client: each manifest row becomes one chat completion and one record.

A request's life (``ClassifyClient.classify``):

1. it takes a slot of the in-flight limit and keeps it until its record is made (``limit.py``);
2. each attempt goes to the healthy endpoint with the fewest outstanding requests (``endpoints.py``)
   under a deadline that follows the shard's pace (``deadline.py``);
3. the answer, or the error with its ``error_kind`` (``error_kinds.py``), fills the record
   (docs/outputs.md, labels); a refused API key or an unknown model stops the job instead;
4. a transient error is retried after a back-off, up to ``classify.max_attempts``; a truncated answer
   gets one retry at TRUNCATION_TOKEN_FACTOR x ``max_tokens``, then a terminal ``truncated`` record.

``attempts`` counts the attempts charged to the request; ``sends`` every HTTP request made for it.
Not charged: the immediate resend after a scattered 503, the truncation retry, and attempts cut for
the server's sake (the stall detector, an endpoint going down, a refused connection), so a server
fault never turns requests into terminal ``timeout`` records. Every send carries its own
``X-Request-Id`` (request id, the client's random token, send number): vLLM V1 before 0.26 refused an
id still running (a retry racing the abort of its previous attempt; two ``classify.models`` entries of
one model on one server). A 5xx is never terminal by its message alone (``error_kinds``): one that
comes back with the same body on every charged attempt while the server answers the request's peers
(requests with the same media kinds, ``vidlabel.serve.breaker.Evidence``) is the request's own (a
1-frame video's "division by zero", an MP4 cut after its header): its record is terminal, since no
rerun could ever finish it. Answers to other kinds prove nothing about it: a server whose video decoder
cannot load answers every photo. "No such file" for a file missing here too is looked for again after
the MEDIA_RECHECK_S pauses (an NFS or autofs hiccup): one that is back is sent again, free. Every
attempt is reported to the job's breaker (``vidlabel.serve.breaker``), which keeps the evidence.

A request is the post's items in order, each introduced by its label, then the prompt
(``vidlabel.prepare.post_prompt.message_content`` of the row's items, ``vidlabel.serve.items``): images
as ``image_url``, videos as ``video_url``. The media checks are per item: the file an error names is
that item's (the record's ``error_item``); a server that cannot see files that are all here is the
server's fault (``media_unreachable``), one of the post's files missing here too is the post's own
``bad_media``.

HTTP goes through aiohttp's public client: measured at ~0.4 ms of client CPU per request, against
~2 ms for openai's public ``client.post`` and ~3.6 ms for httpx (benchmarks/client_overhead.py needs
1,000 req/s on two cores).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
from dataclasses import dataclass
from typing import Any, Callable, Coroutine, TypeVar

import aiohttp

from vidlabel.core.prompt import parse_answers
from vidlabel.serve.breaker import Breaker, request_kinds
from vidlabel.serve.concurrency import adapt, fit_in_flight
from vidlabel.serve.confidence import answer_probabilities
from vidlabel.serve.deadline import Deadlines, Expired
from vidlabel.serve.endpoints import DOWN, Endpoint, Endpoints, NoLiveEndpoint, describe
from vidlabel.serve.error_kinds import (
    admission_refusal,
    classify_error,
    fatal_error,
    response_message,
    retry_after_s,
    server_cannot_see_media,
)
from vidlabel.serve.items import named_item, post_items, sent_items
from vidlabel.serve.limit import InFlightLimit, backoff_s
from vidlabel.serve.probe import Calibration, ServerIdentity
from vidlabel.serve.record import Record, new_result
from vidlabel.serve.settings import ClientSettings

T = TypeVar("T")

TRUNCATION_TOKEN_FACTOR = 2  # the one retry of a truncated answer gets this many times max_tokens
# Attempts the server's own faults may take from a request before they are charged to it after all
# (a bound, so that a request which really does break the connection cannot loop for ever).
FREE_SENDS_FACTOR = 4
CONNECT_TIMEOUT_S = 10.0
# Below uvicorn's 5 s keep-alive (vLLM's server), so that an idle connection is never reused just as
# the server closes it.
KEEPALIVE_S = 4.0
# Pauses before looking again for a file that the server and this job both found missing: an NFS or
# autofs mount can take seconds to come back.
MEDIA_RECHECK_S = (1.0, 3.0)
# 5xx kinds that, the same on every attempt while the request's peers are answered, are its own failure.
SAME_FAILURE_KINDS = frozenset({"server_error", "bad_media"})
# Error kinds that are about one item of the post, when the server's message tells which.
ITEM_KINDS = frozenset({"bad_media", "media_unreachable", "encoder_cache"})

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode


class Stopped(Exception):
    """The client was told to stop (job SIGTERM, no endpoint left) while the request was running."""


@dataclass
class _Outcome:
    """One HTTP attempt: a completion, or an error kind."""
    completion: dict | None = None
    kind: str | None = None
    transient: bool = False
    http_status: int | None = None
    message: str | None = None
    retry_after: float | None = None
    overload: bool = False  # a refusal that shows the server full (limit.py)
    charged: bool = True  # the request's own failure (not the server's: see the module docstring)
    endpoint: Endpoint | None = None
    resend: bool = False  # its media file was missing here too for a moment and is back: send again, free
    own: bool = False  # a 5xx shown to be the request's own here (its file is missing here too)
    item: int | None = None  # the index of the item the error is about (items.named_item)


class ClassifyClient:
    """``async with ClassifyClient(endpoints, settings) as c: record = await c.classify(row)``.

    ``stop_event`` set: requests stop (Stopped). When every endpoint is down the client sets it,
    keeps the reason in ``failure`` and calls ``on_failure(reason)``. ``breaker`` (a
    ``vidlabel.serve.breaker.Breaker``; by default one that only keeps the evidence) hears of every attempt.
    """

    def __init__(self, endpoints: list[tuple[str, str]], settings: ClientSettings,
                 stop_event: asyncio.Event | None = None, on_failure: Callable[[str], None] | None = None,
                 owned: bool = False, breaker: Breaker | None = None, calibration: Calibration | None = None):
        s = self.settings = settings
        self.breaker = breaker if breaker is not None else Breaker()
        self.token = secrets.token_hex(4)  # makes this client's X-Request-Ids its own
        self.calibration = calibration  # the calibration videos each endpoint's identity is probed with
        self.stop_event = stop_event or asyncio.Event()
        self.on_failure = on_failure
        self.failure: NoLiveEndpoint | None = None
        # Adaptive concurrency starts from classify.concurrency (a shard job then fits it to the KV caches) and
        # moves between floor and ceiling.
        start = max(s.adaptive_floor, min(s.concurrency, s.adaptive_ceiling)) if s.adaptive else s.concurrency
        self.limit = InFlightLimit(start)
        self.deadlines = Deadlines(s.request_timeout_s, s.deadline_floor_s, s.adaptive_deadline)
        self.endpoints = Endpoints(endpoints, s.health_interval_s, self._endpoint_down, self._all_down, owned)
        self.limit_history: list[tuple[float, int]] = []
        self._connections = max(s.concurrency, s.adaptive_ceiling if s.adaptive else 0) + 8
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task] = []

    async def __aenter__(self) -> "ClassifyClient":
        connector = aiohttp.TCPConnector(limit=self._connections, keepalive_timeout=KEEPALIVE_S)
        # No total timeout: the deadline is ours, so that it can follow the shard's pace.
        self._session = aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S))
        s = self.settings
        try:
            await self.endpoints.identify(self._session, s.model, self.calibration)
        except BaseException:
            await self._session.close()
            raise
        self._tasks = [asyncio.create_task(self.endpoints.watch()), asyncio.create_task(self.deadlines.watch())]
        if s.adaptive:
            self._tasks.append(asyncio.create_task(adapt(self.limit, self.endpoints.all, s.adaptive_floor,
                                                         s.adaptive_ceiling, s.adaptive_interval_s,
                                                         self.limit_history, self.deadlines.answer_rate)))
        return self

    def fit_in_flight(self, request_tokens: float) -> str | None:
        """Lower the in-flight limit to what the live servers' KV caches hold of requests of
        ``request_tokens`` (``concurrency.fit_in_flight``; classify.in_flight_from_kv_cache), once their
        identities are known; why in words where it moved, else None."""
        if not self.settings.in_flight_from_kv_cache:
            return None
        live = [ep for ep in self.endpoints.all if ep.state != DOWN and ep.identity is not None]
        if not live:
            return None
        n, why = fit_in_flight(self.limit.ceiling, [ep.identity.kv_cache_tokens for ep in live], request_tokens)
        if n >= self.limit.ceiling:
            return None
        self.limit.set_ceiling(n)
        return why

    async def __aexit__(self, *exc) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._session.close()

    # ---- endpoint health ---------------------------------------------------------------------
    def _endpoint_down(self, ep: Endpoint) -> None:
        self.deadlines.expire(lambda a: a.endpoint is ep, "connection", f"{ep.base_url} went down: {ep.reason}",
                              charged=False)

    def _all_down(self, reason: str) -> None:
        self.failure = NoLiveEndpoint(reason)
        self.stop_event.set()
        if self.on_failure is not None:
            self.on_failure(reason)

    def _check_stop(self) -> None:
        if self.stop_event.is_set():
            raise NoLiveEndpoint(str(self.failure)) if self.failure else Stopped()

    # ---- one attempt ---------------------------------------------------------------------------
    def _body(self, row: dict, max_tokens: int) -> bytes:
        """The attempt's body: the row's Request's (vidlabel.serve.request), nothing else."""
        return _dumps(row["request"].body(max_tokens)).encode()

    def _readable_here(self, path: str) -> bool:
        """The file exists where the job runs, inside the directory the server is meant to read."""
        root = self.settings.media_root
        inside = root is None or os.path.commonpath([root, os.path.realpath(path)]) == root
        return inside and os.path.isfile(path)

    async def _back_after_pauses(self, paths: list[str]) -> bool:
        """The files are all there again after one of the MEDIA_RECHECK_S pauses."""
        for pause in MEDIA_RECHECK_S:
            await self._sleep_or_stop(pause)
            if all(self._readable_here(p) for p in paths):
                return True
        return False

    async def _media_check(self, items: list[dict], item: dict | None) -> tuple[str, bool, bool, dict | None]:
        """(kind, transient, resend, item) of a server that says it cannot see (some of) the post's files."""
        suspects = [item] if item is not None else sent_items(items)
        missing = [i for i in suspects if not self._readable_here(i["media_path"])]
        if not missing:
            # The files are here, the server does not see them: the server's mount or its
            # --allowed-local-media-path, never the post's fault (the breaker stops the job).
            return "media_unreachable", True, False, item
        if await self._back_after_pauses([i["media_path"] for i in missing]):
            return "bad_media", True, True, item  # missing here too, for a moment: a mount's hiccup
        return "bad_media", False, False, missing[0]  # the post's own: its file is gone

    async def _attempt(self, row: dict, max_tokens: int, tokens: int, send: int) -> _Outcome:
        n = await self.limit.send()
        try:
            ep = self.endpoints.pick()
        except NoLiveEndpoint:
            self.limit.returned(n)
            raise
        headers = {**ep.headers, "X-Request-Id": f"{row['request_id']}-{self.token}-{send}"}
        ep.outstanding += 1
        ep.sent += 1
        t0 = time.monotonic()
        try:
            with self.deadlines.attempt(tokens, ep):
                async with self._session.post(ep.chat_url, data=self._body(row, max_tokens), headers=headers) as resp:
                    status, data = resp.status, await resp.read()
        except Expired as exc:
            return _Outcome(kind=exc.kind, transient=True, message=str(exc), charged=exc.charged, endpoint=ep)
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            self.endpoints.unreachable(ep, describe(exc))
            return _Outcome(kind="connection", transient=True, message=f"{ep.base_url}: {describe(exc)}",
                            charged=False, endpoint=ep)
        except aiohttp.ClientError as exc:  # reset, closed mid-answer, truncated body
            return _Outcome(kind="connection", transient=True, message=f"{ep.base_url}: {describe(exc)}", endpoint=ep)
        finally:
            ep.outstanding -= 1
            self.limit.returned(n)
        if status != 200:
            message = response_message(data)
            fatal = fatal_error(ep.base_url, status, message)
            if fatal is not None:
                raise fatal
            items = post_items(row)
            kind, transient = classify_error(status, message, [i["media_path"] for i in sent_items(items)])
            resend = False
            item = named_item(message, items) if kind in ITEM_KINDS else None
            if kind == "bad_media" and server_cannot_see_media(message):
                kind, transient, resend, item = await self._media_check(items, item)
            overload = kind == "server_overloaded" and self.limit.refused(
                n, admission=admission_refusal(status, message))
            own = kind == "bad_media" and not transient and status >= 500  # missing here too: the media check
            return _Outcome(kind=kind, transient=transient, http_status=status, message=message, own=own,
                            retry_after=retry_after_s(resp.headers), overload=overload,
                            charged=kind != "media_unreachable" and not resend, endpoint=ep, resend=resend,
                            item=None if item is None else item.get("index"))
        self.limit.answered(n)
        self.deadlines.answered(time.monotonic() - t0, tokens)
        try:
            completion = json.loads(data)
            if not isinstance(completion["choices"][0]["message"], dict):
                raise TypeError("choices[0].message is not an object")
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            return _Outcome(kind="invalid_output", http_status=status, message=f"unreadable response body "
                            f"({type(exc).__name__}: {exc}): {data[:200].decode(errors='replace')}", endpoint=ep)
        return _Outcome(completion=completion, endpoint=ep)

    # ---- one request -------------------------------------------------------------------------
    async def classify(self, row: dict) -> Record:
        """Run one manifest row to its frozen record (retries included), stamped with the server that
        answered; the job stamps what else made it (vidlabel.serve.provenance). Raises Stopped,
        NoLiveEndpoint or FatalClientError."""
        await self.limit.acquire()
        try:
            rec = await self._classify(row)
        finally:
            self.limit.release()
        server = rec.pop("server")
        return Record.from_journal({**rec, **({"server": server.label, "server_fingerprint": server.fingerprint}
                                              if isinstance(server, ServerIdentity) else {})})

    async def _classify(self, row: dict) -> dict:
        """The working result of one row while it is retried (vidlabel.serve.record.new_result)."""
        s = self.settings
        rec = new_result(row)
        max_tokens = s.max_tokens
        tokens = int(row.get("est_prompt_tokens") or 0) + s.max_tokens
        charged = free = 0
        last_kind = None
        kinds = request_kinds(post_items(row))
        evidence = self.breaker.evidence
        same_failure: list[_Failure] = []  # the run of identical 5xx answers, with the peers answered by then
        while True:
            self._check_stop()
            t0 = time.time()
            if rec["started_at"] is None:
                rec["started_at"] = t0
            rec["sends"] += 1
            outcome = await self._attempt(row, max_tokens, tokens, rec["sends"])
            rec["finished_at"] = time.time()
            rec["latency_s"] = rec["finished_at"] - t0
            server = None
            if outcome.endpoint is not None:
                rec["server"] = outcome.endpoint.identity
                server = outcome.endpoint.base_url
            self.breaker.attempt(row["request_id"], outcome.kind, outcome.http_status, outcome.message,
                                 outcome.charged, kinds=kinds, server=server)
            if outcome.completion is not None:
                rec["attempts"] = charged + 1
                if fill_from_answer(rec, outcome.completion, s.questions, max_tokens) or max_tokens > s.max_tokens:
                    return rec
                max_tokens = s.max_tokens * TRUNCATION_TOKEN_FACTOR  # a free retry with more room
                continue
            rec.update(error_kind=outcome.kind, error=outcome.message, error_item=outcome.item,
                       http_status=outcome.http_status, raw_text=None, answers=None, answer_probs=None,
                       answer_probs_missing=None, finish_reason=None)
            if not outcome.transient:
                rec["attempts"] = charged + 1
                rec["own_failure"] = outcome.own
                return rec
            if outcome.kind == "media_unreachable":  # the job decides (the breaker): not retried here
                rec["retryable"] = True
                return rec
            self._check_stop()  # the server is going away: this error says nothing about the request
            if outcome.resend and free < FREE_SENDS_FACTOR * s.max_attempts:
                free += 1
                continue
            # A scattered 503 (no load shown, no Retry-After) is sent again at once, the first time in
            # a row, and costs nothing from the budget: the next refusal in a row backs off and counts.
            scattered = (outcome.kind == "server_overloaded" and not outcome.overload
                         and outcome.retry_after is None and last_kind != "server_overloaded")
            last_kind = outcome.kind
            if scattered:
                continue
            if outcome.charged or free >= FREE_SENDS_FACTOR * s.max_attempts:
                charged += 1
            else:
                free += 1
            rec["attempts"] = charged
            same = _same_failure_run(same_failure, outcome, server, evidence.peers(server, kinds))
            if charged >= s.max_attempts:
                if same == charged and any(evidence.peers(f.server, kinds) > f.peers for f in same_failure):
                    rec["retryable"], rec["own_failure"] = False, True
                    rec["error"] = (f"{outcome.message} (the same answer on all {charged} attempts while the "
                                    "server answered other requests of its media kinds: this request's own "
                                    "failure)")
                    return rec
                rec["retryable"] = True
                rec["error"] = f"{outcome.message} (gave up after {charged} attempts)"
                return rec
            await self._sleep_or_stop(backoff_s(max(1, charged), s.backoff_initial_s, s.backoff_max_s,
                                                outcome.retry_after))

    async def _sleep_or_stop(self, delay: float) -> None:
        if delay <= 0:
            return
        try:
            await asyncio.wait_for(self.stop_event.wait(), timeout=delay)
        except asyncio.TimeoutError:
            return
        self._check_stop()


@dataclass(frozen=True)
class _Failure:
    """One attempt of a request's run of identical 5xx answers."""
    http_status: int | None
    message: str | None
    server: str | None
    peers: int  # requests of its media kinds the server had answered by then (breaker.Evidence.peers)


def _same_failure_run(history: list[_Failure], outcome: _Outcome, server: str | None, peers: int) -> int:
    """Track the run of identical 5xx answers (status and body) of one request; its length. Not "busy"
    (503) nor a gateway's timeout (504): those say "not now"."""
    if (not outcome.charged or outcome.kind not in SAME_FAILURE_KINDS or not outcome.transient
            or (outcome.http_status or 0) < 500):
        history.clear()
        return 0
    if history and (history[-1].http_status, history[-1].message) != (outcome.http_status, outcome.message):
        history.clear()
    history.append(_Failure(outcome.http_status, outcome.message, server, peers))
    return len(history)


def fill_from_answer(rec: dict, completion: dict, questions: list[dict[str, Any]], max_tokens: int) -> bool:
    """Record a 200 answer in ``rec``; False when it was truncated and may be retried with more tokens.

    An answer cut before the ``max_tokens`` it was sent with was cut by the server for lack of context
    (vLLM lowers max_tokens to what the context leaves, without a word): the prompt took more than the plan
    estimated. It is no label, and more tokens would not help: ``over_context``, with the figures."""
    choice = completion["choices"][0]
    text = (choice.get("message") or {}).get("content") or ""
    usage = completion.get("usage") or {}
    rec.update(http_status=200, error_item=None, finish_reason=choice.get("finish_reason"), raw_text=text,
               prompt_tokens=usage.get("prompt_tokens"), completion_tokens=usage.get("completion_tokens"))
    if rec["finish_reason"] == "length" and (rec["completion_tokens"] or 0) < max_tokens:
        rec.update(status="error", error_kind="over_context", answers=None,
                   error=f"the server cut the answer at {rec['completion_tokens']} of its {max_tokens} tokens: the "
                         f"prompt took {rec['prompt_tokens']} tokens of the context where the plan estimated "
                         f"{rec.get('est_prompt_tokens')}, leaving no room for the answer (docs/planning.md)")
        return True
    if rec["finish_reason"] == "length":
        rec.update(status="error", error_kind="truncated", answers=None,
                   error=f"answer cut at max_tokens ({rec['completion_tokens']} tokens)")
        return False
    try:
        rec["answers"] = parse_answers(text, questions)
    except ValueError as exc:
        rec.update(status="error", error_kind="invalid_output", error=str(exc), answers=None)
        return True
    # How sure the model was of each answer (vidlabel.serve.confidence); a question without usable
    # log-probabilities is left out and says why.
    probs, missing = answer_probabilities((choice.get("logprobs") or {}).get("content"), questions)
    rec.update(status="ok", error_kind=None, error=None, answer_probs=probs or None,
               answer_probs_missing=missing or None)
    return True


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on uvloop's event loop when uvloop is installed (the ``speed`` extra: about
    0.1 ms less client CPU per request), else on asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
