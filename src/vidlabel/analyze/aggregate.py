"""Aggregate stage: ``labels.parquet`` (+ optional human labels) -> ``summary/`` tables, plots, summary.md.

Everything that scales with the number of posts runs in DuckDB (queries in ``sql/``); Python only
handles per-question results and drawing. The statistics are explained in docs/statistics.md.

Choices worth knowing (also stated in summary.md):
- Populations. The classified posts (status ``ok`` or ``error``) are the population of the human-only
  and corrected shares; posts excluded before classification (probe errors, too long, ...) are
  outside it and counted in errors.csv. The model share is over the posts the model answered: a post
  without an answer (request error, or a key missing from the answer) is not in it; ``no_answer``
  counts it. Every sentence of summary.md that gives a share names its population.
- Prediction. The model's probability of "yes" (``answer_probs``, when the labels carry it), else its
  answer as 1/0; a post without an answer gets the question's model share, so human labels on
  failed posts still count and the correction accounts for the imputation.
- Design. Without ``sampling_probability`` (or with one value for every row) the human labels are a
  uniform random sample: Wilson human-only interval, PPI++ correction (DuckDB SQL, cross-checked
  against ppi_py). With varying probabilities (an active or other known-probability design): Hajek
  human-only share and the Horvitz-Thompson active estimator (``stats.active_mean``).
- Reported corrected interval: ``stats.corrected_interval`` (t quantile on the number of events, and
  the human-only interval folded in below ``stats.MIN_EVENTS`` events); coverage in docs/statistics.md.
- Human labels on unknown posts/questions, with unreadable labels or on excluded posts are not used;
  each is reported (summary.md, errors.csv, warning log). Several labels for one post and question
  are resolved, never dropped together: an ``adjudication`` column wins, else the majority, a tie
  counts 0.5.
- Agreement metrics describe the labelled sample and are not weighted by sampling probabilities.
"""

from __future__ import annotations

import csv
import io
import logging
import math
import zlib
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import pyarrow as pa

from vidlabel.analyze import plots, stats
from vidlabel.analyze.merge import (
    FIXED_COLUMNS,
    PROVENANCE_COLUMNS,
    provenance_counts,
    question_ids,
)
from vidlabel.core import duck
from vidlabel.core.io import write_text
from vidlabel.core.settings import fingerprint

log = logging.getLogger(__name__)

PREVALENCE_COLUMNS = [
    "question", "posts", "answered", "yes", "no", "no_answer", "model_share", "model_lo", "model_hi",
    "human_n", "human_yes", "human_share", "human_lo", "human_hi", "human_ci_method",
    "corrected", "corrected_lo", "corrected_hi", "corrected_se", "corrected_method", "lambda", "events",
    "ppi_population", "ppi_labelled", "design", "weighted", "uniform_halfwidth", "run_no_answer_share",
    "human_no_answer_share", "confidence", "note",
]
AGREEMENT_COLUMNS = ["question", "n", "tp", "fp", "fn", "tn", "no_model_answer", "tied_labels"] + [
    f"{m}{s}" for m in stats.AGREEMENT_METRICS for s in ("", "_lo", "_hi")] + ["confidence", "ci_method", "note"]
TOKENS_COLUMNS = ["direction", "requests", "total", "mean", "p50", "p90", "p99", "max", "prefill_decode_ratio"]
THROUGHPUT_COLUMNS = [
    "shard", "job", "requests", "ok", "errors", "input_tokens", "output_tokens", "first_started_at",
    "last_finished_at", "span_s", "busy_s", "gpus", "requests_per_s", "input_tokens_per_s", "output_tokens_per_s",
    "tokens_per_s", "wall_requests_per_s", "gpu_hours", "cost_usd",
]
ERRORS_COLUMNS = ["stage", "reason", "count"]
PLOTS = ("input_tokens", "output_tokens", "prevalence", "throughput", "errors")

# A human sample whose share of posts without a model answer differs from the run's at this
# significance level gets a warning: coders skipping failed posts (unplayable media) would leave
# the corrected share describing the answered posts only.
NO_ANSWER_SHARE_ALPHA = 0.01
# Under unequal sampling probabilities, fewer effective events than this left the reported interval
# at 92-93 % coverage in benchmarks/interval_coverage.py when the probabilities followed the model's P(yes)
# (0.95 or more when they followed its uncertainty, as vidlabel.analyze.sampling draws them); said in a note.
WEIGHTED_FEW_EVENTS = 30
# Below this many labels Wilson's coverage oscillates down to 0.93 at some prevalences
# (benchmarks/interval_coverage.py: 0.928 at prevalence 0.05 with 30 labels); said in a note.
FEW_LABELS_FOR_WILSON = 50
TIMELINE_BINS = 200
# The SQL moments must reproduce ppi_py; a larger gap means a bug, reported loudly.
PPI_CROSSCHECK_TOLERANCE = 1e-9


