"""compare.md: the models side by side in sentences, per question, with the verdict rule (a model is
called better only when the interval of the paired difference, on the same labelled posts under the same
design weights, excludes 0; as good as the other only inside the equivalence margin the user set), costs
and the first disagreements."""

from __future__ import annotations

import math
from typing import Any, Sequence

# The kinds of rows of disagreements.csv (sql/compare_disagreements.sql), in the order compare.md counts them.
DISAGREEMENT_KINDS = ("answers differ", "some gave no answer")


def to_float(value) -> float:
    if value is None or value == "":
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def parsed_row(row: dict[str, Any]) -> dict[str, Any]:
    """A models.csv row with its numbers as floats (NaN where empty), for text and plot."""
    text = {"model", "model_id", "server", "question", "human_ci_method", "corrected_method", "agreement_design",
            "note"}
    return {k: (v if k in text else to_float(v)) for k, v in row.items()}


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _num(x, digits: int = 2) -> str:
    return f"{x:.{digits}f}" if _finite(x) else "n/a"


def _pct(x) -> str:
    return f"{100 * x:.1f}%" if _finite(x) else "n/a"


def _interval(r: dict, key: str, fmt=_num, bounds: str | None = None) -> str:
    """``key`` with its interval, ``<bounds>_lo`` and ``<bounds>_hi`` (bounds: ``key`` unless given)."""
    bounds = bounds or key
    return f"{fmt(r[key])} [{fmt(r[bounds + '_lo'])}, {fmt(r[bounds + '_hi'])}]"


def _sig(x: float) -> str:
    """Two significant digits, no exponent: 3.1, 24, 0.52, 1,240."""
    if not _finite(x):
        return "n/a"
    if x == 0:
        return "0"
    digits = max(0, 1 - math.floor(math.log10(abs(x))))
    return f"{round(x, digits):,.{digits}f}"


def _cost_text(r: dict) -> str:
    return f"{_sig(r['gpu_hours'])} GPU-hours (${_sig(r['cost_usd'])})"


def _cost_ratio(r: dict, cheapest: dict | None) -> float:
    if cheapest is None or r is cheapest or not _finite(r["cost_usd"]) or not cheapest["cost_usd"] > 0:
        return math.nan
    return r["cost_usd"] / cheapest["cost_usd"]


