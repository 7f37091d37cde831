"""Lifecycle of the per-job vLLM server: launch, readiness, watchdog, teardown (its command and the
copies a job starts: vidlabel.serve.command).

One server per classify job, bound to 127.0.0.1 on a free port, with a random API key that only
this job knows (given to the server in its environment, as ``VLLM_API_KEY``: arguments are visible
to every user of the node in the process list). The server runs in its own process group so that
teardown reaches the workers it forks; teardown (SIGTERM, then SIGKILL after a grace period) runs on
every exit path: the context manager, ``atexit``, and the parent's death (PR_SET_PDEATHSIG on Linux).
The watchdog watches the process; whether a running server answers is the client's health check
(``vidlabel.serve.endpoints``), the same for own servers and external endpoints.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import logging
import os
import re
import secrets
import shlex
import signal
import subprocess
import time
import weakref
from pathlib import Path
from typing import Callable

import httpx

from vidlabel.core import decode
from vidlabel.serve.command import ServerCopy, build_command, free_port, server_environment, single_copy
from vidlabel.serve.error_kinds import fatal_error, response_message
from vidlabel.serve.settings import ServeSettings

log = logging.getLogger(__name__)

LOG_TAIL_LINES = 40
WATCHDOG_POLL_S = 0.2
PORT_RETRIES = 3
_ADDRESS_IN_USE = re.compile(r"address already in use|errno 98", re.IGNORECASE)


class ServerError(RuntimeError):
    """The server could not be started, or died while the job was using it."""


class ServerBusy(ServerError):
    """The smoke request got a 502, 503 or 504 (or a 429): the server may still become ready."""


class ServerBroken(ServerError):
    """The smoke request got another 5xx (or /health a 500): vLLM opens its port only once its engine is
    up, so the server is broken, not starting."""


# A server whose /health or smoke request answers a 500 this many times in a row is broken (one more try
# than a glitch needs, a few seconds in all).
BROKEN_SMOKE_TRIES = 3
BUSY_STATUSES = frozenset({429, 502, 503, 504})


def log_tail(path: str | Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 64 * 1024))
            text = fh.read().decode(errors="replace")
    except FileNotFoundError:
        return "(no server log)"
    return "\n".join(text.splitlines()[-lines:])


def _die_with_parent() -> None:
    """In the child: get SIGTERM when the job process dies, even by SIGKILL (Linux only)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


_LIVE: "weakref.WeakSet[VLLMServer]" = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        server.stop()


