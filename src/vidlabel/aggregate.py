"""Aggregate stage: ``labels.parquet`` (+ optional human labels) -> ``summary/`` tables, plots, summary.md.

Everything that scales with the number of posts runs in DuckDB (queries in ``sql/``); Python only
handles per-question results and drawing.

Choices worth knowing (also stated in summary.md):
- Population. Prevalence is about the classified posts (status ``ok`` or ``error``); posts excluded
  before classification (probe errors, too long, ...) are outside it and counted in errors.csv.
- Model share = "yes" / answered. A post without an answer (request error, or a key missing from
  the answer) is not in the share; ``no_answer`` counts it.
- Bias correction (PPI++): every classified post is in the "unlabelled" set, labelled ones included
  (this is the population whose share we estimate, and it keeps the estimator defined when every post
  has a human label). A post without a model answer gets the question's model share as its prediction,
  so human labels on failed posts still count and the rectifier corrects for the imputation.
- Human labels on unknown posts/questions, with unreadable labels, on excluded posts, or duplicated
  with conflicting values are not used; each is reported (summary.md, errors.csv, warning log).
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

from . import duck, plots, stats
from .io import write_text
from .merge import FIXED_COLUMNS, question_ids

log = logging.getLogger(__name__)

PREVALENCE_COLUMNS = [
    "question", "posts", "answered", "yes", "no", "no_answer", "model_share", "model_lo", "model_hi",
    "human_n", "human_yes", "human_share", "human_lo", "human_hi", "human_ci_method",
    "corrected", "corrected_lo", "corrected_hi", "corrected_se", "lambda", "ppi_population",
    "ppi_labelled", "weighted", "confidence", "note",
]
AGREEMENT_COLUMNS = ["question", "n", "tp", "fp", "fn", "tn", "no_model_answer"] + [
    f"{m}{s}" for m in stats.AGREEMENT_METRICS for s in ("", "_lo", "_hi")] + ["confidence", "ci_method"]
TOKENS_COLUMNS = ["direction", "requests", "total", "mean", "p50", "p90", "p99", "max", "prefill_decode_ratio"]
THROUGHPUT_COLUMNS = [
    "shard", "requests", "ok", "errors", "input_tokens", "output_tokens", "first_started_at",
    "last_finished_at", "span_s", "busy_s", "requests_per_s", "input_tokens_per_s", "output_tokens_per_s",
    "tokens_per_s", "wall_requests_per_s", "gpu_hours", "cost_usd",
]
ERRORS_COLUMNS = ["stage", "reason", "count"]
PLOTS = ("input_tokens", "output_tokens", "prevalence", "throughput", "errors")

# Below this many human labels a normal-approximation interval deserves a warning.
FEW_HUMAN_LABELS = 30
TIMELINE_BINS = 200
# The SQL moments must reproduce ppi_py; a larger gap means a bug, reported loudly.
PPI_CROSSCHECK_TOLERANCE = 1e-9


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
    _check_label_columns(con, ids, labels_path)
    _register(con, "questions", pa.table({"question": ids, "position": list(range(len(ids)))}))
    con.execute("CREATE TABLE answers_long AS " + duck.sql(
        "answers_long",
        question_names=", ".join(duck.literal(q) for q in ids),
        question_columns=", ".join(duck.identifier(q) for q in ids)))

    human = load_human_labels(con, human_labels_path)
    prevalence_rows = prevalence(con, ids, confidence, human)
    agreement_rows = agreement(con, ids, confidence, int(config["stats"]["bootstrap_samples"])) if human else []
    tokens_rows = _rows(con, duck.sql("tokens"))
    throughput_rows = _rows(con, duck.sql("throughput"), {
        "gpus_per_job": int(config["cost"]["gpus_per_job"]),
        "gpu_hour_usd": float(config["cost"]["gpu_hour_usd"])})
    errors_rows = _rows(con, duck.sql("errors"))

    write_csv(summary_dir / "prevalence.csv", PREVALENCE_COLUMNS, prevalence_rows)
    write_csv(summary_dir / "agreement.csv", AGREEMENT_COLUMNS, agreement_rows)
    write_csv(summary_dir / "tokens.csv", TOKENS_COLUMNS, tokens_rows)
    write_csv(summary_dir / "throughput.csv", THROUGHPUT_COLUMNS, throughput_rows)
    write_csv(summary_dir / "errors.csv", ERRORS_COLUMNS, errors_rows)

    status_counts = dict(con.execute("SELECT status, count(*) FROM labels GROUP BY status").fetchall())
    draw_plots(con, summary_dir / "plots", prevalence_rows, errors_rows, confidence)
    write_text(summary_markdown(config, status_counts, prevalence_rows, agreement_rows, tokens_rows,
                                throughput_rows, errors_rows, human), summary_dir / "summary.md")
    log.info("summary written to %s (%d question(s), human labels: %s)", summary_dir, len(ids),
             human["path"] if human else "none")


# --------------------------------------------------------------------------------------------
# Inputs

def _register(con, name: str, table: pa.Table) -> None:
    con.register(f"{name}_arrow", table)
    con.execute(f"CREATE OR REPLACE TABLE {name} AS SELECT * FROM {name}_arrow")
    con.unregister(f"{name}_arrow")


def _columns(con, relation: str) -> list[str]:
    return [row[0] for row in con.execute(f"DESCRIBE {relation}").fetchall()]


def _check_label_columns(con, ids: Sequence[str], labels_path) -> None:
    columns = set(_columns(con, "labels"))
    missing = [c for c in FIXED_COLUMNS if c not in columns]
    missing += [q for q in ids if q not in columns]
    if missing:
        raise ValueError(f"{labels_path} lacks column(s) {missing}: was it merged with another question set? "
                         "Rerun the merge rule.")


def load_human_labels(con, path: str | Path | None) -> dict[str, Any] | None:
    """Read and check the human labels into table ``human_checked`` and view ``human_valid``.

    Returns None without human labels (empty tables are still created so the SQL stays uniform),
    else a description: path, rows, usable rows, whether sampling probabilities weight them, and
    the issues found (issue, rows, examples).
    """
    if path is None or str(path) == "":
        con.execute("CREATE TABLE human_checked (line BIGINT, post_id VARCHAR, question VARCHAR, "
                    "label_text VARCHAR, y DOUBLE, probability DOUBLE, issue VARCHAR)")
        con.execute("CREATE VIEW human_valid AS SELECT post_id, question, y, probability FROM human_checked "
                    "WHERE issue IS NULL")
        return None
    path = Path(path)
    if not path.is_file():
        raise HumanLabelError(f"human labels file {path} does not exist (config key human_labels)")
    if path.suffix.lower() in (".parquet", ".pq"):
        reader = f"read_parquet({duck.literal(path)})"
    else:
        # Every column as text: labels come as yes/no, 1/0 or true/false and are normalised in SQL.
        reader = f"read_csv({duck.literal(path)}, header = true, all_varchar = true)"
    try:
        con.execute(f"CREATE VIEW human_raw AS SELECT * FROM {reader}")
        columns = {c.lower(): c for c in _columns(con, "human_raw")}
    except Exception as exc:  # duckdb raises several exception types for unreadable files
        raise HumanLabelError(f"cannot read human labels {path}: {exc}") from None
    question_column = columns.get("question") or columns.get("question_id")
    missing = [name for name, present in (("post_id", "post_id" in columns),
                                          ("question", question_column is not None),
                                          ("label", "label" in columns)) if not present]
    if missing:
        raise HumanLabelError(f"human labels {path} lack column(s) {missing}; found {sorted(columns.values())}. "
                              "Expected post_id, question, label and optionally sampling_probability.")
    probability_column = columns.get("sampling_probability")
    con.execute(duck.sql(
        "human_labels",
        question_column=_quote_any(question_column),
        probability_column=_quote_any(probability_column) if probability_column else "NULL",
        has_probability="true" if probability_column else "false"))
    con.execute("CREATE VIEW human_valid AS SELECT post_id, question, y, probability FROM human_checked "
                "WHERE issue IS NULL")
    rows, usable = con.execute("SELECT count(*), count(*) FILTER (WHERE issue IS NULL) FROM human_checked").fetchone()
    issues = con.execute("""
        SELECT issue, count(*), list({'line': line, 'post_id': post_id, 'question': question,
                                      'label': label_text} ORDER BY line)[1:3]
        FROM human_checked WHERE issue IS NOT NULL GROUP BY issue ORDER BY count(*) DESC, issue
    """).fetchall()
    for issue, count, examples in issues:
        log.warning("human labels: %d row(s) not used: %s (e.g. %s)", count, issue, _examples(examples))
    return {"path": str(path), "rows": rows, "usable": usable, "weighted": probability_column is not None,
            "issues": issues}


def _quote_any(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _examples(examples: Iterable[dict]) -> str:
    return "; ".join(f"line {e['line']}: post {e['post_id']!r}, question {e['question']!r}, label {e['label']!r}"
                     for e in examples)


# --------------------------------------------------------------------------------------------
# Prevalence and agreement

def _rows(con, query: str, params: dict | None = None) -> list[dict[str, Any]]:
    cur = con.execute(query, params) if params else con.execute(query)
    names = [d[0] for d in cur.description]
    return [dict(zip(names, row)) for row in cur.fetchall()]


def ppi_moments(con) -> dict[str, dict[str, Any]]:
    """PPI++ moments per question from table ``ppi_items`` (sql/ppi_moments.sql)."""
    return {row["question"]: row for row in _rows(con, duck.sql("ppi_moments"))}


def ppi_moments_from_items(items: pa.Table) -> dict[str, dict[str, Any]]:
    """The same SQL on a given ``ppi_items`` table (question, yhat, y, r): y NULL = unlabelled,
    r = inverse sampling probability of a labelled item. Used by the tests and the simulation, where
    ``question`` can stand for a simulated dataset so that hundreds are computed in one query."""
    con = duck.connect()
    _register(con, "ppi_items", items)
    return ppi_moments(con)


def prevalence(con, ids: Sequence[str], confidence: float, human: dict | None) -> list[dict[str, Any]]:
    model = {r["question"]: r for r in _rows(con, duck.sql("prevalence_model"))}
    moments: dict[str, dict] = {}
    if human:
        con.execute(duck.sql("ppi_items"))
        moments = ppi_moments(con)
    rows = []
    for qid in ids:
        m = model.get(qid, {"posts": 0, "answered": 0, "yes": 0, "no": 0, "no_answer": 0})
        row: dict[str, Any] = {"question": qid, **{k: m[k] for k in ("posts", "answered", "yes", "no", "no_answer")},
                               "confidence": confidence}
        row["model_share"] = m["yes"] / m["answered"] if m["answered"] else math.nan
        row["model_lo"], row["model_hi"] = stats.wilson_interval(m["yes"], m["answered"], confidence)
        notes = []
        if human:
            notes += _human_and_corrected(con, qid, row, moments.get(qid), confidence, human["weighted"])
        row["note"] = "; ".join(notes)
        rows.append(row)
    return rows


def _human_and_corrected(con, qid: str, row: dict, mom: dict | None, confidence: float,
                         weighted: bool) -> list[str]:
    notes = []
    labelled = con.execute("SELECT y, yhat, r FROM ppi_items WHERE question = ? AND y IS NOT NULL",
                           [qid]).fetchnumpy()
    y, yhat, r = (np.asarray(labelled[k], dtype=float) for k in ("y", "yhat", "r"))
    row["human_n"], row["human_yes"], row["weighted"] = int(y.size), int(y.sum()), weighted
    if y.size == 0:
        notes.append("no usable human label for this question")
        return notes
    if weighted:
        row["human_share"], row["human_lo"], row["human_hi"] = stats.weighted_mean_interval(y, r, confidence)
        row["human_ci_method"] = "weighted CLT (inverse sampling probability)"
    else:
        row["human_share"] = float(y.mean())
        row["human_lo"], row["human_hi"] = stats.wilson_interval(int(y.sum()), int(y.size), confidence)
        row["human_ci_method"] = "Wilson"
    if y.size < FEW_HUMAN_LABELS:
        notes.append(f"only {y.size} human labels: normal-approximation intervals are unreliable")
    if mom is None:
        return notes
    lo, hi = stats.ppi_interval(mom["estimate"], mom["imputed_var"], mom["rectifier_var"], confidence)
    row.update({"corrected": mom["estimate"], "corrected_se": math.sqrt(mom["imputed_var"] + mom["rectifier_var"]),
                "lambda": mom["lambda"], "ppi_population": mom["big_n"], "ppi_labelled": mom["n"]})
    # A share lies in [0, 1]; clipping the normal interval to it keeps its coverage.
    row["corrected_lo"], row["corrected_hi"] = max(0.0, lo), min(1.0, hi)
    if lo < 0 or hi > 1:
        notes.append("corrected interval clipped to [0, 1]")
    if not mom["pooled_var"] or mom["pooled_var"] <= 0:
        notes.append("model predictions do not vary: lambda = 0 (human-only estimate)")
    notes += _crosscheck(con, qid, y, yhat, r if weighted else None, mom, (lo, hi), confidence)
    return notes


def _crosscheck(con, qid, y, yhat, weights, mom, interval, confidence) -> list[str]:
    """Recompute the corrected estimate with ppi_py; the SQL moments must agree."""
    yhat_all = con.execute("SELECT yhat FROM ppi_items WHERE question = ?", [qid]).fetchnumpy()["yhat"]
    lam = None if mom["pooled_var"] and mom["pooled_var"] > 0 else 0.0
    ref = stats.ppi_reference(y, yhat, np.asarray(yhat_all, dtype=float), confidence, weights=weights, lam=lam)
    gap = max(abs(ref["estimate"] - mom["estimate"]), abs(ref["lo"] - interval[0]), abs(ref["hi"] - interval[1]))
    if not gap <= PPI_CROSSCHECK_TOLERANCE:
        log.warning("question %s: SQL PPI++ result differs from ppi_py by %.3g (estimate %r vs %r)",
                    qid, gap, mom["estimate"], ref["estimate"])
        return [f"SQL and ppi_py disagree by {gap:.3g}"]
    return []


def agreement(con, ids: Sequence[str], confidence: float, bootstrap_samples: int) -> list[dict[str, Any]]:
    counts = {r["question"]: r for r in _rows(con, duck.sql("agreement_counts"))}
    method = (f"Wilson: accuracy, precision, recall; percentile bootstrap ({bootstrap_samples} resamples "
              "of the labelled pairs): f1, kappa")
    rows = []
    for qid in ids:
        c = counts.get(qid, {"tp": 0, "fp": 0, "fn": 0, "tn": 0, "no_model_answer": 0})
        seed = zlib.crc32(qid.encode())  # reproducible intervals, different per question
        row = {"question": qid,
               **stats.agreement(int(c["tp"]), int(c["fp"]), int(c["fn"]), int(c["tn"]), confidence,
                                 bootstrap_samples, seed),
               "no_model_answer": int(c["no_model_answer"]), "confidence": confidence, "ci_method": method}
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


def draw_plots(con, plot_dir: Path, prevalence_rows, errors_rows, confidence: float) -> None:
    tokens = con.execute(duck.sql("token_values")).fetchnumpy()
    plots.token_histogram(_float_array(tokens["prompt_tokens"]), plot_dir / "input_tokens.png",
                          "Input tokens per request", "input (prompt) tokens, video included")
    plots.token_histogram(_float_array(tokens["completion_tokens"]), plot_dir / "output_tokens.png",
                          "Output tokens per request", "output (completion) tokens")
    plots.prevalence(prevalence_rows, plot_dir / "prevalence.png", confidence)
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


def _pct(x) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"


def _num(x, digits=2) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:,.{digits}f}"


def summary_markdown(config, status_counts, prevalence_rows, agreement_rows, tokens_rows, throughput_rows,
                     errors_rows, human) -> str:
    conf = float(config["stats"]["confidence"])
    c = f"{conf:.0%}"
    total = sum(status_counts.values())
    ok, err, exc = (status_counts.get(k, 0) for k in ("ok", "error", "excluded"))
    out = ["# vidlabel summary", "",
           f"The inventory holds {total:,} posts: {ok:,} were classified, {err:,} requests ended in an error "
           f"and {exc:,} posts were excluded before classification (see errors.csv).", ""]

    out += ["## Prevalence", ""]
    for r in prevalence_rows:
        s = (f"- **{r['question']}**: the model answered \"yes\" for {_pct(r['model_share'])} of the "
             f"{r['answered']:,} posts it answered")
        s += f" ({r['no_answer']:,} classified posts without an answer are left out of this share)." \
            if r["no_answer"] else "."
        if human and r.get("human_n"):
            s += (f" The {r['human_n']:,} usable human labels give a human-only share of {_pct(r.get('human_share'))} "
                  f"({c} CI {_pct(r.get('human_lo'))}–{_pct(r.get('human_hi'))}, {r.get('human_ci_method')}).")
            if r.get("corrected") is not None:
                s += (f" Corrected for the model's errors (PPI++, λ = {r['lambda']:.2f}) the share is "
                      f"**{_pct(r['corrected'])}** ({c} CI {_pct(r['corrected_lo'])}–{_pct(r['corrected_hi'])}).")
        elif human:
            s += " No usable human label for this question: no corrected estimate."
        if r.get("note") and (r.get("human_n") or not human):
            s += f" Note: {r['note']}."
        out.append(s)
    if not human:
        out += ["", "No human labels are configured (config key `human_labels`), so the shares above are the "
                    "model's alone and may be biased; agreement.csv has a header only."]
    out.append("")

    if agreement_rows:
        out += ["## Agreement with human labels", ""]
        for a in agreement_rows:
            if not a["n"]:
                out.append(f"- **{a['question']}**: no post has both a human label and a model answer.")
                continue
            parts = ", ".join(f"{m} {_num(a[m])} ({_num(a[m + '_lo'])}–{_num(a[m + '_hi'])})"
                              for m in stats.AGREEMENT_METRICS)
            s = f"- **{a['question']}** on {a['n']:,} posts: {parts}."
            if a["no_model_answer"]:
                s += f" {a['no_model_answer']:,} labelled posts have no model answer and are not compared."
            out.append(s)
        out += ["", f"Intervals at {c}: {agreement_rows[0]['ci_method']}.", ""]

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
                   f"That is {_num(overall['gpu_hours'], 2)} GPU-hours at {config['cost']['gpus_per_job']} GPUs per job, "
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

    if human:
        out += ["## Human labels", "",
                f"{human['rows']:,} rows read from `{human['path']}`, {human['usable']:,} used"
                + (", weighted by inverse sampling probability." if human["weighted"] else
                   " (no sampling_probability column: a uniform random sample is assumed).")]
        if human["issues"]:
            out.append("Rows not used (reported, not silently dropped):")
            out += [f"- {issue}: {count:,} row(s), e.g. {_examples(ex)}" for issue, count, ex in human["issues"]]
        out.append("")

    out += ["## How these numbers are made", "",
            "- Population: the classified posts (status ok or error). Excluded posts are outside it.",
            "- Model share: \"yes\" / answered; posts without an answer are counted in `no_answer`, not in the share. "
            "Its interval (Wilson) reflects sampling only, not the model's bias.",
            "- Human-only share: mean of the usable human labels (Wilson interval, or a weighted CLT interval "
            "with inverse sampling probabilities).",
            "- Corrected share: PPI++ mean with the power-tuning λ (ppi_py's estimator, computed in DuckDB SQL "
            "and cross-checked against ppi_py). All classified posts form the unlabelled set; a post without a model "
            "answer is predicted as the question's model share, so human labels on failed posts still count. "
            "λ = 0 is the human-only estimate, λ = 1 plain PPI.",
            f"- Every interval is at the configured confidence ({c}, config stats.confidence).",
            ""]
    return "\n".join(out)
