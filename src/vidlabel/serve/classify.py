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

The first request goes alone, as the media check: a server that cannot see the job's media (another
mount, another ``--allowed-local-media-path``) stops the job there, naming the probable cause, with
nothing journaled (its calibration videos usually show it before). During the run, a row of
MEDIA_FAILURE_RUN distinct videos failing with the same media error and no answer in between stops it
the same way; those records are not journaled.

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
import re
import signal
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from vidlabel.core import identity
from vidlabel.core.io import write_parquet
from vidlabel.core.journal import Journal, JournalLocked
from vidlabel.serve.calibration import calibration
from vidlabel.serve.client import ClassifyClient, ClientSettings, Stopped, run
from vidlabel.serve.command import server_copies
from vidlabel.serve.endpoints import DOWN, NoLiveEndpoint, external_endpoints
from vidlabel.serve.error_kinds import FatalClientError
from vidlabel.serve.parallelism import choose_layout
from vidlabel.serve.probe import CalibrationMediaError
from vidlabel.serve.progress import Progress
from vidlabel.serve.provenance import JobIdentity, Provenance
from vidlabel.serve.record import labels_table
from vidlabel.serve.resume import from_other_servers, is_terminal, matching_records, resume_state
from vidlabel.serve.server import ServerError, ServerGroup, log_tail
from vidlabel.serve.settings import ServeSettings

log = logging.getLogger(__name__)

RERUN_ATTEMPT_FACTOR = 2
# This many distinct videos in a row failing with the same media error, no answer in between: the
# server's media access is broken, not the videos (see the module docstring).
MEDIA_FAILURE_RUN = 12

MANIFEST_COLUMNS = ["request_id", "post_id", "media_path", "prompt", "est_prompt_tokens"]
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


def read_shard(path: str | Path) -> list[dict[str, Any]]:
    """Manifest rows (one per request; a repeated request_id is kept once)."""
    table = pq.read_table(path)
    missing = [c for c in MANIFEST_COLUMNS if c not in table.column_names]
    if missing:
        raise ClassifyError(f"manifest shard {path} lacks columns {missing} (see docs/outputs.md)")
    columns = MANIFEST_COLUMNS + [c for c in OPTIONAL_MANIFEST_COLUMNS if c in table.column_names]
    rows, seen = [], set()
    for row in table.select(columns).to_pylist():
        if row["request_id"] in seen:
            continue
        seen.add(row["request_id"])
        rows.append(row)
    return rows


def run_shard(config: dict, shard_path: str | Path, output_path: str | Path, journal_path: str | Path,
              server_log_path: str | Path, shard: int) -> None:
    """Classify every request of a manifest shard under ``config`` (one model's); see the module
    docstring. Raises ClassifyError, ServerError or FatalClientError when the shard is not complete."""
    classify_shard(ServeSettings.from_config(config), shard_path, output_path, journal_path, server_log_path, shard)


def classify_shard(settings: ServeSettings, shard_path: str | Path, output_path: str | Path,
                   journal_path: str | Path, server_log_path: str | Path, shard: int) -> None:
    """``run_shard`` under settings already resolved."""
    for noisy in ("httpx", "httpx2"):  # one INFO line per HTTP request would drown the progress lines
        if logging.getLogger(noisy).level == logging.NOTSET:
            logging.getLogger(noisy).setLevel(logging.WARNING)
    rows = read_shard(shard_path)
    job = JobIdentity.resolve(settings)
    provenance = Provenance.of(settings, job, shard)
    media = identity.media_items([r["media_path"] for r in rows], settings.media_identity)
    for row in rows:
        row["fingerprint"] = job.fingerprint(row, media[row["media_path"]])
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


