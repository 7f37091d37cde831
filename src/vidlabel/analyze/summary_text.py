"""summary.md: every number of the aggregate's tables in sentences, each share with the population it
describes, and how the numbers are made."""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from vidlabel.analyze import stats
from vidlabel.analyze.humans import example_rows, resolution_examples
from vidlabel.analyze.merge import provenance_counts
from vidlabel.analyze.sample_design import describe
from vidlabel.core.stage_settings import fingerprint

NO_TYPE = "no type"  # how the tables and summary.md name a post without post_type
TOKEN_KINDS = ("video", "image", "audio", "text")


def provenance_section(con, config: dict[str, Any]) -> list[str]:
    """Lines of summary.md's provenance section: what made the answers (model, server, classify
    settings and prompt fingerprints, from the labels' provenance columns), loudly when more than one
    thing did. ``summary_markdown`` places it after the errors."""
    rows = provenance_counts(con)
    if not rows:
        return ["labels.parquet carries no provenance (merged before vidlabel recorded it): rerun the merge."]
    lines = [f"- {r.answers:,} requests answered by {r.server or 'an unknown server'} for model `{r.model}`"
             + (f" ({r.model_revision})" if r.model_revision else "")
             + f", classify settings `{r.settings_fingerprint}`, prompt `{r.prompt_hash}`" for r in rows]
    if len(rows) > 1:
        lines.insert(0, f"**WARNING: the answers come from {len(rows)} different servers, model revisions or "
                        "settings** (listed below; each row of labels.parquet names its own). Rerun classify "
                        "under one setting if they must not be mixed.")
    return lines + ["", f"The settings of this summary: `{fingerprint(config, 'aggregate')}` "
                        "(each job's log prints its settings in full)."]


def is_missing(x) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def pct(x) -> str:
    return "n/a" if is_missing(x) else f"{100 * x:.1f}%"


def num(x, digits=2) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:,.{digits}f}"


def _prevalence_sentence(r: dict, human: dict | None, c: str) -> str:
    """One question's shares, each with the population it is about."""
    s = f"- **{r['question']}**: "
    if r["answered"]:
        s += (f"the model answered \"yes\" for {pct(r['model_share'])} of the {r['answered']:,} posts it answered "
              f"({c} CI {pct(r['model_lo'])}–{pct(r['model_hi'])}")
        s += (f"; the {r['no_answer']:,} classified posts without an answer are not in this share)."
              if r["no_answer"] else ").")
    else:
        s += f"the model answered none of the {r['posts']:,} classified posts."
    if human and r.get("human_n"):
        population = r.get("ppi_population") or r["posts"]
        posts = "classified posts of the sample's frame" if r.get("outside_frame") else "classified posts"
        s += (f" Human labels on {r['human_n']:,} of the {population:,} {posts} give a human-only share "
              f"of {pct(r.get('human_share'))} for all {population:,} {posts} ({c} CI "
              f"{pct(r.get('human_lo'))}–{pct(r.get('human_hi'))}, {r.get('human_ci_method')}).")
        if not is_missing(r.get("corrected")):
            s += (f" Combining the model's predictions with the human labels ({r['corrected_method']}, "
                  f"λ = {r['lambda']:.2f}), the share among all {population:,} {posts}, answered "
                  f"or not, is **{pct(r['corrected'])}** ({c} CI {pct(r['corrected_lo'])}–"
                  f"{pct(r['corrected_hi'])}).")
            if not is_missing(r.get("uniform_halfwidth")):
                half = (r["corrected_hi"] - r["corrected_lo"]) / 2
                s += (" A uniform random sample of as many posts would have given about "
                      f"±{pct(r['uniform_halfwidth'])} (PPI++) against ±{pct(half)} here.")
    if r.get("note"):
        s += f" Note: {r['note']}."
    return s