# Columns of labels.parquet that older merges did not write: without answer_probs the model's hard
# answers are the predictions; the provenance columns only feed the provenance section.
OPTIONAL_LABEL_COLUMNS = ("answer_probs", *PROVENANCE_COLUMNS, "request_fingerprint", "gpus", "transcript_status",
                          "model_revision", "server_fingerprint", "job_id")


class HumanLabelError(ValueError):
    """The human-label file cannot be read as a table of post_id, question, label."""


# --------------------------------------------------------------------------------------------
# Entry point

def run(config: dict[str, Any], labels_path: str | Path, human_labels_path: str | Path | None,
        summary_dir: str | Path) -> None:
    """Write every file of ``summary_dir`` (docs/outputs.md) from ``labels.parquet``."""
    summary_dir = Path(summary_dir)
    confidence = float(config["stats"]["confidence"])
    ids = question_ids(config)
    con = duck.connect()
    duck.parquet_view(con, "labels", labels_path)
    # Merged before jobs recorded them: their GPUs (then cost.gpus_per_job) and their job (then one per shard).
    absent = [f"NULL::{kind} AS {name}" for name, kind in (("gpus", "BIGINT"), ("job_id", "VARCHAR"))
              if name not in relation_columns(con, "labels")]
    if absent:
        con.read_parquet(str(labels_path)).project(", ".join(["*", *absent])).create_view("labels", replace=True)
    check_label_columns(con, ids, labels_path)
    register_table(con, "questions", pa.table({"question": ids, "position": list(range(len(ids)))}))
    con.execute("CREATE TABLE answers_long AS " + duck.sql(
        "answers_long",
        question_names=", ".join(duck.literal(q) for q in ids),
        question_columns=", ".join(duck.identifier(q) for q in ids),
        question_probs=", ".join(answer_prob_expressions(con, ids))))

    human = load_human_labels(con, human_labels_path)
    prevalence_rows = prevalence(con, ids, confidence, human)
    agreement_rows = agreement(con, ids, confidence, int(config["stats"]["bootstrap_samples"])) if human else []
    tokens_rows = query_rows(con, duck.sql("tokens"))
    throughput_rows = query_rows(con, duck.sql("throughput"), {
        "gpus_per_job": int(config["cost"]["gpus_per_job"]),
        "gpu_hour_usd": float(config["cost"]["gpu_hour_usd"])})
    errors_rows = query_rows(con, duck.sql("errors"))

    write_csv(summary_dir / "prevalence.csv", PREVALENCE_COLUMNS, prevalence_rows)
    write_csv(summary_dir / "agreement.csv", AGREEMENT_COLUMNS, agreement_rows)
    write_csv(summary_dir / "tokens.csv", TOKENS_COLUMNS, tokens_rows)
    write_csv(summary_dir / "throughput.csv", THROUGHPUT_COLUMNS, throughput_rows)
    write_csv(summary_dir / "errors.csv", ERRORS_COLUMNS, errors_rows)

    status_counts = dict(con.execute("SELECT status, count(*) FROM labels GROUP BY status").fetchall())
    draw_plots(con, summary_dir / "plots", prevalence_rows, errors_rows, confidence,
               human["sampling_probabilities"] if human and human["weighted"] else None)
    write_text(summary_markdown(config, status_counts, prevalence_rows, agreement_rows, tokens_rows,
                                throughput_rows, errors_rows, human, provenance_section(con, config)),
               summary_dir / "summary.md")
    log.info("summary written to %s (%d question(s), human labels: %s)", summary_dir, len(ids),
             human["path"] if human else "none")


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
                        f"settings** (listed "
                        "below; each row of labels.parquet names its own). Rerun classify under one setting "
                        "if they must not be mixed.")
    return lines + ["", f"The settings of this summary: `{fingerprint(config, 'aggregate')}` "
                        "(each job's log prints its settings in full)."]


# --------------------------------------------------------------------------------------------
# Inputs

def register_table(con, name: str, table: pa.Table) -> None:
    con.register(f"{name}_arrow", table)
    con.execute(f"CREATE OR REPLACE TABLE {name} AS SELECT * FROM {name}_arrow")
    con.unregister(f"{name}_arrow")


