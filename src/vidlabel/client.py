"""Asynchronous classification client: one chat completion per manifest row, typed errors, retries.

- Bounded concurrency (a limit that adaptive concurrency may move); the per-attempt deadline starts
  when the request holds a slot, so waiting for a slot never times a request out.
- Every outcome becomes one record (see docs/outputs.md, labels): ``status`` ok | error and, for
  errors, an ``error_kind``. Errors are classified by HTTP status *and* message: vLLM answers a
  missing media file with a 500 "[Errno 2] No such file or directory", which is permanent.
- Transient errors (503, other 5xx, connection resets, timeouts) are retried with exponential backoff
  and full jitter, honouring Retry-After; a 503 also closes a gate shared by all requests, so that
  an overloaded server sees the whole client slow down rather than every request hammering it.
- The openai library's own retries are off (``max_retries=0``): these are the only retries.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Coroutine, TypeVar

import httpx
import openai
from openai._models import FinalRequestOptions

try:  # the installed openai (3.x) is built on httpx2; older releases on httpx
    import httpx2 as _openai_httpx
except ImportError:  # pragma: no cover
    _openai_httpx = httpx

from vidlabel.prompt import parse_answers, response_format

log = logging.getLogger(__name__)

T = TypeVar("T")

# Kinds that will not change on a retry: recorded once, terminal.
PERMANENT_KINDS = frozenset({"too_long", "encoder_cache", "bad_media", "invalid_output", "truncated"})
# Kinds that may succeed later: retried here, and by a later run once this run's attempts are spent.
TRANSIENT_KINDS = frozenset({"timeout", "server_overloaded", "server_error", "connection"})
ERROR_KINDS = PERMANENT_KINDS | TRANSIENT_KINDS

TRUNCATION_TOKEN_FACTOR = 4  # the one retry of a truncated answer gets this many times max_tokens
MAX_RETRY_AFTER_S = 600.0  # a longer Retry-After is treated as this

_BAD_MEDIA = re.compile(
    r"no such file or directory|errno 2\b|must be a subpath of|cannot open video|failed to (?:load|open|decode)"
    r"|could not (?:open|decode|read)|invalid (?:video|media)|unsupported (?:video|media)|not a video",
    re.IGNORECASE)
_TOO_LONG = re.compile(r"maximum context length|exceeds model's maximum context|input length .* exceeds"
                       r"|prompt is too long|too many (?:input )?tokens", re.IGNORECASE)
_ENCODER_CACHE = re.compile(r"encoder cache", re.IGNORECASE)


class FatalClientError(RuntimeError):
    """An error that every request would hit (bad API key, unknown model): stop the job, not the request."""


class Stopped(Exception):
    """The client was told to stop (job SIGTERM or server watchdog) while the request was running."""


def classify_error(http_status: int | None, message: str) -> tuple[str, bool]:
    """(error_kind, transient) from the HTTP status and the error message together."""
    msg = message or ""
    if _ENCODER_CACHE.search(msg):
        return "encoder_cache", False
    if _TOO_LONG.search(msg) and (http_status is None or http_status < 500):
        return "too_long", False
    if _BAD_MEDIA.search(msg):
        return "bad_media", False  # includes vLLM's 500 for a missing file
    if http_status is None:
        return "connection", True
    if http_status in (503, 429):
        return "server_overloaded", True
    if http_status in (408, 504):
        return "timeout", True
    if http_status >= 500:
        return "server_error", True
    return "server_error", False  # another 4xx: the request itself is refused; retrying will not help


def error_message(exc: openai.APIStatusError) -> str:
    body = exc.body
    if isinstance(body, dict):
        msg = body.get("message") or body.get("error")
        if isinstance(msg, dict):
            msg = msg.get("message")
        if msg:
            return str(msg)
    return str(exc.message)


def retry_after_s(headers) -> float | None:
    """Seconds from a Retry-After (or retry-after-ms) header; None when absent or unparsable."""
    if headers is None:
        return None
    try:
        ms = headers.get("retry-after-ms")
        if ms is not None:
            return max(0.0, float(ms) / 1000)
        value = headers.get("retry-after")
        if value is not None:
            return max(0.0, float(value))
    except (TypeError, ValueError):
        pass
    return None


@dataclass
class ClientSettings:
    model: str
    questions: list[dict[str, Any]]
    concurrency: int = 16
    max_tokens: int = 512
    temperature: float = 0.0
    request_timeout_s: float = 900.0
    max_attempts: int = 6
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 60.0
    adaptive: bool = False
    adaptive_floor: int = 4
    adaptive_ceiling: int = 64
    adaptive_interval_s: float = 2.0

    @classmethod
    def from_config(cls, config: dict) -> "ClientSettings":
        c = config["classify"]
        ad = c["adaptive_concurrency"]
        return cls(model=c["model"], questions=c["questions"], concurrency=c["concurrency"],
                   max_tokens=c["max_tokens"], temperature=c["temperature"],
                   request_timeout_s=c["request_timeout_s"], max_attempts=c["max_attempts"],
                   backoff_initial_s=c["backoff_initial_s"], backoff_max_s=c["backoff_max_s"],
                   adaptive=ad["enabled"], adaptive_floor=ad["floor"], adaptive_ceiling=ad["ceiling"])


class Limiter:
    """A semaphore whose limit can move while requests are in flight (adaptive concurrency)."""

    def __init__(self, limit: int):
        self.limit = max(1, int(limit))
        self.in_flight = 0
        self._cond = asyncio.Condition()

    async def acquire(self) -> None:
        async with self._cond:
            while self.in_flight >= self.limit:
                await self._cond.wait()
            self.in_flight += 1

    async def release(self) -> None:
        async with self._cond:
            self.in_flight -= 1
            self._cond.notify()

    async def set_limit(self, limit: int) -> None:
        async with self._cond:
            grow = limit - self.limit
            self.limit = max(1, int(limit))
            if grow > 0:
                self._cond.notify(grow)


class BackoffGate:
    """Shared by every request: after a 503 nobody sends until the gate reopens.

    Each 503 in a row doubles the closing time (with jitter, capped); a success halves the level.
    """

    def __init__(self, initial_s: float, max_s: float):
        self.initial_s = initial_s
        self.max_s = max_s
        self.level = 0
        self.open_at = 0.0
        self.closed_at = 0.0

    def overloaded(self, sent_at: float, retry_after: float | None) -> None:
        """A 503 for a request sent at ``sent_at`` (monotonic). Requests sent before the gate last
        closed belong to the same wave and do not close it further."""
        now = time.monotonic()
        if sent_at >= self.closed_at:
            self.level = min(self.level + 1, 30)
            self.closed_at = now
        cap = min(self.max_s, self.initial_s * 2 ** (self.level - 1))
        delay = retry_after if retry_after is not None else random.uniform(cap / 2, cap)
        self.open_at = max(self.open_at, now + min(delay, MAX_RETRY_AFTER_S))

    def succeeded(self) -> None:
        self.level = max(0, self.level - 1) if self.level < 4 else self.level // 2

    async def wait(self) -> None:
        while (delay := self.open_at - time.monotonic()) > 0:
            await asyncio.sleep(delay)


@dataclass
class Endpoint:
    base_url: str
    api_key: str
    client: openai.AsyncOpenAI
    outstanding: int = 0
    sent: int = 0

    @property
    def metrics_url(self) -> str:
        root = self.base_url.rstrip("/")
        if root.endswith("/v1"):
            root = root[: -len("/v1")]
        return root + "/metrics"


@dataclass
class _Attempt:
    """Outcome of one HTTP attempt."""
    ok: bool
    kind: str | None = None
    transient: bool = False
    http_status: int | None = None
    message: str | None = None
    retry_after: float | None = None
    completion: Any = None


@dataclass
class Stats:
    done: int = 0
    ok: int = 0
    error: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    attempts: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)

    def add(self, rec: dict) -> None:
        self.done += 1
        if rec["status"] == "ok":
            self.ok += 1
        else:
            self.error += 1
            self.by_kind[rec["error_kind"]] = self.by_kind.get(rec["error_kind"], 0) + 1
        self.prompt_tokens += rec.get("prompt_tokens") or 0
        self.completion_tokens += rec.get("completion_tokens") or 0


def parse_metrics(text: str) -> dict[str, float]:
    """Sum of each vLLM metric over its label sets, from Prometheus text format."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0].strip()
        try:
            values[name] = values.get(name, 0.0) + float(value)
        except ValueError:
            continue
    # Older vLLM names the KV metric differently.
    if "vllm:kv_cache_usage_perc" not in values and "vllm:gpu_cache_usage_perc" in values:
        values["vllm:kv_cache_usage_perc"] = values["vllm:gpu_cache_usage_perc"]
    return values


