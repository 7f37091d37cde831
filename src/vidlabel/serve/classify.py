"""Classify one manifest shard with one model: start the server (or use the endpoints), stream the
requests, journal every result, and write ``labels/shard-{i}.parquet`` once every request has a
terminal record (in the model's folder, ``results/models/<name>/``: vidlabel.core.models).

Resume: the journal (``journal/shard-{i}.jsonl``) holds one record per finished request. A rerun skips
requests whose record is terminal (``ok``, or an error that a retry would not change) *and* was made
under the same request fingerprint (``vidlabel.serve.client.request_fingerprint``: the prompt, the media
file's size and mtime, the model, schema, generation settings and the server command); a record made
under other settings stays in the journal (append-only) but is never reused, and the job logs how
many it passed over and why. Once the job's servers are up, a record from another server (vLLM
version or model folder, ``vidlabel.serve.endpoints``) is not reused either. Every journal of the results
directory is read, not only the shard's own, so re-dealing posts to shards (``classify.shards``)
sends nothing twice; a record found in another shard's journal is copied into this one. A transient
error (timeout, 503, 5xx, connection) that used up its attempts is recorded but tried again by the
next run, with a fresh attempt budget; once its attempts over all runs reach
``RERUN_ATTEMPT_FACTOR * max_attempts`` the record becomes terminal, so a request that always fails
ends as a clear record instead of failing the job forever.

A failure shared by many requests is the server's, not theirs (``vidlabel.serve.breaker``): until the
job's first answer requests go one at a time (the first is the media check); the same 5xx on two of
them, a server that cannot see the job's media, a run of the same error with no answer in between, or
a refusal that shows the server's limits below the plan's stops the job once with the server's
message and the probable cause (ServerFailing, MediaUnreachable, ServerBelowPlan), and journals
nothing terminal for those requests. Attempts made while nothing of the job was answered are not
charged to the requests; where a request's failure would otherwise stay undecided because nothing else
is left to send, one answered request of the shard is sent again as a control (not journaled).

The job fails (raises) when no server is left (every own server copy exited, or every endpoint failed
its health checks: ``vidlabel.serve.endpoints``; while one is left, traffic moves to it), on SIGTERM/SIGINT
(after a grace period for the requests in flight), on a fatal client error (bad key, unknown model)
and when some request is still waiting for a retry; everything finished so far is in the journal, so
the rerun continues.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import httpx
import pyarrow as pa
import pyarrow.parquet as pq

from vidlabel.core import settings as stage_settings
from vidlabel.core.io import write_parquet
from vidlabel.core.journal import Journal, JournalLocked, iter_records
from vidlabel.serve.breaker import Breaker, PlannedLimits, Trip
from vidlabel.serve.client import (
    ClassifyClient,
    ClientSettings,
    Stopped,
    request_fingerprint,
    run,
)
from vidlabel.serve.endpoints import NoLiveEndpoint
from vidlabel.serve.error_kinds import FatalClientError
from vidlabel.serve.parallelism import choose_layout
from vidlabel.serve.server import (
    BROKEN_SMOKE_TRIES,
    ServerBroken,
    ServerBusy,
    ServerError,
    ServerGroup,
    answer_settings,
    log_tail,
    server_copies,
    smoke_request,
)

log = logging.getLogger(__name__)

RERUN_ATTEMPT_FACTOR = 2
SMOKE_TRIES = 5  # an external endpoint's smoke request is asked again this often while it is busy

MANIFEST_COLUMNS = ["request_id", "post_id", "media_path", "prompt", "est_prompt_tokens"]

LABEL_SCHEMA = pa.schema([
    ("request_id", pa.string()), ("post_id", pa.string()), ("shard", pa.int64()),
    ("status", pa.string()), ("error_kind", pa.string()), ("error", pa.string()),
    ("http_status", pa.int64()), ("attempts", pa.int64()), ("latency_s", pa.float64()),
    ("started_at", pa.float64()), ("finished_at", pa.float64()), ("finish_reason", pa.string()),
    ("prompt_tokens", pa.int64()), ("completion_tokens", pa.int64()), ("est_prompt_tokens", pa.int64()),
    ("raw_text", pa.string()), ("answers", pa.string()), ("answer_probs", pa.string()),
    # Provenance (docs/outputs.md): what made the answer.
    ("model", pa.string()), ("server", pa.string()), ("settings_fingerprint", pa.string()),
    ("prompt_hash", pa.string()), ("request_fingerprint", pa.string()), ("sends", pa.int64()),
    # GPUs the job held while it answered (its own servers); null for classify.endpoints.
    ("gpus", pa.int64()),
])


class ClassifyError(RuntimeError):
    """The shard job did not complete; the journal keeps everything that finished."""


class ShardLocked(ClassifyError):
    """Another job holds this shard's journal."""


