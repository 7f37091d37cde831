"""vidlabel.client: error taxonomy, retries, concurrency and deadline, endpoints, adaptive limit."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from standin import read_request_log, standin_command
from standin.shards import QUESTIONS, YES_IF, expected_answers, make_config, make_video, manifest_rows
from vidlabel.client import (BackoffGate, ClassifyClient, ClientSettings, FatalClientError, Limiter,
                             classify_error, parse_metrics, retry_after_s)
from vidlabel.server import VLLMServer


@pytest.mark.parametrize("status,message,expected", [
    (500, "[Errno 2] No such file or directory: '/data/v.mp4'", ("bad_media", False)),
    (400, "The file path /etc/x.mp4 must be a subpath of `--allowed-local-media-path` /data.", ("bad_media", False)),
    (400, "This model's maximum context length is 32768 tokens. However, your prompt contains at least "
          "40000 input tokens.", ("too_long", False)),
    (400, "Input length (40000) exceeds model's maximum context length (32768).", ("too_long", False)),
    (400, "The number of multimodal tokens (9000) exceeds the pre-allocated encoder cache size (8192).",
     ("encoder_cache", False)),
    (503, "The engine is currently busy and cannot accept new requests.", ("server_overloaded", True)),
    (429, "Too many requests", ("server_overloaded", True)),
    (500, "Internal server error", ("server_error", True)),
    (502, "Bad gateway", ("server_error", True)),
    (504, "Gateway timeout", ("timeout", True)),
    (None, "Connection error.", ("connection", True)),
    (400, "Unknown parameter foo", ("server_error", False)),
])
def test_error_kind_from_status_and_message(status, message, expected):
    assert classify_error(status, message) == expected


def test_retry_after_headers():
    assert retry_after_s({"retry-after": "3"}) == 3.0
    assert retry_after_s({"retry-after-ms": "250"}) == 0.25
    assert retry_after_s({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}) is None
    assert retry_after_s({}) is None and retry_after_s(None) is None


def test_parse_metrics_sums_label_sets_and_maps_old_names():
    text = ('# HELP x\nvllm:num_requests_waiting{engine="0"} 3.0\nvllm:num_requests_waiting{engine="1"} 2\n'
            'vllm:gpu_cache_usage_perc{engine="0"} 0.5\nvllm:num_preemptions_total 7\n')
    m = parse_metrics(text)
    assert m["vllm:num_requests_waiting"] == 5.0
    assert m["vllm:kv_cache_usage_perc"] == 0.5
    assert m["vllm:num_preemptions_total"] == 7.0


def test_backoff_gate_one_wave_of_503_closes_it_once():
    gate = BackoffGate(1.0, 60.0)
    gate.overloaded(sent_at=0.0, retry_after=None)
    first_open = gate.open_at
    for _ in range(15):  # the other requests of the same wave, sent before the gate closed
        gate.overloaded(sent_at=0.0, retry_after=None)
    assert gate.level == 1 and gate.open_at - first_open < 1.0
    import time
    gate.overloaded(sent_at=time.monotonic() + 1, retry_after=None)  # a request sent after it closed
    assert gate.level == 2
    gate.overloaded(sent_at=time.monotonic() + 2, retry_after=30)
    assert gate.open_at - time.monotonic() > 29


def test_limiter_moves_its_limit():
    async def scenario():
        lim = Limiter(2)
        await lim.acquire()
        await lim.acquire()
        third = asyncio.create_task(lim.acquire())
        await asyncio.sleep(0.01)
        assert not third.done()
        await lim.set_limit(3)
        await asyncio.wait_for(third, 1)
        assert lim.in_flight == 3
        await lim.set_limit(1)
        for _ in range(3):
            await lim.release()
        assert lim.in_flight == 0
    asyncio.run(scenario())


def test_adaptive_rule_keeps_a_short_queue():
    client = ClassifyClient.__new__(ClassifyClient)
    client.settings = ClientSettings(model="m", questions=QUESTIONS, adaptive=True, adaptive_floor=4,
                                     adaptive_ceiling=64)
    client.limiter = Limiter(16)
    client.limiter.in_flight = 16
    assert client.next_limit(16, {"vllm:num_requests_waiting": 0}, False) > 16  # slots may idle: grow
    assert client.next_limit(16, {"vllm:num_requests_waiting": 30}, False) < 16  # deep queue: shrink
    assert client.next_limit(16, {"vllm:num_requests_waiting": 2}, False) == 16  # short queue: keep
    assert client.next_limit(16, {"vllm:num_requests_waiting": 2}, True) < 16  # preemption: shrink
    assert client.next_limit(4, {"vllm:num_requests_waiting": 50}, True) == 4  # floor
    assert client.next_limit(64, {"vllm:num_requests_waiting": 0}, False) == 64  # ceiling


# ---- against the stand-in --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def media(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("media")
    make_video(root / "clip.mp4")
    return root


def _rows(cfg: dict, media: Path, n: int) -> list[dict]:
    posts = [{"post_id": f"p{i}", "media_path": str(media / "clip.mp4"),
              "caption": "buy it" if i % 2 else "hi", "transcript": "pizza" if i % 3 == 0 else ""}
             for i in range(n)]
    return manifest_rows(cfg, posts)


def _run(cfg, tmp_path, rows, faults=(), endpoints=None):
    """Start stand-in(s) with ``faults`` and classify ``rows``; returns (records, request events, client)."""
    log = tmp_path / "requests.jsonl"
    cfg["classify"]["server_command"] = standin_command(sys.executable, log, *YES_IF, *faults)

    async def scenario():
        with VLLMServer(cfg, tmp_path / "server.log") as server:
            await server.wait_ready()
            eps = endpoints(server) if endpoints else [(server.base_url, server.api_key)]
            async with ClassifyClient(eps, ClientSettings.from_config(cfg)) as client:
                recs = await asyncio.gather(*(client.classify(r) for r in rows))
                return recs, client

    recs, client = asyncio.run(scenario())
    events = [e for e in read_request_log(log) if not (e.get("request_id") or "smoke-").startswith("smoke-")]
    return recs, events, client


def _max_overlap(events) -> int:
    depth = best = 0
    for e in sorted(events, key=lambda e: e["t"]):
        if e["event"] == "received":
            depth += 1
            best = max(best, depth)
        elif e["event"] in ("completed", "cancelled"):
            depth -= 1
    return best


def test_answers_usage_and_request_id(tmp_path, media):
    cfg = make_config(tmp_path, media, classify={"concurrency": 3})
    rows = _rows(cfg, media, 9)
    recs, events, _ = _run(cfg, tmp_path, rows)
    for row, rec in zip(rows, recs):
        assert rec["status"] == "ok" and rec["attempts"] == 1 and rec["finish_reason"] == "stop"
        post = int(row["post_id"][1:])
        assert rec["answers"] == expected_answers("buy it" if post % 2 else "hi", "pizza" if post % 3 == 0 else "")
        assert rec["prompt_tokens"] > (media / "clip.mp4").stat().st_size // 64
        assert rec["latency_s"] > 0 and rec["finished_at"] >= rec["started_at"]
    assert sorted(e["request_id"] for e in events if e["event"] == "received") == sorted(r["request_id"] for r in rows)


def test_concurrency_bound_and_deadline_excludes_slot_wait(tmp_path, media):
    # 12 requests of 0.5 s each through 2 slots take 3 s, but each attempt's deadline is 1.5 s:
    # waiting for a slot must not count.
    cfg = make_config(tmp_path, media, classify={"concurrency": 2, "request_timeout_s": 1.5, "max_attempts": 1})
    recs, events, _ = _run(cfg, tmp_path, _rows(cfg, media, 12), ("--latency", "0.5"))
    assert all(r["status"] == "ok" for r in recs)
    assert _max_overlap(events) == 2


def test_library_retries_are_off_and_attempts_are_bounded(tmp_path, media):
    cfg = make_config(tmp_path, media, classify={"max_attempts": 3})
    rows = _rows(cfg, media, 2)
    recs, events, _ = _run(cfg, tmp_path, rows, ("--random-500", "1.0"))
    for rec in recs:
        assert (rec["status"], rec["error_kind"], rec["http_status"], rec["attempts"]) == \
            ("error", "server_error", 500, 3)
        assert rec["retryable"] is True
    assert len([e for e in events if e["event"] == "received"]) == 2 * 3


def test_timeout_is_transient_and_cancels_the_request(tmp_path, media):
    cfg = make_config(tmp_path, media, classify={"request_timeout_s": 0.3, "max_attempts": 2})
    rows = _rows(cfg, media, 1)
    rows[0]["prompt"] += "\nhangword"
    recs, events, _ = _run(cfg, tmp_path, rows, ("--hang-on", "hangword"))
    assert (recs[0]["error_kind"], recs[0]["attempts"], recs[0]["retryable"]) == ("timeout", 2, True)
    assert [e["event"] for e in events].count("cancelled") == 2


def test_wrong_model_or_key_is_fatal(tmp_path, media):
    cfg = make_config(tmp_path, media)
    rows = _rows(cfg, media, 1)
    with pytest.raises(FatalClientError, match="401"):
        _run(cfg, tmp_path, rows, endpoints=lambda s: [(s.base_url, "wrong-key")])


def test_least_outstanding_requests_over_endpoints(tmp_path, media):
    cfg = make_config(tmp_path, media, classify={"concurrency": 8})
    slow_cfg = make_config(tmp_path, media)
    slow_log = tmp_path / "slow.jsonl"
    slow_cfg["classify"]["server_command"] = standin_command(sys.executable, slow_log, *YES_IF, "--latency", "0.4")
    rows = _rows(cfg, media, 40)

    async def scenario():
        with VLLMServer(slow_cfg, tmp_path / "slow.log") as slow:
            await slow.wait_ready()
            with VLLMServer(cfg, tmp_path / "fast.log") as fast:
                await fast.wait_ready()
                eps = [(slow.base_url, slow.api_key), (fast.base_url, fast.api_key)]
                async with ClassifyClient(eps, ClientSettings.from_config(cfg)) as client:
                    recs = await asyncio.gather(*(client.classify(r) for r in rows))
                    return recs, [ep.sent for ep in client.endpoints]

    cfg["classify"]["server_command"] = standin_command(sys.executable, tmp_path / "fast.jsonl", *YES_IF,
                                                        "--latency", "0.02")
    recs, (slow_sent, fast_sent) = asyncio.run(scenario())
    assert all(r["status"] == "ok" for r in recs)
    assert slow_sent >= 1 and fast_sent > 2 * slow_sent
    assert slow_sent + fast_sent == 40


def test_adaptive_concurrency_grows_to_fill_the_server(tmp_path, media):
    cfg = make_config(tmp_path, media, classify={
        "concurrency": 2, "adaptive_concurrency": {"enabled": True, "floor": 2, "ceiling": 12}})
    settings = ClientSettings.from_config(cfg)
    settings.adaptive_interval_s = 0.1
    log = tmp_path / "requests.jsonl"
    cfg["classify"]["server_command"] = standin_command(sys.executable, log, *YES_IF, "--slots", "8",
                                                        "--latency", "0.1")
    rows = _rows(cfg, media, 150)

    async def scenario():
        with VLLMServer(cfg, tmp_path / "server.log") as server:
            await server.wait_ready()
            async with ClassifyClient([(server.base_url, server.api_key)], settings) as client:
                recs = await asyncio.gather(*(client.classify(r) for r in rows))
                return recs, [lim for _, lim in client.limit_history]

    recs, limits = asyncio.run(scenario())
    assert all(r["status"] == "ok" for r in recs)
    assert max(limits) >= 8  # grew from the floor until the 8 slots were busy
    assert max(limits) <= 12


def test_chat_request_from_template_equals_the_librarys_own():
    """_AsyncOpenAI builds chat requests after the first from a template: same URL, headers, body."""
    import json

    import openai
    from openai._models import FinalRequestOptions

    from vidlabel.client import CHAT_PATH, _AsyncOpenAI, _make_openai

    client = _make_openai("http://127.0.0.1:9/v1", "secret", 4)
    settings = ClientSettings(model="m", questions=QUESTIONS)
    classify_client = ClassifyClient([("http://127.0.0.1:9/v1", "secret")], settings)

    def options(rid: str, body: bytes) -> FinalRequestOptions:
        return FinalRequestOptions.construct(method="post", url=CHAT_PATH, content=body, headers={
            "X-Request-Id": rid, "X-Stainless-Retry-Count": openai.Omit()})

    first = client._build_request(options("r0", b"{}"))
    assert client._chat_template is not None
    body = classify_client._body({"media_path": "/m/a b.mp4", "prompt": "é \"q\"", "request_id": "r1"}, 64)
    assert json.loads(body)["messages"][0]["content"][0]["video_url"]["url"] == "file:///m/a%20b.mp4"
    fast = client._build_request(options("r1", body))
    library = openai.AsyncOpenAI._build_request(client, options("r1", body))
    assert isinstance(client, _AsyncOpenAI) and fast is not first
    assert (fast.method, fast.url, fast.content, fast.extensions) == \
        (library.method, library.url, library.content, library.extensions)
    assert sorted(fast.headers.raw) == sorted(library.headers.raw)
    assert fast.headers["x-request-id"] == "r1" and fast.headers["authorization"] == "Bearer secret"
    assert not any(k.lower().startswith(b"x-stainless") for k, _ in fast.headers.raw)
    client.api_key = "other"  # a changed key is not served from the old template
    assert client._build_request(options("r2", body)).headers["authorization"] == "Bearer other"
