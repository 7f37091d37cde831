"""The progress line's ETA on a long job of mixed posts: the work left (estimated prompt tokens) over
the rate since the first answer, checked against a simulated job's real end at a quarter, half and
three quarters of it. The simulated server answers at a steady rate after a slow start, so what is
checked is the estimator, not a server's behaviour (the real job's ETA is benchmarks/eta_accuracy.py's
and the GPU session's)."""

from __future__ import annotations

import heapq

import numpy as np
import pytest

from vidlabel.serve.progress import Progress


def simulated_finishes(tokens: list[int], slots: int, tok_per_s: float, start_s: float) -> list[tuple[float, int]]:
    """(finish time, tokens) of each request of a server that answers ``slots`` requests at once, each at
    ``tok_per_s / slots``, its first answers delayed by ``start_s`` (the engine's warm-up); the client sends
    in the given order."""
    free = [(start_s, k) for k in range(slots)]
    out = []
    for n in tokens:
        t, k = heapq.heappop(free)
        done = t + n / (tok_per_s / slots)
        out.append((done, n))
        heapq.heappush(free, (done, k))
    return sorted(out)


@pytest.mark.parametrize("order", ["videos first", "photos first", "shuffled"])
def test_the_eta_of_a_long_mixed_job_converges_on_its_end(order):
    rng = np.random.default_rng(7)
    videos = np.clip(rng.lognormal(np.log(15_000), 0.4, 120), 2_000, 32_000).astype(int).tolist()
    photos = np.clip(rng.lognormal(np.log(1_200), 0.3, 360), 300, 4_000).astype(int).tolist()
    # Post types in runs, as a shard may hold them, or mixed.
    tokens = {"videos first": videos + photos, "photos first": photos + videos,
              "shuffled": rng.permutation(videos + photos).tolist()}[order]
    finishes = simulated_finishes(tokens, slots=16, tok_per_s=20_000, start_s=30)
    end = finishes[-1][0]
    now = [0.0]
    progress = Progress(len(tokens), 0, shard=0, interval_s=60, work=sum(tokens), clock=lambda: now[0])
    by_requests = []
    for i, (t, n) in enumerate(finishes, start=1):
        now[0] = t
        progress.finished({"status": "ok", "est_prompt_tokens": n, "prompt_tokens": n, "completion_tokens": 20})
        if i in (len(tokens) // 4, len(tokens) // 2, 3 * len(tokens) // 4):
            left = end - t
            # Within a tenth of the job's length from half the job on, a fifth at a quarter (the first
            # answers are the short ones: a rate from them is low while long requests are in flight);
            # the drain at the end, a last long request on one slot while the others idle, no rate foresees.
            bound = 0.2 if i == len(tokens) // 4 else 0.1
            assert abs(progress.eta_s() - left) <= bound * end, (i, progress.eta_s(), left, end)
            assert progress.line().endswith(f"ETA {progress.eta_s() / 60:.1f} min")
            by_requests.append(abs((len(tokens) - i) / (i / t) - left) / end)
    if order != "shuffled":  # the scenario tells the two apart: requests left over requests per second
        assert max(by_requests) > 0.25, by_requests
