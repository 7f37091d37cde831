"""Stand-in for a vLLM OpenAI-compatible server, for tests and benchmarks (no GPU, no model).

Launched by the classify job through the same ``classify.server_command`` template as ``vllm serve``.
It behaves like vLLM 0.26 where the client can tell the difference:

- reads the API key from ``VLLM_API_KEY``; ``/v1/*`` without ``Authorization: Bearer <key>`` → 401
  ``{"error":"Unauthorized"}``; ``/health`` and ``/metrics`` are open;
- ``file://`` media outside ``--allowed-local-media-path`` → 400 "... must be a subpath of ...";
  a missing file → 500 "[Errno 2] No such file or directory";
- images (``image_url``) and videos (``video_url``) in the message's order; more of a kind than
  ``--limit-mm-per-prompt`` allows → 400 "At most N image(s) may be provided in one prompt."; with
  ``--video-tokens qwen`` images count as vLLM counts them (``qwen_image.py``: the stored size,
  smart_resize within the image bounds of ``--mm-processor-kwargs``, + 2 markers per image);
- a prompt longer than ``--max-model-len`` → 400 "This model's maximum context length is ...";
- from ``--standin-version 0.33``: a request whose decoded media (sampled frames at the file's size x 3
  bytes, photos x 4, audio as float32) exceed ``VLLM_MAX_MEDIA_REQUEST_DECODE_BYTES`` of its environment
  (else ``--decode-bytes-default``) → 400 "Request decoded media exceeds
  VLLM_MAX_MEDIA_REQUEST_DECODE_BYTES=N (M bytes).";
  an item (video or image) of more tokens than the encoder cache (sized as vLLM sizes it, ``qwen_image.py``)
  → 400 "The decoder prompt contains a(n) image item with N embedding tokens, which exceeds the
  pre-allocated encoder cache size M. ...";
- ``max_tokens`` caps the output: a longer answer is cut and ``finish_reason`` is ``length``;
- a capacity model: ``--slots`` running requests, a waiting queue, service time proportional to the
  prompt and output tokens, 503 "The engine is currently busy ..." above ``--max-queued`` waiting;
- ``/metrics`` in Prometheus text with vLLM's metric names, the info gauge ``vllm:cache_config_info``
  included; ``/server_info`` (the engine's config) only with VLLM_SERVER_DEV_MODE=1, as vLLM;
- vidlabel's calibration requests (``X-Request-Id: calibrate-...``) are served like any other, but no
  fault hits them and they count for none (``--crash-after``, ``--storm-503``, random faults).

Started through ``tests/standin/bin``'s ``vllm`` (``vllm_shim``), it takes vLLM's own command line
(the default ``classify.server_command``): unknown flags are refused as vLLM's parser would, and
``--video-tokens qwen`` counts video tokens by vLLM's Qwen2.5-VL rule on the real file
(``qwen_video.py``: frames at ``--media-io-kwargs`` fps, ``--mm-processor-kwargs`` pixel bounds) with
vLLM's encoder cache (max of ``--max-num-batched-tokens``, default 8192, and the profiler's largest
item). An empty or non-video file → 400 "Could not open video stream"; an MP4 cut after its index →
500 "Expected there to be 1 prompt placeholders ...". ``--random-weights`` answers like a model with
random weights under a JSON schema: valid JSON only with
``--structured-outputs-config '{"disable_any_whitespace": true}'``, else whitespace up to max_tokens.

Answers are deterministic: for every question id listed in the prompt (lines ``- qid: ...``) the
answer is "yes" iff a word given by ``--yes-if QID=WORD`` occurs (case-insensitive) inside the
prompt's <caption> or <transcript> block, else "no".

Every request event is appended to ``--request-log`` (JSON lines, flushed): ``received``,
``completed`` (with the HTTP status), ``cancelled`` (the client went away), with the request id from
the ``X-Request-Id`` header and the time.

Faults (for the fault-matrix tests): ``--storm-503 START:COUNT``, ``--random-503 P``, ``--random-500 P``,
``--reset-on WORD[:TIMES]``, ``--reset-rate P``, ``--crash-after N``, ``--never-healthy``,
``--hang-on WORD[:TIMES]``, ``--hang-rate P``, ``--invalid-json-on WORD``, ``--verbose-on WORD=TOKENS``,
``--slow-start S``, ``--fail-all-with STATUS:MESSAGE`` (every chat request, the text-only smoke request
included: a server broken past its start), ``--fail-video STATUS:MESSAGE`` (every request with a video,
while photos and text are answered: a video decoder that fails the posts' videos), ``--drop-video``
(the connection of every request with a video closed mid-answer, while the others are answered),
``--refuse-running-ids`` (vLLM V1 before request ids were
randomised: a second request with the X-Request-Id of one still running gets 400 "Request id chatcmpl-<id>
already running."). A ``--media-io-kwargs`` video ``backend`` whose module this Python cannot import
(``pynvvideocodec``, ``torchcodec``) answers every video request 500 "No module named '<module>'", as vLLM
0.26 does (measured).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import random
import re
import sys
import time
import urllib.parse
import urllib.request
from collections import defaultdict

import qwen_image  # beside this script
import qwen_video
import served
from aiohttp import web

VLLM_DEFAULT_BATCHED_TOKENS = 8192  # vLLM's API-server default on H100/H200
CALIBRATION_PREFIX = "calibrate-"  # X-Request-Id of vidlabel's calibration requests (vidlabel.serve.probe)
_QUESTION_LINE = re.compile(r"^\s*-\s*([a-z][a-z0-9_]*)\s*:", re.MULTILINE)
_BLOCKS = re.compile(r"<(caption|transcript)>(.*?)</\1>", re.DOTALL | re.IGNORECASE)


def _word_times(spec: str) -> tuple[str, int]:
    """'WORD' or 'WORD:TIMES' (TIMES attempts of each matching request are affected; 0 = always)."""
    word, _, times = spec.partition(":")
    return word.lower(), int(times) if times else 0


def request_of(send_id: str | None) -> str | None:
    """The request id of a send: vidlabel sends ``<request id>-<job token>-<send number>`` (the request id
    is 24 hex digits; older versions sent ``<request id>-<send number>``)."""
    if send_id is None:
        return None
    head = send_id.split("-", 1)[0]
    return head if len(head) == 24 and send_id.rpartition("-")[2].isdigit() else send_id


# vLLM 0.26's video backends (multimodal/video.py) and the module each imports.
VIDEO_BACKEND_MODULES = {"pynvvideocodec": "PyNvVideoCodec", "torchcodec": "torchcodec"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--allowed-local-media-path", required=True)
    p.add_argument("--served-model", "--served-model-name", dest="served_model", default="standin-model")
    p.add_argument("--request-log", default=None, help="JSON-lines file of request events")
    p.add_argument("--control", type=json.loads, default=None, metavar="JSON",
                   help='{"request_log": PATH, "faults_file": PATH}: the two as one argument that names no file, '
                        "so that a job's server command stays the same while the test changes them (vidlabel "
                        "identifies every file-valued server argument by its content)")
    p.add_argument("--yes-if", action="append", default=[], metavar="QID=WORD")
    p.add_argument("--standin-version", default="0.26.0", help="what /version answers")
    p.add_argument("--decode-bytes-default", type=int, default=715827880,
                   help="from version 0.33: the per-request cap on decoded media where the environment sets no "
                        "VLLM_MAX_MEDIA_REQUEST_DECODE_BYTES (vLLM's default; smaller to reach it with small "
                        "test media)")
    p.add_argument("--answer-confidence", type=float, default=0.9,
                   help="probability the log-probabilities give the chosen answer")
    p.add_argument("--model-root", default=None, help="the model folder /v1/models names (default: the name)")
    p.add_argument("--standin-model-type", default=None,
                   help="the config.json model_type to serve as (default: the model folder's, else the name's; "
                        "served.py)")
    # Token accounting.
    p.add_argument("--video-tokens", choices=["bytes", "qwen"], default="qwen",
                   help="qwen: vLLM's rule (the default); bytes: file size / --bytes-per-video-token for the posts "
                        "(a cheap synthetic load; the calibration media are still counted by vLLM's rule)")
    p.add_argument("--bytes-per-video-token", type=float, default=64.0)
    p.add_argument("--chars-per-text-token", type=float, default=4.0)
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument("--encoder-cache-tokens", type=int, default=0, help="0 = no encoder-cache limit")
    # Capacity model.
    p.add_argument("--slots", type=int, default=0, help="running requests at most; 0 = unlimited, no queue")
    p.add_argument("--max-queued", type=int, default=-1, help="waiting requests at most (-1 = unbounded); over it: 503")
    p.add_argument("--kv-capacity-tokens", type=int, default=0, help="0 = unlimited KV cache")
    p.add_argument("--latency", type=float, default=0.0, help="fixed seconds per request")
    p.add_argument("--prefill-tokens-per-s", type=float, default=0.0, help="0 = prefill is free")
    p.add_argument("--decode-tokens-per-s", type=float, default=0.0, help="0 = decode is free")
    p.add_argument("--seed", type=int, default=0)
    # Faults.
    p.add_argument("--storm-503", default=None, metavar="START:COUNT",
                   help="chat requests number START+1 .. START+COUNT answer 503")
    p.add_argument("--retry-after", type=float, default=None, help="Retry-After header on 503s")
    p.add_argument("--random-503", type=float, default=0.0, metavar="P",
                   help="of requests with a video: 503 at once, whatever the load (a proxy's)")
    p.add_argument("--random-500", type=float, default=0.0, metavar="P", help="of requests with a video")
    p.add_argument("--reset-on", action="append", default=[], metavar="WORD[:TIMES]",
                   help="reset the connection mid-response for prompts containing WORD")
    p.add_argument("--reset-rate", type=float, default=0.0, metavar="P")
    p.add_argument("--crash-after", type=int, default=0, metavar="N",
                   help="exit when chat request N+1 arrives")
    p.add_argument("--never-healthy", action="store_true")
    p.add_argument("--health-error", action="store_true",
                   help="/health answers 500 Internal Server Error (an exception in its check, not a dead engine)")
    p.add_argument("--unhealthy-after", type=int, default=0, metavar="N",
                   help="/health answers 503 once N chat requests completed (engine dead, HTTP alive)")
    p.add_argument("--hang-on", action="append", default=[], metavar="WORD[:TIMES]",
                   help="never answer prompts containing WORD (until the client goes away)")
    p.add_argument("--hang-rate", type=float, default=0.0, metavar="P",
                   help="of requests with a video: never answered (until the client goes away)")
    p.add_argument("--invalid-json-on", action="append", default=[], metavar="WORD")
    p.add_argument("--error-on", action="append", default=[], metavar="WORD=STATUS:MESSAGE",
                   help="every attempt of prompts containing WORD answers STATUS with MESSAGE")
    p.add_argument("--error-latency", type=float, default=0.0, metavar="S",
                   help="seconds before an --error-on answer (no slot taken)")
    p.add_argument("--verbose-on", action="append", default=[], metavar="WORD=TOKENS",
                   help="the answer to prompts containing WORD needs TOKENS output tokens")
    p.add_argument("--fail-all-with", default=None, metavar="STATUS:MESSAGE",
                   help="every chat request, the smoke request included, answers STATUS with MESSAGE")
    p.add_argument("--fail-video", default=None, metavar="STATUS:MESSAGE",
                   help="every request with a video answers STATUS with MESSAGE once its videos are loaded; "
                        "photos and text are answered")
    p.add_argument("--drop-video", action="store_true",
                   help="the connection of every request with a video is closed mid-answer; the others are answered")
    p.add_argument("--refuse-running-ids", action="store_true",
                   help="400 'Request id ... already running.' for an X-Request-Id still running (vLLM V1 "
                        "before request ids were randomised)")
    p.add_argument("--slow-start", type=float, default=0.0, metavar="S")
    p.add_argument("--slow-health", type=float, default=0.0, metavar="S",
                   help="/health answers after S seconds (an API server busy preprocessing)")
    p.add_argument("--media-invisible-after", type=int, default=-1, metavar="N",
                   help="after N answered video requests, every file is missing here (another mount, an NFS "
                        "outage): 500 [Errno 2] No such file or directory; 0 = from the start")
    p.add_argument("--random-weights", action="store_true",
                   help="answer like random weights: random yes/no, whitespace runaways without the vLLM flag")
    # vLLM's own flags (those vidlabel's default command uses, and a few common ones).
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--data-parallel-size", type=int, default=1)
    p.add_argument("--limit-mm-per-prompt", type=json.loads, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--mm-encoder-tp-mode", choices=["weights", "data"], default="weights")
    p.add_argument("--mm-processor-kwargs", type=json.loads, default={})
    p.add_argument("--media-io-kwargs", type=json.loads, default={})
    p.add_argument("--structured-outputs-config", type=json.loads, default={})
    p.add_argument("--generation-config", default="auto")
    p.add_argument("--chat-template", default=None, help="a template file (or the template itself), as vLLM's")
    p.add_argument("--api-server-count", type=int, default=1)
    p.add_argument("--mm-processor-cache-gb", type=float, default=4.0)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--max-logprobs", type=int, default=20)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--quantization", "-q", default=None)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--faults-file", default=None,
                   help="JSON list of further arguments (faults), read at start: a test changes the faults "
                        "between runs while the server command, and so the answers' fingerprint, stays the same")
    args = p.parse_args(argv)
    control = args.control or {}
    faults_file = args.faults_file or control.get("faults_file")
    if faults_file:
        with open(faults_file) as fh:
            extra = json.load(fh)
        args = p.parse_args([*(sys.argv[1:] if argv is None else argv), *map(str, extra)])
    args.request_log = args.request_log or control.get("request_log")
    if args.video_tokens == "qwen" and args.max_num_batched_tokens is None:
        args.max_num_batched_tokens = VLLM_DEFAULT_BATCHED_TOKENS
    return args


class RequestLog:
    def __init__(self, path: str | None):
        self._fh = open(path, "a", buffering=1) if path else None

    def write(self, event: str, request_id: str | None, **fields) -> None:
        if self._fh is None:
            return
        rec = {"event": event, "request_id": request_id, "t": time.time(), "pid": os.getpid(), **fields}
        self._fh.write(json.dumps(rec) + "\n")
        self._fh.flush()


# vLLM 0.26's buckets of its request-time histograms (vllm/v1/metrics/loggers.py, request_latency_buckets).
REQUEST_TIME_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                          240.0, 480.0, 960.0, 1920.0, 7680.0)


class Engine:
    """N running slots and a FIFO waiting queue; the KV cache limits how much prompt can run at once."""

    def __init__(self, args):
        self.slots = args.slots * args.data_parallel_size  # vLLM's data parallel: copies behind one port
        self.max_queued = args.max_queued
        self.kv_capacity = args.kv_capacity_tokens
        self.running = 0
        self.running_tokens = 0
        self.waiting: list[tuple[int, asyncio.Future]] = []
        self.preemptions = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.requests_total = defaultdict(int)
        # vllm:request_queue_time_seconds: each admitted request's time in the waiting queue (vLLM observes
        # it when the request finishes; here at admission, which a run's end reads alike).
        self.queue_time_counts = [0] * len(REQUEST_TIME_BUCKETS_S)
        self.queue_time_sum = 0.0
        self.queue_time_count = 0

    def _queued(self, seconds: float) -> None:
        self.queue_time_sum += seconds
        self.queue_time_count += 1
        for i, bound in enumerate(REQUEST_TIME_BUCKETS_S):
            if seconds <= bound:
                self.queue_time_counts[i] += 1

    def full(self) -> bool:
        return self.slots > 0 and self.max_queued >= 0 and len(self.waiting) >= self.max_queued

    def _fits(self, tokens: int) -> bool:
        if self.slots > 0 and self.running >= self.slots:
            return False
        if self.kv_capacity and self.running and self.running_tokens + tokens > self.kv_capacity:
            return False
        return True

    async def acquire(self, tokens: int) -> None:
        if (self.slots <= 0 and not self.kv_capacity) or (not self.waiting and self._fits(tokens)):
            self.running += 1
            self.running_tokens += tokens
            self._queued(0.0)
            return
        fut = asyncio.get_running_loop().create_future()
        entry = (tokens, fut)
        self.waiting.append(entry)
        queued_at = time.monotonic()
        try:
            await fut
        except asyncio.CancelledError:
            if entry in self.waiting:
                self.waiting.remove(entry)
            elif fut.done() and not fut.cancelled():
                self.release(tokens)  # admitted just as the client went away
            raise
        self._queued(time.monotonic() - queued_at)

    def release(self, tokens: int) -> None:
        self.running -= 1
        self.running_tokens -= tokens
        while self.waiting and self._fits(self.waiting[0][0]):
            tok, fut = self.waiting.pop(0)
            if fut.done():
                continue
            self.running += 1
            self.running_tokens += tok
            fut.set_result(None)

    def kv_usage(self) -> float:
        if self.kv_capacity:
            return min(1.0, self.running_tokens / self.kv_capacity)
        return 0.0 if self.slots <= 0 else self.running / self.slots


def error_body(message: str, code: int, type_: str = "BadRequestError") -> dict:
    return {"object": "error", "message": message, "type": type_, "param": None, "code": code}


class StandIn:
    def __init__(self, args):
        self.args = args
        self.api_key = os.environ.get("VLLM_API_KEY")
        self.allowed = os.path.realpath(args.allowed_local_media_path)
        self.log = RequestLog(args.request_log)
        self.engine = Engine(args)
        self.rng = random.Random(args.seed)
        self.yes_if: dict[str, list[str]] = defaultdict(list)
        for spec in args.yes_if:
            qid, _, word = spec.partition("=")
            self.yes_if[qid].append(word.lower())
        self.storm = tuple(int(x) for x in args.storm_503.split(":")) if args.storm_503 else None
        self.reset_on = [_word_times(s) for s in args.reset_on]
        self.hang_on = [_word_times(s) for s in args.hang_on]
        self.invalid_on = [w.lower() for w in args.invalid_json_on]
        self.verbose_on = []
        for spec in args.verbose_on:
            word, _, tokens = spec.partition("=")
            self.verbose_on.append((word.lower(), int(tokens)))
        fps = float((args.media_io_kwargs.get("video") or {}).get("fps", 2))
        kind = served.model_type(args.model_root or args.served_model, args.standin_model_type)
        self.served = served.Served(kind, args.mm_processor_kwargs, fps)
        self.engine_dead = False  # vLLM 0.26.0's engine after an audio-in-video request
        if args.video_tokens == "qwen" and self.served.family != "qwen2_5_vl":
            # The profiler's largest items of the Qwen3 families, approximately: at least what any
            # item of the tests takes (the tests size --max-num-batched-tokens themselves).
            self.encoder_cache = max(args.max_num_batched_tokens, self.served.image_max // self.served.cell ** 2)
        elif args.video_tokens == "qwen":
            self.encoder_cache = qwen_image.encoder_cache_size(args.max_num_batched_tokens, args.mm_processor_kwargs,
                                                               args.limit_mm_per_prompt, args.max_model_len)
        else:
            self.encoder_cache = args.encoder_cache_tokens or args.max_num_batched_tokens or 0
        self.no_whitespace = bool(args.structured_outputs_config.get("disable_any_whitespace"))
        self.chat_arrivals = 0
        self.chat_completed = 0
        self.seen = defaultdict(int)  # attempts per request id, for faults that hit the first TIMES only
        self.probed: dict[tuple, asyncio.Future] = {}  # (path, size, mtime_ns) -> its probe
        self.running_ids: set[str] = set()
        backend = (args.media_io_kwargs.get("video") or {}).get("backend")
        module = VIDEO_BACKEND_MODULES.get(backend)
        # Imported by the server only when a video is loaded: every video request fails, the smoke request not.
        self.missing_video_module = module if module and importlib.util.find_spec(module) is None else None

    # ---- helpers -------------------------------------------------------------------------------
    def decode_cap(self) -> int:
        """vLLM 0.33's cap on one request's decoded media (0: none; versions before 0.33 have none)."""
        if tuple(int(x) for x in self.args.standin_version.split(".")[:2]) < (0, 33):
            return 0
        return int(os.environ.get("VLLM_MAX_MEDIA_REQUEST_DECODE_BYTES", self.args.decode_bytes_default))

    async def probe(self, path: str) -> "qwen_video.VideoInfo":
        """qwen_video.probe in a thread (vLLM decodes off its event loop), once per file version."""
        st = os.stat(path)
        key = (path, st.st_size, st.st_mtime_ns)
        if key not in self.probed:  # one probe per file version, however many requests wait for it
            self.probed[key] = asyncio.ensure_future(asyncio.to_thread(qwen_video.probe, path))
        return await asyncio.shield(self.probed[key])

    def authorised(self, request: web.Request) -> bool:
        if not self.api_key:
            return True
        return request.headers.get("Authorization", "") == f"Bearer {self.api_key}"

    def _match(self, rules, prompt_lower: str, attempt: int) -> bool:
        for word, times in rules:
            if word in prompt_lower and (times == 0 or attempt <= times):
                return True
        return False

    def answer_for(self, prompt: str) -> dict[str, str]:
        blocks = " ".join(m.group(2) for m in _BLOCKS.finditer(prompt)).lower()
        answers = {}
        for qid in _QUESTION_LINE.findall(prompt):
            words = self.yes_if.get(qid, [])
            answers[qid] = "yes" if any(w and w in blocks for w in words) else "no"
        return answers

    def random_answer(self, answers: dict[str, str], body: dict) -> tuple[str, int]:
        """What a model with random weights answers: under a JSON schema, valid JSON spelled a byte a
        token or so, but free whitespace wherever the grammar allows it unless it is disabled."""
        if (body.get("response_format") or {}).get("type") == "json_schema" and self.no_whitespace:
            text = json.dumps({q: self.rng.choice(["yes", "no"]) for q in answers}, separators=(",", ":"))
            return text, len(text) // 2 + 1
        if (body.get("response_format") or {}).get("type") == "json_schema":
            return "{\r\n \t\n" + " " * 64, 10 ** 6  # a whitespace runaway: cut at max_tokens
        return "lorem ipsum " * 64, 10 ** 6

    def logprobs(self, text: str, body: dict) -> dict | None:
        """``choices[0].logprobs`` as vLLM gives it under a JSON schema, when the body asks for it: the
        grammar forces the keys and punctuation (log-probability 0), and where an answer starts the
        allowed first tokens are the answers' prefixes ('y', 'yes', 'n', 'no'). The chosen answer gets
        probability ``--answer-confidence``, spread over its prefixes; the other answer the rest."""
        if not body.get("logprobs"):
            return None
        k = int(body.get("top_logprobs") or 0)
        try:
            answers = json.loads(text)
        except ValueError:
            answers = None
        content = []

        def token(tok: str, logprob: float, alternatives: list[tuple[str, float]]) -> None:
            tops = sorted(alternatives, key=lambda a: -a[1])[:k]
            content.append({"token": tok, "logprob": logprob, "bytes": list(tok.encode()),
                            "top_logprobs": [{"token": a, "logprob": lp, "bytes": list(a.encode())} for a, lp in tops]})

        if not isinstance(answers, dict):  # not an answer object: one forced token per character
            for ch in text:
                token(ch, 0.0, [(ch, 0.0)])
            return {"content": content}
        sure = self.args.answer_confidence
        for i, (qid, value) in enumerate(answers.items()):
            head = ("{" if i == 0 else ",") + f'"{qid}":"'
            token(head, 0.0, [(head, 0.0)])
            other = "no" if value == "yes" else "yes"
            # Two tokenisations of each answer: the whole word, and its first letter.
            alternatives = [(value, math.log(sure * 0.75)), (value[0], math.log(sure * 0.25)),
                            (other, math.log((1 - sure) * 0.75)), (other[0], math.log((1 - sure) * 0.25))]
            token(value, alternatives[0][1], alternatives)
            token('"', 0.0, [('"', 0.0)])
        token("}", 0.0, [("}", 0.0)])
        return {"content": content}

    # ---- routes --------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        if self.args.slow_health:
            await asyncio.sleep(self.args.slow_health)
        if self.args.health_error:
            return web.Response(status=500, text="Internal Server Error")
        dead = self.args.never_healthy or self.engine_dead or (
            self.args.unhealthy_after and self.chat_completed >= self.args.unhealthy_after)
        return web.Response(status=503 if dead else 200)

    async def models(self, request: web.Request) -> web.Response:
        if not self.authorised(request):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return web.json_response({"object": "list", "data": [
            {"id": self.args.served_model, "object": "model", "created": 0, "owned_by": "vllm",
             "root": self.args.model_root or self.args.served_model, "max_model_len": self.args.max_model_len}]})

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": self.args.standin_version})

    async def server_info(self, request: web.Request) -> web.Response:
        """vLLM's development endpoint (served only with VLLM_SERVER_DEV_MODE=1): the engine's config."""
        a = self.args
        config = {
            "model_config": {"model": a.model_root or a.served_model, "served_model_name": a.served_model,
                             "dtype": "bfloat16", "quantization": a.quantization, "max_model_len": a.max_model_len,
                             "generation_config": a.generation_config, "seed": 0,
                             "multimodal_config": {"media_io_kwargs": a.media_io_kwargs,
                                                   "mm_processor_kwargs": a.mm_processor_kwargs}},
            "cache_config": {"block_size": 16, "cache_dtype": a.kv_cache_dtype,
                             "gpu_memory_utilization": a.gpu_memory_utilization},
            "load_config": {"load_format": a.load_format},
            "structured_outputs_config": {"backend": (a.structured_outputs_config or {}).get("backend", "auto"),
                                          "disable_any_whitespace": self.no_whitespace},
            "parallel_config": {"tensor_parallel_size": a.tensor_parallel_size,
                                "data_parallel_size": a.data_parallel_size},
        }
        return web.json_response({"vllm_config": config})

    async def metrics(self, request: web.Request) -> web.Response:
        e = self.engine
        label = f'{{engine="0",model_name="{self.args.served_model}"}}'
        lines = [
            "# TYPE vllm:num_requests_running gauge", f"vllm:num_requests_running{label} {e.running}",
            "# TYPE vllm:num_requests_waiting gauge", f"vllm:num_requests_waiting{label} {len(e.waiting)}",
            "# TYPE vllm:kv_cache_usage_perc gauge", f"vllm:kv_cache_usage_perc{label} {e.kv_usage()}",
            "# TYPE vllm:num_preemptions_total counter", f"vllm:num_preemptions_total{label} {float(e.preemptions)}",
            "# TYPE vllm:prompt_tokens_total counter", f"vllm:prompt_tokens_total{label} {float(e.prompt_tokens_total)}",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{label} {float(e.generation_tokens_total)}",
        ]
        # vLLM's info gauge of the engine's CacheConfig (its fields as labels, value 1).
        cache = {"block_size": 16, "cache_dtype": self.args.kv_cache_dtype, "calculate_kv_scales": False,
                 "cpu_offload_gb": 0, "enable_prefix_caching": self.args.enable_prefix_caching, "engine": 0,
                 "gpu_memory_utilization": self.args.gpu_memory_utilization, "num_cpu_blocks": 0,
                 # --kv-capacity-tokens 0 (unlimited): a cache of 2**20 tokens, more than any test sends at once
                 "num_gpu_blocks": self.args.kv_capacity_tokens // 16 or 2 ** 16, "swap_space": 4}
        lines += ["# TYPE vllm:cache_config_info gauge",
                  "vllm:cache_config_info{" + ",".join(f'{k}="{v}"' for k, v in cache.items()) + "} 1.0"]
        lines.append("# TYPE vllm:request_queue_time_seconds histogram")
        for bound, n in zip(REQUEST_TIME_BUCKETS_S, e.queue_time_counts):
            lines.append(f'vllm:request_queue_time_seconds_bucket{label[:-1]},le="{bound}"}} {float(n)}')
        lines += [f'vllm:request_queue_time_seconds_bucket{label[:-1]},le="+Inf"}} {float(e.queue_time_count)}',
                  f"vllm:request_queue_time_seconds_count{label} {float(e.queue_time_count)}",
                  f"vllm:request_queue_time_seconds_sum{label} {e.queue_time_sum}"]
        for status, n in sorted(e.requests_total.items()):
            lines.append(f'standin:requests_total{{status="{status}"}} {n}')
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        send_id = request.headers.get("X-Request-Id")
        rid = request_of(send_id)
        if not self.authorised(request):
            self.log.write("completed", rid, status=401)
            return web.json_response({"error": "Unauthorized"}, status=401)
        calibration = (send_id or "").startswith(CALIBRATION_PREFIX)
        if calibration:  # served like vLLM, but outside the faults and their counts
            self.log.write("received", rid, attempt=1, send_id=send_id)
            return (await self._chat(request, rid, 1, calibration=True))[1]
        self.chat_arrivals += 1
        if self.args.crash_after and self.chat_arrivals > self.args.crash_after:
            self.log.write("crash", rid)
            sys.stderr.write(f"stand-in: crashing on chat request {self.chat_arrivals}\n")
            sys.stderr.flush()
            os._exit(3)
        self.seen[rid] += 1
        attempt = self.seen[rid]
        self.log.write("received", rid, attempt=attempt, send_id=send_id)
        if self.args.refuse_running_ids and send_id is not None and send_id in self.running_ids:
            status, resp = self._error(rid, 400, f"Request id chatcmpl-{send_id} already running.", "BadRequestError")
            self.engine.requests_total[status] += 1
            return resp
        if send_id is not None:
            self.running_ids.add(send_id)
        try:
            status, resp = await self._chat(request, rid, attempt)
        except asyncio.CancelledError:
            self.log.write("cancelled", rid)
            raise
        finally:
            self.running_ids.discard(send_id)
        self.engine.requests_total[status] += 1
        if status == 200:
            self.chat_completed += 1
        return resp

    def _error(self, rid, status: int, message: str, type_: str, headers=None, **fields):
        self.log.write("completed", rid, status=status, error=message[:200], **fields)
        return status, web.json_response(error_body(message, status, type_), status=status, headers=headers)

    async def _chat(self, request: web.Request, rid: str | None, attempt: int, calibration: bool = False):
        args = self.args
        faults = not calibration
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return self._error(rid, 400, "request body is not JSON", "BadRequestError")
        if body.get("model") != args.served_model:
            return self._error(rid, 404, f"The model `{body.get('model')}` does not exist.", "NotFoundError")
        if args.fail_all_with:
            status_text, _, message = args.fail_all_with.partition(":")
            return self._error(rid, int(status_text), message, "InternalServerError")
        if self.engine_dead:
            return self._error(rid, 500, "EngineCore encountered an issue. See stack trace (above) for the root "
                               "cause.", "InternalServerError")
        if (body.get("mm_processor_kwargs") or {}).get("use_audio_in_video") and args.standin_version == "0.26.0":
            # vLLM 0.26.0: qwen3_omni_moe_thinker.embed_input_ids raises in the engine, which dies.
            self.engine_dead = True
            return self._error(rid, 500, "EngineCore encountered an issue. See stack trace (above) for the root "
                               "cause.", "InternalServerError")

        if body.get("logprobs") and int(body.get("top_logprobs") or 0) > args.max_logprobs:
            return self._error(rid, 400, f"Requested sample logprobs of {body['top_logprobs']}, which is greater "
                               f"than max allowed: {args.max_logprobs}", "BadRequestError")
        # Admission: a storm, then the capacity cap.
        n = self.chat_arrivals
        if faults and self.storm and self.storm[0] < n <= self.storm[0] + self.storm[1]:
            headers = {"Retry-After": f"{args.retry_after:g}"} if args.retry_after is not None else None
            return self._error(rid, 503, "The engine is currently busy and cannot accept new requests.",
                               "ServiceUnavailableError", headers=headers)
        if self.engine.full():
            return self._error(rid, 503, "The engine is currently busy and cannot accept new requests.",
                               "ServiceUnavailableError")

        prompt_parts, media = [], []  # media: (kind, url) in the message's order
        for msg in body.get("messages", []):
            content = msg.get("content")
            if isinstance(content, str):
                prompt_parts.append(content)
                continue
            for part in content or []:
                if part.get("type") == "text":
                    prompt_parts.append(part.get("text", ""))
                elif part.get("type") in ("video_url", "image_url", "audio_url"):
                    kind = part["type"].split("_")[0]
                    media.append((kind, part[part["type"]]["url"]))
        prompt = "\n".join(prompt_parts)
        prompt_lower = prompt.lower()
        if faults and media and args.random_503 and self.rng.random() < args.random_503:
            return self._error(rid, 503, "Service Unavailable (injected)", "ServiceUnavailableError")
        counts = {k: sum(1 for kind, _ in media if kind == k) for k in ("image", "video", "audio")}
        if counts["audio"] and not self.served.hears:
            return self._error(rid, 400, "At most 0 audio(s) may be provided in one prompt.", "BadRequestError")
        over = qwen_image.too_many(args.limit_mm_per_prompt, counts)
        if over:
            return self._error(rid, 400, over, "BadRequestError")

        # --video-tokens bytes is a synthetic load for the posts; vidlabel's calibration media are counted as
        # vLLM counts them, so that a job's calibration passes and the test reaches its posts.
        exact = args.video_tokens == "qwen" or calibration
        media_tokens = 0
        decoded_bytes, decode_cap = 0, self.decode_cap()
        for kind, url in media:
            if not url.startswith("file://"):
                return self._error(rid, 400, "Only file:// URLs are served by the stand-in", "BadRequestError")
            # Like vLLM's MediaConnector: decode the URL, resolve symlinks, then check the parents.
            parsed = urllib.parse.urlparse(url)
            path = urllib.request.url2pathname(parsed.netloc + parsed.path)
            real = os.path.realpath(path)
            if os.path.commonpath([real, self.allowed]) != self.allowed:
                return self._error(rid, 400, f"The file path {path} must be a subpath of "
                                   f"`--allowed-local-media-path` {self.allowed}.", "BadRequestError")
            self.log.write("media", rid, path=real)  # which file the server would decode
            invisible = args.media_invisible_after >= 0 and self.chat_completed >= args.media_invisible_after
            try:
                if invisible:
                    raise FileNotFoundError(real)
                size = os.stat(real).st_size
            except FileNotFoundError:
                return self._error(rid, 500, f"[Errno 2] No such file or directory: '{path}'",
                                   "InternalServerError")
            if self.missing_video_module and kind == "video":
                # vLLM imports the --media-io-kwargs video backend only when it decodes a video.
                return self._error(rid, 500, f"No module named '{self.missing_video_module}'", "InternalServerError")
            if kind == "audio":
                try:
                    item_tokens, embeds = self.served.audio_tokens(real)
                except (ValueError, EOFError, OSError) as exc:
                    return self._error(rid, 400, f"Failed to load audio: {exc}", "BadRequestError")
                decoded_bytes += self.served.audio_samples(real) * 4  # float32 PCM
            elif exact and kind == "image":
                try:
                    item_tokens, embeds = self.served.image_tokens(real)
                except qwen_image.CannotLoad as exc:
                    return self._error(rid, 400, str(exc), "BadRequestError")
                if decode_cap:  # vLLM charges 4 bytes a pixel
                    width, height = qwen_image.stored_size(real)
                    decoded_bytes += width * height * 4
            elif exact:
                try:
                    info = await self.probe(real)
                except qwen_video.CannotOpen:
                    return self._error(rid, 400, "Could not open video stream", "BadRequestError")
                except qwen_video.NoFrames:
                    return self._error(rid, 500, "Expected there to be 1 prompt placeholders corresponding to 1 "
                                       "video items, but instead found 0 prompt placeholders! Make sure the "
                                       "implementation of `_call_hf_processor` and `_get_mm_fields_config` are "
                                       "consistent with each other.", "InternalServerError")
                item_tokens, embeds = self.served.video_tokens(info)
                decoded_bytes += self.served.decoded_frames(info) * info.width * info.height * 3  # RGB frames
            else:
                embeds = item_tokens = 2 + int(size / args.bytes_per_video_token)
            media_tokens += item_tokens
            if decode_cap and decoded_bytes > decode_cap:  # vLLM 0.33, multimodal/media/base.py
                return self._error(rid, 400, f"Request decoded media exceeds VLLM_MAX_MEDIA_REQUEST_DECODE_BYTES="
                                   f"{decode_cap} ({decoded_bytes} bytes).", "BadRequestError")
            if self.encoder_cache and embeds > self.encoder_cache:
                return self._error(rid, 400, f"The decoder prompt contains a(n) {kind} item with {embeds} embedding "
                                   f"tokens, which exceeds the pre-allocated encoder cache size "
                                   f"{self.encoder_cache}. Please reduce the input size or increase the encoder "
                                   "cache size by setting --limit-mm-per-prompt at startup.", "BadRequestError")
        prompt_tokens = media_tokens + 1 + int(len(prompt) / args.chars_per_text_token)
        if prompt_tokens > args.max_model_len and args.video_tokens == "qwen":
            return self._error(rid, 400, f"Input length ({prompt_tokens}) exceeds model's maximum context length "
                               f"({args.max_model_len}).", "BadRequestError")
        if prompt_tokens > args.max_model_len:
            return self._error(rid, 400, f"This model's maximum context length is {args.max_model_len} tokens. "
                               f"However, your prompt contains at least {prompt_tokens} input tokens.",
                               "BadRequestError")
        if faults and args.fail_video and any(kind == "video" for kind, _ in media):
            status_text, _, message = args.fail_video.partition(":")
            return self._error(rid, int(status_text), message, "InternalServerError")
        for spec in args.error_on if faults else ():
            word, _, rest = spec.partition("=")
            status_text, _, message = rest.partition(":")
            if word.lower() in prompt_lower:
                await asyncio.sleep(args.error_latency)
                return self._error(rid, int(status_text), message, "InternalServerError")
        if faults and media and args.random_500 and self.rng.random() < args.random_500:
            return self._error(rid, 500, "Internal server error (injected)", "InternalServerError")

        # The answer and its length.
        answers = self.answer_for(prompt)
        text = json.dumps(answers) if answers else "no"
        needed = 1 + len(text) // 4
        if args.random_weights:
            text, needed = self.random_answer(answers, body)
        for word, tokens in self.verbose_on:
            if word in prompt_lower:
                needed = max(needed, tokens)
                text = json.dumps(answers, indent=" " * 2)
        if any(w in prompt_lower for w in self.invalid_on):
            text = "Sure! Here are the answers: " + text.replace('"', "'")
            needed = 1 + len(text) // 4
        # vLLM lowers max_tokens to what the context leaves, without a word (finish_reason "length").
        max_tokens = min(body.get("max_tokens") or args.max_model_len, args.max_model_len - prompt_tokens)
        finish = "stop"
        completion_tokens = needed
        if needed > max_tokens:
            finish = "length"
            completion_tokens = max_tokens
            text = text[: max(1, len(text) * max_tokens // needed - 1)]

        # Service: wait for a slot, then time proportional to the tokens.
        await self.engine.acquire(prompt_tokens)
        try:
            service = args.latency
            if args.prefill_tokens_per_s:
                service += prompt_tokens / args.prefill_tokens_per_s
            if args.decode_tokens_per_s:
                service += completion_tokens / args.decode_tokens_per_s
            if faults and (self._match(self.hang_on, prompt_lower, attempt) or (
                    media and args.hang_rate and self.rng.random() < args.hang_rate)):
                self.log.write("hanging", rid)
                await asyncio.Event().wait()  # until the client disconnects (handler cancelled)
            if service > 0:
                await asyncio.sleep(service)
        finally:
            self.engine.release(prompt_tokens)
        self.engine.prompt_tokens_total += prompt_tokens
        self.engine.generation_tokens_total += completion_tokens

        payload = {
            "id": f"chatcmpl-{rid}", "object": "chat.completion", "created": int(time.time()),
            "model": args.served_model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": finish, "logprobs": self.logprobs(text, body)}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
        }
        data = json.dumps(payload).encode()
        reset = faults and (self._match(self.reset_on, prompt_lower, attempt) or (
            args.reset_rate and self.rng.random() < args.reset_rate) or (
            args.drop_video and any(kind == "video" for kind, _ in media)))
        if reset:
            resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
            resp.content_length = len(data)
            await resp.prepare(request)
            await resp.write(data[: len(data) // 2])
            self.log.write("completed", rid, status=0, error="connection reset mid-response")
            request.transport.abort()
            return 0, resp
        self.log.write("completed", rid, status=200, finish_reason=finish,
                       prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)
        return 200, web.Response(body=data, content_type="application/json")


def make_app(args) -> web.Application:
    standin = StandIn(args)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_get("/health", standin.health)
    app.router.add_get("/v1/models", standin.models)
    app.router.add_get("/version", standin.version)
    app.router.add_get("/metrics", standin.metrics)
    if os.environ.get("VLLM_SERVER_DEV_MODE") == "1":
        app.router.add_get("/server_info", standin.server_info)
    app.router.add_post("/v1/chat/completions", standin.chat)
    return app


async def main(argv=None) -> None:
    args = parse_args(argv)
    print(f"stand-in: starting (pid {os.getpid()}), model {args.served_model}, media loading threads "
          f"{os.environ.get('VLLM_MEDIA_LOADING_THREAD_COUNT', 'default')}, CUDA_VISIBLE_DEVICES "
          f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}, tensor {args.tensor_parallel_size} x data "
          f"{args.data_parallel_size}, api servers {args.api_server_count}, max_num_batched_tokens "
          f"{args.max_num_batched_tokens}", flush=True)
    if args.slow_start:
        await asyncio.sleep(args.slow_start)  # loading weights
    app = make_app(args)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, backlog=1024)
    await site.start()
    print(f"stand-in: listening on http://{args.host}:{args.port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    import signal
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    print("stand-in: shutting down", flush=True)
    await runner.cleanup()


if __name__ == "__main__":
    asyncio.run(main())
