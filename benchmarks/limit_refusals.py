"""The in-flight limit under refusals (vidlabel.serve.limit), simulated: how often scattered 503s lower it
and how fast a server's admission 503s do.

    .venv/bin/python benchmarks/limit_refusals.py [--trials 1000] [--requests 120] [--concurrency 8]
        [--scattered 0.2] [--capacity 3] [--jitter 0.3] [--time-scale 0.1]

Each trial runs ``--requests`` requests through one ``InFlightLimit`` the way the client does: a request
holds its slot until answered; each attempt waits for a place at the server; a refusal is sent again at
once the first time in a row unless the limit read it as load, else it waits out a full-jitter back-off
of up to 2 s. The server answers after 50 ms (times a log-normal of sigma ``--jitter``: a loaded
machine) and refuses at once. Times are multiplied by ``--time-scale`` so that a trial takes a fraction
of a second.

Printed, per scenario: the runs whose limit ended elsewhere than it should, and refusals per run.

- scattered: ``--scattered`` of the attempts refused at random, at ``--concurrency`` in flight, read as
  anonymous refusals (this client's rule) and, for comparison, as vLLM's admission wording (the majority
  rule); the limit should end where it began;
- admission: a server that holds ``--capacity`` requests and refuses the next with vLLM's admission 503,
  at 12 in flight; the limit should end at most one above the capacity.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from vidlabel.serve.limit import InFlightLimit  # noqa: E402

ANSWER_S = 0.05
REFUSAL_S = 0.002
BACKOFF_S = 2.0


def trial(seed: int, args, *, concurrency: int, scattered: float, capacity: int | None,
          admission: bool) -> tuple[int, int]:
    """(the limit at the end, refusals) of one simulated job."""
    rng = random.Random(seed)
    scale = args.time_scale
    lim = InFlightLimit(concurrency)
    at_server = [0]
    refusals = [0]

    async def request() -> None:
        await lim.acquire()
        last_refused = False
        try:
            while True:
                n = await lim.send()
                taken = rng.random() >= scattered and (capacity is None or at_server[0] < capacity)
                at_server[0] += taken
                try:
                    await asyncio.sleep((ANSWER_S * rng.lognormvariate(0, args.jitter) if taken
                                         else REFUSAL_S * rng.random()) * scale)
                finally:
                    at_server[0] -= taken
                    lim.returned(n)
                if taken:
                    lim.answered(n)
                    return
                refusals[0] += 1
                load = lim.refused(n, admission=admission)
                if not load and not last_refused:
                    last_refused = True
                    continue
                last_refused = True
                await asyncio.sleep(rng.uniform(0, BACKOFF_S) * scale)
        finally:
            lim.release()

    async def job() -> None:
        await asyncio.gather(*(request() for _ in range(args.requests)))

    asyncio.run(job())
    return lim.limit, refusals[0]


def report(name: str, results: list[tuple[int, int]], wrong) -> None:
    off = sum(1 for limit, _ in results if wrong(limit))
    per_run = sum(r for _, r in results) / len(results)
    ends = sorted({limit for limit, _ in results})
    print(f"  {name:58s} {off:5d} / {len(results)} runs   {per_run:6.1f} refusals a run   limits at the end {ends}",
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--scattered", type=float, default=0.2)
    ap.add_argument("--capacity", type=int, default=3)
    ap.add_argument("--jitter", type=float, default=0.3)
    ap.add_argument("--time-scale", type=float, default=0.1)
    args = ap.parse_args()
    print(f"limit_refusals: {args.trials} runs of {args.requests} requests each; answers after 50 ms x "
          f"lognormal(0, {args.jitter}); times x {args.time_scale}")
    print(f"  {'scenario':58s} {'limit off':>16s}")
    c = args.concurrency
    for admission, rule in ((False, "anonymous refusals (margin)"), (True, "read as admission (majority)")):
        results = [trial(s, args, concurrency=c, scattered=args.scattered, capacity=None, admission=admission)
                   for s in range(args.trials)]
        report(f"scattered {args.scattered:.0%} at {c} in flight, {rule}", results, lambda limit: limit < c)
    results = [trial(s, args, concurrency=12, scattered=0.0, capacity=args.capacity, admission=True)
               for s in range(args.trials)]
    report(f"admission 503s, server holds {args.capacity}, 12 in flight", results,
           lambda limit: limit > args.capacity + 1)


if __name__ == "__main__":
    main()
