"""Classify one manifest shard: start the server (or use the endpoints), stream the requests, journal
every result, and write ``labels/shard-{i}.parquet`` once every request has a terminal record.

Resume: the journal (``journal/shard-{i}.jsonl``) holds one record per finished request. A rerun skips
requests whose record is terminal: ``ok``, or an error that a retry would not change. A transient
error (timeout, 503, 5xx, connection) that used up its attempts is recorded but tried again by the
next run, with a fresh attempt budget; once its attempts over all runs reach
``RERUN_ATTEMPT_FACTOR * max_attempts`` the record becomes terminal, so a request that always fails
ends as a clear record instead of failing the job forever.

The job fails (raises) when no server is left (every own server copy exited, or every endpoint failed
its health checks: ``vidlabel.endpoints``; while one is left, traffic moves to it), on SIGTERM/SIGINT
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import httpx
import pyarrow as pa
import pyarrow.parquet as pq

from vidlabel.client import ClassifyClient, ClientSettings, Stopped, run
from vidlabel.endpoints import NoLiveEndpoint
from vidlabel.error_kinds import FatalClientError
from vidlabel.io import write_parquet
from vidlabel.journal import Journal, JournalLocked
from vidlabel.parallelism import choose_layout
from vidlabel.server import ServerBusy, ServerError, ServerGroup, log_tail, server_copies, smoke_request

log = logging.getLogger(__name__)

RERUN_ATTEMPT_FACTOR = 2
SMOKE_TRIES = 5  # an external endpoint's smoke request is asked again this often after a 5xx

MANIFEST_COLUMNS = ["request_id", "post_id", "media_path", "prompt", "est_prompt_tokens"]

LABEL_SCHEMA = pa.schema([
    ("request_id", pa.string()), ("post_id", pa.string()), ("shard", pa.int64()),
    ("status", pa.string()), ("error_kind", pa.string()), ("error", pa.string()),
    ("http_status", pa.int64()), ("attempts", pa.int64()), ("latency_s", pa.float64()),
    ("started_at", pa.float64()), ("finished_at", pa.float64()), ("finish_reason", pa.string()),
    ("prompt_tokens", pa.int64()), ("completion_tokens", pa.int64()), ("est_prompt_tokens", pa.int64()),
    ("raw_text", pa.string()), ("answers", pa.string()),
])


class ClassifyError(RuntimeError):
    """The shard job did not complete; the journal keeps everything that finished."""


class ShardLocked(ClassifyError):
    """Another job holds this shard's journal."""


class JobInterrupted(ClassifyError):
    """SIGTERM/SIGINT: the job stopped sending, let in-flight requests finish (grace) and flushed."""


class ShardIncomplete(ClassifyError):
    """Some requests ended with transient errors this run; a rerun retries them."""


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
            elif name == "answers":
                ans = rec.get("answers")
                cols[name].append(json.dumps(ans, sort_keys=True) if ans is not None else None)
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
    try:
        journal = Journal(journal_path, key="request_id", fsync=c["journal_fsync"]).__enter__()
    except JournalLocked as exc:
        raise ShardLocked(f"shard {shard}: {exc}") from None
    try:
        prior = journal.read()
        pending = [r for r in rows if not is_terminal(prior.get(r["request_id"]))]
        log.info("shard %d: %d requests, %d already terminal in %s, %d to send", shard, len(rows),
                 len(rows) - len(pending), journal_path, len(pending))
        if pending:
            run(_classify(config, pending, journal, prior, server_log_path, shard, len(rows)))
        final = journal.read()
    finally:
        journal.close()
    unfinished = [r["request_id"] for r in rows if not is_terminal(final.get(r["request_id"]))]
    if unfinished:
        kinds: dict[str, int] = {}
        for rid in unfinished:
            kind = (final.get(rid) or {}).get("error_kind") or "not sent"
            kinds[kind] = kinds.get(kind, 0) + 1
        raise ShardIncomplete(f"shard {shard}: {len(unfinished)} requests still need a retry ({kinds}); "
                              f"rerun the job to retry them (finished ones are kept in {journal_path})")
    write_parquet(labels_table([final[r["request_id"]] for r in rows], shard), output_path)
    log.info("shard %d: wrote %s (%d rows)", shard, output_path, len(rows))