def relation_columns(con, relation: str) -> list[str]:
    return [row[0] for row in con.execute(f"DESCRIBE {relation}").fetchall()]


def check_label_columns(con, ids: Sequence[str], labels_path) -> None:
    columns = set(relation_columns(con, "labels"))
    missing = [c for c in FIXED_COLUMNS if c not in columns and c not in OPTIONAL_LABEL_COLUMNS]
    missing += [q for q in ids if q not in columns]
    if missing:
        raise ValueError(f"{labels_path} lacks column(s) {missing}: was it merged with another question set? "
                         "Rerun the merge rule.")


def answer_prob_expressions(con, ids: Sequence[str]) -> list[str]:
    """Per question, the SQL expression of the model's P(yes) (sql/answer_prob.sql), or NULL for
    labels written before ``answer_probs`` existed."""
    if "answer_probs" not in relation_columns(con, "labels"):
        return ["CAST(NULL AS DOUBLE)"] * len(ids)
    return ["(" + duck.sql("answer_prob", path=duck.literal(f'$.{duck.identifier(q)}')) + ")" for q in ids]


def _empty_human_tables(con) -> None:
    con.execute("CREATE TABLE human_checked (line BIGINT, post_id VARCHAR, question VARCHAR, label_text VARCHAR, "
                "y DOUBLE, adjudicated DOUBLE, probability DOUBLE, issue VARCHAR)")
    con.execute("CREATE TABLE human_resolved (post_id VARCHAR, question VARCHAR, y DOUBLE, probability DOUBLE, "
                "copies BIGINT, resolution VARCHAR)")
    con.execute("CREATE VIEW human_valid AS SELECT post_id, question, y, probability FROM human_resolved")


def _read_human_raw(con, path: Path) -> None:
    """View ``human_raw`` over the file: CSV (every column as text: labels come as yes/no, 1/0 or
    true/false and are normalised in SQL), Parquet, or a Label Studio JSON export."""
    if path.suffix.lower() == ".json":
        from vidlabel.analyze.labelstudio import (
            read_export,  # only for Label Studio exports
        )

        try:
            table = read_export(path)
        except (OSError, ValueError) as exc:
            raise HumanLabelError(f"cannot read the Label Studio export {path}: {exc}") from None
        con.register("human_raw_arrow", table)
        con.execute("CREATE TABLE human_raw AS SELECT * FROM human_raw_arrow")
        con.unregister("human_raw_arrow")
        return
    if path.suffix.lower() in (".parquet", ".pq"):
        reader = f"read_parquet({duck.literal(path)})"
    else:
        reader = f"read_csv({duck.literal(path)}, header = true, all_varchar = true)"
    con.execute(f"CREATE VIEW human_raw AS SELECT * FROM {reader}")