class JobInterrupted(ClassifyError):
    """SIGTERM/SIGINT: the job stopped sending, let in-flight requests finish (grace) and flushed."""


class ShardIncomplete(ClassifyError):
    """Some requests ended with transient errors this run; a rerun retries them."""


class MediaUnreachable(ClassifyError):
    """The server cannot read the job's media (mount, allowed path or codec): stop, journal nothing."""


class ServerFailing(ClassifyError):
    """The server fails every request the same way (vidlabel.serve.breaker): stop, journal nothing."""


class ServerBelowPlan(ClassifyError):
    """The server's encoder cache or context is smaller than planned: stop, journal nothing."""


# The breaker's trip kinds (vidlabel.serve.breaker.Trip) and the error each raises.
TRIP_ERRORS = {"server": ServerFailing, "limits": ServerBelowPlan, "media": MediaUnreachable}


@dataclass(frozen=True)
class Provenance:
    """What every record of this job is made under (docs/outputs.md, labels)."""
    model: str
    settings_fingerprint: str
    prompt_hash: str
    server_settings: dict
    gpus: int | None = None  # held by the job's own servers, once they are laid out

    @classmethod
    def from_config(cls, config: dict) -> "Provenance":
        c = config["classify"]
        return cls(model=c["model"], settings_fingerprint=stage_settings.fingerprint(config, "classify"),
                   prompt_hash=stage_settings.digest([c["prompt_template"], c["questions"]]),
                   server_settings=answer_settings(config))


def is_terminal(record: dict | None) -> bool:
    return record is not None and (record.get("status") == "ok" or not record.get("retryable", False))


def read_shard(path: str | Path) -> list[dict[str, Any]]:
    """Manifest rows (one per request; a repeated request_id is kept once)."""
    table = pq.read_table(path)
    missing = [c for c in MANIFEST_COLUMNS if c not in table.column_names]
    if missing:
        raise ClassifyError(f"manifest shard {path} lacks columns {missing} (see docs/outputs.md)")
    rows, seen = [], set()
    for row in table.select(MANIFEST_COLUMNS).to_pylist():
        if row["request_id"] in seen:
            continue
        seen.add(row["request_id"])
        rows.append(row)
    return rows


def labels_table(records: list[dict[str, Any]], shard: int) -> pa.Table:
    cols: dict[str, list] = {f.name: [] for f in LABEL_SCHEMA}
    for rec in records:
        for name in cols:
            if name == "shard":
                cols[name].append(shard)
            elif name in ("answers", "answer_probs"):
                value = rec.get(name)
                cols[name].append(json.dumps(value, sort_keys=True) if value is not None else None)
            else:
                cols[name].append(rec.get(name))
    return pa.table(cols, schema=LABEL_SCHEMA)


@dataclass
class Stats:
    """This run's finished requests, for the progress line."""
    done: int = 0
    ok: int = 0
    error: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, rec: dict) -> None:
        self.done += 1
        if rec["status"] == "ok":
            self.ok += 1
        else:
            self.error += 1
        self.prompt_tokens += rec.get("prompt_tokens") or 0
        self.completion_tokens += rec.get("completion_tokens") or 0


class _Progress:
    def __init__(self, total: int, already: int, shard: int, interval_s: float):
        self.total = total
        self.already = already
        self.shard = shard
        self.interval_s = interval_s
        self.stats = Stats()
        self.t0 = self.last_finish = time.monotonic()
        self.in_flight: Callable[[], int] = lambda: 0

    def finished(self, rec: dict) -> None:
        self.stats.add(rec)
        self.last_finish = time.monotonic()

    def line(self) -> str:
        s = self.stats
        now = time.monotonic()
        elapsed = max(1e-9, now - self.t0)
        rate = s.done / elapsed
        done = self.already + s.done
        quiet = now - self.last_finish
        if self.in_flight() and quiet >= self.interval_s and not s.done:
            # A large model's first answers take longer than a progress interval: not a stall yet.
            eta = f"first answers pending for {quiet:.0f} s ({self.in_flight()} in flight)"
        elif self.in_flight() and quiet >= self.interval_s:
            # An ETA from the average rate would keep counting down while nothing finishes.
            eta = f"stalled for {quiet:.0f} s ({self.in_flight()} in flight, none finished)"
        else:
            eta = "ETA " + (f"{(self.total - done) / rate / 60:.1f} min" if rate > 0 else "?")
        return (f"shard {self.shard}: {done}/{self.total} done ({s.ok} ok, {s.error} error this run), "
                f"{rate:.2f} req/s, {s.prompt_tokens / elapsed:.0f} input tok/s, "
                f"{s.completion_tokens / elapsed:.1f} output tok/s, {eta}")


