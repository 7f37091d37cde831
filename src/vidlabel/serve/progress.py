"""The progress line of a shard job: what finished this run, the rates, and an ETA (or a stall)."""

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
    def __init__(self, total: int, already: int, shard: int, interval_s: float):
        self.total = total
        self.already = already
        self.shard = shard
        self.interval_s = interval_s
        self.stats = Stats()
        self.t0 = self.last_finish = time.monotonic()
        self.in_flight: Callable[[], int] = lambda: 0

    def finished(self, rec: dict) -> None:
        self.stats.add(rec)
        self.last_finish = time.monotonic()

    def line(self) -> str:
        s = self.stats
        now = time.monotonic()
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
            eta = "ETA " + (f"{(self.total - done) / rate / 60:.1f} min" if rate > 0 else "?")
        return (f"shard {self.shard}: {done}/{self.total} done ({s.ok} ok, {s.error} error this run), "
                f"{rate:.2f} req/s, {s.prompt_tokens / elapsed:.0f} input tok/s, "
                f"{s.completion_tokens / elapsed:.1f} output tok/s, {eta}")
