"""Resume: which journaled answers a shard job may keep, and which requests it sends again.

A record is reused only when it is terminal (``ok``, or an error a retry would not change) and was
made under the row's request fingerprint (vidlabel.serve.provenance: prompt, media, transcript, plan,
model, server command and program, generation settings, schema). Every journal of the results
directory is read, not only the shard's own, so re-dealing posts to shards (``classify.shards``)
sends nothing twice; a record found in another shard's journal is copied into this one, stamped
with this shard and keeping the job that made it (``job_id``: busy time and GPU-hours are counted
per job, vidlabel/sql/throughput.sql). Once servers are probed (vidlabel.serve.probe), a record made
by a server with another fingerprint is sent again.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterable

from vidlabel.core.journal import Journal, iter_records
from vidlabel.serve.probe import ServerIdentity
from vidlabel.serve.record import Record

log = logging.getLogger(__name__)


def is_terminal(record: Record | None) -> bool:
    return record is not None and record.terminal


def matching_records(paths: list[Path], rows: list[dict]) -> dict[str, Record]:
    """The latest record of each row made under the row's fingerprint, from ``paths`` in order (a
    later file only fills in rows an earlier one lacks)."""
    wanted = {r["request_id"]: r["fingerprint"] for r in rows}
    found: dict[str, Record] = {}
    for path in paths:
        here: dict[str, Record] = {}
        for rec in iter_records(path, "request_id", wanted):
            rid = rec.get("request_id")
            if rid in wanted and rid not in found and rec.get("request_fingerprint") == wanted[rid]:
                here[rid] = Record.from_journal(rec)
        found.update(here)
    return found


def resume_state(rows: list[dict], journal: Journal, shard: int) -> tuple[dict[str, Record], dict[str, Record]]:
    """(prior, reused): this journal's latest record per request under the request's fingerprint, and
    the terminal ones among them plus those of every other journal beside it (copied into this one).
    Logs how many journaled answers were passed over, and why."""
    prior = matching_records([journal.path], rows)
    others = sorted(p for p in journal.path.parent.glob("*.jsonl") if p != journal.path)
    todo = [r for r in rows if not is_terminal(prior.get(r["request_id"]))]
    elsewhere = {rid: rec.stamped(shard=shard, copied_from_shard_journal=True)
                 for rid, rec in matching_records(others, todo).items() if is_terminal(rec)}
    for rec in elsewhere.values():
        journal.append(rec.journal())
    if elsewhere:
        log.info("copied %d answer(s) from other shards' journals (their posts were in other shards before)",
                 len(elsewhere))
    reused = {rid: rec for rid, rec in prior.items() if is_terminal(rec)} | elsewhere
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
