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
  human-only share and the Horvitz-Thompson active estimator (``estimators.active_mean``). A
  two-phase sample (label_sample's default): ``estimators.two_phase_mean``. With the design file
  (config key ``human_design``) each label's probability and phase come from it, and the shares are
  over the posts of its frame: posts classified since are counted apart, with the model's share alone.
- Reported corrected interval: ``stats.corrected_interval`` (t quantile on the number of events, and
  the human-only interval folded in below ``stats.MIN_EVENTS`` events); coverage in docs/statistics.md.
- Human labels on unknown posts/questions, with unreadable labels or on excluded posts are not used;
  each is reported (summary.md, errors.csv, warning log). Several labels for one post and question
  are resolved, never dropped together: an ``adjudication`` column wins, else the majority, a tie
  counts 0.5.
- Agreement metrics estimate each metric over all classified posts: weighted by the design when the
  probabilities vary; a labelled post without a model answer counts as a wrong answer.
- Post types (issue 26, ``post_types``): every share above again over each type's classified posts,
  the human labels that fall on a type standing for it under the same design; what each type holds
  and costs; the input tokens by kind are the manifest's estimates (the server reports no split).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from vidlabel.analyze import plots
from vidlabel.analyze.agreement import AGREEMENT_COLUMNS, agreement
from vidlabel.analyze.humans import check_frame, load_human_labels
from vidlabel.analyze.labels_db import (
    check_label_columns,
    create_answers_long,
    float_array,
    query_rows,
    register_table,
    relation_columns,
    write_csv,
)
from vidlabel.analyze.merge import POST_COLUMNS, question_ids
from vidlabel.analyze.post_types import (
    POST_TYPE_COLUMNS,
    PREVALENCE_BY_TYPE_COLUMNS,
    post_type_rows,
    prevalence_by_type,
)
from vidlabel.analyze.prevalence import PREVALENCE_COLUMNS, prevalence
from vidlabel.analyze.summary_text import TOKEN_KINDS, post_type_section, provenance_section, summary_markdown
from vidlabel.core import duck
from vidlabel.core.io import write_text

log = logging.getLogger(__name__)

TOKENS_COLUMNS = ["direction", "source", "requests", "total", "mean", "p50", "p90", "p99", "max",
                  "prefill_decode_ratio"]
THROUGHPUT_COLUMNS = [
    "shard", "job", "requests", "ok", "errors", "input_tokens", "output_tokens", "first_started_at",
    "last_finished_at", "span_s", "busy_s", "gpus", "requests_per_s", "input_tokens_per_s", "output_tokens_per_s",
    "tokens_per_s", "wall_requests_per_s", "gpu_hours", "cost_usd",
]
ERRORS_COLUMNS = ["stage", "reason", "count"]
PLOTS = ("input_tokens", "input_tokens_by_kind", "output_tokens", "prevalence", "throughput", "errors")
# Columns older merges did not write, with their types: NULL for every post (labels_db.OPTIONAL_LABEL_COLUMNS).
# Without gpus, cost.gpus_per_job; without job_id, one job per shard; without the post's columns, no type.
ABSENT_COLUMN_TYPES = {"gpus": "BIGINT", "job_id": "VARCHAR",
                       **{name: "VARCHAR" if name in ("post_type", "items_dropped") else "BIGINT"
                          for name in POST_COLUMNS}}
TIMELINE_BINS = 200


def run(config: dict[str, Any], labels_path: str | Path, human_labels_path: str | Path | None,
        summary_dir: str | Path, human_design_path: str | Path | None = None) -> None:
    """Write every file of ``summary_dir`` (docs/outputs.md) from ``labels.parquet``, the human labels
    and the design they were drawn under (``sample_design``; config key human_design)."""
    summary_dir = Path(summary_dir)
    confidence = float(config["stats"]["confidence"])
    ids = question_ids(config)
    con = duck.connect()
    duck.parquet_view(con, "labels", labels_path)
    absent = [f"NULL::{kind} AS {name}" for name, kind in ABSENT_COLUMN_TYPES.items()
              if name not in relation_columns(con, "labels")]
    if absent:
        con.read_parquet(str(labels_path)).project(", ".join(["*", *absent])).create_view("labels", replace=True)
    check_label_columns(con, ids, labels_path)
    register_table(con, "questions", pa.table({"question": ids, "position": list(range(len(ids)))}))
    create_answers_long(con, ids)

    human = load_human_labels(con, human_labels_path, human_design_path)
    if human and human["sample_design"]:
        check_frame(con, human["sample_design"], labels_path)
    prevalence_rows = prevalence(con, ids, confidence, human)
    agreement_rows = agreement(con, ids, confidence, int(config["stats"]["bootstrap_samples"]), human) if human else []
    tokens_rows = query_rows(con, duck.sql("tokens"))
    throughput_rows = query_rows(con, duck.sql("throughput"), {
        "gpus_per_job": int(config["cost"]["gpus_per_job"]),
        "gpu_hour_usd": float(config["cost"]["gpu_hour_usd"])})
    errors_rows = query_rows(con, duck.sql("errors"))
    type_rows = post_type_rows(con)
    # After every query of the whole population: it leaves ppi_items holding one type's posts.
    prevalence_type_rows = prevalence_by_type(con, ids, confidence, human)

    write_csv(summary_dir / "prevalence.csv", PREVALENCE_COLUMNS, prevalence_rows)
    write_csv(summary_dir / "agreement.csv", AGREEMENT_COLUMNS, agreement_rows)
    write_csv(summary_dir / "tokens.csv", TOKENS_COLUMNS, tokens_rows)
    write_csv(summary_dir / "throughput.csv", THROUGHPUT_COLUMNS, throughput_rows)
    write_csv(summary_dir / "errors.csv", ERRORS_COLUMNS, errors_rows)
    write_csv(summary_dir / "post_types.csv", POST_TYPE_COLUMNS, type_rows)
    write_csv(summary_dir / "prevalence_by_type.csv", PREVALENCE_BY_TYPE_COLUMNS, prevalence_type_rows)

    status_counts = dict(con.execute("SELECT status, count(*) FROM labels GROUP BY status").fetchall())
    draw_plots(con, summary_dir / "plots", prevalence_rows, errors_rows, confidence,
               human["sampling_probabilities"] if human and human["weighted"] else None)
    write_text(summary_markdown(config, status_counts, prevalence_rows, agreement_rows, tokens_rows,
                                throughput_rows, errors_rows, human, provenance_section(con, config),
                                post_type_section(type_rows, prevalence_type_rows, human, confidence)),
               summary_dir / "summary.md")
    log.info("summary written to %s (%d question(s), human labels: %s)", summary_dir, len(ids),
             human["path"] if human else "none")


def draw_plots(con, plot_dir: Path, prevalence_rows, errors_rows, confidence: float,
               sampling_probabilities: np.ndarray | None = None) -> None:
    tokens = con.execute(duck.sql("token_values")).fetchnumpy()
    plots.token_histogram(float_array(tokens["prompt_tokens"]), plot_dir / "input_tokens.png",
                          "Input tokens per request", "input (prompt) tokens, media included")
    estimates = con.execute(duck.sql("token_estimates")).fetchnumpy()
    plots.token_histograms_by_kind({kind: float_array(estimates[f"est_{kind}_tokens"])
                                    for kind in TOKEN_KINDS},
                                   plot_dir / "input_tokens_by_kind.png", "Input tokens per request by kind "
                                   "(the manifest's estimates)")
    plots.token_histogram(float_array(tokens["completion_tokens"]), plot_dir / "output_tokens.png",
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