# The openai library sends these telemetry headers with every request; vLLM ignores them and each
# one is normalised and copied by three HTTP layers per request (measured: ~0.15 ms of client CPU
# per request; benchmarks/client_overhead.py).
_TELEMETRY_HEADERS = ("X-Stainless-Lang", "X-Stainless-Package-Version", "X-Stainless-OS", "X-Stainless-Arch",
                      "X-Stainless-Runtime", "X-Stainless-Runtime-Version", "X-Stainless-Async")


CHAT_PATH = "/chat/completions"
_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode


class _AsyncOpenAI(openai.AsyncOpenAI):
    """openai.AsyncOpenAI that builds each chat request from a template the library built.

    The library's request builder parses and merges the URL three times and normalises every
    header through two header classes for each request (measured: ~0.25 ms of client CPU per
    request, a fifth of the total; benchmarks/client_overhead.py). A chat request of ours differs
    from the previous one only in its body and its X-Request-Id, so the library builds the first
    one and the rest reuse its URL, headers and extensions. Anything else (another path, retries,
    files, query parameters, a changed API key, an idempotency header) takes the library's path;
    tests/test_client.py checks that both paths build the same request.
    """

    _chat_template: tuple | None = None  # (key, URL, headers without X-Request-Id, extensions)

    _chat_options: FinalRequestOptions | None = None

    @property
    def user_agent(self) -> str:
        return f"AsyncOpenAI/Python {openai.__version__}"  # the library's, not this subclass's name

    async def post_chat(self, content: bytes, request_id: str) -> Any:
        """``post(CHAT_PATH, content=content, cast_to=httpx.Response)`` with an X-Request-Id header;
        the request options are copied from a template rather than validated anew (measured: ~0.1 ms
        of client CPU per request)."""
        if self._chat_options is None:
            self._chat_options = FinalRequestOptions.construct(method="post", url=CHAT_PATH, content=b"")
        options = self._chat_options.model_copy(update={"content": content, "headers": {
            "X-Request-Id": request_id, "X-Stainless-Retry-Count": openai.Omit()}})
        return await self.request(_openai_httpx.Response, options)

    def _build_request(self, options, *, retries_taken: int = 0):
        headers = options.headers
        if (retries_taken or options.url != CHAT_PATH or options.method != "post"
                or type(options.content) is not bytes or options.json_data is not None
                or options.extra_json is not None or options.files is not None or options.params
                or not isinstance(options.timeout, openai.NotGiven) or not isinstance(headers, dict)
                or self._idempotency_header is not None or getattr(self, "_provider_runtime", None) is not None):
            return super()._build_request(options, retries_taken=retries_taken)
        key = (self.api_key, self.timeout, tuple((k, v if isinstance(v, str) else type(v).__name__)
                                                 for k, v in headers.items() if k != "X-Request-Id"))
        template = self._chat_template
        if template is None or template[0] != key:
            request = super()._build_request(options, retries_taken=retries_taken)
            kept = [(k, v) for k, v in request.headers.raw if k.lower() not in (b"x-request-id", b"content-length")]
            self._chat_template = (key, request.url, kept, request.extensions)
            return request
        _, url, kept, extensions = template
        rid = headers.get("X-Request-Id")
        return _openai_httpx.Request("POST", url, headers=kept + [(b"x-request-id", rid.encode())] if rid else kept,
                                     content=options.content, extensions=dict(extensions))


