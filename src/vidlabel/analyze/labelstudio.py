"""Label Studio: the labelling config and tasks for a human sample, and reading the coders' export back.

The tasks carry every media item of the post, the caption and the transcripts, never the model's
answer (a coder who sees it tends to agree with it): ``videos`` and ``images`` are lists of items
(``url``, ``label``, and for a video ``fps``, its frame rate from the inventory), shown by Label
Studio's Repeater tag one Video or Image per item under its label ("Photo 2 of 3", with the item's
place in the post where it has several), and ``transcript`` holds each transcript under its item's
label (a soundtrack's, a clip's speech). A one-video post is a ``videos`` list of one. Each task's data
also keeps ``post_id``, ``pi`` (the post's inclusion probability) and ``questions``, so that every export
format carries what the estimate needs.

What a task shows (``videos``, ``images``, ``caption``, ``transcript``) is kept apart from what
identifies it (``post_id``, ``pi``, ``seed``, ``design``, ``questions``): reading an export back needs
only the latter and the question ids.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import urllib.parse
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Iterable

import pyarrow as pa

from vidlabel.core.prompt import ANSWER_CHOICES

# Columns of read_export's table: one row per annotation and question. ``adjudication`` repeats the
# label on the rows of the annotation set as the task's ground truth (empty elsewhere): the decision
# of whoever adjudicated the coders' disagreement (docs/human_labels.md).
EXPORT_COLUMNS = ("post_id", "question", "label", "sampling_probability", "annotator", "adjudication")
# The question ids, in task data and in the flat (CSV, JSON-MIN) exports.
QUESTIONS_SEPARATOR = ";"
# The object every question's Choices point at: the caption's Text, which every task has (a post may
# have no video, or no image).
CHOICES_TARGET = "caption"
# Fields of a task's data; tasks() writes them. Each of ``videos`` has its ``fps`` from the inventory,
# the Video tag's frameRate (null when the probe found none: Label Studio then assumes 24).
TASK_FIELDS = ("post_id", "videos", "images", "caption", "transcript", "questions", "pi", "seed", "design")
# Names a question id cannot take: Label Studio's CSV and JSON-MIN exports put the task's data fields,
# one column per question and these annotation columns side by side, and tag names must be unique
# (the items' tags are video_0, video_1, ..., image_0, ...).
RESERVED_NAMES = frozenset(TASK_FIELDS) | {"id", "annotator", "annotation_id", "created_at", "updated_at",
                                           "lead_time"}
_ITEM_TAG = re.compile(r"^(video|image)_\d+$")


class ExportError(ValueError):
    """A Label Studio export cannot be read as labels of the sampled posts; the message names the task."""


# --------------------------------------------------------------------------------------------
# Import files

def labelling_config(questions: list[dict[str, Any]]) -> str:
    """Label Studio labelling config (XML): every video of the post at its own frame rate (the item's
    ``fps``: without it Label Studio counts frames at 24 per second) and every image, each under its
    label, then the caption and the transcripts, then one required single-choice question per question
    id, headed by the question's text."""
    clash = reserved_question_ids(q["id"] for q in questions)
    if clash:
        raise ValueError(f"question id(s) {clash} are names the Label Studio files use themselves; rename them")
    view = ET.Element("View")
    for kind, tag in (("videos", "Video"), ("images", "Image")):
        repeater = ET.SubElement(view, "Repeater", on=f"${kind}", indexFlag="{{idx}}")
        ET.SubElement(repeater, "Header", value=f"${kind}[{{{{idx}}}}].label", size="5")
        attrs = {"name": f"{kind[:-1]}_{{{{idx}}}}", "value": f"${kind}[{{{{idx}}}}].url"}
        if tag == "Video":
            attrs["frameRate"] = f"${kind}[{{{{idx}}}}].fps"
        ET.SubElement(repeater, tag, **attrs)
    for field, title in (("caption", "Caption"), ("transcript", "Transcript")):
        ET.SubElement(view, "Header", value=title, size="5")
        ET.SubElement(view, "Text", name=field, value=f"${field}")
    for q in questions:
        ET.SubElement(view, "Header", value=q["text"], size="4")
        choices = ET.SubElement(view, "Choices", name=q["id"], toName=CHOICES_TARGET, choice="single",
                                showInline="true", required="true")
        for choice in ANSWER_CHOICES[q.get("type", "yes/no")]:
            ET.SubElement(choices, "Choice", value=choice)
    ET.indent(view)
    return ET.tostring(view, encoding="unicode") + "\n"