def load_human_labels(con, path: str | Path | None) -> dict[str, Any] | None:
    """Read, check and resolve the human labels: table ``human_checked`` (every row, with its issue),
    table ``human_resolved`` and view ``human_valid`` (one label per post and question).

    Returns None without human labels (empty tables are still created so the SQL stays uniform),
    else a description: path, rows, usable rows, labelled posts, the design ("uniform" or
    "weighted"), the labelled posts' sampling probabilities, the issues found (issue, rows,
    examples) and how duplicates were resolved (resolution, post-questions, examples).
    """
    if path is None or str(path) == "":
        _empty_human_tables(con)
        return None
    path = Path(path)
    if not path.is_file():
        raise HumanLabelError(f"human labels file {path} does not exist (config key human_labels)")
    try:
        _read_human_raw(con, path)
        columns = {c.lower(): c for c in relation_columns(con, "human_raw")}
    except HumanLabelError:
        raise
    except Exception as exc:  # duckdb raises several exception types for unreadable files
        raise HumanLabelError(f"cannot read human labels {path}: {exc}") from None
    question_column = columns.get("question") or columns.get("question_id")
    missing = [name for name, present in (("post_id", "post_id" in columns),
                                          ("question", question_column is not None),
                                          ("label", "label" in columns)) if not present]
    if missing:
        raise HumanLabelError(f"human labels {path} lack column(s) {missing}; found {sorted(columns.values())}. "
                              "Expected post_id, question, label and optionally sampling_probability, adjudication.")
    probability_column = columns.get("sampling_probability")
    adjudication_column = columns.get("adjudication")
    con.execute(duck.sql(
        "human_labels",
        question_column=_quote_any(question_column),
        probability_column=_quote_any(probability_column) if probability_column else "NULL",
        adjudication_column=_quote_any(adjudication_column) if adjudication_column else "NULL",
        has_probability="true" if probability_column else "false"))
    con.execute("CREATE VIEW human_valid AS SELECT post_id, question, y, probability FROM human_resolved")
    rows, usable = con.execute("SELECT count(*), count(*) FILTER (WHERE issue IS NULL) FROM human_checked").fetchone()
    issues = con.execute("""
        SELECT issue, count(*), list({'line': line, 'post_id': post_id, 'question': question,
                                      'label': label_text} ORDER BY line)[1:3]
        FROM human_checked WHERE issue IS NOT NULL GROUP BY issue ORDER BY count(*) DESC, issue
    """).fetchall()
    for issue, count, examples in issues:
        log.warning("human labels: %d row(s) not used: %s (e.g. %s)", count, issue, _examples(examples))
    resolutions = con.execute("""
        SELECT resolution, count(*), list({'post_id': post_id, 'question': question, 'copies': copies,
                                           'label': y} ORDER BY post_id, question)[1:3]
        FROM human_resolved WHERE resolution IS NOT NULL AND resolution <> 'agreeing copies'
        GROUP BY resolution ORDER BY count(*) DESC, resolution
    """).fetchall()
    for resolution, count, examples in resolutions:
        log.warning("human labels: %d post-question(s) with several labels: %s (e.g. %s)", count, resolution,
                    _resolution_examples(examples))
    # One inclusion probability per post (a post drawn once serves every question).
    probabilities = np.array([p for (p,) in con.execute(
        "SELECT any_value(probability) FROM human_resolved GROUP BY post_id").fetchall()
        if p is not None], dtype=float)
    weighted = probabilities.size > 0 and float(probabilities.max() - probabilities.min()) > 1e-12
    # fetchall, not fetchone: callers go on using the connection, which a half-read result blocks
    posts = con.execute("SELECT count(DISTINCT post_id) FROM human_resolved").fetchall()[0][0]
    return {"path": str(path), "rows": rows, "usable": usable, "posts": posts,
            "design": "weighted" if weighted else "uniform", "weighted": weighted,
            "has_probability": probability_column is not None,
            "sampling_probabilities": probabilities, "issues": issues, "resolutions": resolutions}


