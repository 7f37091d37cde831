"""Compare stage: several models' labels of the same posts side by side -> ``compare/``.

Each model was merged and aggregated on its own (``vidlabel.analyze.aggregate``); every per-model number here
(shares, corrected prevalence, agreement with the human labels, tokens, GPU-hours, cost) is copied
from that model's summary, so it reads the same in both places. What only the models together give
is added: agreement between each pair of models, the posts they disagree on (a list a person can
open), a plot of each model's prevalence and a summary in plain words of which model reaches what,
at what cost. A model is called better than another only when the interval of their paired difference
(the same labelled posts, the same design weights) excludes 0 (``paired_differences``).

Everything that scales with the posts runs in DuckDB (``sql/compare_*.sql``, and the aggregate's
``answers_long`` and ``prevalence_model``); Python handles per-question statistics and text.
Inputs that do not fit together (a model's labels of another question set or another post set, a
summary made from other labels) stop the stage with a message naming the file.
"""

from __future__ import annotations

import csv
import logging
import math
import zlib
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pyarrow as pa

from vidlabel.analyze import estimators, plots, stats
from vidlabel.analyze.agreement import label_design
from vidlabel.analyze.compare_text import compare_markdown, parsed_row, to_float
from vidlabel.analyze.humans import load_human_labels
from vidlabel.analyze.labels_db import (
    answers_long_sql,
    check_label_columns,
    query_rows,
    register_table,
    relation_columns,
    write_csv,
)
from vidlabel.analyze.merge import FIXED_COLUMNS, provenance_counts, question_ids
from vidlabel.core import duck
from vidlabel.core.io import write_text

log = logging.getLogger(__name__)

SUMMARY_METRICS = tuple(f"{m}{s}" for m in stats.AGREEMENT_METRICS for s in ("", "_lo", "_hi"))
MODELS_COLUMNS = [
    "model", "model_id", "server", "provenances", "question", "posts", "answered", "no_answer",
    "model_share", "model_lo", "model_hi", "human_n", "human_share", "human_lo", "human_hi", "human_ci_method",
    "corrected", "corrected_lo", "corrected_hi", "corrected_method", "agreement_design", "agreement_n",
    "agreement_no_answer", *SUMMARY_METRICS,
    "requests", "input_tokens", "output_tokens", "busy_s", "gpu_hours", "cost_usd", "confidence", "note",
]
# models.csv column -> the column of the model's prevalence.csv / agreement.csv it is copied from
PREVALENCE_FIELDS = {c: c for c in ("posts", "answered", "no_answer", "model_share", "model_lo", "model_hi",
                                    "human_n", "human_share", "human_lo", "human_hi", "human_ci_method",
                                    "corrected", "corrected_lo", "corrected_hi", "corrected_method")}
AGREEMENT_FIELDS = {"agreement_design": "design", "agreement_n": "n", "agreement_no_answer": "no_model_answer",
                    **{c: c for c in SUMMARY_METRICS}}
THROUGHPUT_FIELDS = ("requests", "input_tokens", "output_tokens", "busy_s", "gpu_hours", "cost_usd")
PAIR_COUNTS = ["both_answered", "both_yes", "only_a_yes", "only_b_yes", "both_no", "only_a_answered",
               "only_b_answered"]
# Per pair and question, the paired comparison on the same labelled posts (``paired_differences``): for each
# metric of estimators.PAIRED_METRICS each model's estimate, A - B with its interval, the smallest difference
# the labels can detect and the verdict (VERDICTS).
PAIRED_COLUMNS = ["paired_n", "paired_discordant", "paired_design", "equivalence_margin"] + [
    f"{m}_{k}" for m in estimators.PAIRED_METRICS
    for k in ("a", "b", "difference", "difference_lo", "difference_hi", "detectable", "verdict")]
MODEL_AGREEMENT_COLUMNS = [
    "question", "model_a", "model_b", *PAIR_COUNTS, "agreement", "agreement_lo", "agreement_hi",
    "kappa", "kappa_lo", "kappa_hi", "a_yes_share", "b_yes_share", "yes_share_difference", *PAIRED_COLUMNS,
    "confidence", "ci_method", "note",
]
# The verdict on one metric from the interval of the paired difference A - B (a metric of which lower is
# better, the prevalence error, reversed): A better, B better, as good as each other within the equivalence
# margin, or the labels cannot tell.
VERDICTS = ("a_better", "b_better", "equivalent", "cannot_tell", "no_labels")
# Each model's cell (sql/agreement_cells.sql) on the labelled posts of a question.
ONE_MODEL_CELLS = "SELECT question, post_id, probability, phase, cell FROM ({cells}) WHERE cell IS NOT NULL"
# Rows of disagreements.csv shown in compare.md; the file holds them all.
DISAGREEMENTS_SHOWN = 20
SUMMARY_FILES = ("prevalence.csv", "agreement.csv", "throughput.csv")
# Every model's answers in long form: sql/answers_long.sql on each model's labels, tagged with the
# model's position and name.
MODEL_ANSWERS_TABLE = """CREATE TABLE model_answers (position INTEGER, model VARCHAR, post_id VARCHAR,
    status VARCHAR, question VARCHAR, answer VARCHAR, p_yes DOUBLE)"""