async def _external_endpoints(config: dict) -> tuple[list[tuple[str, str]], dict[int, str]]:
    """The endpoints and, by index, why those that failed their smoke request are down (ServerError
    when all did; FatalClientError when one refused the key)."""
    c = config["classify"]
    key = os.environ.get(c["api_key_env"], "")
    if not key:
        log.warning("environment variable %s is empty: sending requests without an API key", c["api_key_env"])
    endpoints = [(url.rstrip("/"), key or "none") for url in c["endpoints"]]
    down: dict[int, str] = {}
    async with httpx.AsyncClient(timeout=60.0) as http:
        for i, (url, k) in enumerate(endpoints):
            for attempt in range(1, SMOKE_TRIES + 1):
                try:
                    await smoke_request(http, url, {"Authorization": f"Bearer {k}"}, c["model"])
                    break
                except ServerError as exc:
                    if isinstance(exc, ServerBusy) and attempt < SMOKE_TRIES:  # a 5xx: ask again
                        await asyncio.sleep(1.0)
                        continue
                    log.error("endpoint %s is down at the start: %s", url, exc)
                    down[i] = str(exc)
                    break
    if len(down) == len(endpoints):
        raise ServerError("no endpoint answered: " + "; ".join(down.values()))
    return endpoints, down


async def _classify(config: dict, pending: list[dict], journal: Journal, prior: dict, server_log_path,
                    shard: int, total: int) -> None:
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

    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(RuntimeError, ValueError, NotImplementedError):
            loop.add_signal_handler(sig, on_signal, sig.name)
            installed.append(sig)

    server = None
    watchdog = None
    down: dict[int, str] = {}
    try:
        if c["endpoints"]:
            endpoints, down = await _external_endpoints(config)
        else:
            largest = max(int(r["est_prompt_tokens"] or 0) for r in pending) + c["max_tokens"]
            layout = choose_layout(config, largest)
            log.info("shard %d: parallelism %s", shard, layout.reason)
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

        progress = _Progress(total, total - len(pending), shard, c["progress_interval_s"])
        async with ClassifyClient(endpoints, settings, stop_event=abort, on_failure=on_server_failure) as client:
            for index, reason in down.items():
                client.endpoints.mark_down(index, reason)
            if server is not None:
                # A copy whose process exits is down for good; its traffic moves to the others.
                watchdog = asyncio.create_task(server.watchdog(
                    lambda index, message: client.endpoints.mark_down(index, message, final=True)))
            progress.in_flight = lambda: client.deadlines.in_flight
            await _stream(client, pending, journal, prior, settings, progress, stop_sending, abort,
                          why, c["shutdown_grace_s"])
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
    if reason == "fatal":
        raise FatalClientError(f"shard {shard}: {why['message']}")
    if reason:
        raise JobInterrupted(f"shard {shard}: stopped by {reason}; {progress.stats.done} requests finished "
                             f"this run and are journaled; rerun to continue")


async def _stream(client: ClassifyClient, pending: list[dict], journal: Journal, prior: dict,
                  settings: ClientSettings, progress: _Progress, stop_sending: asyncio.Event,
                  abort: asyncio.Event, why: dict, grace_s: float) -> None:
    rows = iter(pending)
    rerun_limit = RERUN_ATTEMPT_FACTOR * settings.max_attempts

    def finish(rec: dict) -> None:
        before = prior.get(rec["request_id"])
        if before:
            rec["attempts"] += int(before.get("attempts") or 0)
        if rec["retryable"] and rec["attempts"] >= rerun_limit:
            rec["retryable"] = False
            rec["error"] = f"{rec['error']}; {rec['attempts']} attempts over several runs, giving up"
        journal.append(rec)
        progress.finished(rec)

    async def worker() -> None:
        while not stop_sending.is_set():
            row = next(rows, None)
            if row is None:
                return
            try:
                rec = await client.classify(row)
            except (Stopped, NoLiveEndpoint):  # the reason is in `why` already
                return
            except FatalClientError as exc:
                why.setdefault("reason", "fatal")
                why.setdefault("message", str(exc))
                stop_sending.set()
                abort.set()
                return
            finish(rec)

    async def report() -> None:
        while True:
            await asyncio.sleep(progress.interval_s)
            log.info(progress.line())

    n_workers = max(settings.concurrency, settings.adaptive_ceiling if settings.adaptive else 0)
    workers = [asyncio.create_task(worker()) for _ in range(min(n_workers, len(pending)))]
    reporter = asyncio.create_task(report())
    # asyncio.wait, not gather: a gather future whose workers get cancelled holds a CancelledError
    # that nobody retrieves, and asyncio prints it as a traceback when the server dies mid-shard.
    all_done = asyncio.create_task(asyncio.wait(workers))
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
    for w in workers:  # a worker's own failure (a bug) must not pass silently
        if not w.cancelled() and w.exception() is not None:
            raise w.exception()