class VLLMServer:
    """A server process for one job. ``with VLLMServer(settings, log_path) as srv: await srv.wait_ready()``."""

    def __init__(self, settings: ServeSettings, log_path: str | Path, *, copy: ServerCopy | None = None,
                 env: dict | None = None, api_key: str | None = None):
        self.settings = settings.server
        self.copy = copy or single_copy(settings, log_path)
        self.log_path = self.copy.log_path
        self.port = free_port()
        self.api_key = api_key or secrets.token_urlsafe(32)
        self.argv = build_command(self.settings, self.port, self.copy)
        self.model = self.settings.model
        self.startup_timeout_s = self.settings.startup_timeout_s
        self.grace_s = self.settings.shutdown_grace_s
        self.extra_env = dict(env or {})
        self.proc: subprocess.Popen | None = None
        self.failure: str | None = None
        self.started_at: float | None = None
        self.ready_after_s: float | None = None

    @property
    def root_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.root_url}/v1"

    # ---- launch and teardown ----------------------------------------------------------------
    def start(self) -> "VLLMServer":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = server_environment(self.api_key, self.copy, {**os.environ, **self.extra_env})
        log_fh = open(self.log_path, "ab")
        log_fh.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {shlex.join(self.argv)}\n".encode())
        log_fh.flush()
        try:
            self.proc = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=log_fh, stderr=subprocess.STDOUT, env=env,
                start_new_session=True, preexec_fn=_die_with_parent, close_fds=True)
        except OSError as exc:
            raise ServerError(f"cannot start the server ({shlex.join(self.argv)}): {exc}") from None
        finally:
            log_fh.close()
        _LIVE.add(self)
        self.started_at = time.monotonic()
        log.info("server %d started (pid %d, port %d, GPUs %s, %d API servers x %d media threads), log %s",
                 self.copy.index, self.proc.pid, self.port, ",".join(self.copy.gpus) or "as inherited",
                 self.copy.api_servers, int(env.get("VLLM_MEDIA_LOADING_THREAD_COUNT", 0)), self.log_path)
        return self

    def terminate(self) -> None:
        """SIGTERM to the process group, without waiting (``stop`` waits)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)

    def stop(self) -> None:
        """SIGTERM to the process group, SIGKILL after the grace period. Idempotent."""
        proc = self.proc
        if proc is None:
            return
        _LIVE.discard(self)
        if proc.poll() is None:
            self.terminate()
            try:
                proc.wait(timeout=self.grace_s)
            except subprocess.TimeoutExpired:
                log.warning("server did not exit within %.0f s of SIGTERM; killing it", self.grace_s)
        # Workers of the group may outlive the leader: SIGKILL whatever is left.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        log.info("server %d stopped (exit status %s)", self.copy.index, proc.returncode)

    def __enter__(self) -> "VLLMServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- readiness and watchdog ------------------------------------------------------------
    def _lost_port_race(self) -> bool:
        tail = log_tail(self.log_path, LOG_TAIL_LINES).rsplit("\n==== ", 1)[-1]
        return bool(_ADDRESS_IN_USE.search(tail))

    def _exited_message(self) -> str:
        return (f"server exited with status {self.proc.returncode}; last lines of {self.log_path}:\n"
                f"{log_tail(self.log_path)}")

    async def wait_ready(self) -> None:
        """Return once /health answers 200 and a one-token request succeeds; ServerError otherwise: at
        once when the process exits, after BROKEN_SMOKE_TRIES 500s in a row (broken), else after
        ``startup_timeout_s`` (a refused connection or a 503 means still starting)."""
        deadline = time.monotonic() + self.startup_timeout_s
        headers = {"Authorization": f"Bearer {self.api_key}"}
        restarts = 0
        broken = 0
        async with httpx.AsyncClient(timeout=30.0) as http:
            while True:
                if self.proc.poll() is not None:
                    if self._lost_port_race() and restarts < PORT_RETRIES:
                        # Another process took the free port between our probe and the server's bind.
                        restarts += 1
                        log.warning("port %d was taken before the server bound it; retrying on another", self.port)
                        self.port = free_port()
                        self.argv = build_command(self.settings, self.port, self.copy)
                        self.start()
                        continue
                    raise ServerError("server exited during startup: " + self._exited_message())
                if time.monotonic() > deadline:
                    raise ServerError(f"server not ready after {self.startup_timeout_s:g} s "
                                      f"(classify.startup_timeout_s); last lines of {self.log_path}:\n"
                                      f"{log_tail(self.log_path)}")
                try:
                    health = await http.get(f"{self.root_url}/health")
                except httpx.HTTPError:
                    health = None
                try:
                    if health is not None and health.status_code == 500:
                        raise ServerBroken(f"{self.root_url}/health answered 500: {health.text[:500]}")
                    if health is not None and health.status_code == 200:
                        await self._smoke(http, headers)
                        self.ready_after_s = time.monotonic() - self.started_at
                        log.info("server %d ready on port %d, %.1f s after its start", self.copy.index,
                                 self.port, self.ready_after_s)
                        return
                except ServerBusy as exc:  # overloaded or still warming up: ask again
                    log.info("server not ready yet: %s", exc)
                except ServerBroken as exc:
                    broken += 1
                    if broken >= BROKEN_SMOKE_TRIES:
                        raise ServerBroken(f"{exc} ({broken} times in a row: broken, not starting); last lines "
                                           f"of {self.log_path}:\n{log_tail(self.log_path)}") from None
                    log.warning("server %d: %s; asking again", self.copy.index, exc)
                    await asyncio.sleep(1.0)
                    continue
                broken = 0
                await asyncio.sleep(0.25)

    async def _smoke(self, http: httpx.AsyncClient, headers: dict) -> None:
        await smoke_request(http, self.base_url, headers, self.model, self.log_path)

    async def watchdog(self, on_failure: Callable[[str], None]) -> None:
        """Run until cancelled; when the process exits call ``on_failure(reason)``."""
        while self.proc.poll() is None:
            await asyncio.sleep(WATCHDOG_POLL_S)
        self.failure = self._exited_message()
        on_failure(self.failure)


class ServerGroup:
    """The servers of one job (one per copy), sharing the job's API key; started, watched and stopped
    together. Teardown sends SIGTERM to every copy first, so their grace periods run at once."""

    def __init__(self, settings: ServeSettings, copies: list[ServerCopy]):
        key = secrets.token_urlsafe(32)
        self.servers = [VLLMServer(settings, c.log_path, copy=c, api_key=key) for c in copies]

    def start(self) -> "ServerGroup":
        first = self.servers[0]  # the decoder the command asks for, importable where the server runs?
        problem = decode.preflight(first.argv, server_environment(first.api_key, first.copy, os.environ))
        if problem:
            raise ServerError(problem)
        try:
            for server in self.servers:
                server.start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for server in self.servers:
            server.terminate()
        for server in self.servers:
            server.stop()

    @property
    def endpoints(self) -> list[tuple[str, str]]:
        return [(s.base_url, s.api_key) for s in self.servers]

    @property
    def ready_after_s(self) -> float | None:
        times = [s.ready_after_s for s in self.servers]
        return None if None in times else max(times)

    async def wait_ready(self) -> None:
        """Every copy ready, or ServerError from the first that fails (the others are not waited for)."""
        tasks = [asyncio.create_task(s.wait_ready()) for s in self.servers]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def watchdog(self, on_failure: Callable[[int, str], None]) -> None:
        """Until cancelled; every copy that dies calls ``on_failure(index, reason)``, the reason naming
        the copy when there are several."""
        def failed(index: int) -> Callable[[str], None]:
            return lambda message: on_failure(index, message if len(self.servers) == 1 else f"copy {index}: {message}")

        await asyncio.gather(*(s.watchdog(failed(i)) for i, s in enumerate(self.servers)))


async def smoke_request(http: httpx.AsyncClient, base_url: str, headers: dict, model: str,
                        log_path: str | Path | None = None) -> None:
    """One text-only, one-token chat completion: proves the model is loaded and the key works (a
    refused key raises FatalClientError, which says so)."""
    body = {"model": model, "messages": [{"role": "user", "content": "Reply with yes."}],
            "max_tokens": 1, "temperature": 0}
    try:
        resp = await http.post(f"{base_url}/chat/completions", json=body,
                               headers={**headers, "X-Request-Id": f"smoke-{secrets.token_hex(4)}"})
    except httpx.HTTPError as exc:
        raise ServerError(f"smoke request to {base_url} failed: {exc!r}") from None
    if resp.status_code in (401, 403):
        raise fatal_error(base_url, resp.status_code, response_message(resp.content))
    if resp.status_code in BUSY_STATUSES:
        raise ServerBusy(f"smoke request to {base_url} answered {resp.status_code}: {resp.text[:200]}")
    if resp.status_code >= 500:
        raise ServerBroken(f"smoke request to {base_url} answered {resp.status_code}: "
                           f"{response_message(resp.content)[:500]}")
    if resp.status_code != 200:
        tail = f"; last lines of {log_path}:\n{log_tail(log_path)}" if log_path else ""
        raise ServerError(f"smoke request to {base_url} answered {resp.status_code}: {resp.text[:500]}{tail}")