def _make_openai(base_url: str, api_key: str, connections: int) -> openai.AsyncOpenAI:
    # aiohttp under the openai client: measured at half the client CPU per request of the default
    # httpx transport. Keep-alive for every connection, so that no request pays a new connection.
    http_client = openai.DefaultAioHttpClient(
        limits=_openai_httpx.Limits(max_connections=connections, max_keepalive_connections=connections))
    # timeout=None: the per-attempt deadline is ours (asyncio), so that it can exclude slot waiting.
    return _AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=None,
                        http_client=http_client, default_headers={h: openai.Omit() for h in _TELEMETRY_HEADERS})


if sys.version_info >= (3, 11):
    _deadline = asyncio.timeout  # cancels the request in place
else:  # pragma: no cover
    @contextlib.asynccontextmanager
    async def _deadline(seconds: float):
        """asyncio.timeout for Python 3.10: cancel the current task after ``seconds``."""
        task = asyncio.current_task()
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            task.cancel()

        handle = asyncio.get_running_loop().call_later(seconds, expire)
        try:
            yield
        except asyncio.CancelledError:
            if expired:
                raise asyncio.TimeoutError() from None
            raise
        finally:
            handle.cancel()


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on uvloop's event loop when uvloop is installed (the ``speed`` extra: about
    0.1 ms less client CPU per request), else on asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


