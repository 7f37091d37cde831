"""Coverage of every interval summary.md reports, by simulation (issue: intervals you can publish).

    .venv/bin/python benchmarks/interval_coverage.py [--reps 1000] [--posts 35000] [--seed 1]

For each design, prevalence (0.01, 0.05, 0.3, 0.5) and number of human labels n (30, 150, 600) it
draws ``--reps`` populations of ``--posts`` posts (``_stats_sim.population``: calibrated model, Beta
concentration ``--concentration``) and a human sample, computes the intervals exactly as
``vidlabel.analyze.aggregate`` does (the PPI++ moments through the production SQL) and counts how often
each covers the truth: the share of "yes" over all N posts (prevalence), or the population's
metric computed on all N posts (agreement). Designs:
  uniform-hard  simple random sample; the model's hard answers (labels without answer_probs)
  uniform-prob  simple random sample; the model's P(yes) as prediction (answer_probs present)
  active        Poisson sample, pi ∝ sqrt(p(1 - p)) with the uniform floor (vidlabel.analyze.sampling)
  score         Poisson sample, pi ∝ p with the same floor (oversampling likely positives)
Intervals: human (Wilson; weighted: Hajek mean, Wilson at the effective size), corrected_raw (the
normal PPI++ / active interval), corrected (what is reported, stats.corrected_interval: a t quantile
with events - 1 degrees of freedom, and the hull with the human interval below stats.MIN_EVENTS
events; "guarded" is the share of datasets where the hull was taken), and for uniform samples the agreement
metrics (Wilson: accuracy, precision, recall; bootstrap: f1, kappa; an interval the summary reports
as n/a is not counted, its share is printed). Prints one markdown table.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from _stats_sim import (
    active_design,
    covers,
    estimators,
    poisson_draw,
    population,
    score_design,
    simple_random_sample,
    stats,
    uniform_ppi,
)

PREVALENCES = (0.01, 0.05, 0.3, 0.5)
SAMPLE_SIZES = (30, 150, 600)
DESIGNS = ("uniform-hard", "uniform-prob", "active", "score")
CONFIDENCE = 0.95
CHUNK = 100  # datasets per vectorised batch (memory: a few (CHUNK, N) float arrays)


def prevalence_intervals(design, truth, p, labelled, pi):
    """Every prevalence interval the summary gives for these R datasets: name -> (lo, hi)."""
    if design.startswith("uniform"):
        f = (p > 0.5).astype(float) if design == "uniform-hard" else p
        n = labelled.sum(axis=1)
        k = np.where(labelled, truth, 0).sum(axis=1)
        human = stats.wilson_bounds(k, n, CONFIDENCE)
        m = uniform_ppi(truth, f, labelled)
        half = stats.z_value(CONFIDENCE) * np.sqrt(m["imputed_var"] + m["rectifier_var"])
        raw = (np.clip(m["estimate"] - half, 0, 1), np.clip(m["estimate"] + half, 0, 1))
    else:
        f = p
        h = estimators.hajek_share(truth, pi, CONFIDENCE, labelled)
        human = (h["lo"], h["hi"])
        a = estimators.active_mean(f, truth, labelled, pi, CONFIDENCE)
        raw = (a["lo"], a["hi"])
    estimate = m["estimate"] if design.startswith("uniform") else a["estimate"]
    se = np.sqrt(m["imputed_var"] + m["rectifier_var"]) if design.startswith("uniform") else a["se"]
    reported = stats.corrected_interval(estimate, se, stats.sample_events(truth, f, labelled, pi), human[0], human[1],
                                        CONFIDENCE)
    return {"human": human, "corrected_raw": raw, "corrected": (reported["lo"], reported["hi"])}, reported["few"]


def agreement_intervals(truth, hard, labelled, seed):
    t, m = truth.astype(bool), hard.astype(bool)
    cells = [(np.where(labelled, a & b, False)).sum(axis=1) for a, b in ((t, m), (~t, m), (t, ~m), (~t, ~m))]
    tp, fp, fn, tn = cells
    boot = stats.bootstrap_agreement(tp, fp, fn, tn, CONFIDENCE, 2000, seed)
    out = {"accuracy": stats.wilson_bounds(tp + tn, tp + fp + fn + tn, CONFIDENCE),
           "precision": stats.wilson_bounds(tp, tp + fp, CONFIDENCE),
           "recall": stats.wilson_bounds(tp, tp + fn, CONFIDENCE),
           "f1": boot["f1"], "kappa": boot["kappa"]}
    one_class = (tp + fn == 0) | (fp + tn == 0)  # reported as n/a (stats.agreement)
    for name in ("f1", "kappa"):
        out[name] = tuple(np.where(one_class, np.nan, b) for b in out[name])
    pop = stats.confusion_metrics((t & m).sum(1), (~t & m).sum(1), (t & ~m).sum(1), (~t & ~m).sum(1))
    return out, pop


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=1000)
    ap.add_argument("--posts", type=int, default=35_000)
    ap.add_argument("--concentration", type=float, default=1.0)
    ap.add_argument("--floor-share", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--designs", default=",".join(DESIGNS))
    ap.add_argument("--prevalences", default=",".join(map(str, PREVALENCES)))
    ap.add_argument("--sizes", default=",".join(map(str, SAMPLE_SIZES)))
    args = ap.parse_args()
    designs = args.designs.split(",")
    prevalences = [float(x) for x in args.prevalences.split(",")]
    sizes = [int(x) for x in args.sizes.split(",")]
    rng = np.random.default_rng(args.seed)
    started = time.time()
    # (design, prevalence, n) -> name -> list of (covered, reported) arrays per chunk
    hits: dict = {}
    accuracy: dict = {}
    for prev in prevalences:
        for start in range(0, args.reps, CHUNK):
            reps = min(CHUNK, args.reps - start)
            truth, p = population(rng, reps, args.posts, prev, args.concentration, "calibrated")
            target = truth.mean(axis=1)
            hard = (p > 0.5).astype(float)
            accuracy.setdefault(prev, []).append((hard == truth).mean())
            for n in sizes:
                for design in designs:
                    if design.startswith("uniform"):
                        labelled, pi = simple_random_sample(rng, reps, args.posts, n), None
                    else:
                        pi = (active_design if design == "active" else score_design)(p, n, args.floor_share)
                        labelled = poisson_draw(rng, pi)
                    cell = hits.setdefault((design, prev, n), {})
                    intervals, few = prevalence_intervals(design, truth, p, labelled, pi)
                    for name, (lo, hi) in intervals.items():
                        cell.setdefault(name, []).append((covers(lo, hi, target), np.isfinite(lo)))
                    cell.setdefault("guarded", []).append((few, np.ones(reps, bool)))
                    cell.setdefault("width", []).append((intervals["corrected"][1] - intervals["corrected"][0],
                                                         np.ones(reps, bool)))
                    if design == "uniform-hard":
                        agree, pop = agreement_intervals(truth, hard, labelled, seed=start + n)
                        for name, (lo, hi) in agree.items():
                            cell.setdefault(name, []).append((covers(lo, hi, pop[name]),
                                                              np.isfinite(lo) & np.isfinite(pop[name])))
    names = ["human", "corrected_raw", "corrected", "accuracy", "precision", "recall", "f1", "kappa"]
    print(f"reps {args.reps}, N {args.posts:,}, calibrated model (Beta concentration {args.concentration}), "
          f"floor share {args.floor_share}, seed {args.seed}; {time.time() - started:.0f} s")
    print("model accuracy (hard answers): " + ", ".join(f"prevalence {k}: {np.mean(v):.3f}"
                                                        for k, v in accuracy.items()))
    print()
    print("| design | prevalence | n | " + " | ".join(names) + " | guarded | corrected width |")
    print("|" + "---|" * (len(names) + 5))
    for (design, prev, n), cell in hits.items():
        row = []
        for name in names:
            if name not in cell:
                row.append("")
                continue
            covered = np.concatenate([c for c, _ in cell[name]])
            reported = np.concatenate([r for _, r in cell[name]])
            text = f"{covered[reported].mean():.3f}" if reported.any() else "n/a"
            if (~reported).any():
                text += f" ({(~reported).mean():.0%} n/a)"
            row.append(text)
        guarded = np.concatenate([c for c, _ in cell["guarded"]]).mean()
        width = np.concatenate([c for c, _ in cell["width"]]).mean()
        print(f"| {design} | {prev} | {n} | " + " | ".join(row) + f" | {guarded:.0%} | {width:.4f} |")


if __name__ == "__main__":
    main()
