"""Which posts people code: a sample drawn where the model is unsure, its inclusion probabilities, and
the files to code it in Label Studio (rule ``label_sample``; docs/human_labels.md).

- Population: every classified post of ``labels.parquet`` (status ok or error), as in aggregate.
- Confidence: P(yes) per post and question from ``answer_probs`` (vidlabel.serve.confidence). A question
  answered without probabilities takes the question's model share as its P(yes), so with no
  probabilities at all every answered post gets the same uncertainty (a uniform design over them). A
  post without an answer (status error) has no P(yes): ``sampling.post_uncertainty`` counts it as
  maximally uncertain, so failed posts, which are part of the population, are drawn more often.
- Designs (``label_sample.design``): ``two_phase`` (the default) draws in two runs. Without
  ``label_sample.burn_in`` it draws a uniform burn-in (``sampling.burn_in_size``); once that is coded
  and collected, ``label_sample.burn_in`` names the labels and the same rule draws the rest with
  ``sampling.two_phase_design`` (the model's P(yes) checked on the burn-in's resolved labels:
  adjudication, else majority, a tie as 0.5; a mixture of the uniform and the active design). ``active``
  and ``uniform`` draw once (``sampling.inclusion_probabilities``, ``sampling.draw``).
- ``design.parquet`` (``sample_design``) records the frame (every post of the population) with each
  post's pi, fixed here before any new label is seen, and when, from which labels file and how it was
  drawn; aggregate reads it (config key ``human_design``).
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa

from vidlabel.analyze import labelstudio, sampling
from vidlabel.analyze import sample_design as sd
from vidlabel.analyze.humans import load_human_labels
from vidlabel.analyze.merge import question_ids
from vidlabel.core import duck
from vidlabel.core.io import atomic_path, write_text
from vidlabel.core.stage_settings import fingerprint

log = logging.getLogger(__name__)

# video_path: the post's first video (empty for a photo post); media: every item's original file, in
# the post's order (a JSON array).
SAMPLE_COLUMNS = ("post_id", "video_path", "media", "caption", "transcript", "questions", "pi", "seed", "design")
# The human-labels file (aggregate's format); adjudication carries a burn-in's adjudicated labels and
# those of the annotations set as ground truth in Label Studio, phase the phase of a two-phase design a
# label belongs to (1 burn-in, 2 second draw; empty for one phase).
HUMAN_LABEL_COLUMNS = (*labelstudio.EXPORT_COLUMNS, "phase")
# label_sample.floor_share null: the floor the simulations support for each design (docs/human_labels.md,
# docs/statistics.md): 0.4 for a one-phase active design on the raw model probabilities, 0.2 for the
# active part of a two-phase design's second draw (the burn-in, not the floor, then guards against an
# uninformative model).
FLOOR_SHARE_ACTIVE = sd.MEASURED_FLOOR_SHARES[sd.KIND_ACTIVE]
FLOOR_SHARE_SECOND_PHASE = sd.MEASURED_FLOOR_SHARES[sd.KIND_TWO_PHASE]
# A task's pi (written as JSON or CSV text) may differ from design.parquet's by rounding only.
PI_TOLERANCE = 1e-9
# The choice whose probability drives the design (yes/no questions).
POSITIVE_CHOICE = "yes"

# answer_probs is a JSON string {question: {choice: p}} (docs/outputs.md); anything else is a bug upstream.
UNREADABLE_PROBS_SQL = """
SELECT post_id FROM labels
WHERE answer_probs IS NOT NULL
  AND coalesce(json_type(TRY_CAST(CAST(answer_probs AS VARCHAR) AS JSON)) <> 'OBJECT', true)
