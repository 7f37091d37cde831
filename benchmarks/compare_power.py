"""compare's verdict between two models, by simulation: how often it finds a real F1 gap, and how often it
names a better model when there is none (issue 33: a comparison that can find a real difference).

    .venv/bin/python benchmarks/compare_power.py [--reps 1000] [--labels 400] [--gap 0.03]

Two models label N posts (``--posts``) of prevalence ``--prevalence``: each post has a true label Y and a
signal s = 2.1 Y + Normal(0, 1) both models see (they agree on most posts, as an FP8 and a bf16 copy of one
model do); model A answers "yes" when s + Normal(0, sigma_A) > t, model B when s + Normal(0, sigma_B) > t.
sigma_A is 0.3 and t = 1.0; sigma_B is found (bisection on a population of 400,000 posts) so that A's
population F1 exceeds B's by ``--gap`` (the first setting, F1 about 0.76 against 0.73, the F1 of docs/models.md's
FP8-vs-bf16 question) or equals it (sigma_B = sigma_A: no gap). Per dataset a uniform sample of ``--labels``
posts is labelled and compare's paired difference is taken (vidlabel.analyze.estimators.paired_difference,
``--bootstrap`` replicates, the design bootstrap of a uniform sample), with the verdict compare.md gives:
a better model named when the interval of F1(A) - F1(B) excludes 0.

Prints, for the gap and for no gap: how often A is named better (power), how often B is, the interval's
coverage of the population difference, the mean smallest detectable difference compare.md states, and,
for contrast, how often the earlier rule (two separate F1 intervals that do not overlap) named one.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from _stats_sim import estimators, stats

SIGNAL = 2.1
THRESHOLD = 1.0
SIGMA_A = 0.3
CONFIDENCE = 0.95


def answers(rng, truth: np.ndarray, signal: np.ndarray, sigma: float) -> np.ndarray:
    return signal + sigma * rng.standard_normal(truth.shape) > THRESHOLD


def cells(truth: np.ndarray, says_yes: np.ndarray) -> np.ndarray:
    """stats' cell order: 0 tp, 1 fp, 2 fn, 3 tn."""
    return np.where(truth, np.where(says_yes, 0, 2), np.where(says_yes, 1, 3))


def f1(truth, says_yes) -> float:
    tp = np.sum(truth & says_yes)
    return float(2 * tp / (2 * tp + np.sum(~truth & says_yes) + np.sum(truth & ~says_yes)))


def sigma_b_for(gap: float, prevalence: float, seed: int) -> float:
    """sigma_B with F1(A) - F1(B) = gap on a large population (bisection; F1 falls as sigma grows)."""
    rng = np.random.default_rng(seed)
    n = 400_000
    truth = rng.random(n) < prevalence
    signal = SIGNAL * truth + rng.standard_normal(n)
    noise_a, noise_b = rng.standard_normal(n), rng.standard_normal(n)
    target = f1(truth, signal + SIGMA_A * noise_a > THRESHOLD) - gap
    lo, hi = SIGMA_A, 5.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f1(truth, signal + mid * noise_b > THRESHOLD) > target else (lo, mid)
    return (lo + hi) / 2


def run(args, sigma_b: float, rng) -> dict[str, float]:
    named_a = named_b = covered = old_named = 0
    detectable, gaps, f1s = [], [], []
    for rep in range(args.reps):
        truth = rng.random(args.posts) < args.prevalence
        signal = SIGNAL * truth + rng.standard_normal(args.posts)
        a, b = answers(rng, truth, signal, SIGMA_A), answers(rng, truth, signal, sigma_b)
        population = f1(truth, a) - f1(truth, b)
        gaps.append(population)
        f1s.append((f1(truth, a), f1(truth, b)))
        labelled = rng.choice(args.posts, args.labels, replace=False)
        cells_a, cells_b = cells(truth[labelled], a[labelled]), cells(truth[labelled], b[labelled])
        paired = estimators.paired_difference(cells_a, cells_b, estimators.srs_design(args.labels), CONFIDENCE,
                                              args.bootstrap, seed=rep)["f1"]
        named_a += paired["lo"] > 0
        named_b += paired["hi"] < 0
        covered += paired["lo"] <= population <= paired["hi"]
        detectable.append(paired["detectable"])
        # the earlier rule: each model's own F1 interval (stats.agreement), better only when they do not overlap
        own = [stats.agreement(*np.bincount(c, minlength=4), CONFIDENCE, args.bootstrap, seed=rep) for c in
               (cells_a, cells_b)]
        old_named += own[0]["f1_lo"] > own[1]["f1_hi"] or own[1]["f1_lo"] > own[0]["f1_hi"]
    return {"a": named_a / args.reps, "b": named_b / args.reps, "coverage": covered / args.reps,
            "detectable": float(np.mean(detectable)), "gap": float(np.mean(gaps)),
            "f1": tuple(np.mean(f1s, axis=0)), "old": old_named / args.reps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=1000)
    ap.add_argument("--posts", type=int, default=20_000)
    ap.add_argument("--labels", type=int, default=400)
    ap.add_argument("--prevalence", type=float, default=0.3)
    ap.add_argument("--gap", type=float, default=0.03)
    ap.add_argument("--bootstrap", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=4)
    args = ap.parse_args()
    started = time.time()
    rng = np.random.default_rng(args.seed)
    rows = []
    for name, gap in (("a real gap", args.gap), ("no gap", 0.0)):
        sigma_b = sigma_b_for(gap, args.prevalence, args.seed) if gap else SIGMA_A
        rows.append((name, sigma_b, run(args, sigma_b, rng)))
    print(f"reps {args.reps}, N {args.posts:,}, {args.labels} labelled (uniform), prevalence {args.prevalence}, "
          f"{args.bootstrap} bootstrap replicates, seed {args.seed}; {time.time() - started:.0f} s")
    print()
    print("| setting | sigma_B | population F1 A / B (mean) | F1(A) - F1(B) | A named better | B named better | "
          "interval covers the difference | detectable difference (mean) | earlier rule (separate intervals) "
          "named one |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, sigma_b, r in rows:
        print(f"| {name} | {sigma_b:.3f} | {r['f1'][0]:.3f} / {r['f1'][1]:.3f} | {r['gap']:+.4f} | {r['a']:.1%} | "
              f"{r['b']:.1%} | {r['coverage']:.3f} | {r['detectable']:.3f} | {r['old']:.1%} |")
    power, false_gap = rows[0][2]["a"], rows[0][2]["b"]
    false_none = rows[1][2]["a"] + rows[1][2]["b"]
    print()
    print(f"Against the goals: the real gap reported in {power:.1%} of samples (goal >= 15%), a false verdict at no gap "
          f"in {false_none:.1%} (goal <= 6%), the wrong model named at the gap in {false_gap:.1%}: "
          + ("met." if power >= 0.15 and false_none <= 0.06 else "missed."))


if __name__ == "__main__":
    main()