MODEL_ANSWERS_INSERT = """INSERT INTO model_answers
    SELECT $position, $name, post_id, status, question, answer, p_yes FROM ({answers_long})"""
# One model's answers as the view sql/prevalence_model.sql reads.
ONE_MODEL_ANSWERS = """CREATE OR REPLACE VIEW answers_long AS
    SELECT post_id, status, question, answer, p_yes FROM model_answers WHERE position = {position:d}"""
DISAGREEMENT_COUNTS = """SELECT question, kind, count(*) AS n, count(human_label) AS labelled
    FROM disagreements GROUP BY ALL"""
DISAGREEMENTS_FIRST = "SELECT * FROM disagreements LIMIT {limit:d}"
# Per model and question, the classified posts with a usable human label: the human_n its summary
# must show if it was made with the same human labels.
HUMAN_LABELLED_COUNTS = """SELECT a.position, a.question, count(*) AS human_n
    FROM model_answers a JOIN human_valid h USING (post_id, question)
    WHERE a.status IN ('ok', 'error')
    GROUP BY ALL"""


class CompareError(ValueError):
    """The models' inputs do not fit together; the message names the file and the problem."""


# --------------------------------------------------------------------------------------------
# Entry point

def run(config: dict[str, Any], models: list[tuple[str, str, str]], inventory_path: str,
        human_labels_path: str | None, compare_dir: str, human_design_path: str | None = None) -> None:
    """Write models.csv, model_agreement.csv, disagreements.csv, plots/prevalence_by_model.png and
    compare.md into ``compare_dir``. ``models``: (name, labels_path, summary_dir) per model, in the
    config's order; the human labels and their design as each model's aggregate read them."""
    compare_dir = Path(compare_dir)
    confidence = float(config["stats"]["confidence"])
    ids = question_ids(config)
    names = [name for name, _, _ in models]
    if not models:
        raise CompareError("no model to compare (classify.models is empty)")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise CompareError(f"model name(s) {repeated} given more than once: each model needs its own name")

    con = duck.connect()
    duck.parquet_view(con, "inventory", inventory_path)
    register_table(con, "questions", pa.table({"question": ids, "position": list(range(len(ids)))}))
    register_table(con, "models", pa.table({"position": list(range(len(names))), "name": names}))
    con.execute(MODEL_ANSWERS_TABLE)
    described = [_load_model(con, ids, position, name, labels_path, inventory_path)
                 for position, (name, labels_path, _) in enumerate(models)]
    for d, (_, _, summary_dir) in zip(described, models):
        d["summary"] = _read_summary(con, ids, d, Path(summary_dir), confidence)

    # The human labels every model's summary was made with; the post sets are equal, so the first
    # model's labels serve for checking them.
    duck.parquet_view(con, "labels", described[0]["labels_path"])
    human = load_human_labels(con, human_labels_path, human_design_path)
    _check_human_counts(con, described, ids, human_labels_path)

    model_rows = models_table(described, ids, confidence)
    samples = int(config["stats"]["bootstrap_samples"])
    pair_rows = model_agreement(con, confidence, samples)
    margin = config.get("compare", {}).get("equivalence_margin")
    paired = paired_differences(con, described, human, confidence, samples, margin)
    for row in pair_rows:
        row.update(paired.get((row["question"], row["model_a"], row["model_b"]),
                              {"paired_n": 0, "equivalence_margin": margin,
                               **{f"{m}_verdict": "no_labels" for m in estimators.PAIRED_METRICS}}))
    write_csv(compare_dir / "models.csv", MODELS_COLUMNS, model_rows)
    write_csv(compare_dir / "model_agreement.csv", MODEL_AGREEMENT_COLUMNS, pair_rows)
    disagreements = write_disagreements(con, names, compare_dir / "disagreements.csv")
    plots.prevalence_by_model([parsed_row(r) for r in model_rows], compare_dir / "plots" / "prevalence_by_model.png",
                              confidence)
    write_text(compare_markdown(config, described, ids, model_rows, pair_rows, disagreements, human),
               compare_dir / "compare.md")
    log.info("comparison of %d model(s) written to %s (human labels: %s)", len(models), compare_dir,
             human["path"] if human else "none")