"""
# The resolved burn-in labels (table human_resolved of humans.load_human_labels): one y per post
# and question, 0.5 for a tie.
BURN_IN_RESOLVED_SQL = "SELECT post_id, question, y FROM human_resolved"
# The manifest's columns a task shows, where the shards have them (items: a post of several media items;
# video_path: a one-video manifest's).
TASK_MANIFEST_COLUMNS = ("items", "video_path", "caption", "transcript")
# The sampled posts' manifest rows, in the sample's order.
SAMPLED_POSTS_SQL = """
SELECT s.post_id, s.post_id IN (SELECT post_id FROM manifest) AS found, {columns}
FROM sampled s LEFT JOIN manifest m USING (post_id)
ORDER BY s.position
"""
# Each item's frame rate from the inventory (Label Studio's frameRate): from each post's items where the
# inventory has them, else the post's own (an inventory written before items).
INVENTORY_ITEM_FPS_SQL = """
SELECT post_id, item.index AS item_index, item.fps AS fps
FROM (SELECT post_id, unnest(items) AS item FROM inventory WHERE post_id IN (SELECT post_id FROM sampled))
"""
INVENTORY_POST_FPS_SQL = """
SELECT post_id, NULL AS item_index, fps FROM inventory WHERE post_id IN (SELECT post_id FROM sampled)
"""
# Transcript texts by identity, for the items of the sampled posts.
TRANSCRIPTS_SQL = "SELECT transcript_id, text FROM transcripts WHERE transcript_id IS NOT NULL AND status = 'ok'"


class SampleError(ValueError):
    """The human sample cannot be drawn as configured; the message names the key or the posts."""


def sample_questions(config: dict[str, Any]) -> list[dict[str, Any]]:
    """The questions coders answer: ``label_sample.questions`` (ids) or every classify question."""
    by_id = {q["id"]: q for q in config["classify"]["questions"]}
    wanted = config["label_sample"]["questions"] or list(by_id)
    unknown = [qid for qid in wanted if qid not in by_id]
    if unknown:
        raise SampleError(f"config key 'label_sample.questions': {unknown} are not classify.questions ids "
                          f"({sorted(by_id)})")
    clash = labelstudio.reserved_question_ids(wanted)
    if clash:
        raise SampleError(f"question id(s) {clash} are names the Label Studio files use themselves "
                          f"({sorted(labelstudio.RESERVED_NAMES)}); rename them in classify.questions")
    return [by_id[qid] for qid in wanted]


def read_population(con, ids: list[str]) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """post ids, status, (N, Q) P(yes) from answer_probs (NaN unknown), (N, Q) hard answers (NaN none)."""
    columns = {row[0] for row in con.execute("DESCRIBE labels").fetchall()}
    missing = [qid for qid in ids if qid not in columns]
    if missing:
        raise SampleError(f"labels.parquet has no column(s) {missing}: was it merged with another question set?")
    if "answer_probs" in columns:
        unreadable = con.execute(UNREADABLE_PROBS_SQL).fetchall()
        if unreadable:
            raise SampleError(f"labels.parquet: answer_probs of {len(unreadable)} post(s) is not a JSON object, "
                              f"e.g. {[post_id for post_id, in unreadable[:5]]}")
        path = "'$.\"{qid}\".\"" + POSITIVE_CHOICE + "\"'"
        probability = ", ".join(
            f"TRY_CAST(json_extract_string(CAST(answer_probs AS VARCHAR), {path.format(qid=qid)}) AS DOUBLE) "
            f"AS {duck.identifier('p_' + qid)}" for qid in ids)
    else:
        log.warning("labels.parquet has no answer_probs column: every answered post gets the same uncertainty "
                    "(a uniform design over them); classify with log-probabilities for an active design")
        probability = ", ".join(f"CAST(NULL AS DOUBLE) AS {duck.identifier('p_' + qid)}" for qid in ids)
    answers = ", ".join(f"CASE {duck.identifier(qid)} WHEN 'yes' THEN 1.0 WHEN 'no' THEN 0.0 END "
                        f"AS {duck.identifier('a_' + qid)}" for qid in ids)
    table = con.sql(duck.sql("label_sample_population", probability_columns=probability,
                             answer_columns=answers)).to_arrow_table()
    if table.num_rows == 0:
        raise SampleError("labels.parquet has no classified post (status ok or error) to sample from")

    def matrix(prefix):
        return np.column_stack([table.column(prefix + qid).to_numpy(zero_copy_only=False).astype(float)
                                for qid in ids])

    return table.column("post_id").to_pylist(), np.asarray(table.column("status").to_pylist()), \
        matrix("p_"), matrix("a_")


def p_yes(probabilities: np.ndarray, answers: np.ndarray, ok: np.ndarray, ids: list[str]) -> np.ndarray:
    """P(yes) per post and question for the design: the model's probability; for an answer without one,
    the question's model share (yes / answered); NaN for a post whose request failed."""
    bad = np.isfinite(probabilities) & ((probabilities < 0) | (probabilities > 1))
    if bad.any():
        raise SampleError(f"answer_probs holds {int(bad.sum())} P(yes) outside [0, 1]")
    out = np.where(ok[:, None], probabilities, np.nan)
    for q, qid in enumerate(ids):
        answered = ok & np.isfinite(answers[:, q])
        fallback = answered & ~np.isfinite(out[:, q])
        if fallback.any():
            share = float(answers[answered, q].mean())
            out[fallback, q] = share
            log.info("question %s: %d of %d answered posts have no probability; they take the model share %.3f",
                     qid, int(fallback.sum()), int(answered.sum()), share)
    return out


