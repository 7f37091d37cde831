"""Posts by type (issue 26: a post is a caption and an ordered list of videos, images and audio):
what each post type holds and costs (``post_type_rows``, sql/post_types.sql) and its prevalences
(``prevalence_by_type``).

- The types are labels.parquet's ``post_type`` (vidlabel.prepare.post_plan.post_type): ``video``,
  ``photo``, ``slideshow``, ``carousel``, ``audio``; none (null) for a post with no usable item, and
  for every post of labels merged before post types existed.
- The prevalences of a type are ``prevalence.prevalence`` over that type's classified posts: the model's
  share with its interval; the human-only and corrected shares from the human labels that fall on the
  type's posts. Restricting a sample to a part of the population fixed before it was drawn (a domain)
  leaves it a sample of that part under the same design: a uniform sample stays uniform within the
  type (given how many fell in it), a labelled post keeps its sampling probability. A type without
  labels (or, under a two-phase design, without burn-in labels) gets no corrected share, and its row
  says why.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from vidlabel.analyze.labels_db import query_rows
from vidlabel.analyze.prevalence import PREVALENCE_COLUMNS, prevalence
from vidlabel.analyze.summary_text import NO_TYPE
from vidlabel.core import duck

log = logging.getLogger(__name__)

# The order of the tables and summary.md: one item first, then several; no type last.
TYPE_ORDER = ("video", "photo", "slideshow", "carousel", "audio")

POST_TYPE_COLUMNS = [
    "post_type", "posts", "ok", "error", "excluded", "items_mean", "items_max", "posts_with_items_dropped",
    "videos", "images", "audio", "classified", "est_video_tokens_mean", "est_image_tokens_mean",
    "est_audio_tokens_mean", "est_text_tokens_mean", "input_tokens_mean",
]
PREVALENCE_BY_TYPE_COLUMNS = ["post_type", *PREVALENCE_COLUMNS]

# answers_long with each post's type, once; then one type's part of it at a time, the table the
# prevalence queries read (their @answers@).
ANSWERS_TYPED = """CREATE OR REPLACE TABLE answers_typed AS
    SELECT a.*, l.post_type FROM answers_long a JOIN labels l USING (post_id)"""
ANSWERS_OF_TYPE = """CREATE OR REPLACE TABLE answers_of_type AS
    SELECT * EXCLUDE (post_type) FROM answers_typed WHERE post_type IS NOT DISTINCT FROM $post_type"""
CLASSIFIED_TYPES = "SELECT DISTINCT post_type FROM labels WHERE status IN ('ok', 'error')"


def type_order(post_type: str | None) -> tuple[int, str]:
    """Sort key: the known types in TYPE_ORDER, then any other by name, then none."""
    if post_type is None:
        return (len(TYPE_ORDER) + 1, "")
    return (TYPE_ORDER.index(post_type) if post_type in TYPE_ORDER else len(TYPE_ORDER), post_type)


def type_name(post_type: str | None) -> str:
    return NO_TYPE if post_type is None else post_type


def post_type_rows(con) -> list[dict[str, Any]]:
    """One row per post type of view ``labels`` (POST_TYPE_COLUMNS, sql/post_types.sql), in type order."""
    return sorted(query_rows(con, duck.sql("post_types")), key=lambda r: type_order(r["post_type"]))


def prevalence_by_type(con, ids: Sequence[str], confidence: float, human: dict | None) -> list[dict[str, Any]]:
    """Per post type with classified posts and question, the prevalence row (PREVALENCE_BY_TYPE_COLUMNS)
    over that type's classified posts; from tables ``answers_long`` and the human labels'. Leaves
    ``ppi_items`` holding the last type's items: call it after every query of the whole population."""
    types = sorted((row[0] for row in con.execute(CLASSIFIED_TYPES).fetchall()), key=type_order)
    con.execute(ANSWERS_TYPED)
    rows = []
    for post_type in types:
        con.execute(ANSWERS_OF_TYPE, {"post_type": post_type})
        population = f"{post_type} posts" if post_type is not None else "posts of no type"
        rows += [{"post_type": post_type, **row}
                 for row in prevalence(con, ids, confidence, human, answers="answers_of_type", population=population)]
    log.info("prevalence by post type: %s", ", ".join(type_name(t) for t in types) or "no classified post")
    return rows
