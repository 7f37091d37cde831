"""Agreement with the human labels under the sampling design, by simulation (issue: human labels you can rely on).

    .venv/bin/python benchmarks/agreement_design.py [--reps 1000] [--posts 20000] [--labels 300]

Two equally good models label the same N posts: each reports P(yes) from its own independent noisy
signal of the post's true label (z ~ Normal(±mu, 1), P(yes) = P(Y = 1 | z); hard answer P(yes) > 0.5,
accuracy 0.86 at mu 1 and prevalence 0.3), so in the population F1(A) - F1(B) is 0 up to noise. The
human sample is drawn with probabilities steered by model A, as label_sample draws it, and each
model's agreement is computed as aggregate computes it:
  uniform     simple random sample (stats.agreement),
  active      Poisson sample, pi from A's uncertainty, floor ``--floor-share`` (label_sample.design: active),
  two_phase   uniform burn-in, then the mixture design chosen from it (label_sample's default; both
              phases steered by A, as when A is label_sample.model),
and for the steered designs both unweighted (the labelled counts, as compare did before) and weighted
by the design (estimators.weighted_agreement). A share ``--fail-share`` of B's answers fails, chosen
among the posts B is least sure about; a failure counts as a wrong answer.
Prints, per design and method, the mean and sd of F1(A) - F1(B) minus its population value (the bias),
the coverage of each model's F1 interval and of the other metrics' intervals (truth: the metric over
all N posts), and how often compare's verdict (the interval of the paired F1 difference,
estimators.paired_difference, excludes 0) names a better model, with that interval's coverage.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from _stats_sim import active_design, estimators, poisson_draw, simple_random_sample, stats, two_phase_sample

CONFIDENCE = 0.95
METRICS = stats.AGREEMENT_METRICS


def models(rng, n_posts: int, prevalence: float, mu: float):
    truth = rng.random(n_posts) < prevalence
    prior = np.log(prevalence / (1 - prevalence))

    def one():
        z = rng.normal(mu * (2 * truth - 1), 1.0)
        return 1 / (1 + np.exp(-(prior + 2 * mu * z)))

    return truth, one(), one()


def cells(truth, says_yes):
    """Cell per post (estimators.TP ...); a failed answer (NaN) counts as wrong, as aggregate counts it."""
    answer = np.where(np.isnan(says_yes), ~truth, says_yes > 0.5)
    return np.where(truth, np.where(answer, estimators.TP, estimators.FN), np.where(answer, estimators.FP, estimators.TN))


def population_metrics(c):
    counts = np.bincount(c, minlength=4)
    return stats.confusion_metrics(*counts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=1000)
    ap.add_argument("--posts", type=int, default=20_000)
    ap.add_argument("--labels", type=int, default=300)
    ap.add_argument("--prevalence", type=float, default=0.3)
    ap.add_argument("--mu", type=float, default=1.0)
    ap.add_argument("--floor-share", type=float, default=0.4)
    ap.add_argument("--burn-in-share", type=float, default=0.1)
    ap.add_argument("--second-floor-share", type=float, default=0.2)
    ap.add_argument("--fail-share", type=float, default=0.0)
    ap.add_argument("--bootstrap", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=3)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    started = time.time()
    out: dict = {}
    accuracy = []
    for rep in range(args.reps):
        truth, p_a, p_b = models(rng, args.posts, args.prevalence, args.mu)
        answer_b = (p_b > 0.5).astype(float)
        if args.fail_share:
            unsure = np.argsort(np.abs(p_b - 0.5))[:int(args.fail_share * args.posts)]
            answer_b[unsure] = np.nan
        cells_a, cells_b = cells(truth, (p_a > 0.5).astype(float)), cells(truth, answer_b)
        accuracy.append(np.mean((p_a > 0.5) == truth))
        pop = {"A": population_metrics(cells_a), "B": population_metrics(cells_b)}
        samples = {"uniform": (simple_random_sample(rng, 1, args.posts, args.labels)[0], None)}
        pi = active_design(p_a[None], args.labels, args.floor_share)[0]
        drawn = poisson_draw(rng, pi)
        samples["active"] = (drawn, estimators.poisson_design(pi[drawn]))
        two = two_phase_sample(rng, truth[None].astype(float), p_a[None], args.labels, args.burn_in_share,
                               args.second_floor_share)
        burn = two.burn_in[0]
        drawn = burn | two.drawn[0]
        samples["two_phase"] = (drawn, estimators.two_phase_weights(burn[drawn], two.pi_burn_in[0], two.pi[0][drawn],
                                                                    two.combination[0]))
        for design, (drawn, weights) in samples.items():
            for method in (("counts",) if design == "uniform" else ("unweighted", "weighted")):
                results = {}
                for name, c in (("A", cells_a), ("B", cells_b)):
                    seed = rep * 7 + (name == "B")
                    if method == "counts" or method == "unweighted":
                        counts = np.bincount(c[drawn], minlength=4)
                        results[name] = stats.agreement(*(int(x) for x in counts), CONFIDENCE, args.bootstrap, seed)
                    else:
                        results[name] = estimators.weighted_agreement(c[drawn], weights, CONFIDENCE, args.bootstrap,
                                                                      seed)
                cell = out.setdefault((design, method), {})
                cell.setdefault("diff", []).append((results["A"]["f1"] - results["B"]["f1"])
                                                   - (pop["A"]["f1"] - pop["B"]["f1"]))
                cell.setdefault("labels", []).append(int(np.sum(drawn)))
                for name in ("A", "B"):
                    for m in METRICS:
                        r = results[name]
                        if np.isfinite(r[m + "_lo"]):
                            cell.setdefault(f"cov_{m}", []).append(r[m + "_lo"] <= pop[name][m] <= r[m + "_hi"])
                # compare's verdict: the paired difference on the same labelled posts, the same design weights
                design_weights = weights if method == "weighted" else estimators.srs_design(int(np.sum(drawn)))
                paired = estimators.paired_difference(cells_a[drawn], cells_b[drawn], design_weights, CONFIDENCE,
                                                      args.bootstrap, seed=rep * 7 + 2)["f1"]
                cell.setdefault("verdict", []).append(paired["lo"] > 0 or paired["hi"] < 0)
                cell.setdefault("cov_paired", []).append(paired["lo"] <= pop["A"]["f1"] - pop["B"]["f1"] <= paired["hi"])
    print(f"reps {args.reps}, N {args.posts:,}, {args.labels} labels, prevalence {args.prevalence}, mu {args.mu} "
          f"(accuracy of each model {np.mean(accuracy):.3f}), floor share {args.floor_share}, failures of B "
          f"{args.fail_share:.0%}, {args.bootstrap} bootstrap replicates, seed {args.seed}; {time.time() - started:.0f} s")
    print()
    print("| design | agreement | labels (mean) | F1(A) - F1(B): bias | sd | coverage F1 (A and B) | coverage accuracy / "
          "precision / recall / kappa | paired F1(A) - F1(B): coverage | verdict names a better model |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (design, method), c in out.items():
        diff = np.array(c["diff"])
        others = " / ".join(f"{np.mean(c['cov_' + m]):.3f}" for m in ("accuracy", "precision", "recall", "kappa"))
        print(f"| {design} | {method} | {np.mean(c['labels']):.0f} | {diff.mean():+.4f} (± {diff.std() / np.sqrt(diff.size):.4f}) | "
              f"{diff.std():.4f} | {np.mean(c['cov_f1']):.3f} | {others} | {np.mean(c['cov_paired']):.3f} | "
              f"{np.mean(c['verdict']):.1%} |")


if __name__ == "__main__":
    main()