# --------------------------------------------------------------------------------------------
# Inputs

def _load_model(con, ids: Sequence[str], position: int, name: str, labels_path, inventory_path) -> dict[str, Any]:
    """Check one model's labels.parquet and add its answers to table ``model_answers``."""
    duck.parquet_view(con, "labels", labels_path)
    check_label_columns(con, ids, labels_path)
    other_questions = [c for c in relation_columns(con, "labels") if c not in FIXED_COLUMNS and c not in ids]
    if other_questions:
        raise CompareError(f"{labels_path} (model {name}) holds question column(s) {other_questions} that "
                           f"classify.questions does not have ({list(ids)}): it was labelled with another question "
                           "set. Rerun its classify and merge.")
    problems = con.execute(duck.sql("compare_post_sets")).fetchall()
    if problems:
        raise CompareError(f"{labels_path} (model {name}) does not hold the posts of {inventory_path}: "
                           + "; ".join(f"{problem}: {n} post(s), e.g. {', '.join(map(str, examples))}"
                                       for problem, n, examples in problems)
                           + ". Every model must label the same inventory: rerun its merge.")
    answers = answers_long_sql(con, ids)
    con.execute(MODEL_ANSWERS_INSERT.format(answers_long=answers), {"position": position, "name": name})
    provenance = provenance_counts(con)
    return {"name": name, "position": position, "labels_path": str(labels_path), "provenance": provenance,
            "model_ids": sorted({str(r.model) for r in provenance}),
            "servers": sorted({str(r.server) for r in provenance}),
            "prompts": sorted({str(r.prompt_hash) for r in provenance})}


def _read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def _read_summary(con, ids: Sequence[str], model: dict, summary_dir: Path, confidence: float) -> dict[str, Any]:
    """The model's aggregate tables, checked against its labels: a summary made from other labels
    (a stale one) would put another run's numbers beside this one's."""
    name = model["name"]
    for file in SUMMARY_FILES:
        if not (summary_dir / file).is_file():
            raise CompareError(f"{summary_dir / file} (model {name}) does not exist: run the model's aggregate first")
    prevalence = {r["question"]: r for r in _read_csv(summary_dir / "prevalence.csv")}
    if list(prevalence) != list(ids):
        raise CompareError(f"{summary_dir / 'prevalence.csv'} (model {name}) holds questions {list(prevalence)}, "
                           f"not classify.questions {list(ids)}: rerun the model's aggregate")
    levels = {r["confidence"] for r in prevalence.values()}
    if any(to_float(level) != confidence for level in levels):
        raise CompareError(f"{summary_dir / 'prevalence.csv'} (model {name}) has intervals at confidence "
                           f"{sorted(levels)}, not stats.confidence {confidence}: rerun the model's aggregate")
    con.execute(ONE_MODEL_ANSWERS.format(position=model["position"]))
    counted = {r["question"]: r for r in query_rows(con, duck.sql("prevalence_model", answers="answers_long"))}
    for qid in ids:
        expected = counted.get(qid, {"posts": 0, "answered": 0, "yes": 0})
        found = prevalence[qid]
        for key in ("posts", "answered", "yes"):
            if _int(found.get(key)) != int(expected[key]):
                raise CompareError(
                    f"{summary_dir / 'prevalence.csv'} (model {name}) does not match {model['labels_path']}: "
                    f"question {qid}: {key} {found.get(key)!r} in the summary, {expected[key]} in the labels. "
                    "The summary was made from other labels: rerun the model's aggregate.")
    agreement = {r["question"]: r for r in _read_csv(summary_dir / "agreement.csv")}
    overall = next((r for r in _read_csv(summary_dir / "throughput.csv") if r["shard"] == "all"), {})
    return {"dir": str(summary_dir), "prevalence": prevalence, "agreement": agreement, "throughput": overall}


