"""The design a human sample was drawn under, as label_sample records it: ``design.parquet`` holds every post
of the population it was drawn from (the frame) with its inclusion probability, and, in the file's
metadata, when, from which labels file, under which settings, and what a two-phase estimate needs.

aggregate reads it (config key ``human_design``): the corrected and human-only shares are over the
posts of the frame, posts classified since are estimated apart from the model alone, and each label
takes its post's probability and phase from the design.

Columns: post_id, status, uncertainty (from the model's P(yes)), pi (the post's inclusion probability
in its phase), drawn, phase (1: the uniform burn-in of a two-phase design, 2: its second draw, null
for a one-phase design), design (how the post came into the sample: active, uniform, burn_in,
second_phase), calibrated (after a second draw: per question of the description's ``questions`` the
P(yes) the draw was made from, the two-phase estimate's prediction; null otherwise).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from vidlabel.core.io import write_parquet

# Schema metadata key of design.parquet holding the design's description (JSON).
METADATA_KEY = b"vidlabel.design"
DESIGN_SCHEMA = pa.schema([("post_id", pa.string()), ("status", pa.string()), ("uncertainty", pa.float64()),
                           ("pi", pa.float64()), ("drawn", pa.bool_()), ("phase", pa.int8()),
                           ("design", pa.string()), ("calibrated", pa.list_(pa.float64()))])
# design.parquet's design kinds (metadata "design") and how a post came into the sample (column design).
KIND_ACTIVE, KIND_UNIFORM, KIND_TWO_PHASE = "active", "uniform", "two_phase"
POST_ACTIVE, POST_UNIFORM, POST_BURN_IN, POST_SECOND_PHASE = "active", "uniform", "burn_in", "second_phase"
DIGEST_CHARS = 16
# The uniform floor share (label_sample.floor_share) the simulations support for each design: 0.4 for a
# one-round active draw on the raw model probabilities, 0.2 for the active part of a two-phase design's
# second draw (docs/statistics.md). Below, posts the model is sure about carry weights of hundreds; at
# floor 0 the corrected interval covered 0.61-0.66. label_sample warns and aggregate's summary says so.
MEASURED_FLOOR_SHARES = {KIND_ACTIVE: 0.4, KIND_TWO_PHASE: 0.2}


def floor_warning(metadata: dict[str, Any]) -> str | None:
    """The summary's warning for a design drawn with a floor share below ``MEASURED_FLOOR_SHARES``."""
    kind, floor = metadata.get("design"), metadata.get("floor_share")
    if kind not in MEASURED_FLOOR_SHARES or floor is None or float(floor) >= MEASURED_FLOOR_SHARES[kind]:
        return None
    return (f"WARNING: the human sample was drawn with label_sample.floor_share {float(floor):g}, below the "
            f"{MEASURED_FLOOR_SHARES[kind]:g} the simulations support for its {kind} design: posts the model was sure "
            "about carry weights of hundreds, and the human-only and corrected intervals may cover less than their "
            "level (0.61-0.66 at floor 0 in simulation, docs/statistics.md)")


class DesignError(ValueError):
    """The design file cannot be read or does not fit the human labels; the message says how."""


def file_digest(path: str | Path) -> str:
    """SHA-256 of a file's bytes, shortened: which labels.parquet a design was drawn from."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:DIGEST_CHARS]


def write_design(path: str | Path, columns: dict[str, Any], metadata: dict[str, Any]) -> None:
    """design.parquet from its columns (DESIGN_SCHEMA's names) and its description."""
    table = pa.table({name: pa.array(columns[name], type=field.type) for name, field in
                      zip(DESIGN_SCHEMA.names, DESIGN_SCHEMA)}, schema=DESIGN_SCHEMA)
    write_parquet(table.replace_schema_metadata({METADATA_KEY: json.dumps(metadata, sort_keys=True).encode()}),
                  path)


def read_design(path: str | Path) -> tuple[pa.Table, dict[str, Any]]:
    """(the posts, the description) of a design.parquet written by ``write_design``."""
    path = Path(path)
    if not path.is_file():
        raise DesignError(f"design file {path} does not exist (config key human_design)")
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowInvalid) as exc:
        raise DesignError(f"cannot read the design file {path}: {exc}") from None
    raw = (table.schema.metadata or {}).get(METADATA_KEY)
    missing = [c for c in DESIGN_SCHEMA.names if c not in table.column_names]
    if raw is None or missing:
        raise DesignError(f"{path} is not a design file written by label_sample (missing "
                          f"{'its description' if raw is None else missing}): point human_design at "
                          "results/label_sample/design.parquet or a copy of it")
    return table.select(DESIGN_SCHEMA.names), json.loads(raw)


def describe(metadata: dict[str, Any]) -> str:
    """One sentence on where a design comes from, for summary.md."""
    drawn = f"drawn {metadata.get('created_at', 'at an unknown time')} from {metadata.get('labels_path', '?')}"
    kinds = {KIND_TWO_PHASE: (f"two-phase design (a uniform burn-in of {metadata.get('burn_in_posts')} posts, "
                              + ("then a second draw)" if metadata.get("phase") == 2 else "the second draw not yet made)")),
             KIND_ACTIVE: "active design", KIND_UNIFORM: "uniform design"}
    text = (f"{kinds.get(metadata.get('design'), 'design')} over {metadata.get('frame_posts', '?'):,} posts, {drawn} "
            f"(labels `{metadata.get('labels_sha256', '?')}`), seed {metadata.get('seed')}")
    if metadata.get("requested_design"):
        text += (f"; label_sample.design {metadata['requested_design']} was asked for and switched to this draw: "
                 f"{metadata.get('switched_because', '')}")
    return text
