"""How many requests are in flight, how 503s move that number, and how long a retry waits.

A request holds its slot from its first send to its record, back-off waits included: a request that
the server refused waits out its back-off (exponential, full jitter, at least the Retry-After) without
its slot going to another request, so an overloaded server sees fewer requests at once in proportion
to its refusals, and nobody else stops sending. Every attempt, retries included, is also sent only
while fewer than ``limit`` attempts are at the server, so that a lowered limit holds back the
retries of requests that already have a slot.

The limit moves below its ceiling (``classify.concurrency``, or what adaptive concurrency chose):

- an answer to an attempt sent while the limit was full (n at least the limit) raises it by 1/limit,
  i.e. one slot per round trip of answers, up to the ceiling; an answer sent with the limit not full
  says nothing about one more request (RFC 7661's congestion-window validation), so a client that
  cannot fill its limit (requests still being built, a slow disk) does not creep back up to where the
  server refused;
- a refusal (503 or 429) of an attempt sent while n attempts were at the server lowers it to n - 1
  when the attempts sent with n or more at the server show the server full at n, counting the recent
  outcomes (the last OUTCOMES_PER_SLOT x ceiling answers and refusals) and the attempts still at the
  server (a refusal comes back at once, so those were taken). Then the client stops offering n; the
  refused request waits out its back-off. How much evidence that takes depends on what the refusal
  says:

  - vLLM's admission 503 (``--max-num-queued-reqs``: "The engine is currently busy ...",
    ``error_kinds.admission_refusal``) is the server's own word that it is full: more refusals than
    answers there, and at least MIN_REFUSALS (answers still on their way make the client count a
    few more at the server than it has, so the boundary is not sharp: a lone refusal at n proves
    little about n - 1);
  - any other refusal (a proxy, a fault, a gateway's 429) may be scattered: 20 % of attempts refused
    at every level alike say nothing about load. Those lower the limit only when refusals outnumber
    the answers at n or more by ANONYMOUS_MARGIN. A bare majority is no test for them: a refusal
    comes back a round trip before the answers sent beside it, and a refused request is sent again
    at once, at the top level, so a few scattered refusals in a row there (at the start, in the last
    requests) outnumber the answers: in 78 of 1,000 simulated runs of 20 % scattered 503s at 8 in
    flight the limit ended lower, with the margin in none (``benchmarks/limit_refusals.py``). The
    client sends such a request again at once (its first refusal in a row, unless the server asked
    for a Retry-After), so it costs one round trip.

A multiplicative decrease per refusal (TCP's) would read 20 % scattered 503s as congestion and
halve the limit every round trip.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter, deque

MIN_REFUSALS = 3  # fewer admission refusals at a level are no evidence that the server is full there
# How many more refusals than answers at a level an anonymous refusal needs: under 20 % scattered
# refusals the difference walks down 4 steps in 5 and climbs 6 above where it stands about 1 time in
# 4,000 ((1/4)^6).
ANONYMOUS_MARGIN = 6
# The outcomes remembered, per slot of the ceiling: enough that a level's refusals are weighed against
# several round trips of answers, not only the last one.
OUTCOMES_PER_SLOT = 4


def backoff_s(attempt: int, initial_s: float, max_s: float, retry_after: float | None) -> float:
    """Delay before retry number ``attempt`` (1, 2, ...): full jitter up to initial x 2^(attempt-1),
    capped at max_s; never less than the server's Retry-After."""
    delay = random.uniform(0, min(max_s, initial_s * 2 ** (attempt - 1)))
    return delay if retry_after is None else max(delay, retry_after)


class InFlightLimit:
    """A semaphore whose size moves: ``await acquire()`` / ``release()`` around a request's lifetime;
    around each HTTP attempt ``n = await send()`` and ``returned(n)``, then ``answered(n)`` or
    ``refused(n)`` when the server answered or refused it."""

    def __init__(self, ceiling: int):
        self.ceiling = max(1, int(ceiling))
        self._window = float(self.ceiling)
        self.in_flight = 0  # slot holders, back-off waits included
        self.at_server = 0  # attempts sent and not yet returned
        self._levels: Counter[int] = Counter()  # the n of each attempt at the server
        self._outcomes: deque[tuple[int, bool]] = deque(maxlen=OUTCOMES_PER_SLOT * self.ceiling)  # (n, refused)
        self._waiters: deque[asyncio.Future] = deque()  # for a slot
        self._senders: deque[asyncio.Future] = deque()  # for a place at the server

    @property
    def limit(self) -> int:
        return max(1, min(self.ceiling, int(self._window)))

    async def acquire(self) -> None:
        if self.in_flight < self.limit and not self._waiters:
            self.in_flight += 1
            return
        await self._wait(self._waiters, self.release)

    def release(self) -> None:
        self.in_flight -= 1
        self._wake()

    async def send(self) -> int:
        """Wait for a place at the server; the number of attempts there with this one."""
        if self.at_server < self.limit and not self._senders:
            self.at_server += 1
        else:
            await self._wait(self._senders, self._give_back_place)
        self._levels[self.at_server] += 1
        return self.at_server

    def _give_back_place(self) -> None:
        self.at_server -= 1
        self._wake()

    def returned(self, n: int) -> None:
        self._levels[n] -= 1
        self._give_back_place()

    async def _wait(self, queue: deque, give_back) -> None:
        fut = asyncio.get_running_loop().create_future()
        queue.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                give_back()  # granted just as the waiter was cancelled
            elif fut in queue:
                queue.remove(fut)
            raise

    def _wake(self) -> None:
        while self._senders and self.at_server < self.limit:
            fut = self._senders.popleft()
            if not fut.done():
                self.at_server += 1
                fut.set_result(None)
        while self._waiters and self.in_flight < self.limit:
            fut = self._waiters.popleft()
            if not fut.done():
                self.in_flight += 1
                fut.set_result(None)

    def set_ceiling(self, ceiling: int) -> None:
        """Adaptive concurrency moved the ceiling; a limit that was at the old one follows it."""
        at_ceiling = self._window >= self.ceiling
        self.ceiling = max(1, int(ceiling))
        self._window = float(self.ceiling) if at_ceiling else min(self._window, float(self.ceiling))
        self._outcomes = deque(self._outcomes, maxlen=OUTCOMES_PER_SLOT * self.ceiling)
        self._wake()

    def answered(self, n: int) -> None:
        self._outcomes.append((n, False))
        if self._window < self.ceiling and n >= self.limit:
            self._window = min(float(self.ceiling), self._window + 1 / self._window)
            self._wake()

    def refused(self, n: int, *, admission: bool) -> bool:
        """Record a refusal; True when it shows the server full at n (the limit is now below n).
        ``admission``: vLLM's admission 503, the server's word that it is full (module docstring)."""
        self._outcomes.append((n, True))
        refusals = sum(1 for m, refused in self._outcomes if refused and m >= n)
        taken = sum(1 for m, refused in self._outcomes if not refused and m >= n)
        taken += sum(count for m, count in self._levels.items() if m >= n)
        if admission:
            full = refusals >= MIN_REFUSALS and refusals > taken
        else:
            full = refusals - taken >= ANONYMOUS_MARGIN
        if not full:
            return False
        self._window = min(self._window, float(max(1, n - 1)))
        return True