async def _classify(settings: ServeSettings, provenance: Provenance, rows: list[dict], pending: list[dict],
                    reused: dict, journal: Journal, prior: dict, server_log_path, shard: int) -> None:
    client_settings = settings.client
    grace_s = settings.server.shutdown_grace_s
    stop_sending = asyncio.Event()  # no new requests (SIGTERM, watchdog, fatal error)
    abort = asyncio.Event()  # abandon in-flight requests now
    why: dict[str, str] = {}
    loop = asyncio.get_running_loop()

    def on_signal(signame: str) -> None:
        if "reason" not in why:
            log.warning("shard %d: %s received: no new requests; %g s grace for those in flight",
                        shard, signame, grace_s)
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

    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(RuntimeError, ValueError, NotImplementedError):
            loop.add_signal_handler(sig, on_signal, sig.name)
            installed.append(sig)

    server = None
    watchdog = None
    progress = None
    down: dict[int, str] = {}
    try:
        if settings.endpoints:
            endpoints, down = await external_endpoints(settings)
        else:
            largest = max(int(r["est_prompt_tokens"] or 0) for r in pending) + client_settings.max_tokens
            layout = choose_layout(settings, largest)
            log.info("shard %d: parallelism %s", shard, layout.reason)
            provenance = replace(provenance, gpus=layout.held or None)
            # Requests in flight scale with the copies: classify.concurrency is per copy.
            client_settings = replace(client_settings, concurrency=client_settings.concurrency * layout.data)
            server = ServerGroup(settings, server_copies(settings, layout, server_log_path)).start()
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

        try:
            client = ClassifyClient(endpoints, client_settings, stop_event=abort, on_failure=on_server_failure,
                                    owned=server is not None, calibration=calibration(settings))
            async with client:
                for index, reason in down.items():
                    client.endpoints.mark_down(index, reason)
                live = [ep.identity for ep in client.endpoints.all if ep.state != DOWN]
                pending = pending + from_other_servers(rows, reused, pending, live, shard)
                if not pending:
                    log.info("shard %d: every answer is journaled and came from the servers now up: nothing to send",
                             shard)
                    return
                progress = Progress(len(rows), len(rows) - len(pending), shard, settings.progress_interval_s)
                if server is not None:
                    # A copy whose process exits is down for good; its traffic moves to the others.
                    watchdog = asyncio.create_task(server.watchdog(
                        lambda index, message: client.endpoints.mark_down(index, message, final=True)))
                progress.in_flight = lambda: client.deadlines.in_flight
                await _stream(client, pending, journal, prior, client_settings, provenance, progress, stop_sending,
                              abort, why, grace_s)
        except CalibrationMediaError as exc:
            raise MediaUnreachable(f"shard {shard}: {exc} — probable cause: "
                                   f"{probable_media_cause({'error': exc.message})}. Nothing was sent; fix it "
                                   "and rerun.") from None
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
    if reason == "media":
        raise MediaUnreachable(f"shard {shard}: {why['message']}")
    if reason == "fatal":
        raise FatalClientError(f"shard {shard}: {why['message']}")
    if reason:
        raise JobInterrupted(f"shard {shard}: stopped by {reason}; {progress.stats.done} requests finished "
                             f"this run and are journaled; rerun to continue")


def _media_failure_key(rec: dict) -> str | None:
    """What a run of the same media error has in common, or None when ``rec`` is no media error."""
    if rec["status"] == "ok" or rec["error_kind"] not in ("bad_media", "media_unreachable"):
        return None
    return f"{rec['http_status']} " + re.sub(r"(/\S+|\d+)", "_", rec.get("error") or "")[:200]


def probable_media_cause(rec: dict) -> str:
    message = rec.get("error") or ""
    if "subpath" in message:
        return ("the server may not read where the videos are: its --allowed-local-media-path differs from the "
                "job's media_root (or the transcoded media directory)")
    if "No such file" in message or "Errno 2" in message:
        return ("the server does not see the videos at the job's paths: mount the media at the same path on the "
                "server's node (or set media_root to where the server sees it)")
    return "the server cannot decode these videos (a codec or container it does not support; see docs/planning.md)"


class MediaErrorRun:
    """Holds media-error records back until an answer shows the server can read media; MEDIA_FAILURE_RUN
    distinct videos in a row with the same error and no answer in between mean it cannot."""

    def __init__(self, limit: int):
        self.limit = limit
        self.held: dict[str, list[dict]] = {}

    def add(self, rec: dict) -> tuple[list[dict], dict | None]:
        """(records to journal now, the record that completes a run, else None)."""
        key = _media_failure_key(rec)
        if key is None:
            # An answer shows the server reads media: the errors held were the videos' own.
            return (self.flush() if rec["status"] == "ok" else []) + [rec], None
        group = self.held.setdefault(key, [])
        group.append(rec)
        return [], rec if len({r["post_id"] for r in group}) >= self.limit else None

    def flush(self) -> list[dict]:
        out = [r for group in self.held.values() for r in group]
        self.held.clear()
        return out


