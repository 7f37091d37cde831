"""The progress line of a shard job: what finished this run, the rates, and an ETA (or a stall).

The ETA is the work left over the rate at which work was done, the work of a request being its
estimated prompt tokens (the manifest's ``est_prompt_tokens``): a shard's videos cost ten times its
photos, so requests left over requests per second would be far off wherever the post types come in
runs. The rate is measured from this run's first answer on: the server's start and the first
answers' latency are not part of the rate the rest of the job runs at.

The requests in flight count as half done: a job that keeps a steady number in flight has them spread
evenly between sent and answered, and counting their whole work as left makes the ETA run high by
about half a latency until the end. On the GPU (491 mixed requests, 32 in flight, docs/serving.md)
counting them whole ran 37 s high on average over the last third of a 443 s request phase, half 10 s."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable


@dataclass
class Stats:
    """This run's finished requests, for the progress line."""
    done: int = 0
    ok: int = 0
    error: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, rec: dict) -> None:
        self.done += 1
        if rec["status"] == "ok":
            self.ok += 1
        else:
            self.error += 1
        self.prompt_tokens += rec.get("prompt_tokens") or 0
        self.completion_tokens += rec.get("completion_tokens") or 0


class Progress:
    def __init__(self, total: int, already: int, shard: int, interval_s: float, work: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        """``total`` requests of the shard, ``already`` answered before this run; ``work``: the estimated
        prompt tokens of the requests left (None or 0: unknown, each request counts as one)."""
        self.total = total
        self.already = already
        self.shard = shard
        self.interval_s = interval_s
        self.stats = Stats()
        self.clock = clock
        self.t0 = self.last_finish = clock()
        self.in_flight: Callable[[], int] = lambda: 0
        # The client's in-flight limit (classify.concurrency, fitted to the KV caches, moved by
        # adaptive concurrency): the line says it, as throughput follows it.
        self.in_flight_limit: Callable[[], int | None] = lambda: None
        self.counts_tokens = bool(work)
        self.work_left = float(work) if work else float(total - already)
        self.first_finish: float | None = None
        self.work_since_first = 0.0  # the work finished after this run's first answer
        self.work_in_flight: dict[str, float] = {}  # request id -> its work, from its send to its record

    def _work(self, rec) -> float:
        return (rec.get("est_prompt_tokens") or self._mean_work()) if self.counts_tokens else 1.0

    def sent(self, row: dict) -> None:
        """A request of the shard was sent (once per request, whatever its retries)."""
        self.work_in_flight[row["request_id"]] = self._work(row)

    def finished(self, rec: dict) -> None:
        self.stats.add(rec)
        self.last_finish = self.clock()
        self.work_in_flight.pop(rec.get("request_id"), None)
        work = self._work(rec)
        self.work_left = max(0.0, self.work_left - work)
        if self.first_finish is None:
            self.first_finish = self.last_finish
        else:
            self.work_since_first += work

    def _mean_work(self) -> float:
        left = self.total - self.already - self.stats.done + 1  # this one included
        return self.work_left / max(1, left)

    def eta_s(self) -> float | None:
        """Seconds left (module docstring); None before two answers."""
        if self.first_finish is None or self.work_since_first <= 0:
            return None
        rate = self.work_since_first / max(1e-9, self.clock() - self.first_finish)
        return max(0.0, self.work_left - sum(self.work_in_flight.values()) / 2) / rate

    def line(self) -> str:
        s = self.stats
        now = self.clock()
        elapsed = max(1e-9, now - self.t0)
        rate = s.done / elapsed
        done = self.already + s.done
        quiet = now - self.last_finish
        if self.in_flight() and quiet >= self.interval_s and not s.done:
            # A large model's first answers take longer than a progress interval: not a stall yet.
            eta = f"first answers pending for {quiet:.0f} s ({self.in_flight()} in flight)"
        elif self.in_flight() and quiet >= self.interval_s:
            # An ETA from the average rate would keep counting down while nothing finishes.
            eta = f"stalled for {quiet:.0f} s ({self.in_flight()} in flight, none finished)"
        else:
            left = self.eta_s()
            eta = "ETA " + (f"{left / 60:.1f} min" if left is not None else "?")
            if in_flight := self.in_flight():
                limit = self.in_flight_limit()
                eta = f"{in_flight} in flight" + (f" (limit {limit})" if limit else "") + f", {eta}"
        return (f"shard {self.shard}: {done}/{self.total} done ({s.ok} ok, {s.error} error this run), "
                f"{rate:.2f} req/s, {s.prompt_tokens / elapsed:.0f} input tok/s, "
                f"{s.completion_tokens / elapsed:.1f} output tok/s, {eta}")