def summary_markdown(config, status_counts, prevalence_rows, agreement_rows, tokens_rows, throughput_rows,
                     errors_rows, human, provenance_lines: Sequence[str] = (),
                     post_type_lines: Sequence[str] = ()) -> str:
    conf = float(config["stats"]["confidence"])
    c = f"{conf:.0%}"
    total = sum(status_counts.values())
    ok, err, exc = (status_counts.get(k, 0) for k in ("ok", "error", "excluded"))
    out = ["# vidlabel summary", "",
           f"The inventory holds {total:,} posts: {ok:,} were classified, {err:,} requests ended in an error "
           f"and {exc:,} posts were excluded before classification (see errors.csv).", ""]

    out += ["## Prevalence", ""]
    for r in prevalence_rows:
        out.append(_prevalence_sentence(r, human, c))
    if not human:
        out += ["", "No human labels are configured (config key `human_labels`), so the shares above are the "
                    "model's alone and may be biased; agreement.csv has a header only."]
    out.append("")

    if agreement_rows:
        out += ["## Agreement with human labels", ""]
        for a in agreement_rows:
            if not a["n"]:
                out.append(f"- **{a['question']}**: no post has a human label (not tied).")
                continue
            parts = ", ".join(f"{m} {num(a[m])} ({num(a[m + '_lo'])}–{num(a[m + '_hi'])})"
                              for m in stats.AGREEMENT_METRICS)
            weighted = " (weighted by the sampling design)" if a["design"] != "uniform" else ""
            s = f"- **{a['question']}** on the {a['n']:,} human-labelled posts{weighted}: {parts}."
            if a["tied_labels"]:
                s += f" {a['tied_labels']:,} labelled post(s) with tied human labels are not compared."
            if a["note"]:
                s += f" Note: {a['note']}."
            out.append(s)
        out += ["", "A labelled post the model gave no answer for counts as a wrong answer (fn where the human said "
                    "\"yes\", fp where \"no\"), so that a failure never makes a model look better. Every figure "
                    "estimates the metric over all classified posts: with varying sampling probabilities each label "
                    "is weighted by its design weight (an active sample draws the posts the model is unsure about; "
                    f"unweighted they would describe those posts only). Intervals at {c}: "
                    + "; ".join(sorted({a['ci_method'] for a in agreement_rows})) + ".", ""]

    out += ["## Tokens", ""]
    tok = {r["direction"]: r for r in tokens_rows}
    if tok.get("input", {}).get("requests"):
        i, o = tok["input"], tok.get("output", {})
        out.append(f"{i['requests']:,} requests reported usage: {num(i['mean'], 0)} input tokens on average "
                   f"(p50 {num(i['p50'], 0)}, p90 {num(i['p90'], 0)}, p99 {num(i['p99'], 0)}, max {i['max']:,}) "
                   f"and {num(o.get('mean'), 1)} output tokens (max {o.get('max') or 0:,}); "
                   f"{num(i['total'], 0)} input and {num(o.get('total'), 0)} output tokens in all, a prefill:decode "
                   f"ratio of {num(i['prefill_decode_ratio'], 1)}:1.")
    else:
        out.append("No request reported token usage.")
    out += ["", _tokens_by_kind_text(tok), ""]

    if post_type_lines:
        out += ["## By post type", "", *post_type_lines, ""]

    out += ["## Throughput and cost", ""]
    overall = next((r for r in throughput_rows if r["shard"] == "all"), None)
    if overall:
        shards = len(throughput_rows) - 1
        out.append(f"{overall['requests']:,} requests over {shards} shard job(s) kept the model busy for "
                   f"{num(overall['busy_s'] / 3600, 2)} instance-hours: {num(overall['requests_per_s'], 3)} requests/s "
                   f"and {num(overall['tokens_per_s'], 0)} tokens/s per model instance "
                   f"({num(1 / overall['requests_per_s'] if overall['requests_per_s'] else math.nan, 2)} s per request). "
                   f"Wall clock from first to last request: {num(overall['span_s'] / 3600, 2)} h "
                   f"({num(overall['wall_requests_per_s'], 3)} requests/s for the whole run). "
                   f"That is {num(overall['gpu_hours'], 2)} GPU-hours at {_gpus_per_job(throughput_rows)} GPUs per job, "
                   f"about ${num(overall['cost_usd'], 2)} at ${config['cost']['gpu_hour_usd']} per GPU-hour "
                   "(server start-up not included).")
    else:
        out.append("No request has timestamps yet.")
    out.append("")

    out += ["## Errors", ""]
    if errors_rows:
        out += [f"- {e['stage']}: {e['reason']}: {e['count']:,}" for e in errors_rows]
    else:
        out.append("None.")
    out.append("")

    if provenance_lines:
        out += ["## Provenance", "", *provenance_lines, ""]

    if human:
        out += ["## Human labels", "", _human_labels_text(human)]
        if human["issues"]:
            out.append("Rows not used (reported, not silently dropped):")
            out += [f"- {issue}: {count:,} row(s), e.g. {example_rows(ex)}" for issue, count, ex in human["issues"]]
        if human["resolutions"]:
            out.append("Posts with several labels for one question (resolved, none dropped):")
            out += [f"- {resolution}: {count:,} post-question(s), e.g. {resolution_examples(ex)}"
                    for resolution, count, ex in human["resolutions"]]
        out.append("")

    out += ["## How these numbers are made", "",
            "- Populations: the classified posts (status ok or error) for the human-only and corrected shares (with "
            "the design file, config human_design: those of the frame the sample was drawn from; posts classified "
            "since are described by the model alone); the answered posts for the model share. Excluded posts are "
            "outside both.",
            "- Model share: \"yes\" / answered; posts without an answer are counted in `no_answer`, not in the share. "
            "Its interval (Wilson) reflects sampling only, not the model's errors: it is not an interval for the "
            "true share.",
            "- Human-only share: uniform sample: mean of the human labels with the Wilson interval; sample with "
            "varying `sampling_probability`: Hajek (inverse-probability) mean with Wilson's interval at the "
            "design's effective sample size; two-phase sample: the burn-in's mean and the second draw's Hajek mean "
            "combined.",
            "- Corrected share: uniform sample: PPI++ with the power-tuning λ (ppi_py's estimator, computed in DuckDB "
            "SQL and cross-checked against ppi_py), each label corrected with the λ of the other labels "
            "(cross-fitted: a λ tuned on the label it corrects biased rare shares low); varying probabilities: the "
            "active (Horvitz-Thompson) estimator with power tuning, cross-fitted the same way; two-phase sample: the "
            "burn-in's estimate and the second draw's (conditional on the burn-in) combined with the design's "
            "weights, each half of the burn-in weighed with the weight chosen without its labels. The prediction is the model's probability of \"yes\" when the labels carry it, else "
            "its answer as 1/0; a post without a model answer is predicted as the question's model share, so human "
            "labels on failed posts still count. λ = 0 uses the human labels alone (its interval is then a t "
            "interval, not the Wilson one), λ = 1 the model's predictions in full. The interval uses a t quantile "
            f"on the number of events and contains the human-only interval below {stats.MIN_EVENTS} events "
            "(labelled \"yes\", labelled \"no\", model-human disagreements); its coverage by simulation is in "
            "docs/statistics.md.",
            "- Several human labels for one post and question: the `adjudication` column if given, else the "
            "majority; a tie counts 0.5.",
            f"- Every interval is at the configured confidence ({c}, config stats.confidence).",
            ""]
    return "\n".join(out)