def run_shard(config: dict, shard_path: str | Path, output_path: str | Path, journal_path: str | Path,
              server_log_path: str | Path, shard: int) -> None:
    """Classify every request of a manifest shard; see the module docstring. Raises ClassifyError,
    ServerError or FatalClientError when the shard is not complete."""
    c = config["classify"]
    for noisy in ("httpx", "httpx2"):  # one INFO line per HTTP request would drown the progress lines
        if logging.getLogger(noisy).level == logging.NOTSET:
            logging.getLogger(noisy).setLevel(logging.WARNING)
    rows = read_shard(shard_path)
    provenance = Provenance.from_config(config)
    client_settings = ClientSettings.from_config(config)
    for row in rows:
        row["fingerprint"] = request_fingerprint(client_settings, provenance.server_settings, row)
    try:
        journal = Journal(journal_path, key="request_id", fsync=c["journal_fsync"]).__enter__()
    except JournalLocked as exc:
        raise ShardLocked(f"shard {shard}: {exc}") from None
    try:
        prior, reused = resume_state(rows, journal)
        pending = [r for r in rows if r["request_id"] not in reused]
        log.info("shard %d: %d requests, %d answered before under the same settings, %d to send", shard,
                 len(rows), len(reused), len(pending))
        if pending:
            run(_classify(config, provenance, rows, pending, reused, journal, prior, server_log_path, shard))
        final = matching_records([journal.path], rows)
    finally:
        journal.close()
    unfinished = [r for r in rows if not is_terminal(final.get(r["request_id"]))]
    if unfinished:
        kinds: dict[str, int] = {}
        for row in unfinished:
            kind = (final.get(row["request_id"]) or {}).get("error_kind") or "not sent"
            kinds[kind] = kinds.get(kind, 0) + 1
        raise ShardIncomplete(f"shard {shard}: {len(unfinished)} requests still need a retry ({kinds}); "
                              f"rerun the job to retry them (finished ones are kept in {journal_path})")
    write_parquet(labels_table([final[r["request_id"]] for r in rows], shard), output_path)
    log.info("shard %d: wrote %s (%d rows)", shard, output_path, len(rows))


def matching_records(paths: list[Path], rows: list[dict]) -> dict[str, dict]:
    """The latest record of each row made under the row's fingerprint, from ``paths`` in order (a
    later file only fills in rows an earlier one lacks)."""
    wanted = {r["request_id"]: r["fingerprint"] for r in rows}
    found: dict[str, dict] = {}
    for path in paths:
        here: dict[str, dict] = {}
        for rec in iter_records(path, "request_id", wanted):
            rid = rec.get("request_id")
            if rid in wanted and rid not in found and rec.get("request_fingerprint") == wanted[rid]:
                here[rid] = rec
        found.update(here)
    return found


def resume_state(rows: list[dict], journal: Journal) -> tuple[dict[str, dict], dict[str, dict]]:
    """(prior, reused): this journal's latest record per request under the request's fingerprint, and
    the terminal ones among them plus those of every other journal beside it (posts move between
    shards when ``classify.shards`` changes; such records are copied into this journal). Logs how many
    journaled answers were passed over, and why."""
    prior = matching_records([journal.path], rows)
    others = sorted(p for p in journal.path.parent.glob("*.jsonl") if p != journal.path)
    todo = [r for r in rows if not is_terminal(prior.get(r["request_id"]))]
    elsewhere = {rid: rec for rid, rec in matching_records(others, todo).items() if is_terminal(rec)}
    for rec in elsewhere.values():
        journal.append(dict(rec, copied_from_shard_journal=True))
    if elsewhere:
        log.info("copied %d answer(s) from other shards' journals (their posts were in other shards before)",
                 len(elsewhere))
    reused = {rid: rec for rid, rec in prior.items() if is_terminal(rec)} | elsewhere
    missing = {r["request_id"] for r in rows} - set(reused)
    passed_over: dict[str, int] = {}
    for rec in iter_records(journal.path):
        rid = rec.get("request_id")
        if rid in missing and is_terminal(rec):
            missing.discard(rid)
            why = ("made before records had fingerprints" if "request_fingerprint" not in rec
                   else "made under other settings, prompt, media or server")
            passed_over[why] = passed_over.get(why, 0) + 1
    for why, n in passed_over.items():
        log.info("passed over the journaled answers of %d request(s), %s: they are sent again", n, why)
    return prior, reused