def _quote_any(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _examples(examples: Iterable[dict]) -> str:
    return "; ".join(f"line {e['line']}: post {e['post_id']!r}, question {e['question']!r}, label {e['label']!r}"
                     for e in examples)


def _resolution_examples(examples: Iterable[dict]) -> str:
    return "; ".join(f"post {e['post_id']!r}, question {e['question']!r}: {e['copies']} labels -> {e['label']:g}"
                     for e in examples)


# --------------------------------------------------------------------------------------------
# Prevalence and agreement

def query_rows(con, query: str, params: dict | None = None) -> list[dict[str, Any]]:
    cur = con.execute(query, params) if params else con.execute(query)
    names = [d[0] for d in cur.description]
    return [dict(zip(names, row)) for row in cur.fetchall()]


def ppi_moments(con) -> dict[str, dict[str, Any]]:
    """PPI++ moments per question from table ``ppi_items`` (sql/ppi_moments.sql)."""
    return {row["question"]: row for row in query_rows(con, duck.sql("ppi_moments"))}


def ppi_moments_from_items(items: pa.Table) -> dict[str, dict[str, Any]]:
    """The same SQL on a given ``ppi_items`` table (question, yhat, y, r): y NULL = unlabelled,
    r = inverse sampling probability of a labelled item. Used by the tests and the simulation, where
    ``question`` can stand for a simulated dataset so that hundreds are computed in one query."""
    con = duck.connect()
    register_table(con, "ppi_items", items)
    return ppi_moments(con)


def prevalence(con, ids: Sequence[str], confidence: float, human: dict | None) -> list[dict[str, Any]]:
    model = {r["question"]: r for r in query_rows(con, duck.sql("prevalence_model"))}
    moments: dict[str, dict] = {}
    if human:
        con.execute(duck.sql("ppi_items"))
        if not human["weighted"]:
            moments = ppi_moments(con)
    rows = []
    for qid in ids:
        m = model.get(qid, {"posts": 0, "answered": 0, "yes": 0, "no": 0, "no_answer": 0})
        row: dict[str, Any] = {"question": qid, **{k: m[k] for k in ("posts", "answered", "yes", "no", "no_answer")},
                               "confidence": confidence}
        row["model_share"] = m["yes"] / m["answered"] if m["answered"] else math.nan
        row["model_lo"], row["model_hi"] = stats.wilson_interval(m["yes"], m["answered"], confidence)
        notes = []
        if m["posts"] and not m["answered"]:
            notes.append("the model answered no post for this question: no model share")
        if human:
            notes += _human_and_corrected(con, qid, row, moments.get(qid), confidence, human)
        row["note"] = "; ".join(notes)
        rows.append(row)
    return rows


def _human_and_corrected(con, qid: str, row: dict, mom: dict | None, confidence: float,
                         human: dict) -> list[str]:
    """Human-only and corrected share of one question into ``row``; returns the notes."""
    weighted = human["weighted"]
    row["design"], row["weighted"] = human["design"], weighted
    items = con.execute("SELECT yhat, y, r, no_answer FROM ppi_items WHERE question = ?", [qid]).fetchnumpy()
    f = _float_array(items["yhat"])
    y = _float_array(items["y"])
    labelled = ~np.isnan(y)
    pi = np.where(labelled, 1.0 / np.where(labelled, _float_array(items["r"]), 1.0), 1.0)
    no_answer = np.asarray(items["no_answer"], dtype=bool)
    n = int(labelled.sum())
    y_sum = float(y[labelled].sum())
    row["human_n"] = n
    row["human_yes"] = int(y_sum) if y_sum.is_integer() else y_sum
    if n == 0:
        return ["no usable human label for this question: no human-only or corrected share (n/a)"]
    notes = []
    if weighted:
        h = stats.hajek_share(y[labelled], pi[labelled], confidence)
        row["human_share"], row["human_lo"], row["human_hi"] = h["estimate"], h["lo"], h["hi"]
        row["human_ci_method"] = f"Hajek mean, Wilson at the design's effective size ({h['n_eff']:,.0f})"
        est = stats.active_mean(f, y, labelled, pi, confidence)
        estimate, se, lam = est["estimate"], est["se"], est["lambda"]
        events = stats.sample_events(y, f, labelled, pi)
        row["corrected_method"] = "active estimator (Horvitz-Thompson with power tuning)"
        row["uniform_halfwidth"] = stats.z_value(confidence) * stats.uniform_equivalent_se(f, y, labelled, pi)
        row["ppi_population"], row["ppi_labelled"] = f.size, n
    else:
        row["human_share"] = y_sum / n
        row["human_lo"], row["human_hi"] = stats.wilson_interval(y_sum, n, confidence)
        row["human_ci_method"] = "Wilson"
        if n < FEW_LABELS_FOR_WILSON:
            notes.append(f"{n} human labels: below {FEW_LABELS_FOR_WILSON}, Wilson's coverage dips to about 93 % at "
                         "some prevalences (docs/statistics.md)")
        estimate, se, lam = mom["estimate"], math.sqrt(mom["imputed_var"] + mom["rectifier_var"]), mom["lambda"]
        events = stats.sample_events(y[labelled], f[labelled])
        row["corrected_method"] = "PPI++"
        row["ppi_population"], row["ppi_labelled"] = mom["big_n"], mom["n"]
        notes += _crosscheck(con, qid, y[labelled], f[labelled], f, mom, confidence)
    if y_sum in (0, n):
        notes.append(f"every human label is \"{'no' if y_sum == 0 else 'yes'}\": the human-only interval is "
                     f"{_pct(row['human_lo'])}–{_pct(row['human_hi'])}, not a point")
    ci = stats.corrected_interval(estimate, se, events, row["human_lo"], row["human_hi"], confidence)
    if not 0 <= estimate <= 1:
        notes.append(f"the corrected estimate {estimate:.4f} lies outside [0, 1] (the estimator is unbiased, not "
                     "bounded) and is reported clipped")
        estimate = min(1.0, max(0.0, estimate))
    row.update({"corrected": estimate, "corrected_se": se, "lambda": lam, "events": events,
                "corrected_lo": ci["lo"], "corrected_hi": ci["hi"]})
    if ci["few"]:
        notes.append(f"only {events:.1f} events back the corrected interval (the fewest of labelled \"yes\", "
                     f"labelled \"no\" and model-human disagreements; fewer than {stats.MIN_EVENTS}): it is "
                     "widened to contain the human-only interval")
    elif weighted and events < WEIGHTED_FEW_EVENTS:
        notes.append(f"{events:.1f} effective events under unequal sampling probabilities: such intervals "
                     "covered 92-93 % in simulation when the probabilities followed the model's P(yes), 95 % or more "
                     "when they followed its uncertainty (docs/statistics.md)")
    if not np.ptp(f) > 0:
        notes.append("the model's prediction is the same for every post: lambda = 0, the corrected share rests on "
                     "the human labels alone (with a t interval): the human-only interval is the one to quote")
    notes += _no_answer_share_check(row, no_answer, labelled, pi, weighted)
    return notes


def _no_answer_share_check(row: dict, no_answer: np.ndarray, labelled: np.ndarray, pi: np.ndarray,
                           weighted: bool) -> list[str]:
    """Warn when the human sample's share of posts without a model answer differs from the run's."""
    from scipy.stats import binomtest, norm

    run_share = float(no_answer.mean()) if no_answer.size else math.nan
    n = int(labelled.sum())
    if weighted:
        w = 1.0 / pi[labelled]
        sample_share = float((w * no_answer[labelled]).sum() / w.sum())
        kish = float(w.sum() ** 2 / (w * w).sum())
        spread = math.sqrt(run_share * (1 - run_share) / kish)
        p_value = 2 * norm.sf(abs(sample_share - run_share) / spread) if spread > 0 else float(
            sample_share == run_share)
    else:
        k = int(no_answer[labelled].sum())
        sample_share = k / n
        p_value = binomtest(k, n, run_share).pvalue if 0 < run_share < 1 else float(sample_share == run_share)
    row["run_no_answer_share"], row["human_no_answer_share"] = run_share, sample_share
    if p_value < NO_ANSWER_SHARE_ALPHA:
        log.warning("question %s: %.1f%% of the human-labelled posts have no model answer, %.1f%% of the run's",
                    row["question"], 100 * sample_share, 100 * run_share)
        return [f"WARNING: {_pct(sample_share)} of the human-labelled posts have no model answer against "
                f"{_pct(run_share)} of all classified posts (p = {p_value:.2g}): if the coders skipped posts "
                "(e.g. unplayable media) the human labels do not represent every classified post, and the "
                "shares above describe the posts that were labelled alike"]
    return []


def _crosscheck(con, qid, y, yhat, yhat_all, mom, confidence) -> list[str]:
    """Recompute the PPI++ estimate and its normal interval with ppi_py; the SQL moments must agree."""
    lam = None if mom["pooled_var"] and mom["pooled_var"] > 0 else 0.0
    ref = stats.ppi_reference(y, yhat, yhat_all, confidence, lam=lam)
    lo, hi = stats.ppi_interval(mom["estimate"], mom["imputed_var"], mom["rectifier_var"], confidence)
    gap = max(abs(ref["estimate"] - mom["estimate"]), abs(ref["lo"] - lo), abs(ref["hi"] - hi))
    if not gap <= PPI_CROSSCHECK_TOLERANCE:
        log.warning("question %s: SQL PPI++ result differs from ppi_py by %.3g (estimate %r vs %r)",
                    qid, gap, mom["estimate"], ref["estimate"])
        return [f"SQL and ppi_py disagree by {gap:.3g}"]
    return []


def agreement(con, ids: Sequence[str], confidence: float, bootstrap_samples: int) -> list[dict[str, Any]]:
    counts = {r["question"]: r for r in query_rows(con, duck.sql("agreement_counts"))}
    method = (f"Wilson: accuracy, precision, recall; percentile bootstrap ({bootstrap_samples} resamples "
              "of the labelled pairs): f1, kappa (in simulation these covered 93-97 % at 150 or more labels, "
              "docs/statistics.md)")
    rows = []
    for qid in ids:
        c = counts.get(qid, {"tp": 0, "fp": 0, "fn": 0, "tn": 0, "no_model_answer": 0, "tied_labels": 0})
        seed = zlib.crc32(qid.encode())  # reproducible intervals, different per question
        row = {"question": qid,
               **stats.agreement(int(c["tp"]), int(c["fp"]), int(c["fn"]), int(c["tn"]), confidence,
                                 bootstrap_samples, seed),
               "no_model_answer": int(c["no_model_answer"]), "tied_labels": int(c["tied_labels"]),
               "confidence": confidence, "ci_method": method}
        rows.append(row)
    return rows


# --------------------------------------------------------------------------------------------
# Output

def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, (bool, np.bool_)):
        return "true" if value else "false"
    if isinstance(value, (float, np.floating)):
        return "" if math.isnan(value) else repr(float(value))
    if isinstance(value, np.integer):
        return str(int(value))
    return str(value)