def _check_human_counts(con, described: Sequence[dict], ids: Sequence[str], human_labels_path) -> None:
    """Every model's summary was made with these human labels (or none): its human_n per question
    is the number of its classified posts that carry one."""
    counts = {(position, qid): n for position, qid, n in con.execute(HUMAN_LABELLED_COUNTS).fetchall()}
    for d in described:
        for qid in ids:
            found = d["summary"]["prevalence"][qid].get("human_n") or "0"
            expected = counts.get((d["position"], qid), 0)
            if _int(found) != expected:
                raise CompareError(
                    f"{Path(d['summary']['dir']) / 'prevalence.csv'} (model {d['name']}) was made with other human "
                    f"labels: question {qid}: human_n {found} in the summary, {expected} labelled posts in "
                    f"{human_labels_path or 'no human-label file'}. Rerun the model's aggregate.")


def _int(text) -> int | None:
    try:
        return int(text)
    except (TypeError, ValueError):
        return None


# --------------------------------------------------------------------------------------------
# Tables

def models_table(described: Sequence[dict], ids: Sequence[str], confidence: float) -> list[dict[str, Any]]:
    """One row per (model, question); the numbers are the model's summary's, as written there."""
    rows = []
    for d in described:
        s = d["summary"]
        for qid in ids:
            prevalence, agreement = s["prevalence"][qid], s["agreement"].get(qid, {})
            row = {"model": d["name"], "model_id": "; ".join(d["model_ids"]), "server": "; ".join(d["servers"]),
                   "provenances": len(d["provenance"]), "question": qid, "confidence": confidence}
            row.update({k: prevalence.get(v, "") for k, v in PREVALENCE_FIELDS.items()})
            row.update({k: agreement.get(v, "") for k, v in AGREEMENT_FIELDS.items()})
            row.update({k: s["throughput"].get(k, "") for k in THROUGHPUT_FIELDS})
            notes = [n for n in (prevalence.get("note"), agreement.get("note")) if n]
            if len(d["provenance"]) > 1:
                notes.append(f"mixed provenance: answers from {len(d['provenance'])} servers or settings")
            if not s["throughput"]:
                notes.append("no request has timestamps: no busy time, GPU-hours or cost")
            row["note"] = "; ".join(notes)
            rows.append(row)
    return rows


def model_agreement(con, confidence: float, bootstrap_samples: int) -> list[dict[str, Any]]:
    """Agreement between each pair of models per question, on the posts both answered. Model B
    stands in the place of the reference of ``stats.agreement`` (kappa is symmetric; its accuracy
    is the share of posts on which the two agree)."""
    method = (f"Wilson: agreement; percentile bootstrap ({bootstrap_samples} resamples of the posts both "
              "answered): kappa")
    rows = []
    for c in query_rows(con, duck.sql("compare_pairs")):
        both_yes, only_a, only_b, both_no = (int(c[k]) for k in ("both_yes", "only_a_yes", "only_b_yes", "both_no"))
        n = int(c["both_answered"])
        seed = zlib.crc32(f"{c['question']}|{c['model_a']}|{c['model_b']}".encode())
        metrics = stats.agreement(both_yes, only_a, only_b, both_no, confidence, bootstrap_samples, seed)
        row = {**c, "agreement": metrics["accuracy"], "agreement_lo": metrics["accuracy_lo"],
               "agreement_hi": metrics["accuracy_hi"], "kappa": metrics["kappa"], "kappa_lo": metrics["kappa_lo"],
               "kappa_hi": metrics["kappa_hi"], "confidence": confidence, "ci_method": method, "note": ""}
        a_yes, b_yes = both_yes + only_a, both_yes + only_b
        row["a_yes_share"] = a_yes / n if n else math.nan
        row["b_yes_share"] = b_yes / n if n else math.nan
        row["yes_share_difference"] = row["a_yes_share"] - row["b_yes_share"]
        constant = [(m, "yes" if k == n else "no") for m, k in ((c["model_a"], a_yes), (c["model_b"], b_yes))
                    if n and k in (0, n)]
        if not n:
            row["note"] = "no post answered by both models"
        elif constant:
            # one model giving one answer everywhere: kappa is 0 or undefined whatever the other does
            row["kappa_lo"] = row["kappa_hi"] = math.nan
            row["note"] = ("; ".join(f"{m} answered \"{a}\" on every post both answered" for m, a in constant)
                           + ": the kappa interval cannot be estimated (n/a)")
        elif min(both_yes, only_a, only_b, both_no) == 0:
            row["note"] = (f"a cell of the 2x2 table is empty: kappa resampled from cell shares smoothed by "
                           f"+{stats.EMPTY_CELL_PSEUDOCOUNT}")
        rows.append(row)
    return rows


