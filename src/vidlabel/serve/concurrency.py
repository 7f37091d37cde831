"""Adaptive concurrency (``classify.adaptive_concurrency``): the in-flight ceiling from the servers'
``/metrics``, read every few seconds."""

from __future__ import annotations

import asyncio
import logging
import time

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
                 floor: int, top: int) -> int:
    """Keep a short queue in front of the server: enough that no slot idles, no more.

    Waiting requests hold no KV cache but they count against time-outs and are lost work on a
    kill; preemptions mean the server is over-committed. KV-cache usage is not a signal on its
    own: a full cache with an empty queue is a busy server, not an overloaded one.
    """
    waiting = metrics.get("vllm:num_requests_waiting", 0.0)
    target_queue = max(2, ceiling // 8)
    if preempted:
        new = int(ceiling * 0.8)
    elif waiting > 2 * target_queue:
        new = ceiling - max(1, int(waiting - 2 * target_queue) // 2)
    elif waiting < target_queue and in_flight >= ceiling - 1:
        new = ceiling + max(1, ceiling // 8)
    else:
        new = ceiling
    return max(floor, min(top, new))


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
                history: list[tuple[float, int]]) -> None:
    """Move ``limit``'s ceiling between ``floor`` and ``top`` until cancelled; append each value to ``history``."""
    last_preemptions = None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0)) as http:
        while True:
            await asyncio.sleep(interval_s)
            metrics = await read_metrics(http, endpoints)
            if metrics is None:
                continue
            pre = metrics.get("vllm:num_preemptions_total", 0.0)
            preempted = last_preemptions is not None and pre > last_preemptions
            last_preemptions = pre
            new = next_ceiling(limit.ceiling, limit.in_flight, metrics, preempted, floor, top)
            if new != limit.ceiling:
                log.debug("adaptive concurrency %d -> %d (metrics %s)", limit.ceiling, new, metrics)
                limit.set_ceiling(new)
            history.append((time.monotonic(), new))