async def _stream(client: ClassifyClient, pending: list[dict], journal: Journal, prior: dict,
                  settings: ClientSettings, provenance: Provenance, progress: Progress,
                  stop_sending: asyncio.Event, abort: asyncio.Event, why: dict, grace_s: float) -> None:
    rerun_limit = RERUN_ATTEMPT_FACTOR * settings.max_attempts
    media_run = MediaErrorRun(MEDIA_FAILURE_RUN)

    def stop_for_media(rec: dict, first: bool) -> None:
        where = "the first request (the media check)" if first else \
            f"{MEDIA_FAILURE_RUN} videos in a row, with no answer in between"
        why.setdefault("reason", "media")
        why.setdefault("message", f"{where} failed with: {rec['error']} — probable cause: "
                                  f"{probable_media_cause(rec)}. Nothing was journaled for them; fix it and rerun.")
        stop_sending.set()
        abort.set()

    def journal_records(records: list[dict]) -> None:
        for rec in records:
            journal.append(rec.journal())
            progress.finished(rec)

    def finish(rec: dict, row: dict, first: bool = False) -> None:
        before = prior.get(rec["request_id"])
        if before:
            rec["attempts"] += int(before.get("attempts") or 0)
            rec["sends"] += int(before.get("sends") or 0)
        if rec["retryable"] and rec["attempts"] >= rerun_limit and rec["error_kind"] != "media_unreachable":
            rec["retryable"] = False
            rec["error"] = f"{rec['error']}; {rec['attempts']} attempts over several runs, giving up"
        rec = provenance.record(rec, row)  # frozen from here on, stamped with what made it
        if first and rec["error_kind"] == "media_unreachable":
            stop_for_media(rec, first=True)
            return
        ready, completes_run = media_run.add(rec)
        if completes_run is not None:
            stop_for_media(completes_run, first=False)
            media_run.held.clear()  # journal nothing terminal for them: the rerun sends them again
            return
        journal_records(ready)

    async def one(row: dict, first: bool = False) -> bool:
        try:
            rec = await client.classify(row)
        except (Stopped, NoLiveEndpoint):  # the reason is in `why` already
            return False
        except FatalClientError as exc:
            why.setdefault("reason", "fatal")
            why.setdefault("message", str(exc))
            stop_sending.set()
            abort.set()
            return False
        finish(rec, row, first)
        return True

    # The media check: one real video alone, before the shard's traffic.
    rows = iter(pending)
    first = next(rows)
    if not await one(first, first=True) or stop_sending.is_set():
        journal_records(media_run.flush() if why.get("reason") != "media" else [])
        return

    async def worker() -> None:
        while not stop_sending.is_set():
            row = next(rows, None)
            if row is None or not await one(row):
                return

    async def report() -> None:
        while True:
            await asyncio.sleep(progress.interval_s)
            log.info(progress.line())

    n_workers = max(settings.concurrency, settings.adaptive_ceiling if settings.adaptive else 0)
    workers = [asyncio.create_task(worker()) for _ in range(min(n_workers, len(pending) - 1))]
    reporter = asyncio.create_task(report())
    # asyncio.wait, not gather: a gather future whose workers get cancelled holds a CancelledError
    # that nobody retrieves, and asyncio prints it as a traceback when the server dies mid-shard.
    all_done = asyncio.create_task(asyncio.wait(workers)) if workers else asyncio.create_task(asyncio.sleep(0))
    stopper = asyncio.create_task(stop_sending.wait())
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
        for task in (stopper, reporter, all_done, *workers):
            task.cancel()
        await asyncio.gather(stopper, reporter, all_done, *workers, return_exceptions=True)
        if why.get("reason") != "media":
            journal_records(media_run.flush())  # fewer than a run: the videos' own errors
    for w in workers:  # a worker's own failure (a bug) must not pass silently
        if not w.cancelled() and w.exception() is not None:
            raise w.exception()