def paired_differences(con, described: Sequence[dict], human: dict | None, confidence: float, samples: int,
                       margin: float | None) -> dict[tuple[str, str, str], dict[str, Any]]:
    """Each pair of models on the same human-labelled posts, per question: the design-weighted paired
    difference of every metric of estimators.PAIRED_METRICS (``estimators.paired_difference``, the design's
    replicate weights shared by both models) and the verdict (``verdict``). Keyed by (question, model A,
    model B); empty without human labels. A post a model gave no answer for is its wrong answer, as in each
    model's agreement.csv (sql/agreement_cells.sql); tied human labels are left out."""
    if not human:
        return {}
    per_model = []
    for d in described:
        con.execute(ONE_MODEL_ANSWERS.format(position=d["position"]))
        per_model.append(con.execute(ONE_MODEL_CELLS.format(cells=duck.sql("agreement_cells"))).fetchnumpy())
    first = per_model[0]
    for d, cells in zip(described, per_model):
        if list(cells["post_id"]) != list(first["post_id"]):  # the post sets were checked equal: a bug if reached
            raise CompareError(f"model {d['name']}: its labelled posts differ from {described[0]['name']}'s")
    questions = np.asarray(first["question"], dtype=object)
    pi = np.asarray(first["probability"], dtype=float)
    pi = np.where(np.isfinite(pi), pi, 1.0)
    phase = np.asarray(first["phase"], dtype=float)
    out = {}
    for qid in dict.fromkeys(questions.tolist()):
        mine = questions == qid
        design_name, design = label_design(qid, pi[mine], phase[mine], human)
        for i, a in enumerate(described):
            for j in range(i + 1, len(described)):
                b = described[j]
                seed = zlib.crc32(f"paired|{qid}|{a['name']}|{b['name']}".encode())
                result = estimators.paired_difference(np.asarray(per_model[i]["cell"])[mine].astype(int),
                                                      np.asarray(per_model[j]["cell"])[mine].astype(int), design,
                                                      confidence, samples, seed)
                discordant = result["f1"]["discordant"]
                row: dict[str, Any] = {"paired_n": int(mine.sum()), "paired_discordant": discordant,
                                       "paired_design": design_name, "equivalence_margin": margin}
                for metric, r in result.items():
                    row.update({f"{metric}_{k}": r[k] for k in ("a", "b", "difference", "detectable")})
                    row[f"{metric}_difference_lo"], row[f"{metric}_difference_hi"] = r["lo"], r["hi"]
                    # no post tells them apart: a zero-width interval that would read as "as good as"
                    row[f"{metric}_verdict"] = (verdict(r["lo"], r["hi"], margin, metric == "prevalence_error")
                                                if discordant else "cannot_tell")
                out[(qid, a["name"], b["name"])] = row
    return out


def verdict(lo: float, hi: float, margin: float | None, lower_is_better: bool = False) -> str:
    """One of VERDICTS from the interval [lo, hi] of the paired difference A - B: a model is better only when
    the interval excludes 0; as good as each other only when it lies inside +-``margin`` (set by the user
    before the results, config compare.equivalence_margin); otherwise the labels cannot tell."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "no_labels"
    if lo > 0 or hi < 0:
        return ("b_better" if lo > 0 else "a_better") if lower_is_better else ("a_better" if lo > 0 else "b_better")
    if margin is not None and -margin < lo and hi < margin:
        return "equivalent"
    return "cannot_tell"


def write_disagreements(con, names: Sequence[str], path: Path) -> dict[str, Any]:
    """Write disagreements.csv (sql/compare_disagreements.sql); return the counts per question and
    kind (with and without a human label) and the first rows, for compare.md."""
    columns = []
    for position, name in enumerate(names):
        columns.append(f"any_value(answer) FILTER (WHERE position = {position}) AS {_quoted(f'answer_{name}')}")
        columns.append(f"any_value(p_yes) FILTER (WHERE position = {position}) AS {_quoted(f'p_yes_{name}')}")
    con.execute("CREATE OR REPLACE TABLE disagreements AS "
                + duck.sql("compare_disagreements", answer_columns=",\n        ".join(columns)))
    duck.copy_to_csv(con, "SELECT * FROM disagreements", path)
    counts = con.execute(DISAGREEMENT_COUNTS).fetchall()
    return {"total": sum(n for _, _, n, _ in counts),
            "counts": {(q, kind): (n, labelled) for q, kind, n, labelled in counts},
            "first": query_rows(con, DISAGREEMENTS_FIRST.format(limit=DISAGREEMENTS_SHOWN))}


def _quoted(column: str) -> str:
    """A generated column name as a SQL identifier (model names hold dots and dashes)."""
    return '"' + column.replace('"', '""') + '"'