class ClassifyClient:
    """Sends manifest rows to one or more OpenAI-compatible endpoints; ``await classify(row)`` → record."""

    def __init__(self, endpoints: list[tuple[str, str]], settings: ClientSettings,
                 stop_event: asyncio.Event | None = None):
        if not endpoints:
            raise ValueError("at least one endpoint is needed")
        self.settings = settings
        start_limit = settings.adaptive_floor if settings.adaptive else settings.concurrency
        if settings.adaptive:
            start_limit = max(settings.adaptive_floor, min(settings.concurrency, settings.adaptive_ceiling))
        self.limiter = Limiter(start_limit)
        connections = max(settings.concurrency, settings.adaptive_ceiling if settings.adaptive else 0) + 8
        self.endpoints = [Endpoint(url, key, _make_openai(url, key, connections)) for url, key in endpoints]
        self.gate = BackoffGate(settings.backoff_initial_s, settings.backoff_max_s)
        self.stop_event = stop_event or asyncio.Event()
        self.response_format = response_format(settings.questions)
        self._body_head = _dumps({"model": settings.model, "response_format": self.response_format,
                                  "temperature": settings.temperature})[:-1]
        self.fatal: FatalClientError | None = None
        self._rr = 0
        self._adaptive_task: asyncio.Task | None = None
        self.limit_history: list[tuple[float, int]] = []

    @property
    def limit(self) -> int:
        return self.limiter.limit

    async def __aenter__(self) -> "ClassifyClient":
        if self.settings.adaptive:
            self._adaptive_task = asyncio.create_task(self._adapt())
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._adaptive_task is not None:
            self._adaptive_task.cancel()
            with_suppress = asyncio.gather(self._adaptive_task, return_exceptions=True)
            await with_suppress
            self._adaptive_task = None
        for ep in self.endpoints:
            await ep.client.close()

    # ---- endpoint choice ---------------------------------------------------------------------
    def _pick(self) -> Endpoint:
        if len(self.endpoints) == 1:
            return self.endpoints[0]
        low = min(ep.outstanding for ep in self.endpoints)
        ties = [ep for ep in self.endpoints if ep.outstanding == low]
        self._rr += 1
        return ties[self._rr % len(ties)]

    # ---- one request ------------------------------------------------------------------------
    def _messages(self, row: dict) -> list[dict]:
        return [{"role": "user", "content": [
            # as_uri() percent-encodes spaces, quotes and non-ASCII; vLLM decodes with url2pathname.
            {"type": "video_url", "video_url": {"url": Path(row["media_path"]).as_uri()}},
            {"type": "text", "text": row["prompt"]},
        ]}]

    def _body(self, row: dict, max_tokens: int) -> bytes:
        """The chat request body, encoded as the library would (UTF-8, compact); the parts that are
        the same for every request (model, schema, temperature) are encoded once."""
        return (f'{self._body_head},"max_tokens":{int(max_tokens)},"messages":'
                f'{_dumps(self._messages(row))}}}').encode()

    async def _attempt(self, row: dict, max_tokens: int) -> _Attempt:
        ep = self._pick()
        ep.outstanding += 1
        ep.sent += 1
        try:
            # The low-level call (client.post, here post_chat) sends our body as is and hands back
            # the HTTP response: the typed chat.completions.create() walks every message through the
            # library's param transformer and builds pydantic models (measured: 2.2 ms of client
            # CPU per request against 1.3 ms with client.post, 0.9 ms with post_chat;
            # benchmarks/client_overhead.py). Errors are still raised as openai's APIStatusError /
            # APIConnectionError; its retries are off. _deadline rather than asyncio.wait_for: no
            # extra task per request.
            async with _deadline(self.settings.request_timeout_s):
                response = await ep.client.post_chat(self._body(row, max_tokens), row["request_id"])
        except asyncio.TimeoutError:
            return _Attempt(False, "timeout", True, None,
                            f"no answer within {self.settings.request_timeout_s:g} s (classify.request_timeout_s)")
        except openai.APIStatusError as exc:
            status = exc.status_code
            message = error_message(exc)
            if status in (401, 403) or (status == 404 and "model" in message.lower()):
                self.fatal = FatalClientError(f"{ep.base_url} answered {status}: {message}")
                raise self.fatal from None
            kind, transient = classify_error(status, message)
            return _Attempt(False, kind, transient, status, message,
                            retry_after_s(getattr(exc.response, "headers", None)))
        except openai.APITimeoutError as exc:
            return _Attempt(False, "timeout", True, None, str(exc))
        except openai.APIConnectionError as exc:
            cause = exc.__cause__ or exc.__context__
            detail = f"{exc.message} ({type(cause).__name__}: {cause})" if cause else exc.message
            return _Attempt(False, "connection", True, None, detail)
        finally:
            ep.outstanding -= 1
        try:
            completion = response.json()
            if not isinstance(completion["choices"][0]["message"], dict):
                raise TypeError("choices[0].message is not an object")
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            return _Attempt(False, "invalid_output", False, response.status_code,
                            f"unreadable response body ({type(exc).__name__}: {exc}): {response.text[:200]}")
        return _Attempt(True, completion=completion)

    async def _sleep_or_stop(self, delay: float) -> None:
        if delay <= 0:
            return
        try:
            await asyncio.wait_for(self.stop_event.wait(), timeout=delay)
        except asyncio.TimeoutError:
            return
        raise Stopped()

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        cap = min(self.settings.backoff_max_s, self.settings.backoff_initial_s * 2 ** (attempt - 1))
        delay = random.uniform(0, cap)
        if retry_after is not None:
            delay = max(delay, min(retry_after, MAX_RETRY_AFTER_S))
        return delay

    async def classify(self, row: dict) -> dict:
        """Run one manifest row to a record (retries included). Raises Stopped or FatalClientError."""
        s = self.settings
        await self.limiter.acquire()
        try:
            return await self._classify_holding_slot(row, s)
        finally:
            await self.limiter.release()

    async def _classify_holding_slot(self, row: dict, s: ClientSettings) -> dict:
        rec: dict[str, Any] = {
            "request_id": row["request_id"], "post_id": row["post_id"], "status": "error",
            "error_kind": None, "error": None, "http_status": None, "attempts": 0, "latency_s": None,
            "started_at": None, "finished_at": None, "finish_reason": None, "prompt_tokens": None,
            "completion_tokens": None, "est_prompt_tokens": row.get("est_prompt_tokens"),
            "raw_text": None, "answers": None, "retryable": False,
        }
        max_tokens = s.max_tokens
        truncation_retried = False
        transient_attempts = 0
        while True:
            if self.stop_event.is_set():
                raise Stopped()
            await self.gate.wait()
            if self.stop_event.is_set():
                raise Stopped()
            t0 = time.time()
            sent_mono = time.monotonic()
            if rec["started_at"] is None:
                rec["started_at"] = t0
            rec["attempts"] += 1
            outcome = await self._attempt(row, max_tokens)
            t1 = time.time()
            rec["latency_s"] = t1 - t0
            rec["finished_at"] = t1
            if outcome.ok:
                self.gate.succeeded()
                done = self._fill_from_completion(rec, outcome.completion)
                if done or truncation_retried:
                    return rec
                truncation_retried = True
                max_tokens = s.max_tokens * TRUNCATION_TOKEN_FACTOR
                continue
            rec.update(error_kind=outcome.kind, error=outcome.message, http_status=outcome.http_status,
                       raw_text=None, answers=None, finish_reason=None)
            if not outcome.transient:
                return rec
            if self.stop_event.is_set():
                raise Stopped()  # the server is going away: this error says nothing about the request
            if outcome.kind == "server_overloaded":
                self.gate.overloaded(sent_mono, outcome.retry_after)
            transient_attempts += 1
            if transient_attempts >= s.max_attempts:
                rec["retryable"] = True
                rec["error"] = f"{outcome.message} (gave up after {transient_attempts} attempts)"
                return rec
            await self._sleep_or_stop(self._backoff(transient_attempts, outcome.retry_after))

    def _fill_from_completion(self, rec: dict, completion) -> bool:
        """Record a 200 answer; False when it was truncated and may be retried with more tokens."""
        choice = completion["choices"][0]
        text = (choice.get("message") or {}).get("content") or ""
        usage = completion.get("usage") or {}
        rec.update(http_status=200, finish_reason=choice.get("finish_reason"), raw_text=text,
                   prompt_tokens=usage.get("prompt_tokens"), completion_tokens=usage.get("completion_tokens"))
        if rec["finish_reason"] == "length":
            rec.update(status="error", error_kind="truncated", answers=None,
                       error=f"answer cut at max_tokens ({rec['completion_tokens']} tokens)")
            return False
        try:
            rec["answers"] = parse_answers(text, self.settings.questions)
        except ValueError as exc:
            rec.update(status="error", error_kind="invalid_output", error=str(exc), answers=None)
            return True
        rec.update(status="ok", error_kind=None, error=None)
        return True

    # ---- adaptive concurrency -----------------------------------------------------------------
    async def read_metrics(self, http: httpx.AsyncClient) -> dict[str, float] | None:
        total: dict[str, float] = {}
        for ep in self.endpoints:
            try:
                resp = await http.get(ep.metrics_url, headers={"Authorization": f"Bearer {ep.api_key}"})
                resp.raise_for_status()
            except httpx.HTTPError:
                return None
            for k, v in parse_metrics(resp.text).items():
                total[k] = total.get(k, 0.0) + (v / len(self.endpoints) if k.endswith("_perc") else v)
        return total

    def next_limit(self, limit: int, metrics: dict[str, float], preempted: bool) -> int:
        """Keep a short queue in front of the server: enough that no slot idles, no more.

        Waiting requests hold no KV cache but they count against time-outs and are lost work on a
        kill; preemptions mean the server is over-committed. KV-cache usage is not a signal on its
        own: a full cache with an empty queue is a busy server, not an overloaded one.
        """
        s = self.settings
        waiting = metrics.get("vllm:num_requests_waiting", 0.0)
        target_queue = max(2, limit // 8)
        if preempted:
            new = int(limit * 0.8)
        elif waiting > 2 * target_queue:
            new = limit - max(1, int(waiting - 2 * target_queue) // 2)
        elif waiting < target_queue and self.limiter.in_flight >= limit - 1:
            new = limit + max(1, limit // 8)
        else:
            new = limit
        return max(s.adaptive_floor, min(s.adaptive_ceiling, new))

    async def _adapt(self) -> None:
        last_preemptions = None
        async with httpx.AsyncClient(timeout=5.0) as http:
            while True:
                await asyncio.sleep(self.settings.adaptive_interval_s)
                metrics = await self.read_metrics(http)
                if metrics is None:
                    continue
                pre = metrics.get("vllm:num_preemptions_total", 0.0)
                preempted = last_preemptions is not None and pre > last_preemptions
                last_preemptions = pre
                new = self.next_limit(self.limiter.limit, metrics, preempted)
                if new != self.limiter.limit:
                    log.debug("adaptive concurrency %d -> %d (metrics %s)", self.limiter.limit, new, metrics)
                    await self.limiter.set_limit(new)
                self.limit_history.append((time.monotonic(), new))
