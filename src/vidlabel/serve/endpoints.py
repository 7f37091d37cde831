"""The servers a job sends to and their health: which one gets the next request, which are down.

One mechanism for the job's own servers (one per model copy) and for external ``classify.endpoints``:

- every endpoint's ``/health`` is probed every ``classify.health_interval_s`` (``GET /models`` with
  the key where a server has no ``/health``);
- a failed probe, or a request that could not connect, makes it *suspect*: it gets no new request
  while a healthy endpoint is left, and is probed again every SUSPECT_PROBE_S;
- FAILURES_BEFORE_DOWN failed probes in a row mark it *down*, and so does its process exiting (the
  own server's watchdog, at once). Its requests in flight are cut and retried on the others. A down
  external endpoint is still probed and comes back when it answers; an exited server does not;
- when no endpoint is left, ``on_all_down`` stops the job (the journal keeps what finished).

A dead endpoint is thus noticed within about 2 x SUSPECT_PROBE_S of the first refused connection.
Requests go to the healthy endpoint with the fewest outstanding requests.

The job's own servers (``owned``) are judged by their process (the watchdog) and by refused
connections, not by a slow probe: vLLM's ``/health`` runs on the API server's event loop and can take
tens of seconds under heavy preprocessing. For them a probe that times out means busy.

``identify()`` probes each endpoint's identity once (vidlabel.serve.probe: its version, model, reported
settings and calibration videos); every record names the server that answered it and its fingerprint.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import Callable

import aiohttp
import httpx
from yarl import URL

from vidlabel.serve.probe import Calibration, ServerIdentity, identify
from vidlabel.serve.server import BROKEN_SMOKE_TRIES, ServerBroken, ServerBusy, ServerError, smoke_request
from vidlabel.serve.settings import ServeSettings

log = logging.getLogger(__name__)

FAILURES_BEFORE_DOWN = 3
SMOKE_TRIES = 5  # an external endpoint's smoke request is asked again this often while it is busy
SUSPECT_PROBE_S = 1.0
PROBE_TIMEOUT_S = 5.0
UP, SUSPECT, DOWN = "up", "suspect", "down"


class NoLiveEndpoint(RuntimeError):
    """Every endpoint is down."""


def describe(exc: BaseException) -> str:
    """A connection error in words, with its cause (a refused connection is not a timeout)."""
    cause = getattr(exc, "os_error", None) or exc.__cause__
    text = f"{type(exc).__name__}: {exc}".rstrip(": ")
    if cause is not None and str(cause) not in text:
        text += f" ({type(cause).__name__}: {cause})"
    return text


class Endpoint:
    def __init__(self, index: int, base_url: str, api_key: str, owned: bool = False):
        self.index = index
        self.owned = owned
        self.identity: ServerIdentity | None = None
        self.base_url = base_url.rstrip("/")
        root = self.base_url[: -len("/v1")] if self.base_url.endswith("/v1") else self.base_url
        self.chat_url = URL(self.base_url + "/chat/completions")
        self.metrics_url = root + "/metrics"
        self.version_url = root + "/version"
        self.server_info_url = root + "/server_info?config_format=json"
        self.models_url = self.base_url + "/models"
        self.probe_url = root + "/health"
        self.headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
        self.outstanding = 0
        self.sent = 0
        self.state = UP
        self.failures = 0
        self.reason = ""
        self.final = False  # its server process is gone: never probed again
        self.next_probe = 0.0

    @property
    def healthy(self) -> bool:
        return self.state == UP


class Endpoints:
    """The endpoints of one client; ``watch()`` probes them until cancelled."""

    def __init__(self, endpoints: list[tuple[str, str]], interval_s: float,
                 on_down: Callable[[Endpoint], None], on_all_down: Callable[[str], None], owned: bool = False):
        if not endpoints:
            raise ValueError("at least one endpoint is needed")
        self.all = [Endpoint(i, url, key, owned) for i, (url, key) in enumerate(endpoints)]
        self.interval_s = interval_s
        self.on_down = on_down
        self.on_all_down = on_all_down
        self.lost = False
        self._rr = 0
        self._wake = asyncio.Event()
        for ep in self.all:
            ep.next_probe = time.monotonic() + interval_s

    def pick(self) -> Endpoint:
        """The healthy endpoint with the fewest outstanding requests (a suspect one if none is healthy)."""
        if len(self.all) == 1 and self.all[0].state != DOWN:
            return self.all[0]
        live = [ep for ep in self.all if ep.state == UP] or [ep for ep in self.all if ep.state == SUSPECT]
        if not live:
            raise NoLiveEndpoint(self.summary())
        low = min(ep.outstanding for ep in live)
        ties = [ep for ep in live if ep.outstanding == low]
        self._rr += 1
        return ties[self._rr % len(ties)]

    def summary(self) -> str:
        return "; ".join(ep.reason for ep in self.all if ep.state == DOWN) or "no endpoint is down"

    def unreachable(self, ep: Endpoint, detail: str) -> None:
        """A request could not connect to ``ep``: suspect it and probe it now (once: the requests
        refused together are one piece of evidence, the probes count the failures)."""
        if ep.state == UP:
            log.warning("%s: a request could not connect (%s); checking its health", ep.base_url, detail)
            ep.state = SUSPECT
            ep.next_probe = time.monotonic()
            self._wake.set()

    def mark_down(self, index: int, reason: str, final: bool = False) -> None:
        ep = self.all[index]
        ep.final = ep.final or final
        if ep.state == DOWN:
            ep.reason = reason if final else ep.reason
            return
        ep.state = DOWN
        ep.reason = reason
        ep.next_probe = time.monotonic() + self.interval_s
        log.error("endpoint %s is down: %s", ep.base_url, reason)
        self.on_down(ep)
        if not self.lost and all(e.state == DOWN for e in self.all):
            self.lost = True
            self.on_all_down(self.summary())

    async def _probe(self, session: aiohttp.ClientSession, ep: Endpoint) -> None:
        try:
            async with session.get(ep.probe_url, headers=ep.headers) as resp:
                await resp.read()
                status = resp.status
            detail = f"HTTP {status}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            if ep.owned and isinstance(exc, (asyncio.TimeoutError, aiohttp.ServerTimeoutError)):
                # Busy, not dead: its process is watched, and a refused connection still counts.
                ep.next_probe = time.monotonic() + self.interval_s
                return
            status, detail = None, describe(exc)
        if ep.final:
            return
        if status == 404 and ep.probe_url.endswith("/health"):
            ep.probe_url = ep.base_url + "/models"  # a server without /health
            ep.next_probe = time.monotonic()
            return
        if status == 200:
            ep.failures = 0
            ep.next_probe = time.monotonic() + self.interval_s
            if ep.state != UP:
                log.warning("endpoint %s answers its health check again", ep.base_url)
                ep.state = UP
            return
        ep.failures += 1
        what = f"{ep.probe_url.rsplit('/', 1)[-1]} failed {ep.failures} times in a row (last: {detail})"
        if ep.state == DOWN:
            ep.next_probe = time.monotonic() + self.interval_s
        elif ep.failures >= FAILURES_BEFORE_DOWN:
            self.mark_down(ep.index, f"{ep.base_url}: /{what}")
        else:
            if ep.state == UP:
                log.warning("endpoint %s: /%s; no new requests until it recovers", ep.base_url, what)
            ep.state = SUSPECT
            ep.next_probe = time.monotonic() + min(SUSPECT_PROBE_S, self.interval_s)

    async def identify(self, session: aiohttp.ClientSession, model: str,
                       calibration: Calibration | None = None) -> None:
        """Set the ``identity`` of every endpoint not down (vidlabel.serve.probe), with the calibration
        videos if given."""
        live = [ep for ep in self.all if ep.state != DOWN]
        found = await asyncio.gather(*(identify(session, ep, model, calibration) for ep in live))
        for ep, identity in zip(live, found):
            ep.identity = identity

    async def watch(self) -> None:
        timeout = aiohttp.ClientTimeout(total=max(1.0, min(PROBE_TIMEOUT_S, self.interval_s)))
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                self._wake.clear()
                now = time.monotonic()
                due = [ep for ep in self.all if not ep.final and ep.next_probe <= now]
                if due:
                    await asyncio.gather(*(self._probe(session, ep) for ep in due))
                waits = [ep.next_probe for ep in self.all if not ep.final]
                if not waits:
                    return
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), max(0.01, min(waits) - time.monotonic()))


async def external_endpoints(settings: ServeSettings) -> tuple[list[tuple[str, str]], dict[int, tuple[str, bool]]]:
    """The endpoints and, by index, why those that failed their smoke request are down and whether for
    good (ServerError when all did; FatalClientError when one refused the key)."""
    key = os.environ.get(settings.api_key_env, "")
    if not key:
        log.warning("environment variable %s is empty: sending requests without an API key", settings.api_key_env)
    endpoints = [(url, key or "none") for url in settings.endpoints]
    down: dict[int, tuple[str, bool]] = {}  # index -> (why, for good: broken rather than busy or away)
    async with httpx.AsyncClient(timeout=60.0) as http:
        for i, (url, k) in enumerate(endpoints):
            broken = 0
            for attempt in range(1, SMOKE_TRIES + 1):
                try:
                    await smoke_request(http, url, {"Authorization": f"Bearer {k}"}, settings.model)
                    break
                except ServerError as exc:
                    broken += isinstance(exc, ServerBroken)
                    again = isinstance(exc, ServerBusy) or (isinstance(exc, ServerBroken)
                                                            and broken < BROKEN_SMOKE_TRIES)
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
