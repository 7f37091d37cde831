"""Human sampling designs against a uniform human sample, by simulation (issues: spend human labels where the
model is unsure; a design never much worse than uniform).

    .venv/bin/python benchmarks/active_sampling.py [--reps 1000] [--posts 35000] [--floor-share 0.4]
        [--burn-in-share 0.1] [--second-floor-share 0.2]

For each prevalence, model and label budget it draws ``--reps`` populations of ``--posts`` posts
(``_stats_sim.population``) and, on each, four estimates from the same budget:
  classical  human labels of a simple random sample only (Wilson),
  uniform    PPI++ on that simple random sample with the model's P(yes) (the production SQL; the
             reported interval of vidlabel.analyze.stats.corrected_interval),
  active     a Poisson sample with pi from vidlabel.analyze.sampling (sqrt of p(1 - p), uniform floor
             ``--floor-share``) and the active estimator vidlabel.analyze.estimators.active_mean, reported the
             same way (label_sample.design: active),
  two-phase  label_sample's default: a uniform burn-in (``--burn-in-share`` of the budget, at least 5
             expected positives of the question), then vidlabel.analyze.sampling.two_phase_design (the
             model's P(yes) checked and, if need be, recalibrated on the burn-in; a mixture of the uniform
             and the active design, floor ``--second-floor-share``, its weight chosen from the burn-in)
             and estimators.two_phase_mean.
Models: calibrated (Beta concentration ``--concentration``), overconfident (same ranking,
sigmoid(3 logit p)), uninformative (P(yes) drawn independently of Y: varies but says nothing),
constant (P(yes) = the prevalence for every post: calibrated and uninformative).
Prints coverage and mean width of each, the width ratios to uniform, the uniform budget that would
give the same width (from the uniform widths at the three budgets, width ∝ n^-b fitted in log-log),
hence the share of labels saved, the two-phase estimate's bias in units of its standard deviation,
and the issue's criteria for the two-phase design cell by cell.
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
    reported,
    simple_random_sample,
    stats,
    two_phase_interval,
    two_phase_sample,
    uniform_ppi,
)

PREVALENCES = (0.05, 0.15, 0.3)
MODELS = ("calibrated", "overconfident", "uninformative", "constant")
BUDGETS = (150, 300, 600)
CONFIDENCE = 0.95
CHUNK = 100
# The criteria for label_sample's default design, in every cell.
UNINFORMATIVE_MAX_WIDTH = 1.05      # at most 5 % wider than uniform PPI++ (uninformative, constant)
CALIBRATED_MIN_SAVED = 0.35         # at least 35 % fewer labels for the same width (calibrated)
MIN_COVERAGE = 0.94
MAX_BIAS_SD = 0.1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=1000)
    ap.add_argument("--posts", type=int, default=35_000)
    ap.add_argument("--concentration", type=float, default=0.5)
    ap.add_argument("--floor-share", type=float, default=0.4)  # active, one phase
    ap.add_argument("--burn-in-share", type=float, default=0.1, help="0 leaves the two-phase design out")
    ap.add_argument("--second-floor-share", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument("--prevalences", default=",".join(map(str, PREVALENCES)))
    ap.add_argument("--models", default=",".join(MODELS))
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    started = time.time()
    results: dict = {}
    prevalences = [float(x) for x in args.prevalences.split(",")]
    models = args.models.split(",")
    for prev in prevalences:
        for model in models:
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
                    uni = reported(m["estimate"], np.sqrt(m["imputed_var"] + m["rectifier_var"]), truth, p, srs, human,
                                   CONFIDENCE)
                    pi = active_design(p, budget, args.floor_share)
                    drawn = poisson_draw(rng, pi)
                    h = estimators.hajek_share(truth, pi, CONFIDENCE, drawn)
                    a = estimators.active_mean(p, truth, drawn, pi, CONFIDENCE)
                    act = reported(a["estimate"], a["se"], truth, p, drawn, (h["lo"], h["hi"]), CONFIDENCE, pi)
                    if args.burn_in_share > 0:
                        burn, second, pi0, pi2, weight, calibrated, mixture = two_phase_sample(
                            rng, truth, p, budget, args.burn_in_share, args.second_floor_share)
                        est, lo, hi = two_phase_interval(truth, p, burn, second, pi0, pi2, weight, calibrated,
                                                         CONFIDENCE)
                        two = (lo, hi)
                        cell.setdefault("two_error", []).append(est["estimate"] - target)
                        cell.setdefault("two_labels", []).append((burn | second).sum(axis=1))
                        cell.setdefault("two_burn_in", []).append(burn.sum(axis=1))
                        cell.setdefault("two_mixture", []).append(mixture)
                    else:
                        two = (np.full(reps, np.nan), np.full(reps, np.nan))
                    for name, (lo, hi) in (("classical", human), ("uniform", uni), ("active", act), ("two", two)):
                        cell.setdefault(name + "_cov", []).append(covers(lo, hi, target))
                        cell.setdefault(name + "_width", []).append(hi - lo)
                    cell.setdefault("labels", []).append(drawn.sum(axis=1))
            results[(prev, model, "accuracy")] = float(np.mean(acc))
    print(f"reps {args.reps}, N {args.posts:,}, Beta concentration {args.concentration}, active floor share "
          f"{args.floor_share}; two-phase: burn-in share {args.burn_in_share:.3g}, second floor share "
          f"{args.second_floor_share}; seed {args.seed}; {time.time() - started:.0f} s")
    print()
    print("| prevalence | model | accuracy | budget | labels active / two-phase (burn-in) | coverage classical / uniform / "
          "active / two-phase | width classical / uniform / active / two-phase | active / uniform width | two-phase / "
          "uniform width | uniform labels for the same width: active / two-phase | labels saved: active / two-phase | "
          "two-phase: mixture weight, bias / SD |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    failures = []
    for prev in prevalences:
        for model in models:
            cells = [results[(prev, model, b)] for b in BUDGETS]
            mean = [{k: float(np.nanmean(np.concatenate(v))) for k, v in c.items()} for c in cells]
            # uniform width ~ A n^-b, fitted on the three budgets
            slope, intercept = np.polyfit(np.log(BUDGETS), np.log([c["uniform_width"] for c in mean]), 1)
            for budget, c, raw in zip(BUDGETS, mean, cells):
                equivalent = [float(np.exp((np.log(c[k]) - intercept) / slope)) for k in ("active_width", "two_width")]
                saved = [1 - budget / e for e in equivalent]
                ratio = c["two_width"] / c["uniform_width"]
                error = np.concatenate(raw["two_error"]) if "two_error" in raw else np.array([np.nan])
                bias_sd = error.mean() / error.std()
                print(f"| {prev} | {model} | {results[(prev, model, 'accuracy')]:.3f} | {budget} | {c['labels']:.0f} / "
                      f"{c.get('two_labels', np.nan):.0f} ({c.get('two_burn_in', np.nan):.0f}) | "
                      f"{c['classical_cov']:.3f} / {c['uniform_cov']:.3f} / {c['active_cov']:.3f} / {c['two_cov']:.3f} | "
                      f"{c['classical_width']:.4f} / {c['uniform_width']:.4f} / {c['active_width']:.4f} / "
                      f"{c['two_width']:.4f} | {c['active_width'] / c['uniform_width']:.3f} | {ratio:.3f} | "
                      f"{equivalent[0]:.0f} / {equivalent[1]:.0f} | {saved[0]:.0%} / {saved[1]:.0%} | "
                      f"{c.get('two_mixture', np.nan):.2f}, {bias_sd:+.3f} |")
                if args.burn_in_share <= 0:
                    continue
                where = f"prevalence {prev}, {model}, {budget} labels"
                if model in ("uninformative", "constant") and ratio > UNINFORMATIVE_MAX_WIDTH:
                    failures.append(f"{where}: {ratio:.3f} x the uniform width (goal <= {UNINFORMATIVE_MAX_WIDTH})")
                if model == "calibrated" and saved[1] < CALIBRATED_MIN_SAVED:
                    failures.append(f"{where}: {saved[1]:.0%} fewer labels (goal >= {CALIBRATED_MIN_SAVED:.0%})")
                if c["two_cov"] < MIN_COVERAGE:
                    failures.append(f"{where}: coverage {c['two_cov']:.3f} (goal >= {MIN_COVERAGE})")
                if abs(bias_sd) > MAX_BIAS_SD:
                    failures.append(f"{where}: bias {bias_sd:+.3f} SD (goal <= {MAX_BIAS_SD})")
    if args.burn_in_share > 0:
        print()
        print("Two-phase design against the goals: " + ("met in every cell." if not failures else
                                                           "missed in " + "; ".join(failures) + "."))


if __name__ == "__main__":
    main()