def write_csv(path: str | Path, columns: Sequence[str], rows: Sequence[dict[str, Any]]) -> None:
    """CSV with a header (also when there are no rows); empty cell = not available."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(columns)
    for row in rows:
        writer.writerow([_cell(row.get(c)) for c in columns])
    write_text(buf.getvalue(), path)


def draw_plots(con, plot_dir: Path, prevalence_rows, errors_rows, confidence: float,
               sampling_probabilities: np.ndarray | None = None) -> None:
    tokens = con.execute(duck.sql("token_values")).fetchnumpy()
    plots.token_histogram(_float_array(tokens["prompt_tokens"]), plot_dir / "input_tokens.png",
                          "Input tokens per request", "input (prompt) tokens, video included")
    plots.token_histogram(_float_array(tokens["completion_tokens"]), plot_dir / "output_tokens.png",
                          "Output tokens per request", "output (completion) tokens")
    plots.prevalence(prevalence_rows, plot_dir / "prevalence.png", confidence, sampling_probabilities)
    curves: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for shard, bins, completed, t0, width in con.execute(duck.sql("throughput_timeline"),
                                                          {"bins": TIMELINE_BINS}).fetchall():
        minutes, counts = curves.setdefault(str(shard), ([], []))
        minutes.append((bins + 1) * width / 60.0)
        counts.append(completed)
    curves = {s: (np.array(m), np.cumsum(c)) for s, (m, c) in curves.items()}
    plots.throughput(curves, plot_dir / "throughput.png")
    plots.errors(errors_rows, plot_dir / "errors.png")


def _float_array(values) -> np.ndarray:
    # fetchnumpy gives a masked array when there are NULLs
    if isinstance(values, np.ma.MaskedArray):
        values = values.astype(float).filled(np.nan)
    return np.asarray(values, dtype=float)


def _is_missing(x) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def _pct(x) -> str:
    return "n/a" if _is_missing(x) else f"{100 * x:.1f}%"


def _num(x, digits=2) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:,.{digits}f}"


def _prevalence_sentence(r: dict, human: dict | None, c: str) -> str:
    """One question's shares, each with the population it is about."""
    s = f"- **{r['question']}**: "
    if r["answered"]:
        s += (f"the model answered \"yes\" for {_pct(r['model_share'])} of the {r['answered']:,} posts it answered "
              f"({c} CI {_pct(r['model_lo'])}–{_pct(r['model_hi'])}")
        s += (f"; the {r['no_answer']:,} classified posts without an answer are not in this share)."
              if r["no_answer"] else ").")
    else:
        s += f"the model answered none of the {r['posts']:,} classified posts."
    if human and r.get("human_n"):
        s += (f" Human labels on {r['human_n']:,} of the {r['posts']:,} classified posts give a human-only share "
              f"of {_pct(r.get('human_share'))} for all {r['posts']:,} classified posts ({c} CI "
              f"{_pct(r.get('human_lo'))}–{_pct(r.get('human_hi'))}, {r.get('human_ci_method')}).")
        if not _is_missing(r.get("corrected")):
            s += (f" Combining the model's predictions with the human labels ({r['corrected_method']}, "
                  f"λ = {r['lambda']:.2f}), the share among all {r['ppi_population']:,} classified posts, answered "
                  f"or not, is **{_pct(r['corrected'])}** ({c} CI {_pct(r['corrected_lo'])}–"
                  f"{_pct(r['corrected_hi'])}).")
            if not _is_missing(r.get("uniform_halfwidth")):
                half = (r["corrected_hi"] - r["corrected_lo"]) / 2
                s += (" A uniform random sample of as many posts would have given about "
                      f"±{_pct(r['uniform_halfwidth'])} (PPI++) against ±{_pct(half)} here.")
    if r.get("note"):
        s += f" Note: {r['note']}."
    return s


