"""Lifecycle of the per-job vLLM server: launch, readiness, watchdog, teardown.

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
import socket
import subprocess
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import httpx

from vidlabel.prepare.planning import allowed_media_path
from vidlabel.serve import decode, quantization
from vidlabel.serve.error_kinds import fatal_error, response_message
from vidlabel.serve.parallelism import Layout, choose_layout, granted_gpus

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


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now (the server binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# How a server copy's CPUs are shared when classify.api_server_count is null. Each API server process
# decodes videos in its own thread pool and runs the multimodal processor (resize and normalisation
# of every frame, the chat template, request parsing) in its own interpreter: the per-request CPU
# work that decides whether the GPU waits. Measured on one H200 with 16 cores, camera-like H.264,
# 32 requests in flight (vLLM 0.26, docs/serving.md): 8 API servers x 2 media threads 18.5k prompt
# tok/s at 1.4 req/s with the GPU near 100 % busy; 4 x 3 (with 2 CPUs kept aside) 12.9k at 1.0 req/s
# with the GPU idle a third of the time. So no CPUs are kept aside (the engine and the client
# share them with decoding) and every 2 CPUs get an API server.
RESERVED_CPUS = 0
CPUS_PER_API_SERVER = 2
MAX_API_SERVERS = 8  # the most measured


def granted_cpus(environ=os.environ) -> int | None:
    """CPUs SLURM granted this job: --cpus-per-task, else --cpus-per-gpu x the GPUs granted, else
    the job's CPUs on this node (the only one left inside the Snakemake plugin's job step, which
    clears the allocation's SLURM_* variables before its srun)."""
    per_task = environ.get("SLURM_CPUS_PER_TASK", "").strip()
    if per_task.isdigit():
        return int(per_task)
    per_gpu = environ.get("SLURM_CPUS_PER_GPU", "").strip()
    visible = [d for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if per_gpu.isdigit() and visible:
        return int(per_gpu) * len(visible)
    on_node = environ.get("SLURM_CPUS_ON_NODE", "").strip()
    return int(on_node) if on_node.isdigit() else None


def job_cpus(environ=os.environ) -> tuple[int, str]:
    """CPUs this job may use: what SLURM granted, else this process's CPU affinity."""
    granted = granted_cpus(environ)
    if granted:
        return granted, "SLURM"
    return len(os.sched_getaffinity(0)), "CPU affinity"


@dataclass(frozen=True)
class ServerCopy:
    """One server process of a job: its GPUs, its parallel sizes and its share of the job's CPUs."""

    index: int
    gpus: tuple[str, ...]  # CUDA_VISIBLE_DEVICES for it; empty: leave the variable alone
    tensor: int
    data: int  # --data-parallel-size: >1 only when vLLM serves the copies itself
    cpus: int
    api_servers: int
    log_path: Path

    @property
    def media_threads(self) -> int:
        """Video-decoding threads per API server process (vLLM's pool is per process)."""
        return max(1, (self.cpus - RESERVED_CPUS) // self.api_servers)


def api_server_count(config: dict, cpus: int) -> int:
    """``--api-server-count`` for a server copy with ``cpus`` CPUs: ``classify.api_server_count``, or
    one per ``CPUS_PER_API_SERVER`` CPUs between 1 and ``MAX_API_SERVERS`` (16 CPUs: 8 API servers,
    each with 2 media threads, ``ServerCopy.media_threads``)."""
    configured = config["classify"]["api_server_count"]
    if configured:
        return int(configured)
    return max(1, min(MAX_API_SERVERS, (cpus - RESERVED_CPUS) // CPUS_PER_API_SERVER))


def copy_log_path(log_path: str | Path, index: int, copies: int) -> Path:
    """``server-3.log`` for a lone copy; ``server-3.copy-1.log`` for the second of several."""
    path = Path(log_path)
    return path if copies == 1 else path.with_name(f"{path.stem}.copy-{index}{path.suffix}")


def server_copies(config: dict, layout: Layout, log_path: str | Path, environ=os.environ) -> list[ServerCopy]:
    """The server processes that serve ``layout``: one per copy, or one vLLM data-parallel server."""
    cpus, _ = job_cpus(environ)
    pin = bool(granted_gpus(environ)[0])  # fake or unknown GPUs: nothing to pin
    if layout.data > 1 and config["classify"]["data_parallel_backend"] == "servers":
        per_copy = max(1, cpus // layout.data)
        return [ServerCopy(i, group if pin else (), layout.tensor, 1, per_copy,
                           api_server_count(config, per_copy), copy_log_path(log_path, i, layout.data))
                for i, group in enumerate(layout.groups())]
    return [ServerCopy(0, layout.gpus if pin else (), layout.tensor, layout.data, cpus,
                       api_server_count(config, cpus), Path(log_path))]


def server_environment(api_key: str, copy: ServerCopy, environ=os.environ) -> dict[str, str]:
    """The server's environment: the per-job key, its GPUs, and media decoding sized to its CPUs.

    vLLM decodes videos in a thread pool of VLLM_MEDIA_LOADING_THREAD_COUNT (default 8) per API
    server process whatever the job was granted; on a shared node that oversubscribes a small
    allocation or idles a large one. A value the user set is kept.
    """
    env = {**environ, "VLLM_API_KEY": api_key}
    if copy.gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(copy.gpus)
    if "VLLM_MEDIA_LOADING_THREAD_COUNT" not in environ:
        env["VLLM_MEDIA_LOADING_THREAD_COUNT"] = str(copy.media_threads)
    return env


def single_copy(config: dict, log_path: str | Path, environ=os.environ) -> ServerCopy:
    """The one server of a job whose layout is not known yet (its largest request unknown)."""
    return server_copies(config, choose_layout(config, config["classify"]["max_model_len"], environ),
                         log_path, environ)[0]


# Fields of the server command that each job chooses for the GPUs and CPUs it was granted. They do
# not decide an answer, so the command a record is tied to (``answer_settings``) leaves them out:
# a resumed shard on another node reuses its answers.
PER_JOB_FIELDS = ("port", "tensor_parallel_size", "data_parallel_size", "api_server_count", "max_num_seqs")


def build_command(config: dict, port: int, copy: ServerCopy) -> list[str]:
    """The server argv from ``classify.server_command`` (values shell-quoted, then split), followed
    by ``classify.server_args``."""
    return _fill_command(config, {"port": port, "tensor_parallel_size": copy.tensor,
                                  "data_parallel_size": copy.data, "api_server_count": copy.api_servers,
                                  "max_num_seqs": config["classify"]["max_num_seqs"]})


def answer_settings(config: dict) -> dict:
    """The server settings an answer depends on: the job's command with the per-job fields left as
    placeholders, or, with ``classify.endpoints``, nothing known before the servers are asked
    (their identity is read at run time and kept in every record)."""
    if config["classify"]["endpoints"]:
        return {"external": True}
    return {"command": _fill_command(config, {f: f"<{f}>" for f in PER_JOB_FIELDS})}


def _fill_command(config: dict, per_job: dict) -> list[str]:
    cls, plan = config["classify"], config["planning"]
    fields = {
        "model": cls["model"], "media_root": allowed_media_path(config),
        "max_model_len": cls["max_model_len"], "max_num_batched_tokens": cls["max_num_batched_tokens"],
        "min_pixels": plan["min_pixels"], "max_pixels": plan["max_pixels"], "fps": plan["fps"],
        "generation_config": cls["generation_config"], **per_job,
    }
    quoted = {k: shlex.quote(str(v)) for k, v in fields.items()}
    try:
        text = cls["server_command"].format(**quoted)
    except (KeyError, IndexError, ValueError) as exc:
        raise ServerError(f"config key 'classify.server_command': cannot fill in {exc!r}; fields are "
                          f"{sorted(fields)} and literal braces must be doubled") from None
    try:
        extra = shlex.split(cls["server_args"])
    except ValueError as exc:
        raise ServerError(f"config key 'classify.server_args': {exc}") from None
    # planning.decode and classify.quantization (vidlabel.serve.decode, vidlabel.serve.quantization).
    try:
        argv = decode.with_backend(shlex.split(text) + extra, decode.backend(config))
        return quantization.with_flag(argv, config)
    except ValueError as exc:
        raise ServerError(str(exc)) from None


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
    """A server process for one job. ``with VLLMServer(config, log_path) as srv: await srv.wait_ready()``."""

    def __init__(self, config: dict, log_path: str | Path, *, copy: ServerCopy | None = None,
                 env: dict | None = None, api_key: str | None = None):
        cls = config["classify"]
        self.config = config
        self.copy = copy or single_copy(config, log_path)
        self.log_path = self.copy.log_path
        self.port = free_port()
        self.api_key = api_key or secrets.token_urlsafe(32)
        self.argv = build_command(config, self.port, self.copy)
        self.model = cls["model"]
        self.startup_timeout_s = float(cls["startup_timeout_s"])
        self.grace_s = float(cls["shutdown_grace_s"])
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
                        self.argv = build_command(self.config, self.port, self.copy)
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

    def __init__(self, config: dict, copies: list[ServerCopy]):
        key = secrets.token_urlsafe(32)
        self.servers = [VLLMServer(config, c.log_path, copy=c, api_key=key) for c in copies]

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
