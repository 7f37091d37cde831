"""One journal record per finished request: a typed, frozen ``Record`` whose fields are the journal's
schema and (all but the journal-only ones) the columns of the label shards (``LABEL_SCHEMA``).

The client fills a plain result dict while a request is retried (``new_result``: every field at its
default) and hands the job the frozen Record it makes of it; from there a Record changes only by
``stamped`` copies: the job's attempts over runs, then ``Provenance.record``, what made it, in one place.
``Record.from_journal`` reads a journal line back, old ones included: a field an older version did not
write gets its default (such a record has no request fingerprint, so it is never reused).

A Record reads like the journal's JSON object (``rec["status"]``, ``rec.get("attempts")``), so code that
only reads records need not care whether one came from the client or from a journal.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Iterator

import pyarrow as pa

_JOURNAL_ONLY = {"labels": False}  # kept in the journal, not a column of the label shards
_JSON = {"json": True}  # a dict, stored as JSON text in the label shards
_MERGED = {"merged": True}  # also a column of labels.parquet, one row per post (vidlabel.analyze.merge)


@dataclass(frozen=True)
class Record(Mapping):
    request_id: str
    post_id: str
    shard: int | None = None  # the shard whose labels hold it (a copied record is stamped anew)
    status: str = "error"  # ok | error
    error_kind: str | None = None
    error: str | None = None
    # The index of the post's item (docs/outputs.md, the manifest's items) the error is about, where
    # the server's message names one: its file, or an item of a kind the post has one of.
    error_item: int | None = field(default=None, metadata=_MERGED)
    http_status: int | None = None
    attempts: int = 0  # attempts charged to the request, over all runs
    sends: int = 0  # HTTP requests made for it, over all runs
    latency_s: float | None = field(default=None, metadata=_MERGED)
    started_at: float | None = field(default=None, metadata=_MERGED)
    finished_at: float | None = field(default=None, metadata=_MERGED)
    finish_reason: str | None = None
    prompt_tokens: int | None = field(default=None, metadata=_MERGED)
    completion_tokens: int | None = field(default=None, metadata=_MERGED)
    est_prompt_tokens: int | None = None
    raw_text: str | None = None
    answers: dict | None = field(default=None, metadata=_JSON)
    answer_probs: dict | None = field(default=None, metadata={**_JSON, **_MERGED})
    answer_probs_missing: dict | None = field(default=None, metadata=_JOURNAL_ONLY)
    retryable: bool = field(default=False, metadata=_JOURNAL_ONLY)
    # A failure the server could have caused (a 5xx, a timeout, a dropped connection) judged the
    # request's own on evidence: the same 5xx on every attempt while requests like it were answered, its
    # file missing here too, or attempts over several runs while requests like it were answered.
    own_failure: bool = field(default=False, metadata=_JOURNAL_ONLY)
    # ok | no_audio | unavailable (the prompt said the transcript is unavailable)
    transcript_status: str | None = field(default=None, metadata=_MERGED)
    # Provenance (docs/outputs.md): what made the answer.
    model: str | None = field(default=None, metadata=_MERGED)
    # The model's files: a content digest, a snapshot revision, or "name only".
    model_revision: str | None = field(default=None, metadata=_MERGED)
    server: str | None = field(default=None, metadata=_MERGED)  # the server that answered, in words
    server_fingerprint: str | None = field(default=None, metadata=_MERGED)  # what it reported (serve.probe)
    settings_fingerprint: str | None = field(default=None, metadata=_MERGED)
    prompt_hash: str | None = field(default=None, metadata=_MERGED)
    request_fingerprint: str | None = field(default=None, metadata=_MERGED)  # core.identity.answer_fingerprint
    # GPUs the job held while it answered (own servers); null for classify.endpoints.
    gpus: int | None = field(default=None, metadata=_MERGED)
    # The job run that answered; kept when the record is copied into another shard's journal.
    job_id: str | None = field(default=None, metadata=_MERGED)
    copied_from_shard_journal: bool = field(default=False, metadata=_JOURNAL_ONLY)

    # ---- a read-only mapping over the fields, as the journal's JSON has them
    def __getitem__(self, key: str) -> Any:
        if key not in _FIELDS:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(_FIELDS)

    def __len__(self) -> int:
        return len(_FIELDS)

    __hash__ = None  # a Mapping; holds dicts

    @property
    def terminal(self) -> bool:
        """Finished for good: an answer, or an error that a retry would not change: one the server said
        was the request's (a 4xx, an unusable answer), or one the server could have caused that the
        evidence showed was the request's own (``own_failure``). A record that says neither (an older
        version made a shared failure terminal) is sent again, to a server that may answer it."""
        if self.status == "ok":
            return True
        if self.retryable:
            return False
        return self.own_failure or not self.server_could_cause

    @property
    def server_could_cause(self) -> bool:
        """The error is of a kind the server may cause for every request: no status, a 5xx, or "not now"."""
        return (self.http_status is None or self.http_status >= 500
                or self.error_kind in ("timeout", "server_overloaded", "connection", "media_unreachable"))

    def journal(self) -> dict[str, Any]:
        """The journal line's object (``request_id`` first: vidlabel.core.journal filters on it)."""
        return {name: getattr(self, name) for name in _FIELDS}

    @classmethod
    def from_journal(cls, data: Mapping[str, Any]) -> "Record":
        return cls(**{k: v for k, v in data.items() if k in _FIELDS})

    def stamped(self, **changes: Any) -> "Record":
        return replace(self, **changes)


_FIELDS = tuple(f.name for f in fields(Record))
_ARROW = {"str": pa.string(), "int": pa.int64(), "float": pa.float64(), "bool": pa.bool_(), "dict": pa.string()}
LABEL_FIELDS = tuple(f for f in fields(Record) if f.metadata.get("labels", True))
LABEL_SCHEMA = pa.schema([(f.name, _ARROW[str(f.type).split(" ")[0]]) for f in LABEL_FIELDS])
# Record fields labels.parquet carries as they are (its post_id, shard, status and error columns are
# the merge's own, and so are the answer columns).
MERGED_FIELDS = tuple(f.name for f in LABEL_FIELDS if f.metadata.get("merged"))


def new_result(row: Mapping[str, Any]) -> dict[str, Any]:
    """The client's working result for a manifest row: every Record field at its default."""
    blank = Record(request_id=row["request_id"], post_id=row["post_id"],
                   est_prompt_tokens=row.get("est_prompt_tokens"), transcript_status=row.get("transcript_status"))
    return blank.journal()


def labels_table(records: list[Record], shard: int) -> pa.Table:
    """The label shard of ``records`` (each stamped with ``shard``)."""
    cols: dict[str, list] = {f.name: [] for f in LABEL_FIELDS}
    for rec in records:
        for f in LABEL_FIELDS:
            value = shard if f.name == "shard" else getattr(rec, f.name)
            if f.metadata.get("json") and value is not None:
                value = json.dumps(value, sort_keys=True)
            cols[f.name].append(value)
    return pa.table(cols, schema=LABEL_SCHEMA)