def _tokens_by_kind_text(tok: dict[str, dict]) -> str:
    """The manifest's input-token estimates by kind (tokens.csv's input_video, input_image, input_audio,
    input_text)."""
    rows = {kind: tok.get(f"input_{kind}", {}) for kind in TOKEN_KINDS}
    totals = {kind: float(r.get("total") or 0) for kind, r in rows.items()}
    everything = sum(totals.values())
    if not everything:
        return ("No classified post has an input-token estimate by kind (labels merged without the manifest's "
                "estimates, or no classified post).")
    parts = [f"{kind} {num(totals[kind], 0)} ({pct(totals[kind] / everything)}; "
             + (f"{rows[kind]['requests']:,} requests send {kind}, {num(rows[kind]['mean'], 0)} on average)"
                if rows[kind].get("requests") else f"no request sends {kind})")
             for kind in TOKEN_KINDS]
    return ("By kind, the manifest estimated these input tokens for the classified posts (estimates: the server "
            "reports the total only): " + ", ".join(parts) + ".")


def post_type_section(type_rows: Sequence[dict], prevalence_rows: Sequence[dict], human: dict | None,
                      confidence: float) -> list[str]:
    """Lines of summary.md's "By post type" section: posts, how they ended, items and tokens per type
    (post_types.csv), and each question's shares per type (prevalence_by_type.csv)."""
    if not type_rows:
        return ["The inventory holds no post."]
    c = f"{confidence:.0%}"
    out = ["Each post's type comes from its usable items (docs/mixed_media.md): `video` (one video), `photo` (one "
           "image), `slideshow` (images and a soundtrack), `carousel` (two or more images and videos), `audio`; "
           f"\"{NO_TYPE}\": a post with no usable item (excluded), or labels merged before post types. Tokens per "
           "classified post: the manifest's estimates by kind, and the server's input tokens per request.", "",
           "| post type | posts | ok | error | excluded | items per post (mean, max) | posts with items dropped "
           "| video tokens | image tokens | audio tokens | text tokens | input tokens (server) |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in type_rows:
        items = f"{num(r['items_mean'])} ({r['items_max']:,})" if r["items_max"] is not None else "n/a"
        out.append(f"| {r['post_type'] or NO_TYPE} | {r['posts']:,} | {r['ok']:,} | {r['error']:,} | "
                   f"{r['excluded']:,} | {items} | {r['posts_with_items_dropped']:,} | "
                   f"{num(r['est_video_tokens_mean'], 0)} | {num(r['est_image_tokens_mean'], 0)} | "
                   f"{num(r['est_audio_tokens_mean'], 0)} | "
                   f"{num(r['est_text_tokens_mean'], 0)} | {num(r['input_tokens_mean'], 0)} |")
    if not prevalence_rows:
        return out + ["", "No post was classified: no prevalence by post type."]
    out += ["", f"Prevalence per post type, over the type's classified posts ({c} intervals): the model's share "
                "of the posts it answered; with human labels, the corrected share of all the type's classified "
                "posts from the labels that fall on them (prevalence_by_type.csv; its notes say why a share is "
                "missing or to be read with care).", "",
            "| post type | question | answered | model share | human labels | corrected share |",
            "|---|---|---:|---:|---:|---:|"]
    for r in prevalence_rows:
        model = (f"{pct(r['model_share'])} ({pct(r['model_lo'])}–{pct(r['model_hi'])})"
                 if r["answered"] else "n/a")
        corrected = (f"{pct(r['corrected'])} ({pct(r['corrected_lo'])}–{pct(r['corrected_hi'])})"
                     if not is_missing(r.get("corrected")) else "n/a")
        labels = f"{r['human_n']:,}" if human and r.get("human_n") is not None else "none"
        out.append(f"| {r['post_type'] or NO_TYPE} | {r['question']} | {r['answered']:,} of {r['posts']:,} | "
                   f"{model} | {labels} | {corrected} |")
    if not human:
        out += ["", "No human labels are configured: the shares by type are the model's alone."]
    notes = [f"- {r['post_type'] or NO_TYPE}, {r['question']}: {r['note']}." for r in prevalence_rows if r.get("note")]
    if notes:
        out += ["", "Notes:", *notes]
    return out


def _gpus_per_job(throughput_rows) -> str:
    """The GPUs the shard jobs held (as recorded by each job, else cost.gpus_per_job), in words."""
    counts = sorted({int(r["gpus"]) for r in throughput_rows if r["shard"] != "all" and r["gpus"] is not None})
    return " or ".join(map(str, counts)) or "?"


def _human_labels_text(human: dict) -> str:
    text = (f"{human['rows']:,} rows read from `{human['path']}`, {human['usable']:,} used, on "
            f"{human['posts']:,} posts. ")
    probabilities = human["sampling_probabilities"]
    sample = human["sample_design"]
    if sample:
        text += f"The sample was drawn by label_sample (`{sample['path']}`): {describe(sample)}. "
        if sample.get("outside"):
            text += (f"{sample['outside']:,} classified post(s) are not in its frame (classified after the draw): the "
                     "human-only and corrected shares are over the frame's posts, the others are described by the "
                     "model alone (outside_model_share in prevalence.csv). ")
        if sample.get("missing"):
            text += (f"{sample['missing']:,} post(s) of its frame are no longer classified posts (excluded since, or "
                     "gone): the shares are over the rest of the frame, still a sample with the same probabilities. ")
        if sample.get("labels_changed"):
            text += ("labels.parquet is not the file the sample was drawn from: each post keeps the inclusion "
                     "probability it was drawn with, so the estimates stay valid; the predictions are today's. ")
    if human["design"] == "two_phase":
        text += (f"Design: two phases, a uniform burn-in (sampling probability {sample['pi_burn_in']:.3g}) and a "
                 f"second draw whose probabilities the burn-in chose (mixture weight {sample.get('mixture', 0):.2f} "
                 "of the active design); each share combines the two phases' estimates with the design's weights. ")
        return text
    if human["weighted"]:
        q = np.quantile(probabilities, [0, 0.1, 0.5, 0.9, 1])
        text += (f"Design: known, varying sampling probabilities (an active or other weighted sample); among the "
                 f"labelled posts they run from {q[0]:.3g} (10 %: {q[1]:.3g}, median {q[2]:.3g}, 90 %: {q[3]:.3g}) "
                 f"to {q[4]:.3g}, and the labelled posts stand for {np.sum(1 / probabilities):,.0f} posts "
                 "(the sum of 1/probability, which should be near the number of classified posts). "
                 "The prevalence plot shows their distribution.")
    elif human["has_probability"]:
        text += (f"Design: uniform random sample (every sampling_probability is {probabilities[0]:.3g}).")
    else:
        text += "Design: uniform random sample assumed (no sampling_probability column)."
    return text
