"""Active sampling against a uniform human sample, by simulation (issue: spend human labels where the model is unsure).

    .venv/bin/python benchmarks/active_sampling.py [--reps 1000] [--posts 35000] [--floor-share 0.5]
        [--burn-in-share 0.2] [--burn-in-floor-share 0.2]

For each prevalence, model and label budget it draws ``--reps`` populations of ``--posts`` posts
(``_stats_sim.population``) and, on each, three estimates from the same budget:
  classical  human labels of a simple random sample only (Wilson),
  uniform    PPI++ on that simple random sample with the model's P(yes) (the production SQL; the
             reported interval of vidlabel.analyze.stats.corrected_interval),
  active     a Poisson sample with pi from vidlabel.analyze.sampling (sqrt of p(1 - p), uniform floor
             ``--floor-share``) and the active estimator vidlabel.analyze.estimators.active_mean, reported the
             same way.
  burn-in    a uniform burn-in of ``--burn-in-share`` of the budget, then the rest drawn by
             vidlabel.analyze.sampling.burn_in_design (P(yes) recalibrated on the burn-in, floor
             ``--burn-in-floor-share``, every labelled post with its inclusion probability in the
             union of the two samples); the recalibrated P(yes) is the prediction.
Models: calibrated (Beta concentration ``--concentration``), overconfident (same ranking,
sigmoid(3 logit p)), uninformative (P(yes) drawn independently of Y: varies but says nothing),
constant (P(yes) = the prevalence for every post: calibrated and uninformative).
Prints coverage and mean width of each, the width ratios to uniform, and the uniform budget that
would give the same width (from the uniform widths at the three budgets, width ∝ n^-b fitted
in log-log), hence the share of labels saved.
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
    sampling,
    simple_random_sample,
    stats,
    uniform_ppi,
)

PREVALENCES = (0.05, 0.15, 0.3)
MODELS = ("calibrated", "overconfident", "uninformative", "constant")
BUDGETS = (150, 300, 600)
CONFIDENCE = 0.95
CHUNK = 100


def reported(estimate, se, truth, f, labelled, human, pi=None):
    events = stats.sample_events(truth, f, labelled, pi)
    r = stats.corrected_interval(estimate, se, events, human[0], human[1], CONFIDENCE)
    return r["lo"], r["hi"]


def burn_in_estimate(rng, truth, p, budget, floor_share, burn_in_share):
    """A uniform burn-in (``--burn-in-share`` of the budget), then vidlabel.analyze.sampling.burn_in_design
    for the rest; estimate with the recalibrated P(yes) as prediction."""
    reps, n_posts = truth.shape
    first = int(round(budget * burn_in_share))
    burn = simple_random_sample(rng, reps, n_posts, first)
    pi = np.empty((reps, n_posts))
    pi_active = np.empty((reps, n_posts))
    for r in range(reps):
        pi[r], pi_active[r] = sampling.burn_in_design(p[r], burn[r], truth[r][burn[r]], budget, floor_share)
    recal = np.stack([sampling.recalibrate(p[r], p[r][burn[r]], truth[r][burn[r]]) for r in range(reps)])
    drawn = burn | poisson_draw(rng, pi_active)
    h = estimators.hajek_share(truth, pi, CONFIDENCE, drawn)
    a = estimators.active_mean(recal, truth, drawn, pi, CONFIDENCE)
    return reported(a["estimate"], a["se"], truth, recal, drawn, (h["lo"], h["hi"]), pi)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=1000)
    ap.add_argument("--posts", type=int, default=35_000)
    ap.add_argument("--concentration", type=float, default=0.5)
    ap.add_argument("--floor-share", type=float, default=0.5)  # active without burn-in
    ap.add_argument("--burn-in-share", type=float, default=0.2, help="0 leaves the burn-in design out")
    ap.add_argument("--burn-in-floor-share", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument("--prevalences", default=",".join(map(str, PREVALENCES)))
    ap.add_argument("--models", default=",".join(MODELS))
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    started = time.time()
    results: dict = {}
    for prev in [float(x) for x in args.prevalences.split(",")]:
        for model in args.models.split(","):
            acc = []
            for start in range(0, args.reps, CHUNK):
                reps = min(CHUNK, args.reps - start)
                truth, p = population(rng, reps, args.posts, prev, args.concentration, model)
                target = truth.mean(axis=1)
                acc.append(((p > 0.5) == truth).mean())
                for budget in BUDGETS:
                    cell = results.setdefault((prev, model, budget), {})
                    srs = simple_random_sample(rng, reps, args.posts, budget)
                    k = np.where(srs, truth, 0).sum(axis=1)
                    human = stats.wilson_bounds(k, budget, CONFIDENCE)
                    m = uniform_ppi(truth, p, srs)
                    uni = reported(m["estimate"], np.sqrt(m["imputed_var"] + m["rectifier_var"]), truth, p, srs, human)
                    pi = active_design(p, budget, args.floor_share)
                    drawn = poisson_draw(rng, pi)
                    h = estimators.hajek_share(truth, pi, CONFIDENCE, drawn)
                    a = estimators.active_mean(p, truth, drawn, pi, CONFIDENCE)
                    act = reported(a["estimate"], a["se"], truth, p, drawn, (h["lo"], h["hi"]), pi)
                    burn = (burn_in_estimate(rng, truth, p, budget, args.burn_in_floor_share, args.burn_in_share)
                            if args.burn_in_share > 0 else (np.full(reps, np.nan), np.full(reps, np.nan)))
                    for name, (lo, hi) in (("classical", human), ("uniform", uni), ("active", act), ("burnin", burn)):
                        cell.setdefault(name + "_cov", []).append(covers(lo, hi, target))
                        cell.setdefault(name + "_width", []).append(hi - lo)
                    cell.setdefault("labels", []).append(drawn.sum(axis=1))
                    cell.setdefault("pi_max_over_min", []).append(pi.max(axis=1) / pi.min(axis=1))
            results[(prev, model, "accuracy")] = float(np.mean(acc))
    print(f"reps {args.reps}, N {args.posts:,}, Beta concentration {args.concentration}, floor share "
          f"{args.floor_share} (burn-in design: {args.burn_in_floor_share}), burn-in share {args.burn_in_share:.3g}, "
          f"seed {args.seed}; {time.time() - started:.0f} s")
    print()
    print("| prevalence | model | accuracy | budget | labels (active, mean) | coverage classical / uniform / active / "
          "burn-in | width classical / uniform / active / burn-in | active / uniform width | burn-in / uniform width "
          "| uniform labels for the same width: active / burn-in | labels saved: active / burn-in |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for prev in [float(x) for x in args.prevalences.split(",")]:
        for model in args.models.split(","):
            cells = [results[(prev, model, b)] for b in BUDGETS]
            mean = [{k: float(np.mean(np.concatenate(v))) for k, v in c.items()} for c in cells]
            # uniform width ~ A n^-b, fitted on the three budgets
            slope, intercept = np.polyfit(np.log(BUDGETS), np.log([c["uniform_width"] for c in mean]), 1)
            for budget, c in zip(BUDGETS, mean):
                equivalent = [float(np.exp((np.log(c[k]) - intercept) / slope))
                              for k in ("active_width", "burnin_width")]
                print(f"| {prev} | {model} | {results[(prev, model, 'accuracy')]:.3f} | {budget} | {c['labels']:.0f} | "
                      f"{c['classical_cov']:.3f} / {c['uniform_cov']:.3f} / {c['active_cov']:.3f} / "
                      f"{c['burnin_cov']:.3f} | {c['classical_width']:.4f} / {c['uniform_width']:.4f} / "
                      f"{c['active_width']:.4f} / {c['burnin_width']:.4f} | "
                      f"{c['active_width'] / c['uniform_width']:.3f} | "
                      f"{c['burnin_width'] / c['uniform_width']:.3f} | {equivalent[0]:.0f} / {equivalent[1]:.0f} | "
                      f"{1 - budget / equivalent[0]:.0%} / {1 - budget / equivalent[1]:.0%} |")


if __name__ == "__main__":
    main()
