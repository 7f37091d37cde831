"""Classify one manifest shard with one model: start the server (or use the endpoints), stream the
requests, journal every result, and write ``labels/shard-{i}.parquet`` once every request has a
terminal record (in the model's folder, ``results/models/<name>/``: vidlabel.core.models).

Resume (vidlabel.serve.resume): a rerun skips the requests whose journaled record is terminal and was
made under the same request fingerprint (vidlabel.serve.provenance) and, once the servers are probed
(vidlabel.serve.probe), by a server with the same fingerprint. Every job with ``classify.endpoints``
probes them, also with nothing left to send; a job with its own servers and nothing to send starts
none. A transient error (timeout, 503, 5xx, connection) that used up its attempts is recorded but
tried again by the next run; once its attempts over all runs reach ``RERUN_ATTEMPT_FACTOR *
max_attempts`` the record becomes terminal, so a request that always fails ends as a clear record.

A failure shared by many requests is the server's, not theirs (``vidlabel.serve.breaker``: failures are
compared by error, server and media kind): until the job's first answer requests go one at a time (the
first is the media check, after the calibration videos, which usually show a server that cannot read
the job's media before any post is sent); the same error on two requests of a media kind the server
has answered none of (every video failing while photos answer, in whatever order they come), a server
that cannot see the job's media, a run of the same error with no answer of that kind in between, or a
refusal that shows the server's limits below the plan's stops the job once with the server's message
and the probable cause (ServerFailing, MediaUnreachable, ServerBelowPlan), and journals nothing
terminal for those requests. Attempts made while no request of the same media kinds was answered are
not charged to the requests; where a request's failure would otherwise stay undecided, an answered
request of the shard with the same media kinds is sent again as a control (not journaled).

The job fails (raises) when no server is left (every own server copy exited, or every endpoint failed
its health checks: ``vidlabel.serve.endpoints``; while one is left, traffic moves to it), on SIGTERM/SIGINT
(after a grace period for the requests in flight), on a fatal client error (bad key, unknown model)
and when some request is still waiting for a retry; everything finished so far is in the journal, so
the rerun continues.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from vidlabel.core import identity
from vidlabel.core.io import write_parquet
from vidlabel.core.journal import Journal, JournalLocked
from vidlabel.serve.breaker import Breaker, PlannedLimits, Trip, probable_media_cause, request_kinds
from vidlabel.serve.calibration import calibration
from vidlabel.serve.client import ClassifyClient, ClientSettings, Stopped, run
from vidlabel.serve.command import server_copies
from vidlabel.serve.endpoints import DOWN, UP, NoLiveEndpoint, external_endpoints
from vidlabel.serve.error_kinds import FatalClientError
from vidlabel.serve.items import job_limits, post_items, sent_items
from vidlabel.serve.parallelism import choose_layout
from vidlabel.serve.probe import CalibrationBelowPlan, CalibrationMediaError
from vidlabel.serve.progress import Progress
from vidlabel.serve.provenance import JobIdentity, Provenance
from vidlabel.serve.record import Record, labels_table
from vidlabel.serve.resume import from_other_servers, is_terminal, matching_records, resume_state
from vidlabel.serve.server import ServerError, ServerGroup, log_tail
from vidlabel.serve.settings import ServeSettings

log = logging.getLogger(__name__)

RERUN_ATTEMPT_FACTOR = 2

MANIFEST_COLUMNS = ["request_id", "post_id", "prompt", "est_prompt_tokens"]
# What the request sends: the post's items (vidlabel.serve.items), or a one-video manifest's media_path.
MEDIA_COLUMNS = ["items", "media_path"]
# Columns an older manifest may lack: what the row's answer also depends on (vidlabel.core.identity).
OPTIONAL_MANIFEST_COLUMNS = ["plan", "transcript_id", "transcript_status"]


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


def read_shard(path: str | Path) -> list[dict[str, Any]]:
    """Manifest rows (one per request; a repeated request_id is kept once)."""
    table = pq.read_table(path)
    missing = [c for c in MANIFEST_COLUMNS if c not in table.column_names]
    media = next((c for c in MEDIA_COLUMNS if c in table.column_names), None)
    if missing or media is None:
        raise ClassifyError(f"manifest shard {path} lacks columns {missing + ([] if media else ['items'])} "
                            "(see docs/outputs.md)")
    columns = MANIFEST_COLUMNS + [media] + [c for c in OPTIONAL_MANIFEST_COLUMNS if c in table.column_names]
    rows, seen = [], set()
    for row in table.select(columns).to_pylist():
        if row["request_id"] in seen:
            continue
        seen.add(row["request_id"])
        row["items"] = post_items(row)
        rows.append(row)
    return rows


def attach_requests(settings: ServeSettings, rows: list[dict[str, Any]]) -> JobIdentity:
    """Give every manifest row its ``request`` (vidlabel.serve.request: what its answer depends on, and the
    body sent for it) and that request's ``fingerprint``; the job's identity, resolved once."""
    job = JobIdentity.resolve(settings)
    for row in rows:
        row.setdefault("items", post_items(row))
    media = identity.media_items([i["media_path"] for r in rows for i in sent_items(r["items"])],
                                 settings.media_identity)
    for row in rows:
        row["request"] = job.request(row, media)
        row["fingerprint"] = row["request"].fingerprint()
    return job


def run_shard(config: dict, shard_path: str | Path, output_path: str | Path, journal_path: str | Path,
              server_log_path: str | Path, shard: int) -> None:
    """Classify every request of a manifest shard under ``config`` (one model's); see the module
    docstring. Raises ClassifyError, ServerError or FatalClientError when the shard is not complete."""
    classify_shard(ServeSettings.from_config(config), shard_path, output_path, journal_path, server_log_path, shard)


def classify_shard(settings: ServeSettings, shard_path: str | Path, output_path: str | Path,
                   journal_path: str | Path, server_log_path: str | Path, shard: int,
                   manifest_dir: str | Path | None = None) -> None:
    """``run_shard`` under settings already resolved. The server is sized for the data set whose manifest
    is in ``manifest_dir`` (default: the shard's folder; vidlabel.serve.items.job_limits)."""
    for noisy in ("httpx", "httpx2"):  # one INFO line per HTTP request would drown the progress lines
        if logging.getLogger(noisy).level == logging.NOTSET:
            logging.getLogger(noisy).setLevel(logging.WARNING)
    rows = read_shard(shard_path)
    try:
        limits = job_limits(rows, Path(manifest_dir) if manifest_dir is not None else Path(shard_path).parent)
    except ValueError as exc:
        raise ClassifyError(f"shard {shard}: {exc}") from None
    settings = settings.with_media_limits(limits)
    job = attach_requests(settings, rows)
    provenance = Provenance.of(settings, job, shard)
    try:
        journal = Journal(journal_path, key="request_id", fsync=settings.journal_fsync).__enter__()
    except JournalLocked as exc:
        raise ShardLocked(f"shard {shard}: {exc}") from None
    try:
        prior, reused = resume_state(rows, journal, shard)
        pending = [r for r in rows if r["request_id"] not in reused]
        log.info("shard %d (job %s): %d requests, %d answered before under the same settings, %d to send", shard,
                 provenance.job_id, len(rows), len(reused), len(pending))
        if pending or not settings.own_servers:  # the endpoints are probed even when nothing is left
            run(_classify(settings, provenance, rows, pending, reused, journal, prior, server_log_path, shard))
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


@dataclass
class JobStop:
    """Why the job stops (the first reason wins: a signal, the server, the breaker, a fatal client error)
    and how: ``no_new`` set, no new requests are sent; ``abort`` set, those in flight are abandoned."""

    reason: str | None = None
    message: str | None = None
    no_new: asyncio.Event = field(default_factory=asyncio.Event)
    abort: asyncio.Event = field(default_factory=asyncio.Event)

    def stop(self, reason: str, message: str | None = None, *, abort: bool = True) -> None:
        if self.reason is None:
            self.reason, self.message = reason, message
        elif self.message is None:
            self.message = message
        self.no_new.set()
        if abort:
            self.abort.set()


async def _classify(settings: ServeSettings, provenance: Provenance, rows: list[dict], pending: list[dict],
                    reused: dict, journal: Journal, prior: dict, server_log_path, shard: int) -> None:
    client_settings = settings.client
    grace_s = settings.server.shutdown_grace_s
    stop = JobStop()
    loop = asyncio.get_running_loop()

    def on_signal(signame: str) -> None:
        if stop.reason is None:
            log.warning("shard %d: %s received: no new requests; %g s grace for those in flight",
                        shard, signame, grace_s)
        stop.stop(signame, abort=False)

    def on_server_failure(message: str) -> None:
        if server is not None and "last lines of" not in message:  # not a process exit: show its logs
            message += "".join(f"; last lines of {s.log_path}:\n{log_tail(s.log_path)}" for s in server.servers)
        log.error("shard %d: no server left: %s", shard, message)
        stop.stop("server", message)

    def on_trip(trip: Trip) -> None:
        message = trip.message
        if server is not None and trip.kind == "server":
            message += "".join(f"\nlast lines of {s.log_path}:\n{log_tail(s.log_path)}" for s in server.servers)
        log.error("shard %d: stopping: %s", shard, message)
        stop.stop(f"breaker:{trip.kind}", message)

    breaker = Breaker(PlannedLimits.of(settings.plan, settings.server.media_limits), on_trip)
    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(RuntimeError, ValueError, NotImplementedError):
            loop.add_signal_handler(sig, on_signal, sig.name)
            installed.append(sig)

    server = None
    watchdog = None
    progress = None
    down: dict[int, tuple[str, bool]] = {}  # index -> (why, for good)
    try:
        if settings.endpoints:
            endpoints, down = await external_endpoints(settings)
            # classify.concurrency is per server: each endpoint is one, as each copy is below.
            client_settings = client_settings.for_copies(len(settings.endpoints))
        else:
            largest = max(int(r["est_prompt_tokens"] or 0) for r in pending) + client_settings.max_tokens
            layout = choose_layout(settings, largest)
            log.info("shard %d: parallelism %s", shard, layout.reason)
            provenance = replace(provenance, gpus=layout.held or None)
            # Requests in flight scale with the copies: classify.concurrency is per copy.
            client_settings = client_settings.for_copies(layout.data)
            server = ServerGroup(settings, server_copies(settings, layout, server_log_path)).start()
            ready = asyncio.create_task(server.wait_ready())
            stopper = asyncio.create_task(stop.no_new.wait())
            await asyncio.wait({ready, stopper}, return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            if not ready.done():
                ready.cancel()
                await asyncio.gather(ready, return_exceptions=True)
                raise JobInterrupted(f"shard {shard}: {stop.reason} while the server was starting; "
                                     "nothing was sent")
            ready.result()  # raises ServerError
            endpoints = server.endpoints

        try:
            client = ClassifyClient(endpoints, client_settings, stop_event=stop.abort, on_failure=on_server_failure,
                                    owned=server is not None, breaker=breaker, calibration=calibration(settings))
            for index, (reason, final) in down.items():  # before the client probes the others
                client.endpoints.mark_down(index, reason, final=final)
            async with client:
                live = [ep.identity for ep in client.endpoints.all if ep.state != DOWN]
                pending = pending + from_other_servers(rows, reused, pending, live, shard)
                if not pending:
                    log.info("shard %d: every answer is journaled and came from the servers now up: nothing to send",
                             shard)
                    return
                # What the KV caches hold of this shard's requests: more in flight would only queue in the engines.
                mean_tokens = sum(int(r["est_prompt_tokens"] or 0) for r in pending) / len(pending)
                if fitted := client.fit_in_flight(mean_tokens + client_settings.max_tokens):
                    log.info("shard %d: %s", shard, fitted)
                progress = Progress(len(rows), len(rows) - len(pending), shard, settings.progress_interval_s,
                                    work=sum(int(r["est_prompt_tokens"] or 0) for r in pending))
                if server is not None:
                    # A copy whose process exits is down for good; its traffic moves to the others.
                    watchdog = asyncio.create_task(server.watchdog(
                        lambda index, message: client.endpoints.mark_down(index, message, final=True)))
                progress.in_flight = lambda: client.deadlines.in_flight
                progress.in_flight_limit = lambda: client.limit.limit
                await _stream(client, pending, journal, prior, client_settings, provenance, progress, stop,
                              grace_s, breaker, controls(rows, reused, pending))
        except CalibrationMediaError as exc:
            raise MediaUnreachable(f"shard {shard}: {exc} — probable cause: "
                                   f"{probable_media_cause(exc.message)}. Nothing was sent; fix it "
                                   "and rerun.") from None
        except CalibrationBelowPlan as exc:
            raise ServerBelowPlan(f"shard {shard}: {exc} Nothing was sent.") from None
        log.info(progress.line())
    finally:
        if watchdog is not None:
            watchdog.cancel()
            await asyncio.gather(watchdog, return_exceptions=True)
        if server is not None:
            await asyncio.to_thread(server.stop)
        for sig in installed:
            loop.remove_signal_handler(sig)

    reason = stop.reason
    if reason == "server":
        raise ServerError(f"shard {shard}: {stop.message}")
    if breaker.tripped is not None:
        raise TRIP_ERRORS[breaker.tripped.kind](f"shard {shard}: {stop.message}")
    if reason == "fatal":
        raise FatalClientError(f"shard {shard}: {stop.message}")
    if reason:
        raise JobInterrupted(f"shard {shard}: stopped by {reason}; {progress.stats.done} requests finished "
                             f"this run and are journaled; rerun to continue")


def controls(rows: list[dict], reused: dict[str, dict], pending: list[dict]) -> dict[frozenset[str], dict]:
    """Per set of media kinds, an answered request of the shard sending them, the cheapest: sent again when
    only a control can tell whether the server answers such requests at all (its answer is not
    journaled). A kind set the shard has no answered request of is missing."""
    pending_ids = {r["request_id"] for r in pending}
    out: dict[frozenset[str], dict] = {}
    for row in sorted(rows, key=lambda r: int(r["est_prompt_tokens"] or 0)):
        if (reused.get(row["request_id"]) or {}).get("status") == "ok" and row["request_id"] not in pending_ids:
            out.setdefault(request_kinds(row["items"]), dict(row, request_id=f"control-{row['request_id']}"))
    return out


def control_for(controls: dict[frozenset[str], dict], kinds: frozenset[str]) -> dict | None:
    """The cheapest control that sends every kind of ``kinds`` (the one with the fewest other kinds)."""
    fits = [k for k in controls if kinds <= k]
    return controls[min(fits, key=len)] if fits else None


async def _stream(client: ClassifyClient, pending: list[dict], journal: Journal, prior: dict,
                  settings: ClientSettings, provenance: Provenance, progress: Progress,
                  stop: JobStop, grace_s: float,
                  breaker: Breaker, control_rows: dict[frozenset[str], dict] | None = None) -> None:
    rerun_limit = RERUN_ATTEMPT_FACTOR * settings.max_attempts
    in_flight: set[str] = set()
    control_tasks: dict[str, asyncio.Task] = {}  # control request id -> its task, once per job

    def journal_records(records: list[Record]) -> None:
        for rec in records:
            journal.append(rec.journal())
            progress.finished(rec)

    def finish(rec: Record, row: dict, kinds: frozenset[str]) -> None:
        if breaker.tripped and rec.http_status != 200:
            return  # no error of a failing server's requests is journaled: the rerun sends them again
        before = prior.get(rec.request_id) or {}
        # Answers to requests of other media kinds prove nothing about this one (a server that cannot
        # decode videos answers every photo): its failures count only where requests like it were answered.
        proven = breaker.evidence.proven(kinds)
        attempts = (0 if rec.retryable and not proven else rec.attempts) + int(before.get("attempts") or 0)
        rec = rec.stamped(attempts=attempts, sends=rec.sends + int(before.get("sends") or 0))
        if rec.retryable and proven and rec.attempts >= rerun_limit and rec.error_kind != "media_unreachable":
            rec = rec.stamped(retryable=False, own_failure=True,
                              error=f"{rec.error}; {rec.attempts} attempts over several runs, giving up")
        rec = provenance.record(rec, row)
        journal_records(breaker.settle(rec, kinds, answered=rec.http_status == 200))

    async def send(row: dict) -> Record | None:
        in_flight.add(row["request_id"])  # before the first await: see Breaker.turn
        try:
            return await client.classify(row)
        except (Stopped, NoLiveEndpoint):  # the reason is in `stop` already
            return None
        except FatalClientError as exc:
            stop.stop("fatal", str(exc))
            return None
        finally:
            in_flight.discard(row["request_id"])
            breaker.wake()

    async def controlled(control: dict) -> None:
        """Once per job and control: whether the server answers requests like it, from one it answered before."""
        if control["request_id"] not in control_tasks:
            log.info("shard %d: no %s answered yet; sending the answered request %s again as a control",
                     progress.shard, " / ".join(sorted(request_kinds(control["items"]))), control["post_id"])
            control_tasks[control["request_id"]] = asyncio.ensure_future(send(control))
        await asyncio.shield(control_tasks[control["request_id"]])

    async def one(row: dict) -> bool:
        progress.sent(row)
        rec = await send(row)
        if rec is None:
            return False
        kinds = request_kinds(row["items"])
        control = control_for(control_rows or {}, kinds)
        if rec.retryable and not breaker.evidence.proven(kinds) and control is not None:
            await controlled(control)  # whether this failure is the request's own decides its attempts
        finish(rec, row, kinds)
        return True

    rows = iter(pending)

    async def worker() -> None:
        while not stop.no_new.is_set():
            await breaker.turn(in_flight)  # one at a time until the job's first answer
            row = None if stop.no_new.is_set() else next(rows, None)
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
    stopper = asyncio.create_task(stop.no_new.wait())
    stopper.add_done_callback(lambda _: breaker.stop_waiting())
    try:
        await asyncio.wait({all_done, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if not all_done.done():
            if not stop.abort.is_set():
                # SIGTERM: the requests in flight may still finish within the grace period.
                aborter = asyncio.create_task(stop.abort.wait())
                await asyncio.wait({all_done, aborter}, timeout=grace_s,
                                   return_when=asyncio.FIRST_COMPLETED)
                aborter.cancel()
            stop.abort.set()
            for w in workers:
                w.cancel()
    finally:
        tasks = [stopper, reporter, all_done, *workers, *control_tasks.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # Connections dropped by a server that is still up were about their requests (a drop of every video).
        breaker.confirm_drops(ep.base_url for ep in client.endpoints.all if ep.state == UP)
        journal_records(breaker.release())  # no trip: fewer than a run, the requests' own errors
    for w in workers:  # a worker's own failure (a bug) must not pass silently
        if not w.cancelled() and w.exception() is not None:
            raise w.exception()