def summary_markdown(config, status_counts, prevalence_rows, agreement_rows, tokens_rows, throughput_rows,
                     errors_rows, human, provenance_lines: Sequence[str] = ()) -> str:
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
                out.append(f"- **{a['question']}**: no post has both a human label (not tied) and a model answer.")
                continue
            parts = ", ".join(f"{m} {_num(a[m])} ({_num(a[m + '_lo'])}–{_num(a[m + '_hi'])})"
                              for m in stats.AGREEMENT_METRICS)
            s = f"- **{a['question']}** on the {a['n']:,} human-labelled posts with a model answer: {parts}."
            if a["no_model_answer"]:
                s += f" {a['no_model_answer']:,} labelled posts have no model answer and are not compared."
            if a["tied_labels"]:
                s += f" {a['tied_labels']:,} labelled post(s) with tied human labels are not compared."
            if a["note"]:
                s += f" Note: {a['note']}."
            out.append(s)
        out += ["", f"Intervals at {c}: {agreement_rows[0]['ci_method']}. They describe the labelled sample "
                    "(not weighted by sampling probabilities).", ""]

    out += ["## Tokens", ""]
    tok = {r["direction"]: r for r in tokens_rows}
    if tok.get("input", {}).get("requests"):
        i, o = tok["input"], tok.get("output", {})
        out.append(f"{i['requests']:,} requests reported usage: {_num(i['mean'], 0)} input tokens on average "
                   f"(p50 {_num(i['p50'], 0)}, p90 {_num(i['p90'], 0)}, p99 {_num(i['p99'], 0)}, max {i['max']:,}) "
                   f"and {_num(o.get('mean'), 1)} output tokens (max {o.get('max') or 0:,}); "
                   f"{_num(i['total'], 0)} input and {_num(o.get('total'), 0)} output tokens in all, a prefill:decode "
                   f"ratio of {_num(i['prefill_decode_ratio'], 1)}:1.")
    else:
        out.append("No request reported token usage.")
    out.append("")

    out += ["## Throughput and cost", ""]
    overall = next((r for r in throughput_rows if r["shard"] == "all"), None)
    if overall:
        shards = len(throughput_rows) - 1
        out.append(f"{overall['requests']:,} requests over {shards} shard job(s) kept the model busy for "
                   f"{_num(overall['busy_s'] / 3600, 2)} instance-hours: {_num(overall['requests_per_s'], 3)} requests/s "
                   f"and {_num(overall['tokens_per_s'], 0)} tokens/s per model instance "
                   f"({_num(1 / overall['requests_per_s'] if overall['requests_per_s'] else math.nan, 2)} s per request). "
                   f"Wall clock from first to last request: {_num(overall['span_s'] / 3600, 2)} h "
                   f"({_num(overall['wall_requests_per_s'], 3)} requests/s for the whole run). "
                   f"That is {_num(overall['gpu_hours'], 2)} GPU-hours at {_gpus_per_job(throughput_rows)} GPUs per job, "
                   f"about ${_num(overall['cost_usd'], 2)} at ${config['cost']['gpu_hour_usd']} per GPU-hour "
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
            out += [f"- {issue}: {count:,} row(s), e.g. {_examples(ex)}" for issue, count, ex in human["issues"]]
        if human["resolutions"]:
            out.append("Posts with several labels for one question (resolved, none dropped):")
            out += [f"- {resolution}: {count:,} post-question(s), e.g. {_resolution_examples(ex)}"
                    for resolution, count, ex in human["resolutions"]]
        out.append("")

    out += ["## How these numbers are made", "",
            "- Populations: the classified posts (status ok or error) for the human-only and corrected shares; "
            "the answered posts for the model share. Excluded posts are outside both.",
            "- Model share: \"yes\" / answered; posts without an answer are counted in `no_answer`, not in the share. "
            "Its interval (Wilson) reflects sampling only, not the model's errors: it is not an interval for the "
            "true share.",
            "- Human-only share: uniform sample: mean of the human labels with the Wilson interval; sample with "
            "varying `sampling_probability`: Hajek (inverse-probability) mean with Wilson's interval at the "
            "design's effective sample size.",
            "- Corrected share: uniform sample: PPI++ with the power-tuning λ (ppi_py's estimator, computed in DuckDB "
            "SQL and cross-checked against ppi_py); varying probabilities: the active (Horvitz-Thompson) estimator "
            "with power tuning. The prediction is the model's probability of \"yes\" when the labels carry it, else "
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


def _gpus_per_job(throughput_rows) -> str:
    """The GPUs the shard jobs held (as recorded by each job, else cost.gpus_per_job), in words."""
    counts = sorted({int(r["gpus"]) for r in throughput_rows if r["shard"] != "all" and r["gpus"] is not None})
    return " or ".join(map(str, counts)) or "?"


def _human_labels_text(human: dict) -> str:
    text = (f"{human['rows']:,} rows read from `{human['path']}`, {human['usable']:,} used, on "
            f"{human['posts']:,} posts. ")
    probabilities = human["sampling_probabilities"]
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
