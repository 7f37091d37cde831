"""Resume: which journaled answers a shard job may keep, and which requests it sends again.

Every journal of the model's results folder is read, the shard's own among them, and each request's
newest record made under the row's request fingerprint (vidlabel.serve.provenance: prompt, media,
transcript, plan, model, server command and program, generation settings, schema) stands for it:
newest by the time it was made (``finished_at``, which a copy keeps), so neither the journals' names
(``shard-10`` sorts before ``shard-2``) nor which one is the shard's own decide. A shard count changed
up or down (``classify.shards`` re-deals the posts) therefore sends nothing twice, and a post answered
again later (by another server) reports that later answer. A newest record found in another shard's
journal is copied into this one, stamped with this shard and keeping the job that made it (``job_id``:
busy time and GPU-hours are counted per job, vidlabel/sql/throughput.sql), so that the shard's own
journal holds every request's newest record. A record is reused when it is terminal (``ok``, or an
error a retry would not change); once servers are probed (vidlabel.serve.probe), a record made by a
server with another fingerprint is sent again. Records of a request made at the same moment on two
nodes (two jobs of one shard at once, which the journal's lock prevents) would be ordered by the
nodes' clocks.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterable

from vidlabel.core.journal import Journal, iter_records, newest
from vidlabel.serve.probe import ServerIdentity
from vidlabel.serve.record import Record

log = logging.getLogger(__name__)


def is_terminal(record: Record | None) -> bool:
    return record is not None and record.terminal


def newest_records(paths: list[Path], rows: list[dict]) -> dict[str, tuple[Record, Path]]:
    """Each row's newest record made under the row's fingerprint, over ``paths`` (module docstring),
    with the journal it is in; on a tie the first of ``paths`` holding it."""
    wanted = {r["request_id"]: r["fingerprint"] for r in rows}
    found = newest(paths, "request_id", wanted,
                   accept=lambda rec: rec.get("request_fingerprint") == wanted[rec["request_id"]])
    return {rid: (Record.from_journal(rec), path) for rid, (rec, path) in found.items()}


def matching_records(paths: list[Path], rows: list[dict]) -> dict[str, Record]:
    """Each row's newest record made under the row's fingerprint, over ``paths``."""
    return {rid: rec for rid, (rec, _) in newest_records(paths, rows).items()}


def journals(journal: Path) -> list[Path]:
    """Every journal beside ``journal``, itself first (it wins a tie with a copy of its own records)."""
    return [journal, *sorted(p for p in journal.parent.glob("*.jsonl") if p != journal)]


def resume_state(rows: list[dict], journal: Journal, shard: int) -> tuple[dict[str, Record], dict[str, Record]]:
    """(prior, reused): each request's newest record under its fingerprint over every journal beside
    this one, this one included (those of other journals copied into it), and the terminal ones among
    them. Logs how many journaled answers were passed over, and why."""
    prior: dict[str, Record] = {}
    copied = 0
    for rid, (rec, path) in newest_records(journals(journal.path), rows).items():
        if path != journal.path:
            rec = rec.stamped(shard=shard, copied_from_shard_journal=True)
            journal.append(rec.journal())
            copied += 1
        prior[rid] = rec
    if copied:
        log.info("copied %d record(s) from other shards' journals: the newest of their requests, made while their "
                 "posts were in other shards", copied)
    reused = {rid: rec for rid, rec in prior.items() if is_terminal(rec)}
    missing = {r["request_id"] for r in rows} - set(reused)
    passed_over: dict[str, int] = {}
    for rec in iter_records(journal.path):
        rid = rec.get("request_id")
        if rid in missing and is_terminal(Record.from_journal(rec)):
            missing.discard(rid)
            why = ("made before records had fingerprints" if "request_fingerprint" not in rec
                   else "made under another prompt, media, transcript, plan, model, server or settings")
            passed_over[why] = passed_over.get(why, 0) + 1
    for why, n in passed_over.items():
        log.info("passed over the journaled answers of %d request(s), %s: they are sent again", n, why)
    return prior, reused


def from_other_servers(rows: list[dict], reused: dict[str, Record], pending: list[dict],
                       live: Iterable[ServerIdentity | None], shard: int) -> list[dict]:
    """Reused requests answered by a server other than the ones now up (another version, model, reported
    setting or calibration): sent again, so that the shard's answers come from the servers it has."""
    live = [i for i in live if i is not None]
    fingerprints = {i.fingerprint for i in live}
    pending_ids = {r["request_id"] for r in pending}
    again = [r for r in rows if r["request_id"] in reused and r["request_id"] not in pending_ids
             and reused[r["request_id"]].server_fingerprint not in fingerprints]
    if again:
        log.info("shard %d: %d journaled answer(s) came from another server than %s: sent again", shard,
                 len(again), " / ".join(sorted({i.label for i in live})) or "this one")
    return again