def floor_share(settings: dict[str, Any]) -> float:
    """``label_sample.floor_share``, or when it is null the floor of the design in use."""
    if settings["design"] == sd.KIND_UNIFORM:
        return 1.0
    if settings["floor_share"] is not None:
        return float(settings["floor_share"])
    return FLOOR_SHARE_SECOND_PHASE if settings["design"] == sd.KIND_TWO_PHASE else FLOOR_SHARE_ACTIVE


def read_burn_in(con, path: str | Path, ids: list[str], all_ids: list[str],
                 post_ids: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """An existing uniform human sample, checked as aggregate checks human labels: (N,) mask of its
    posts in the population and (n0, Q) resolved labels for the sampled questions ``ids`` (NaN where
    a post has none, 0.5 for a tie). Leaves tables human_checked / human_resolved on ``con``."""
    con.register("questions_arrow", pa.table({"question": all_ids, "position": list(range(len(all_ids)))}))
    con.execute("CREATE OR REPLACE TABLE questions AS SELECT * FROM questions_arrow")
    described = load_human_labels(con, path)
    if not described["usable"]:
        raise SampleError(f"config key 'label_sample.burn_in': {path} has no usable human label")
    if described["weighted"]:
        raise SampleError(f"config key 'label_sample.burn_in': {path} has varying sampling_probability; a "
                          "burn-in must be a uniform sample (its inclusion probability is taken as n0/N)")
    position = {post_id: i for i, post_id in enumerate(post_ids)}
    q_index = {qid: q for q, qid in enumerate(ids)}
    resolved = con.execute(BURN_IN_RESOLVED_SQL).fetchall()
    outside = sorted({post_id for post_id, _, _ in resolved if post_id not in position})
    if outside:  # load_human_labels already drops unknown and excluded posts: a bug if reached
        raise SampleError(f"burn-in: {len(outside)} labelled post(s) are not classified posts, e.g. {outside[:5]}")
    burn_in = np.zeros(len(post_ids), dtype=bool)
    burn_in[[position[post_id] for post_id, _, _ in resolved]] = True
    row = {i: r for r, i in enumerate(np.flatnonzero(burn_in))}
    y = np.full((int(burn_in.sum()), len(ids)), np.nan)
    for post_id, question, label in resolved:
        if question in q_index:
            y[row[position[post_id]], q_index[question]] = label
    partial = int((~np.isfinite(y)).any(axis=1).sum())
    if partial:
        log.warning("burn-in: %d of %d posts lack a label for some sampled question; they are not coded again",
                    partial, y.shape[0])
    return burn_in, y


def burn_in_rows(con, pi_burn_in: float) -> pa.Table:
    """The burn-in's usable rows in human-label format (every coder's label, adjudications kept), each
    with the burn-in's sampling probability n0/N and phase 1."""
    return con.sql(duck.sql("label_sample_burn_in"), params={"pi": pi_burn_in}).to_arrow_table()


class _Draw(NamedTuple):
    """One run's draw: every post's pi (in its phase), drawn, coded now, phase, how it came into the
    sample, the second draw's P(yes) (None otherwise); what the design file's description adds; the
    burn-in's labels to pass on."""

    pi: np.ndarray
    drawn: np.ndarray
    coded: np.ndarray
    phase: list
    post_design: np.ndarray
    calibrated: list
    metadata: dict[str, Any]
    burn_in_rows: pa.Table | None


def run(config: dict[str, Any], labels_path: str | Path, manifest_paths: list[str | Path],
        burn_in_path: str | Path | None, outputs: dict[str, str | Path],
        inventory_path: str | Path | None = None, transcript_paths: list[str | Path] | None = None) -> None:
    """Draw the sample and write ``outputs``: sample (CSV), design (Parquet, ``sample_design``), burn_in
    (CSV, the burn-in's labels in human-label format, header only without one), ls_config (XML), ls_tasks
    (JSON, every item of each post, each video's frame rate from ``inventory_path``, the rule's
    inventory.parquet, and each item's transcript from ``transcript_paths``, the transcript chunks)."""
    settings = config["label_sample"]
    kind = settings["design"]
    questions = sample_questions(config)
    ids = [q["id"] for q in questions]
    con = duck.connect()
    duck.parquet_view(con, "labels", labels_path, file_row_number=True)
    post_ids, status, probabilities, answers = read_population(con, ids)
    ok = status == "ok"
    model_p_yes = p_yes(probabilities, answers, ok, ids)
    uncertainty = sampling.post_uncertainty(model_p_yes)
    budget, seed, floor = float(settings["budget"]), int(settings["seed"]), floor_share(settings)
    if burn_in_path and kind != sd.KIND_TWO_PHASE:
        raise SampleError(f"config key 'label_sample.burn_in' is for label_sample.design two_phase, not {kind}")
    switched = {}
    if kind == sd.KIND_ACTIVE:
        refusal = sampling.active_design_refusal(model_p_yes, budget, ids)
        if refusal:
            log.warning("label_sample.design active switched to a uniform draw: %s. Use design two_phase to spend "
                        "labels where the model is unsure once a burn-in has checked its probabilities.", refusal)
            switched = {"requested_design": kind, "switched_because": refusal}
            kind, floor = sd.KIND_UNIFORM, 1.0
    if kind in sd.MEASURED_FLOOR_SHARES and floor < sd.MEASURED_FLOOR_SHARES[kind]:
        log.warning("config key 'label_sample.floor_share' %g is below the %g the simulations support for design %s: "
                    "posts the model is sure about get weights of hundreds and the intervals may cover less than "
                    "promised (0.61-0.66 at floor 0, docs/statistics.md); summary.md will say so", floor,
                    sd.MEASURED_FLOOR_SHARES[kind], kind)
    if burn_in_path:
        draw = _second_draw(con, config, burn_in_path, post_ids, ids, model_p_yes, budget, seed, floor)
    elif kind == sd.KIND_TWO_PHASE:
        draw = _burn_in_draw(model_p_yes, budget, seed, float(settings["burn_in_share"]))
    else:
        draw = _one_draw(uncertainty, budget, seed, floor)
    metadata = {"design": kind, **switched, "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "labels_path": str(labels_path), "labels_sha256": sd.file_digest(labels_path),
                "frame_posts": len(post_ids), "budget": budget, "seed": seed, "floor_share": floor, "questions": ids,
                "model": settings["model"], "settings": fingerprint(config, "label_sample"), "phase": 1,
                **draw.metadata}
    burn_in_table = draw.burn_in_rows if draw.burn_in_rows is not None else pa.table(
        {c: pa.array([], pa.float64() if c == "sampling_probability" else pa.string()) for c in HUMAN_LABEL_COLUMNS})
    _write_csv(outputs["burn_in"], HUMAN_LABEL_COLUMNS, burn_in_table.to_pylist())
    sd.write_design(outputs["design"], {"post_id": post_ids, "status": status.tolist(), "uncertainty": uncertainty,
                                        "pi": draw.pi, "drawn": draw.drawn, "phase": draw.phase,
                                        "design": draw.post_design.tolist(), "calibrated": draw.calibrated}, metadata)
    new = np.flatnonzero(draw.coded)
    new = new[np.random.default_rng((seed, 1)).permutation(new.size)]  # coding order: a stop part-way is random
    rows = _sample_rows(con, manifest_paths, inventory_path, transcript_paths or [], [post_ids[i] for i in new],
                        draw.pi[new], draw.post_design[new], ids, seed)
    _write_csv(outputs["sample"], SAMPLE_COLUMNS, rows)
    for row in rows:
        for item in (*row["videos"], *row["images"]):
            item["url"] = labelstudio.media_url(settings["video_url"], item["path"], config["media_root"])
    write_text(labelstudio.labelling_config(questions), outputs["ls_config"])
    write_text(json.dumps(labelstudio.tasks(rows), ensure_ascii=False, indent=1) + "\n", outputs["ls_tasks"])
    share = draw.pi[draw.coded] if draw.coded.any() else np.zeros(1)
    log.info("%s design over %d posts (%d ok, %d failed): %d drawn for coding now (budget %g, floor share %g, seed "
             "%d); drawn with pi min %.4g, median %.4g, max %.4g", kind, len(post_ids), int(ok.sum()),
             int((~ok).sum()), new.size, budget, floor, seed, share.min(), float(np.median(share)), share.max())


def _one_draw(uncertainty: np.ndarray, budget: float, seed: int, floor: float) -> _Draw:
    """An active (or, at floor 1, uniform) draw in one round."""
    n_posts = uncertainty.size
    if budget > n_posts:
        raise SampleError(f"config key 'label_sample.budget': {budget:g} is more than the {n_posts} posts to sample")
    pi = sampling.inclusion_probabilities(uncertainty, budget, floor)
    drawn = sampling.draw(pi, seed)
    uniform = np.ptp(pi) <= 1e-12 * pi.max()
    post_design = np.full(n_posts, sd.POST_UNIFORM if uniform else sd.POST_ACTIVE)
    return _Draw(pi, drawn, drawn, [None] * n_posts, post_design, [None] * n_posts, {}, None)


def _burn_in_draw(model_p_yes: np.ndarray, budget: float, seed: int, share: float) -> _Draw:
    """The first round of a two-phase design: a uniform burn-in."""
    n_posts = model_p_yes.shape[0]
    n_burn = sampling.burn_in_size(model_p_yes, budget, share)
    drawn = sampling.uniform_sample(n_posts, n_burn, seed)
    log.info("two-phase design, first draw: a uniform burn-in of %d of the %g labels. Code them, collect them "
             "(python -m vidlabel.analyze.label_sample collect), set label_sample.burn_in to the collected file and "
             "run label_sample again for the rest (docs/human_labels.md)", n_burn, budget)
    return _Draw(np.full(n_posts, n_burn / n_posts), drawn, drawn, [1] * n_posts, np.full(n_posts, sd.POST_BURN_IN),
                 [None] * n_posts, {"burn_in_posts": n_burn, "pi_burn_in": n_burn / n_posts}, None)


def _second_draw(con, config, burn_in_path, post_ids, ids, model_p_yes, budget, seed, floor) -> _Draw:
    """The second round of a two-phase design, from the coded burn-in (``sampling.two_phase_design``)."""
    burn_in, y_burn_in = read_burn_in(con, burn_in_path, ids, question_ids(config), post_ids)
    n_burn, n_posts = int(burn_in.sum()), len(post_ids)
    if not n_burn < budget <= n_posts:
        raise SampleError(f"config key 'label_sample.budget': {budget:g} labels in all must exceed the {n_burn} of "
                          f"the burn-in and fit the {n_posts} posts")
    try:
        design = sampling.two_phase_design(model_p_yes, burn_in, y_burn_in, budget, floor, sampling.fold_of(post_ids))
    except ValueError as exc:
        raise SampleError(f"config key 'label_sample.burn_in': {burn_in_path}: {exc} "
                          f"(questions in order: {ids})") from None
    kept = {qid: sampling.kept_as_given(model_p_yes[:, q], design.calibrated[:, q]) for q, qid in enumerate(ids)}
    log.info("two-phase design, second draw: %d burn-in posts from %s; the model's P(yes) kept for %s, recalibrated "
             "for %s; mixture weight of the active part %.2g", n_burn, burn_in_path,
             [q for q, k in kept.items() if k] or "none", [q for q, k in kept.items() if not k] or "none",
             design.mixture)
    drawn = burn_in | sampling.draw(design.pi, seed)
    return _Draw(np.where(burn_in, design.pi_burn_in, design.pi), drawn, drawn & ~burn_in,
                 np.where(burn_in, 1, 2).tolist(), np.where(burn_in, sd.POST_BURN_IN, sd.POST_SECOND_PHASE),
                 design.calibrated.tolist(),
                 {"phase": 2, "burn_in_path": str(burn_in_path), "burn_in_posts": n_burn,
                  "pi_burn_in": design.pi_burn_in, "mixture": design.mixture, "kept_model_probabilities": kept,
                  "combination": dict(zip(ids, design.combination)),
                  "fold_combination": {qid: list(design.fold_combination[q]) for q, qid in enumerate(ids)}},
                 burn_in_rows(con, design.pi_burn_in))


def _sample_rows(con, manifest_paths, inventory_path, transcript_paths, post_ids, pi, design, ids,
                 seed) -> list[dict[str, Any]]:
    duck.parquet_view(con, "manifest", manifest_paths, union_by_name=True)
    con.register("sampled", pa.table({"post_id": pa.array(post_ids, pa.string()),
                                      "position": list(range(len(post_ids)))}))
    have = {row[0] for row in con.execute("DESCRIBE manifest").fetchall()}
    columns = ", ".join(f"m.{c}" if c in have else f"NULL AS {c}" for c in TASK_MANIFEST_COLUMNS)
    found = con.execute(SAMPLED_POSTS_SQL.format(columns=columns)).fetchall()
    absent = [post_id for post_id, there, *_ in found if not there]
    if absent:
        raise SampleError(f"{len(absent)} sampled post(s) are not in the manifest shards, e.g. {absent[:5]}: "
                          "rerun the workflow so that labels.parquet and the manifest agree")
    fps: dict[tuple[str, int | None], float | None] = {}
    if inventory_path is not None:
        duck.parquet_view(con, "inventory", inventory_path)
        by_item = "items" in {row[0] for row in con.execute("DESCRIBE inventory").fetchall()}
        fps = {(post_id, index): rate for post_id, index, rate in
               con.execute(INVENTORY_ITEM_FPS_SQL if by_item else INVENTORY_POST_FPS_SQL).fetchall()}
    texts: dict[str, str] = {}
    if transcript_paths:
        duck.parquet_view(con, "transcripts", transcript_paths, union_by_name=True)
        texts = dict(con.execute(TRANSCRIPTS_SQL).fetchall())
    rows = []
    for (post_id, _, items, video_path, caption, transcript), p, d in zip(found, pi, design):
        items = items or [{"index": 0, "kind": "video", "path": video_path, "label": None, "transcript_id": None}]
        shown = _shown_items(post_id, items, fps)
        spoken = [(i.get("label"), texts[i["transcript_id"]]) for i in items if texts.get(i.get("transcript_id"))]
        rows.append({"post_id": post_id, "video_path": next((i["path"] for i in items if i["kind"] == "video"), None),
                     "media": json.dumps([i["path"] for i in items], ensure_ascii=False), "caption": caption or "",
                     "transcript": "\n".join(f"{label}: {text}" if label else text for label, text in spoken)
                     if spoken else transcript or "",
                     "questions": labelstudio.QUESTIONS_SEPARATOR.join(ids), "pi": float(p), "seed": seed,
                     "design": str(d), **shown})
    return rows


def _shown_items(post_id: str, items: list[dict], fps: dict) -> dict[str, list[dict]]:
    """The post's videos and images as a task shows them: each under its label, with its place in the post
    where it has several items, and a video with its frame rate (the item's, else the post's)."""
    shown: dict[str, list[dict]] = {"videos": [], "images": []}
    for item in items:
        if item["kind"] not in ("video", "image"):
            continue
        label = item.get("label") or ("Video" if item["kind"] == "video" else "Photo")
        if len(items) > 1:
            label = f"{label} (item {int(item['index']) + 1} of {len(items)})"
        entry = {"path": item["path"], "label": label}
        if item["kind"] == "video":
            entry["fps"] = fps.get((post_id, item["index"]), fps.get((post_id, None)))
        shown[f"{item['kind']}s"].append(entry)
    return shown


def _write_csv(path: str | Path, columns, rows) -> None:
    with atomic_path(path) as tmp, open(tmp, "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


# --------------------------------------------------------------------------------------------
# Bringing the labels back

def collect(sample_dir: str | Path, export_path: str | Path, output_path: str | Path) -> list[dict[str, Any]]:
    """The human-labels file for aggregate (config key human_labels): the coders' labels from a Label
    Studio export, each with its post's pi and phase from ``design.parquet``, plus the burn-in labels
    of a second draw (``burn_in_labels.csv``, with their own sampling probability), both in
    ``sample_dir``. A label on a post that was not drawn for coding in this draw is an error: it is
    outside the design; so is a burn-in file that does not match ``design.parquet``."""
    sample_dir = Path(sample_dir)
    table, metadata = sd.read_design(sample_dir / "design.parquet")
    by_post = {row["post_id"]: row for row in table.to_pylist()}
    second_draw = metadata.get("phase") == 2

    def coded_now(post_id):
        row = by_post.get(post_id)
        return bool(row and row["drawn"] and not (second_draw and row["design"] == sd.POST_BURN_IN))

    export = labelstudio.read_export(export_path).to_pylist()
    outside = sorted({r["post_id"] for r in export if not coded_now(r["post_id"])})
    if outside:
        raise SampleError(f"{export_path}: {len(outside)} labelled post(s) were not drawn for coding in "
                          f"{sample_dir / 'design.parquet'}, e.g. {outside[:5]}: was the export made from another "
                          "sample?")
    changed = sorted({r["post_id"] for r in export
                      if abs(r["sampling_probability"] - by_post[r["post_id"]]["pi"]) > PI_TOLERANCE})
    if changed:
        raise SampleError(f"{export_path}: the pi of {len(changed)} task(s) differs from "
                          f"{sample_dir / 'design.parquet'}, e.g. {changed[:5]}: was the sample drawn again after "
                          "the tasks were imported?")
    rows = [{**r, "sampling_probability": by_post[r["post_id"]]["pi"],
             "phase": "" if by_post[r["post_id"]]["phase"] is None else by_post[r["post_id"]]["phase"]} for r in export]
    with open(sample_dir / "burn_in_labels.csv", newline="", encoding="utf-8") as fh:
        burn_in = list(csv.DictReader(fh))
    foreign = sorted({r["post_id"] for r in burn_in
                      if r["post_id"] not in by_post or by_post[r["post_id"]]["design"] != sd.POST_BURN_IN})
    if foreign:
        raise SampleError(f"{sample_dir / 'burn_in_labels.csv'}: {len(foreign)} post(s) are not burn-in posts of "
                          f"{sample_dir / 'design.parquet'}, e.g. {foreign[:5]}: the two files come from different "
                          "draws")
    _write_csv(output_path, HUMAN_LABEL_COLUMNS, rows + burn_in)
    log.info("%d coder label(s) and %d burn-in label(s) written to %s", len(rows), len(burn_in), output_path)
    return rows + burn_in


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vidlabel.analyze.label_sample",
        description="Turn a Label Studio export of the human sample into the human-labels file for aggregate.")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("collect", help="export (+ burn-in) -> human labels CSV with sampling probabilities")
    c.add_argument("export", help="Label Studio export of the tasks (JSON, JSON-MIN or CSV)")
    c.add_argument("--sample-dir", default="results/label_sample", help="the label_sample rule's output folder")
    c.add_argument("-o", "--output", required=True, help="CSV to write (point config key human_labels at it)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s")
    try:
        collect(args.sample_dir, args.export, args.output)
    except (SampleError, labelstudio.ExportError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