def _question_section(qid: str, rows: list[dict], pairs: list[dict], disagreements: dict,
                      human: dict | None) -> list[str]:
    out = [f"### {qid}", ""]
    for r in rows:
        sentences = []
        if not r["answered"]:
            sentences.append(f"answered none of the {int(r['posts']):,} classified posts (every request failed or gave "
                             "no answer for this question): no share of its own.")
        if human and _finite(r["agreement_n"]) and r["agreement_n"] > 0:
            failed = int(r["agreement_no_answer"]) if _finite(r["agreement_no_answer"]) else 0
            counted = (f", the {failed:,} it gave no answer for counted as wrong answers" if failed else "")
            weighted = " weighted by the sampling design" if r["agreement_design"] != "uniform" else ""
            sentences.append(f"Against the humans on the {int(r['agreement_n']):,} labelled posts{counted}{weighted}: F1 "
                             f"{_interval(r, 'f1')}, precision {_interval(r, 'precision')}, recall "
                             f"{_interval(r, 'recall')}, kappa {_interval(r, 'kappa')}.")
        elif human:
            sentences.append("No human label for this question.")
        if not r["answered"]:
            out.append(f"- **{r['model']}**: " + " ".join(sentences))
            continue
        if _finite(r["corrected"]):
            sentences.append(f"Corrected prevalence {_interval(r, 'corrected', _pct)} of all {int(r['posts']):,} "
                             f"classified posts ({r['corrected_method']}).")
        sentences.append(f"Its own \"yes\" share: {_interval(r, 'model_share', _pct, 'model')} of the "
                         f"{int(r['answered']):,} posts it answered.")
        out.append(f"- **{r['model']}**: " + " ".join(sentences))
    if human:
        human_row = next((r for r in rows if _finite(r["human_share"])), None)
        if human_row:
            out.append(f"- Human labels alone ({int(human_row['human_n']):,} posts): "
                       f"{_interval(human_row, 'human_share', _pct, 'human')} ({human_row['human_ci_method']}).")
        costed = [r for r in rows if _finite(r["cost_usd"])]
        cheapest = min(costed, key=lambda r: r["cost_usd"]) if costed else None
        parts = []
        for r in rows:
            if not _finite(r["f1"]):
                continue
            part = f"{r['model']}: F1 {_interval(r, 'f1')} at {_cost_text(r)}"
            ratio = _cost_ratio(r, cheapest)
            if _finite(ratio):
                part += f", {ratio:.1f} x the cost"
            parts.append(part)
        if len(parts) > 1:
            out.append("- What each model reaches, at what cost: " + "; ".join(parts) + ".")
        out += [f"- {sentence}" for sentence in _verdicts(rows, pairs, cheapest)]
    for p in pairs:
        if not p["both_answered"]:
            out.append(f"- {p['model_a']} and {p['model_b']} never both answered a post.")
            continue
        diff = p["yes_share_difference"]
        s = (f"- {p['model_a']} and {p['model_b']} agree on {_interval(p, 'agreement', _pct)} of the "
             f"{p['both_answered']:,} posts both answered, kappa {_interval(p, 'kappa')}; {p['model_a']} says "
             f"\"yes\" on {_pct(p['a_yes_share'])} of them, {p['model_b']} on {_pct(p['b_yes_share'])} "
             f"({100 * diff:+.1f} points).")
        if p["only_a_answered"] or p["only_b_answered"]:
            s += (f" {p['only_a_answered']:,} post(s) only {p['model_a']} answered, {p['only_b_answered']:,} "
                  f"only {p['model_b']}.")
        out.append(s)
    if len(rows) > 1:
        counts = [disagreements["counts"].get((qid, kind), (0, 0)) for kind in DISAGREEMENT_KINDS]
        (differ, differ_labelled), (failed, failed_labelled) = counts
        if differ or failed:
            out.append(f"- disagreements.csv: {differ:,} post(s) where the answers differ ({differ_labelled:,} with a "
                       f"human label), {failed:,} where some model gave no answer ({failed_labelled:,} with a human "
                       "label).")
        else:
            out.append("- The models gave the same answer on every post of this question that any of them answered, "
                       "and none failed where another answered.")
    out.append("")
    return out


# How compare.md names each metric of the paired comparison (estimators.PAIRED_METRICS).
PAIRED_METRIC_NAMES = {"f1": "F1", "precision": "precision", "recall": "recall",
                       "prevalence_error": "the error of its own \"yes\" share"}


def _difference(p: dict, metric: str) -> str:
    return (f"{p[metric + '_difference']:+.3f} [{p[metric + '_difference_lo']:+.3f}, "
            f"{p[metric + '_difference_hi']:+.3f}]")


def _verdicts(rows: list[dict], pairs: list[dict], cheapest: dict | None) -> list[str]:
    """Per pair of models, the verdict of the paired comparison (compare.paired_differences): F1 in full,
    then precision, recall and the prevalence error in one sentence."""
    by_model = {r["model"]: r for r in rows}
    out = []
    for p in pairs:
        a, b = p["model_a"], p["model_b"]
        if not p.get("paired_n"):
            out.append(f"{a} and {b}: no labelled post to compare them on, so no verdict.")
            continue
        margin = p["equivalence_margin"]
        on = (f"on the same {p['paired_n']:,} labelled posts"
              + (" weighted by the sampling design" if p["paired_design"] != "uniform" else ""))
        kind = p["f1_verdict"]
        if kind in ("a_better", "b_better"):
            better, worse = (a, b) if kind == "a_better" else (b, a)
            s = (f"{better} agrees better with the human labels than {worse} on this question: F1 {p['f1_a']:.3f} "
                 f"({a}) against {p['f1_b']:.3f} ({b}), a paired difference {a} - {b} of {_difference(p, 'f1')} {on}")
            rb, rw = by_model.get(better, {}), by_model.get(worse, {})
            if _finite(rb.get("cost_usd")) and _finite(rw.get("cost_usd")) and rw["cost_usd"] > 0:
                ratio = rb["cost_usd"] / rw["cost_usd"]
                s += (f", at {ratio:.1f} x the cost of {worse}" if ratio >= 1 else
                      f", and costs less ({_sig(ratio)} x the cost of {worse})")
            s += "."
        elif kind == "equivalent":
            s = (f"{a} and {b} are as good as each other on F1 within the equivalence margin ±{margin:g} you set "
                 f"(compare.equivalence_margin): the paired difference {a} - {b} is {_difference(p, 'f1')} {on}.")
        elif kind == "cannot_tell" and not p["paired_discordant"]:
            s = (f"{a} and {b} fall in the same cell of the human comparison on each of the {p['paired_n']:,} labelled "
                 "posts: these labels hold no post that tells them apart, so they cannot say which is better, nor "
                 "that the two are as good as each other (disagreements.csv lists the posts where they differ).")
        elif kind == "cannot_tell":
            s = (f"{a} and {b}: these labels cannot tell the two apart on this question: the "
                 f"paired F1 difference {a} - {b} is {_difference(p, 'f1')} {on}, an interval that holds 0. They "
                 f"would detect a difference of about ±{p['f1_detectable']:.3f} (80 % of the time); "
                 + ("no equivalence margin is set (compare.equivalence_margin), so no claim that the two are as "
                    "good as each other is made either." if margin is None else
                    f"the interval reaches beyond the equivalence margin ±{margin:g}, so neither are they shown to be "
                    "as good as each other."))
        else:
            s = f"{a} and {b}: F1 cannot be estimated on these labels (see the notes in models.csv), so no verdict."
        others = []
        for metric in ("precision", "recall", "prevalence_error"):
            word = {"a_better": f"{a} better", "b_better": f"{b} better", "equivalent": "as good as each other",
                    "cannot_tell": "cannot tell"}.get(p[f"{metric}_verdict"])
            if word:
                others.append(f"{PAIRED_METRIC_NAMES[metric]} {_difference(p, metric)} ({word})")
        if others:
            s += f" Paired differences {a} - {b} of " + "; ".join(others) + "."
        out.append(s)
    return out