async def _external_endpoints(config: dict) -> tuple[list[tuple[str, str]], dict[int, str]]:
    """The endpoints and, by index, why those that failed their smoke request are down (ServerError
    when all did; FatalClientError when one refused the key)."""
    c = config["classify"]
    key = os.environ.get(c["api_key_env"], "")
    if not key:
        log.warning("environment variable %s is empty: sending requests without an API key", c["api_key_env"])
    endpoints = [(url.rstrip("/"), key or "none") for url in c["endpoints"]]
    down: dict[int, tuple[str, bool]] = {}  # index -> (why, for good: broken rather than busy or away)
    async with httpx.AsyncClient(timeout=60.0) as http:
        for i, (url, k) in enumerate(endpoints):
            broken = 0
            for attempt in range(1, SMOKE_TRIES + 1):
                try:
                    await smoke_request(http, url, {"Authorization": f"Bearer {k}"}, c["model"])
                    break
                except ServerError as exc:
                    broken += isinstance(exc, ServerBroken)
                    again = isinstance(exc, ServerBusy) or (isinstance(exc, ServerBroken) and broken < BROKEN_SMOKE_TRIES)
                    if again and attempt < SMOKE_TRIES:
                        await asyncio.sleep(1.0)
                        continue
                    log.error("endpoint %s is down at the start: %s", url, exc)
                    # Broken (a 500 while /health may answer 200): not to be brought back by its health checks.
                    down[i] = (str(exc), isinstance(exc, ServerBroken))
                    break
    if len(down) == len(endpoints):
        raise ServerError("no endpoint answered: " + "; ".join(why for why, _ in down.values()))
    return endpoints, down


