"""Adaptive concurrency where requests spend seconds in the API servers before the engine sees them.

    .venv/bin/python benchmarks/adaptive_transit.py [--seconds 400]

On the GPU (Qwen3-Omni hearing raw video, one H100, 2026-12-07) requests spent ~10 s in vLLM's API
servers (decoding, the audio and image processors) before the engine queued them, and the ceiling went
9 -> 39 -> 4 in 40 s: each raise was read against an engine queue that did not show the last one yet,
then the burst that arrived was cut against, down to the floor. This script runs the controller
(``vidlabel.serve.concurrency.AdaptiveCeiling``) against a model of such a server: a client that keeps
the ceiling in flight, API servers that hand a request to the engine ``transit`` seconds after it was
sent, and an engine that runs ``slots`` requests at a time for ``service`` seconds each, first come
first served. It needs ``slots + transit x slots / service`` in flight to stay busy. Per case, after a
60 s start: the ceiling's range, the share of steps with every slot running, the engine's use (mean
slots running: its throughput against the most it serves), the engine's longest queue, and the busy
share of the first 120 s (how fast it climbs from the count it started at).

The cases with ``workers`` model API servers that are themselves the bottleneck (the Omni on raw video,
3.9 CPU-s per answer in them): they process ``workers`` requests at a time, ``transit`` seconds each,
so they pass fewer requests per second than the engine serves and more in flight only queue in them;
between 150 and 200 s their requests take a third of that (a run of lighter posts), which empties
their backlog into the engine. On the GPU (the same Omni with this rule, 2026-12-07 night) the ceiling
went 7 -> 33 -> 4: the same climb against an engine that lacks work, then cuts against the burst. A
second table holds those cases at fixed ceilings: whether the swing costs throughput (the engine's use)
or only waits. "Every slot busy" is no measure there: API servers that pass requests in step feed the
engine in bursts of their workers, and how well those line up with its slots depends on the count.
"""

from __future__ import annotations

import argparse
from collections import deque

from vidlabel.serve.concurrency import AdaptiveCeiling
from vidlabel.serve.deadline import Deadlines
from vidlabel.serve.limit import InFlightLimit

FLOOR, TOP = 4, 64
# (transit s, slots, service s, the ceiling it starts at, API server workers: None for as many as
# needed): no front end, a short and a long one (the Omni's), a long one starting at
# classify.concurrency, a 7B-like engine of many slots, and API servers slower than the engine.
CASES = [(0, 4, 3.0, 9, None), (3, 4, 3.0, 9, None), (10, 4, 3.0, 9, None), (20, 4, 3.0, 9, None),
         (10, 4, 3.0, 64, None), (2, 40, 8.0, 64, None), (10, 4, 3.0, 9, 12), (10, 4, 3.0, 9, 8)]
# The fixed ceilings the cases with ``workers`` are compared with: from what keeps them fed to the top.
FIXED_CEILINGS = (12, 16, 20, 31, 58)
# Where the API servers are the bottleneck: the window in which their requests take a third of ``transit``.
LIGHT_POSTS_S = (150.0, 200.0)


def simulate(transit_s: float, slots: int = 4, service_s: float = 3.0, start: int = 9, seconds: float = 400.0,
             interval_s: float = 2.0, step_s: float = 0.25,
             workers: int | None = None, adaptive: bool = True) -> list[tuple[float, int, int, int]]:
    """Each step's (time, ceiling, engine running, engine waiting); the controller reads every ``interval_s``.
    ``workers``: the API servers process that many requests at a time (None: every request at once).
    ``adaptive``: False keeps the ceiling at ``start``."""
    limit = InFlightLimit(start)
    controller = AdaptiveCeiling(FLOOR, TOP)
    clock = [0.0]  # the model's time, which the client's answer rate (Deadlines) is measured on
    deadlines = Deadlines(ceiling_s=900, floor_s=1, adaptive=True, clock=lambda: clock[0])
    sent, processing, waiting, running = deque(), [], deque(), []
    trace, t, next_reading = [], 0.0, interval_s
    while t < seconds:
        clock[0] = t
        while limit.in_flight < limit.ceiling:
            limit.in_flight += 1
            limit.at_server += 1
            sent.append(t)
        light = workers is not None and LIGHT_POSTS_S[0] <= t < LIGHT_POSTS_S[1]
        while sent and (workers is None or len(processing) < workers):
            sent.popleft()
            processing.append(t + (transit_s / 3 if light else transit_s))
        waiting.extend(f for f in processing if f <= t)
        processing = [f for f in processing if f > t]
        finished = [f for f in running if f <= t]
        running = [f for f in running if f > t]
        for _ in finished:
            limit.in_flight -= 1
            limit.at_server -= 1
            deadlines.answered(service_s, 1000)
        while waiting and len(running) < slots:
            waiting.popleft()
            running.append(t + service_s)
        if adaptive and t >= next_reading:
            metrics = {"vllm:num_requests_running": float(len(running)),
                       "vllm:num_requests_waiting": float(len(waiting))}
            limit.set_ceiling(controller.step(t, limit, metrics, deadlines.answer_rate()))
            next_reading += interval_s
        trace.append((t, limit.ceiling, len(running), len(waiting)))
        t += step_s
    return trace


def summary(trace: list[tuple[float, int, int, int]], slots: int) -> dict:
    steady = [row for row in trace if row[0] >= 60]
    start = [row for row in trace if row[0] < 120]
    return {"ceiling_min": min(r[1] for r in steady), "ceiling_max": max(r[1] for r in steady),
            "busy": sum(r[2] == slots for r in steady) / len(steady),
            "use": sum(r[2] for r in steady) / (slots * len(steady)),
            "longest_queue": max(r[3] for r in steady),
            "busy_first_120s": sum(r[2] == slots for r in start) / len(start)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=400.0)
    args = ap.parse_args()
    print("| transit s | API server workers | slots x service s | start | needed | ceiling after 60 s | every slot busy "
          "| engine use | longest engine queue | busy, first 120 s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for transit, slots, service, start, workers in CASES:
        s = summary(simulate(transit, slots, service, start, args.seconds, workers=workers), slots)
        needed = slots + transit * slots / service
        # API servers slower than the engine: no count keeps every slot busy; what they pass is the most.
        fed = f"{needed:.0f}" if workers is None or workers / transit >= slots / service else (
            f"- (they pass {workers / transit:.1f} req/s of the engine's {slots / service:.1f})")
        print(f"| {transit} | {workers or 'all'} | {slots} x {service:g} | {start} | {fed} "
              f"| {s['ceiling_min']}..{s['ceiling_max']} | {s['busy']:.0%} | {s['use']:.1%} | {s['longest_queue']} "
              f"| {s['busy_first_120s']:.0%} |")
    print()
    print("API servers slower than the engine, the ceiling fixed: engine use (longest engine queue)")
    print()
    print("| transit s | API server workers | " + " | ".join(f"fixed {c}" for c in FIXED_CEILINGS) + " |")
    print("|---|---|" + "---|" * len(FIXED_CEILINGS))
    for transit, slots, service, _, workers in CASES:
        if workers is None:
            continue
        cells = []
        for c in FIXED_CEILINGS:
            s = summary(simulate(transit, slots, service, c, args.seconds, workers=workers, adaptive=False), slots)
            cells.append(f"{s['use']:.1%} ({s['longest_queue']})")
        print(f"| {transit} | {workers} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
