"""How long one attempt may take, from the pace the shard has shown, and the stall detector.

Deadline: an attempt may take DEADLINE_FACTOR times its expected time, never less than
``classify.deadline_floor_s`` and never more than ``classify.request_timeout_s``. The expected time is
the larger of two: the request's estimated tokens (``est_prompt_tokens`` + ``max_tokens``) times the
seconds per token of the shard's recent answers (the QUANTILE of the last WINDOW answered attempts,
so a slow minority does not read as a hang), and the wait behind the attempts that were in flight
when it was sent, at the rate the shard answers (Little's law). The second matters when a queue
builds: a shard sorted heaviest first answers its first, big requests before any queue forms, and a
small request sent later spends most of its time waiting, not being served (measured on a real vLLM:
at 64 in flight, attempts cut on the first answers' pace halved the throughput of 32). Until MIN_ANSWERS answers have been seen, only ``request_timeout_s`` applies. An
attempt already in flight follows the estimate as it moves (checked every CHECK_S), so a request that
hung before the shard had a pace is still cut once it has one.

Stall: requests are in flight on endpoints that answer their health checks, but nothing has been
answered for longer than the deadline of the smallest of them. Every attempt in flight for longer than
that is cancelled and retried: when the whole shard stops moving, the smallest request's deadline
applies to all of them.

``classify.adaptive_deadline: false`` leaves only ``request_timeout_s`` (no estimate, no stall detector).
An attempt cut by its own deadline is charged to the request; one cut by the stall detector is not
(the whole shard stopped, not this request). vLLM aborts the request when its connection closes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any, Callable

log = logging.getLogger(__name__)

DEADLINE_FACTOR = 4
QUANTILE = 0.9
WINDOW = 128
MIN_ANSWERS = 8
CHECK_S = 0.5


class Expired(Exception):
    """An attempt was cut: its deadline passed, the shard stalled, or its endpoint went down.
    ``charged``: the request's own deadline passed (a stall or a lost endpoint is the server's)."""

    def __init__(self, kind: str, message: str, charged: bool = True):
        super().__init__(message)
        self.kind = kind
        self.charged = charged


class ServiceTime:
    """Seconds per estimated token of the shard's recent answered attempts."""

    def __init__(self) -> None:
        self._ratios: deque[float] = deque(maxlen=WINDOW)
        self._cached: float | None = None

    def observe(self, seconds: float, tokens: int) -> None:
        self._ratios.append(seconds / max(1, tokens))
        self._cached = None

    def per_token(self) -> float | None:
        if len(self._ratios) < MIN_ANSWERS:
            return None
        if self._cached is None:
            ordered = sorted(self._ratios)
            self._cached = ordered[min(len(ordered) - 1, int(QUANTILE * len(ordered)))]
        return self._cached


class _Attempt:
    """One attempt in flight: cancels its task when expired; ``with`` turns that into Expired."""

    __slots__ = ("owner", "task", "started", "tokens", "ahead", "endpoint", "handle", "expiry")

    def __init__(self, owner: "Deadlines", tokens: int, endpoint: Any):
        self.owner = owner
        self.task = asyncio.current_task()
        self.started = time.monotonic()
        self.tokens = tokens
        self.ahead = owner.in_flight  # attempts already at the servers when this one is sent
        self.endpoint = endpoint
        self.expiry: Expired | None = None
        ceiling = owner.ceiling_s
        self.handle = asyncio.get_running_loop().call_later(
            ceiling, self.expire, "timeout", f"no answer within {ceiling:g} s (classify.request_timeout_s)")

    def expire(self, kind: str, message: str, charged: bool = True) -> None:
        if self.expiry is None:
            self.expiry = Expired(kind, message, charged)
            self.task.cancel()

    def __enter__(self) -> "_Attempt":
        self.owner._running.add(self)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.handle.cancel()
        self.owner._running.discard(self)
        if self.expiry is not None and exc_type is asyncio.CancelledError:
            uncancel = getattr(self.task, "uncancel", None)  # Python >= 3.11: the cancel was ours
            if uncancel is not None:
                uncancel()
            raise self.expiry from None
        return False


class Deadlines:
    """The attempts in flight and their deadlines; ``watch()`` applies the adaptive rule and the stall
    detector. Endpoints passed to ``attempt`` need a boolean ``healthy``."""

    def __init__(self, ceiling_s: float, floor_s: float, adaptive: bool, clock=time.monotonic):
        self.clock = clock  # when answers came: the answer rate (a model of a server runs its own clock)
        self.ceiling_s = ceiling_s
        self.floor_s = min(floor_s, ceiling_s)
        self.adaptive = adaptive
        self.service = ServiceTime()
        self.last_answer = clock()
        self._answer_times: deque[float] = deque(maxlen=WINDOW)
        self._running: set[_Attempt] = set()

    @property
    def in_flight(self) -> int:
        return len(self._running)

    def attempt(self, tokens: int, endpoint: Any) -> _Attempt:
        """``with deadlines.attempt(tokens, ep): ...`` raises Expired when the attempt is cut."""
        return _Attempt(self, tokens, endpoint)

    def answered(self, seconds: float, tokens: int) -> None:
        self.service.observe(seconds, tokens)
        self.last_answer = self.clock()
        self._answer_times.append(self.last_answer)

    def answer_rate(self) -> float | None:
        """Answers per second over the last WINDOW answers."""
        times = self._answer_times
        if len(times) < MIN_ANSWERS or times[-1] <= times[0]:
            return None
        return (len(times) - 1) / (times[-1] - times[0])

    def limit_s(self, tokens: int, ahead: int = 0) -> float:
        """The deadline of an attempt of ``tokens`` estimated tokens sent behind ``ahead`` others."""
        per_token = self.service.per_token() if self.adaptive else None
        if per_token is None:
            return self.ceiling_s
        expected = per_token * tokens
        rate = self.answer_rate()
        if rate:
            expected = max(expected, (ahead + 1) / rate)
        return min(self.ceiling_s, max(self.floor_s, DEADLINE_FACTOR * expected))

    def expire(self, which: Callable[[_Attempt], bool], kind: str, message: str, charged: bool = True) -> int:
        """Cut the attempts in flight that ``which`` selects; how many."""
        chosen = [a for a in self._running if which(a)]
        for a in chosen:
            a.expire(kind, message, charged)
        return len(chosen)

    def check(self) -> None:
        if not self.adaptive or not self._running or self.service.per_token() is None:
            return
        now = time.monotonic()
        for a in list(self._running):
            limit = self.limit_s(a.tokens, a.ahead)
            if now - a.started > limit:
                a.expire("timeout", f"no answer within {limit:.0f} s ({DEADLINE_FACTOR}x the time the shard's "
                                    f"answers suggest for ~{a.tokens} tokens, classify.adaptive_deadline)")
        if not self._running:
            return
        stall_after = min(self.limit_s(a.tokens, a.ahead) for a in self._running)
        quiet = now - self.last_answer
        if quiet > stall_after:
            n = self.expire(lambda a: a.endpoint.healthy and now - a.started > stall_after, "timeout",
                            f"stalled: nothing answered for {quiet:.0f} s while the server was healthy",
                            charged=False)
            if n:
                log.warning("stalled: nothing answered for %.0f s with %d requests in flight and healthy "
                            "endpoints; cancelling the %d in flight for over %.0f s to retry them",
                            quiet, len(self._running), n, stall_after)

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(CHECK_S)
            self.check()
