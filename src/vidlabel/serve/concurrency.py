"""Adaptive concurrency (``classify.adaptive_concurrency``): the in-flight ceiling from the servers'
``/metrics``, read every few seconds."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import aiohttp

from vidlabel.serve.endpoints import Endpoint
from vidlabel.serve.limit import InFlightLimit

log = logging.getLogger(__name__)


# Requests in flight per server copy beyond what its KV cache holds: the engine then always has the next
# request decoded and waiting when one finishes (the stand-in's queue_wait benchmark: + 2 kept the
# throughput of 32 in flight within 1 % and cut the engine queue's waits several times).
IN_FLIGHT_HEADROOM = 2


def fit_in_flight(most: int, kv_cache_tokens: list[int | None], request_tokens: float) -> tuple[int, str]:
    """Requests in flight for the live servers: per server, ``most / len(servers)`` (classify.concurrency
    per copy) or, where fewer fit, the requests of ``request_tokens`` (the shard's mean prompt and answer)
    its KV cache holds + IN_FLIGHT_HEADROOM; (the sum, why in words). vLLM admits a waiting request only
    once its whole prompt fits the free KV cache, first come first served: more in flight only queue in
    its engine, each behind all the work ahead of it (minutes on a 72B), while they wait as well in the
    client, holding nothing of the server."""
    if not kv_cache_tokens or request_tokens <= 0:
        return most, f"{most} in flight (classify.concurrency)"
    share = most / len(kv_cache_tokens)
    per_server, unknown = [], 0
    for kv in kv_cache_tokens:
        if kv is None:
            unknown += 1
            per_server.append(share)
        else:
            per_server.append(min(share, int(kv // request_tokens) + IN_FLIGHT_HEADROOM))
    total = max(1, int(sum(per_server)))
    if total >= most:
        return most, f"{most} in flight (classify.concurrency; the KV caches hold more of these requests)"
    known = [kv for kv in kv_cache_tokens if kv is not None]
    held = ", ".join(f"{kv:,}" for kv in known)
    return total, (f"{total} in flight, not classify.concurrency {most}: the KV cache of {held} tokens holds "
                   f"{sum(kv // request_tokens for kv in known):.0f} of this shard's mean request "
                   f"({request_tokens:,.0f} tokens with its answer), + {IN_FLIGHT_HEADROOM} per server"
                   + (f"; {unknown} server(s) report no KV cache" if unknown else "")
                   + " (classify.in_flight_from_kv_cache)")


def parse_metrics(text: str) -> dict[str, float]:
    """Sum of each vLLM metric over its label sets, from Prometheus text format."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0].strip()
        try:
            values[name] = values.get(name, 0.0) + float(value)
        except ValueError:
            continue
    # Older vLLM names the KV metric differently.
    if "vllm:kv_cache_usage_perc" not in values and "vllm:gpu_cache_usage_perc" in values:
        values["vllm:kv_cache_usage_perc"] = values["vllm:gpu_cache_usage_perc"]
    return values


def next_ceiling(ceiling: int, in_flight: int, metrics: dict[str, float], preempted: bool,
                 floor: int, top: int, settled: bool = True) -> int:
    """Keep a short queue in front of the server: enough that no slot idles, no more.

    Waiting requests hold no KV cache but they count against time-outs and are lost work on a
    kill; preemptions mean the server is over-committed. KV-cache usage is not a signal on its
    own: a full cache with an empty queue is a busy server, not an overloaded one.

    The engine sees a change of the ceiling only once the requests it lets through (or holds back)
    have passed the API servers' decoding and processing, seconds later on raw video. Reading the
    queue again before then acts twice on one cause: a raise is followed by more raises until the
    first arrives as a burst, and that burst by cuts down to the floor (Qwen3-Omni on the GPU went
    9 -> 39 -> 4 in 40 s). So a cut waits until the client is back within the ceiling (an earlier cut
    has drained), and any change until ``settled``: the requests the last change let through should
    have reached the engine (``AdaptiveCeiling``). A preemption is cut without waiting for that (the
    server said so), unless an earlier cut is still draining. This covers API servers that delay requests;
    where they are themselves the bottleneck, the engine lacks work whatever the ceiling, so it still
    climbs and then cuts (the same Omni with this rule: 7 -> 33 -> 4; docs/serving.md). The climb banks
    requests in the API servers, which serve them once they speed up: it serves about what a fixed count
    that keeps the engine's queue short serves, and costs engine waits during the burst
    (benchmarks/adaptive_transit.py against fixed counts).
    """
    waiting = metrics.get("vllm:num_requests_waiting", 0.0)
    target_queue = max(2, ceiling // 8)
    if in_flight > ceiling and (preempted or waiting > 2 * target_queue):
        new = ceiling  # an earlier cut is still draining: the queue shows its cause, not a new one
    elif preempted:
        new = int(ceiling * 0.8)
    elif waiting > 2 * target_queue and settled:
        new = ceiling - max(1, int(waiting - 2 * target_queue) // 2)
    elif waiting < target_queue and in_flight >= ceiling - 1 and settled:
        new = ceiling + max(1, ceiling // RAISE_FRACTION)
    else:
        new = ceiling
    return max(floor, min(top, new))


# A raise adds a quarter: it waits for its requests to reach the engine (``AdaptiveCeiling``), so the
# climb is one raise per transit of the API servers (~10 s on heard video) rather than per reading.
RAISE_FRACTION = 4


class AdaptiveCeiling:
    """The ceiling's next value at each reading of the servers' metrics, and what it remembers between
    readings: when it last changed it.

    A request the client sent and the engines do not hold yet (``at_server`` minus the engines' running
    and waiting) is in the API servers' decoding and processing; by Little's law those take
    ``in transit / answer rate`` seconds to reach the engine (the client's answer rate,
    ``Deadlines.answer_rate``), so a change waits that long after the last one (``next_ceiling``). Before
    the first answers the rate is unknown: with requests in transit, no change yet (the fitted count, or
    classify.concurrency, stands).
    """

    def __init__(self, floor: int, top: int):
        self.floor, self.top = floor, top
        self.last_change_s = float("-inf")
        self.last_preemptions: float | None = None

    @staticmethod
    def transit_s(at_server: int, metrics: dict[str, float], answer_rate: float | None) -> float:
        """How long the requests now between the client and the engines take to reach them."""
        in_engines = metrics.get("vllm:num_requests_running", 0.0) + metrics.get("vllm:num_requests_waiting", 0.0)
        in_transit = max(0.0, at_server - in_engines)
        if in_transit < 1:
            return 0.0
        return in_transit / answer_rate if answer_rate else float("inf")

    def step(self, now: float, limit: InFlightLimit, metrics: dict[str, float], answer_rate: float | None) -> int:
        """The ceiling after this reading of the metrics, at the client's ``answer_rate`` (None: unknown yet)."""
        pre = metrics.get("vllm:num_preemptions_total", 0.0)
        preempted = self.last_preemptions is not None and pre > self.last_preemptions
        self.last_preemptions = pre
        settled = now - self.last_change_s >= self.transit_s(limit.at_server, metrics, answer_rate)
        new = next_ceiling(limit.ceiling, limit.in_flight, metrics, preempted, self.floor, self.top, settled)
        if new != limit.ceiling:
            self.last_change_s = now
        return new


async def read_metrics(http: aiohttp.ClientSession, endpoints: list[Endpoint]) -> dict[str, float] | None:
    """The endpoints' metrics summed (shares averaged); None when one cannot be read."""
    total: dict[str, float] = {}
    for ep in endpoints:
        try:
            async with http.get(ep.metrics_url, headers=ep.headers) as resp:
                resp.raise_for_status()
                text = await resp.text()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return None
        for k, v in parse_metrics(text).items():
            total[k] = total.get(k, 0.0) + (v / len(endpoints) if k.endswith("_perc") else v)
    return total


async def adapt(limit: InFlightLimit, endpoints: list[Endpoint], floor: int, top: int, interval_s: float,
                history: list[tuple[float, int]], answer_rate: Callable[[], float | None]) -> None:
    """Move ``limit``'s ceiling between ``floor`` and ``top`` until cancelled; append each value to ``history``.
    ``answer_rate``: the client's answers per second (``Deadlines.answer_rate``)."""
    controller = AdaptiveCeiling(floor, top)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0)) as http:
        while True:
            await asyncio.sleep(interval_s)
            metrics = await read_metrics(http, endpoints)
            if metrics is None:
                continue
            now = time.monotonic()
            new = controller.step(now, limit, metrics, answer_rate())
            if new != limit.ceiling:
                log.debug("adaptive concurrency %d -> %d (metrics %s)", limit.ceiling, new, metrics)
                limit.set_ceiling(new)
            history.append((now, new))