def compare_markdown(config: dict, described: Sequence[dict], ids: Sequence[str], model_rows: Sequence[dict],
                     pair_rows: Sequence[dict], disagreements: dict, human: dict | None) -> str:
    c = f"{float(config['stats']['confidence']):.0%}"
    rows = [parsed_row(r) for r in model_rows]
    names = [d["name"] for d in described]
    out = ["# Model comparison", ""]
    posts = int(rows[0]["posts"]) if rows and _finite(rows[0]["posts"]) else 0
    models = f"{len(described)} model{'s' if len(described) > 1 else ''}"
    out.append(f"{models} labelled the same {posts:,} classified posts: "
               + ", ".join(f"{d['name']} (`{'; '.join(d['model_ids']) or 'no answer recorded'}`)" for d in described)
               + f". Every interval is at {c}. Each model's own numbers come from its summary "
               + ", ".join(f"`{d['summary']['dir']}`" for d in described) + ".")
    out.append("")
    if len(described) == 1:
        out += ["Only one model is configured: there is no pair to compare; its numbers are listed for reference.", ""]
    if human:
        out.append(f"Human labels: `{human['path']}` ({human['usable']:,} usable rows on {human['posts']:,} posts), "
                   "the same for every model. A model is called better than another only when the interval of "
                   "their paired difference (the same labelled posts under the same design weights) excludes 0, and "
                   "as good as the other only when it lies inside the equivalence margin set in "
                   "compare.equivalence_margin.")
    else:
        out.append("**No human labels are configured** (config key `human_labels`): which model is right cannot be "
                   "told. Only the agreement between the models and each model's own share are given; the shares "
                   "are not corrected for the models' errors.")
    for warning in _provenance_warnings(described):
        out += ["", warning]
    out += ["", "## Per question", ""]
    for qid in ids:
        out += _question_section(qid, [r for r in rows if r["question"] == qid],
                                 [p for p in pair_rows if p["question"] == qid], disagreements, human)

    out += ["## Tokens, busy time and cost", "",
            "| model | requests | input tokens | output tokens | busy hours | GPU-hours | cost (USD) |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for name in names:
        r = next(r for r in rows if r["model"] == name)
        cells = [_count(r["requests"]), _count(r["input_tokens"]), _count(r["output_tokens"]),
                 _num(r["busy_s"] / 3600), _num(r["gpu_hours"]), _num(r["cost_usd"])]
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    out += ["", f"Busy time: the time with a request in flight, summed over shard jobs; GPU-hours and cost at each "
                f"model's GPUs per job and ${config['cost']['gpu_hour_usd']} per GPU-hour (server start-up not "
                "included), as in each model's summary. Before a full run, `snakemake estimate` projects each model's "
                "wall time, GPU-hours and cost from a pilot, start-up included: results/estimate.md.", ""]

    out += ["## Disagreements", ""]
    if len(described) == 1:
        out.append("One model: nothing to disagree on.")
    elif not disagreements["total"]:
        out.append("None: on every post and question the models that answered gave the same answer, and none "
                   "failed where another answered.")
    else:
        out.append(f"`disagreements.csv` lists all {disagreements['total']:,} (post, question) pairs where the models' "
                   "answers differ (`kind` = answers differ) or some model gave no answer while another did (`kind` = "
                   "some gave no answer): posts with a human label first, then by post id. Open a post's video at "
                   "`video_path`; `answer_<model>` is each model's answer, `p_yes_<model>` its probability of "
                   "\"yes\" where the server gave log-probabilities, `human_label` the resolved human label.")
        shown = disagreements["first"]
        out += ["", f"The first {len(shown)} of {disagreements['total']:,}:", "",
                "| post_id | question | kind | " + " | ".join(names) + " | human | video_path |",
                "|---|---|---|" + "---|" * len(names) + "---|---|"]
        for d in shown:
            answers = [_answer_cell(d[f"answer_{n}"], d[f"p_yes_{n}"]) for n in names]
            out.append(f"| {d['post_id']} | {d['question']} | {d['kind']} | " + " | ".join(answers)
                       + f" | {d['human_label'] or ''} | {d['video_path'] or ''} |")
    out += ["", "## How these numbers are made", "",
            "- Per model (models.csv): copied from the model's own summary (prevalence.csv, agreement.csv, the `all` "
            "row of throughput.csv); summary.md there explains them.",
            "- A model's own share is over the posts it answered; its interval reflects sampling only, not the "
            "model's errors. The corrected share (all classified posts) combines the model's predictions with the "
            "human labels.",
            "- Agreement with the humans: precision, recall (Wilson intervals), F1 and kappa (percentile bootstrap) on "
            "the same human-labelled posts for every model: a post a model gave no answer for counts as its wrong "
            "answer, so a failure never flatters a model. With varying sampling probabilities (an active sample) each "
            "label is weighted by 1/probability and the intervals resample the design: the figures estimate each "
            "metric over all classified posts, not over the posts the steering model was unsure about.",
            "- Better or not: the two models are scored on the same labelled posts, so their difference is "
            "estimated post by post (paired): the design-weighted difference of F1, precision, recall and of the "
            "error of each one's own \"yes\" share, with a percentile interval from a bootstrap that resamples "
            "the design once for both models. A model is better only when that interval excludes 0; the two are "
            "as good as each other only when it lies inside the equivalence margin (config "
            "compare.equivalence_margin, set before looking); otherwise the labels cannot tell them apart, and "
            "compare.md says how large a difference they could detect (80 % of the time). model_agreement.csv "
            "has every figure. Two separate intervals that overlap prove nothing: the pairing cancels the posts "
            "both models get right or wrong.",
            "- Between models (model_agreement.csv): on the posts both answered, the share on which they agree "
            "(Wilson) and Cohen's kappa (percentile bootstrap); `yes_share_difference` is A's \"yes\" share minus "
            "B's on those posts.",
            ""]
    return "\n".join(out)


def _provenance_warnings(described: Sequence[dict]) -> list[str]:
    out = []
    for d in described:
        if len(d["provenance"]) > 1:
            out.append(f"**WARNING: {d['name']}'s answers come from {len(d['provenance'])} different servers or "
                       f"settings (mixed provenance)**: " + "; ".join(
                           f"{r.answers:,} by {r.server or 'an unknown server'} under settings "
                           f"`{r.settings_fingerprint}`"
                           for r in d["provenance"])
                       + ". Its numbers mix them; rerun its classify under one setting if they must not be mixed "
                       "(its summary.md lists them).")
    prompts = {p for d in described for p in d["prompts"]}
    if len(prompts) > 1:
        out.append(f"**WARNING: the models' answers come from {len(prompts)} different prompts or question texts** "
                   "(labels' `prompt_hash`): the comparison is of model and prompt together.")
    return out


def _count(x) -> str:
    return f"{int(x):,}" if _finite(x) else "n/a"


def _answer_cell(answer, p_yes) -> str:
    if answer is None:
        return "no answer"
    return f"{answer} (P(yes) {p_yes:.2f})" if _finite(p_yes) else str(answer)