async def _classify(config: dict, provenance: Provenance, rows: list[dict], pending: list[dict],
                    reused: dict[str, dict], journal: Journal, prior: dict, server_log_path, shard: int) -> None:
    c = config["classify"]
    settings = ClientSettings.from_config(config)
    stop_sending = asyncio.Event()  # no new requests (SIGTERM, watchdog, fatal error)
    abort = asyncio.Event()  # abandon in-flight requests now
    why: dict[str, str] = {}
    loop = asyncio.get_running_loop()

    def on_signal(signame: str) -> None:
        if "reason" not in why:
            log.warning("shard %d: %s received: no new requests; %g s grace for those in flight",
                        shard, signame, c["shutdown_grace_s"])
        why.setdefault("reason", signame)
        stop_sending.set()

    def on_server_failure(message: str) -> None:
        if server is not None and "last lines of" not in message:  # not a process exit: show its logs
            message += "".join(f"; last lines of {s.log_path}:\n{log_tail(s.log_path)}" for s in server.servers)
        log.error("shard %d: no server left: %s", shard, message)
        why.setdefault("reason", "server")
        why.setdefault("message", message)
        stop_sending.set()
        abort.set()

    def on_trip(trip: Trip) -> None:
        message = trip.message
        if server is not None and trip.kind == "server":
            message += "".join(f"\nlast lines of {s.log_path}:\n{log_tail(s.log_path)}" for s in server.servers)
        log.error("shard %d: stopping: %s", shard, message)
        why.setdefault("reason", f"breaker:{trip.kind}")
        why.setdefault("message", message)
        stop_sending.set()
        abort.set()

    breaker = Breaker(PlannedLimits.from_config(config), on_trip)
    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(RuntimeError, ValueError, NotImplementedError):
            loop.add_signal_handler(sig, on_signal, sig.name)
            installed.append(sig)

    server = None
    watchdog = None
    down: dict[int, tuple[str, bool]] = {}
    try:
        if c["endpoints"]:
            endpoints, down = await _external_endpoints(config)
        else:
            largest = max(int(r["est_prompt_tokens"] or 0) for r in pending) + c["max_tokens"]
            layout = choose_layout(config, largest)
            log.info("shard %d: parallelism %s", shard, layout.reason)
            provenance = replace(provenance, gpus=layout.held or None)
            # Requests in flight scale with the copies: classify.concurrency is per copy.
            settings.concurrency *= layout.data
            server = ServerGroup(config, server_copies(config, layout, server_log_path)).start()
            ready = asyncio.create_task(server.wait_ready())
            stopper = asyncio.create_task(stop_sending.wait())
            await asyncio.wait({ready, stopper}, return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            if not ready.done():
                ready.cancel()
                await asyncio.gather(ready, return_exceptions=True)
                raise JobInterrupted(f"shard {shard}: {why.get('reason')} while the server was starting; "
                                     "nothing was sent")
            ready.result()  # raises ServerError
            endpoints = server.endpoints

        async with ClassifyClient(endpoints, settings, stop_event=abort, on_failure=on_server_failure,
                                  owned=server is not None, breaker=breaker) as client:
            for index, (reason, final) in down.items():
                client.endpoints.mark_down(index, reason, final=final)
            pending = pending + other_servers(rows, reused, pending, client, shard)
            progress = _Progress(len(rows), len(rows) - len(pending), shard, c["progress_interval_s"])
            if server is not None:
                # A copy whose process exits is down for good; its traffic moves to the others.
                watchdog = asyncio.create_task(server.watchdog(
                    lambda index, message: client.endpoints.mark_down(index, message, final=True)))
            progress.in_flight = lambda: client.deadlines.in_flight
            await _stream(client, pending, journal, prior, settings, provenance, progress, stop_sending,
                          abort, why, c["shutdown_grace_s"], breaker, control_row(rows, reused, pending))
        log.info(progress.line())
    finally:
        if watchdog is not None:
            watchdog.cancel()
            await asyncio.gather(watchdog, return_exceptions=True)
        if server is not None:
            await asyncio.to_thread(server.stop)
        for sig in installed:
            loop.remove_signal_handler(sig)

    reason = why.get("reason")
    if reason == "server":
        raise ServerError(f"shard {shard}: {why['message']}")
    if breaker.tripped is not None:
        raise TRIP_ERRORS[breaker.tripped.kind](f"shard {shard}: {why['message']}")
    if reason == "fatal":
        raise FatalClientError(f"shard {shard}: {why['message']}")
    if reason:
        raise JobInterrupted(f"shard {shard}: stopped by {reason}; {progress.stats.done} requests finished "
                             f"this run and are journaled; rerun to continue")


def other_servers(rows: list[dict], reused: dict[str, dict], pending: list[dict], client: ClassifyClient,
                  shard: int) -> list[dict]:
    """Reused requests answered by a server other than the ones now up (another vLLM version or model
    folder): sent again, so that the shard's answers come from one server."""
    identities = {ep.identity for ep in client.endpoints.all}
    pending_ids = {r["request_id"] for r in pending}
    again = [r for r in rows if r["request_id"] in reused and r["request_id"] not in pending_ids
             and reused[r["request_id"]].get("server") not in identities]
    if again:
        log.info("shard %d: %d journaled answer(s) came from another server than %s: sent again", shard,
                 len(again), " / ".join(sorted(filter(None, identities))) or "this one")
    return again


def control_row(rows: list[dict], reused: dict[str, dict], pending: list[dict]) -> dict | None:
    """An answered request of the shard, the cheapest, to send again when only a control can tell whether
    the server answers at all (its answer is not journaled); None when the shard has none."""
    pending_ids = {r["request_id"] for r in pending}
    answered = [r for r in rows if (reused.get(r["request_id"]) or {}).get("status") == "ok"
                and r["request_id"] not in pending_ids]
    if not answered:
        return None
    row = min(answered, key=lambda r: int(r["est_prompt_tokens"] or 0))
    return dict(row, request_id=f"control-{row['request_id']}")


async def _stream(client: ClassifyClient, pending: list[dict], journal: Journal, prior: dict,
                  settings: ClientSettings, provenance: Provenance, progress: _Progress,
                  stop_sending: asyncio.Event, abort: asyncio.Event, why: dict, grace_s: float,
                  breaker: Breaker, control: dict | None = None) -> None:
    rerun_limit = RERUN_ATTEMPT_FACTOR * settings.max_attempts
    in_flight: set[str] = set()
    control_task: asyncio.Task | None = None

    def journal_records(records: list[dict]) -> None:
        for rec in records:
            journal.append(rec)
            progress.finished(rec)

    def finish(rec: dict, row: dict) -> None:
        if breaker.tripped:
            return  # journal nothing for the requests of a failing server: the rerun sends them again
        before = prior.get(rec["request_id"])
        if rec["retryable"] and not breaker.answered_any:
            rec["attempts"] = 0  # the server answered nothing: its failures are not charged to the request
        if before:
            rec["attempts"] += int(before.get("attempts") or 0)
            rec["sends"] += int(before.get("sends") or 0)
        if (rec["retryable"] and breaker.answered_any and rec["attempts"] >= rerun_limit
                and rec["error_kind"] != "media_unreachable"):
            rec["retryable"] = False
            rec["error"] = f"{rec['error']}; {rec['attempts']} attempts over several runs, giving up"
        rec.update(model=provenance.model, settings_fingerprint=provenance.settings_fingerprint,
                   prompt_hash=provenance.prompt_hash, request_fingerprint=row["fingerprint"], gpus=provenance.gpus)
        journal_records(breaker.settle(rec, answered=rec["http_status"] == 200))

    async def send(row: dict) -> dict | None:
        in_flight.add(row["request_id"])  # before the first await: see Breaker.turn
        try:
            return await client.classify(row)
        except (Stopped, NoLiveEndpoint):  # the reason is in `why` already
            return None
        except FatalClientError as exc:
            why.setdefault("reason", "fatal")
            why.setdefault("message", str(exc))
            stop_sending.set()
            abort.set()
            return None
        finally:
            in_flight.discard(row["request_id"])
            breaker.wake()

    async def controlled() -> None:
        """Once per job: whether the server answers at all, from a request it answered before."""
        nonlocal control_task
        if control_task is None:
            log.info("shard %d: nothing answered yet; sending the answered request %s again as a control",
                     progress.shard, control["post_id"])
            control_task = asyncio.ensure_future(send(control))
        await asyncio.shield(control_task)

    async def one(row: dict) -> bool:
        rec = await send(row)
        if rec is None:
            return False
        if rec["retryable"] and not breaker.answered_any and control is not None:
            await controlled()  # whether this failure is the request's own decides its attempts
        finish(rec, row)
        return True

    rows = iter(pending)

    async def worker() -> None:
        while not stop_sending.is_set():
            await breaker.turn(in_flight)  # one at a time until the job's first answer
            row = None if stop_sending.is_set() else next(rows, None)
            if row is None or not await one(row):
                return

    async def report() -> None:
        while True:
            await asyncio.sleep(progress.interval_s)
            log.info(progress.line())

    n_workers = max(settings.concurrency, settings.adaptive_ceiling if settings.adaptive else 0)
    workers = [asyncio.create_task(worker()) for _ in range(min(n_workers, len(pending)))]
    reporter = asyncio.create_task(report())
    # asyncio.wait, not gather: a gather future whose workers get cancelled holds a CancelledError
    # that nobody retrieves, and asyncio prints it as a traceback when the server dies mid-shard.
    all_done = asyncio.create_task(asyncio.wait(workers)) if workers else asyncio.create_task(asyncio.sleep(0))
    stopper = asyncio.create_task(stop_sending.wait())
    stopper.add_done_callback(lambda _: breaker.stop_waiting())
    try:
        await asyncio.wait({all_done, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if not all_done.done():
            if not abort.is_set():
                # SIGTERM: the requests in flight may still finish within the grace period.
                aborter = asyncio.create_task(abort.wait())
                await asyncio.wait({all_done, aborter}, timeout=grace_s,
                                   return_when=asyncio.FIRST_COMPLETED)
                aborter.cancel()
            abort.set()
            for w in workers:
                w.cancel()
    finally:
        tasks = [stopper, reporter, all_done, *workers, *([control_task] if control_task else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        journal_records(breaker.release())  # no trip: fewer than a run, the requests' own errors
    for w in workers:  # a worker's own failure (a bug) must not pass silently
        if not w.cancelled() and w.exception() is not None:
            raise w.exception()