def reserved_question_ids(ids: Iterable[str]) -> list[str]:
    """The question ids that would clash with a tag, a task field or an export column."""
    return sorted(i for i in set(ids) if i in RESERVED_NAMES or _ITEM_TAG.match(i))


def media_url(template: str, video_path: str, media_root: str) -> str:
    """The URL Label Studio loads an item's file (video or image) from: ``template``
    (``label_sample.video_url``) with {relative_path} (to the folder that
    holds ``media_root``, so it starts with media_root's own name) and {path} (absolute), both
    URL-quoted. The default template, ``/data/local-files/?d={relative_path}``, is Label Studio's
    local-files URL with LABEL_STUDIO_LOCAL_FILES_DOCUMENT_ROOT set to that folder and a Local Files
    storage at media_root (docs/human_labels.md)."""
    absolute = os.path.realpath(video_path)
    document_root = os.path.dirname(os.path.realpath(media_root))
    relative = os.path.relpath(absolute, document_root)
    return template.format(relative_path=urllib.parse.quote(relative), path=urllib.parse.quote(absolute))


def tasks(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Label Studio tasks, one per sampled post; ``rows`` have post_id, videos (each url, label and fps,
    None when unknown), images (each url and label), caption, transcript, questions (ids joined by
    QUESTIONS_SEPARATOR), pi, seed and design."""
    return [{"data": {f: _task_value(f, row[f]) for f in TASK_FIELDS}} for row in rows]


def _fps(value: Any) -> float | None:
    """A frame rate, or null (Label Studio's default of 24), never text."""
    return float(value) if value is not None and math.isfinite(value) and value > 0 else None


def _task_value(field: str, value: Any) -> Any:
    if field == "videos":
        return [{"url": v["url"], "label": v.get("label") or "", "fps": _fps(v.get("fps"))} for v in value or []]
    if field == "images":
        return [{"url": i["url"], "label": i.get("label") or ""} for i in value or []]
    return "" if value is None else value


# --------------------------------------------------------------------------------------------
# Export

def read_export(path: str | Path) -> pa.Table:
    """Coders' labels from a Label Studio export of the tasks: one row per annotation and question.

    Reads the JSON export (list of tasks with ``data`` and ``annotations[].result[]``), the JSON-MIN
    export and the CSV export (one flat row per annotation; the question columns are the ids in the
    task's ``questions`` field). Two coders on one post give two rows per question; cancelled
    (skipped) annotations and unanswered questions give none. ``annotator`` is the coder's email
    when the export has it, else their user id. The rows of an annotation set as the task's ground
    truth (JSON export only: the flat exports drop the mark) carry their label as ``adjudication``
    too, the value aggregate resolves the post to. Raises ExportError naming the task for a task
    without post_id or pi and for a question with more than one choice.
    """
    path = Path(path)
    if not path.is_file():
        raise ExportError(f"Label Studio export {path} does not exist")
    if path.suffix.lower() == ".csv":
        with open(path, newline="", encoding="utf-8") as fh:
            rows = _flat_rows(list(csv.DictReader(fh)), path)
    else:
        try:
            export = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ExportError(f"Label Studio export {path} is not JSON: {exc}") from None
        if not isinstance(export, list):
            raise ExportError(f"Label Studio export {path} is not a list of tasks")
        full = [t for t in export if isinstance(t, dict) and "data" in t]
        rows = _json_rows(export, path) if full else _flat_rows(export, path)
    return pa.table({
        "post_id": pa.array([r[0] for r in rows], pa.string()),
        "question": pa.array([r[1] for r in rows], pa.string()),
        "label": pa.array([r[2] for r in rows], pa.string()),
        "sampling_probability": pa.array([r[3] for r in rows], pa.float64()),
        "annotator": pa.array([r[4] for r in rows], pa.string()),
        "adjudication": pa.array([r[5] for r in rows], pa.string()),
    })


def _task_name(task: dict[str, Any], index: int) -> str:
    return f"task {task.get('id', '?')} (item {index})"


def _post_and_pi(data: dict[str, Any], where: str, path: Path) -> tuple[str, float]:
    post_id = data.get("post_id")
    if post_id is None or str(post_id).strip() == "":
        raise ExportError(f"{path}: {where} has no post_id: was it imported from labelstudio_tasks.json?")
    try:
        pi = float(data.get("pi"))
    except (TypeError, ValueError):
        raise ExportError(f"{path}: {where} (post {post_id}) has no valid pi ({data.get('pi')!r})") from None
    if not 0 < pi <= 1:
        raise ExportError(f"{path}: {where} (post {post_id}) has pi {pi} outside (0, 1]")
    return str(post_id).strip(), pi


def _annotator(completed_by: Any) -> str | None:
    if isinstance(completed_by, dict):
        return str(completed_by.get("email") or completed_by.get("id") or "") or None
    return None if completed_by is None else str(completed_by)


def _json_rows(export: list, path: Path) -> list[tuple]:
    rows = []
    for index, task in enumerate(export):
        where = _task_name(task, index) if isinstance(task, dict) else f"item {index}"
        if not isinstance(task, dict) or not isinstance(task.get("data"), dict):
            raise ExportError(f"{path}: {where} is not a task with data")
        post_id, pi = _post_and_pi(task["data"], where, path)
        for annotation in task.get("annotations") or []:
            if annotation.get("was_cancelled"):
                continue
            annotator = _annotator(annotation.get("completed_by"))
            adjudicates = bool(annotation.get("ground_truth"))
            for result in annotation.get("result") or []:
                if result.get("type") != "choices":
                    continue
                choices = (result.get("value") or {}).get("choices") or []
                if len(choices) != 1:
                    raise ExportError(f"{path}: {where} (post {post_id}), question {result.get('from_name')!r}: "
                                      f"expected one choice, found {choices}")
                rows.append((post_id, result.get("from_name"), choices[0], pi, annotator,
                             choices[0] if adjudicates else None))
    return rows


def _flat_rows(records: list, path: Path) -> list[tuple]:
    rows = []
    for index, record in enumerate(records):
        if not isinstance(record, dict):
            raise ExportError(f"{path}: item {index} is not a task")
        where = _task_name(record, index)
        post_id, pi = _post_and_pi(record, where, path)
        questions = [q for q in str(record.get("questions") or "").split(QUESTIONS_SEPARATOR) if q]
        if not questions:
            raise ExportError(f"{path}: {where} (post {post_id}) has no questions field to name its labels")
        annotator = record.get("annotator")
        annotator = None if annotator in (None, "") else str(annotator)
        for question in questions:
            label = record.get(question)
            if label is None or str(label).strip() == "":
                continue
            if isinstance(label, dict) and "choices" in label:  # JSON-MIN with choice="multiple"
                label = label["choices"]
            if isinstance(label, list):
                if len(label) != 1:
                    raise ExportError(f"{path}: {where} (post {post_id}), question {question!r}: "
                                      f"expected one choice, found {label}")
                label = label[0]
            rows.append((post_id, question, str(label).strip(), pi, annotator, None))
    return rows
