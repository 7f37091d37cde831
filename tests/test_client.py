"""vidlabel.serve.client and its parts: error kinds, the in-flight limit, deadlines and the stall detector,
endpoint health, adaptive concurrency; then the client against the stand-in with injected faults."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import socket
import sys
import time
from collections import deque
from pathlib import Path

import pytest
from aiohttp import web
from format_zoo import BENCHMARKS
from standin import is_probe, max_in_flight, read_request_log, standin_command
from standin.shards import (
    QUESTIONS,
    YES_IF,
    expected_answers,
    make_config,
    make_video,
    manifest_rows,
)

from vidlabel.serve.classify import attach_requests
from vidlabel.serve.client import ClassifyClient
from vidlabel.serve.concurrency import next_ceiling, parse_metrics
from vidlabel.serve.deadline import DEADLINE_FACTOR, MIN_ANSWERS, Deadlines, Expired
from vidlabel.serve.endpoints import DOWN, SUSPECT, UP, Endpoints, NoLiveEndpoint
from vidlabel.serve.error_kinds import (
    FatalClientError,
    admission_refusal,
    classify_error,
    fatal_error,
    response_message,
    retry_after_s,
)
from vidlabel.serve.limit import InFlightLimit, backoff_s
from vidlabel.serve.server import VLLMServer
from vidlabel.serve.settings import ServeSettings

sys.path.insert(0, str(BENCHMARKS))
import adaptive_transit  # noqa: E402

# ---- error kinds -----------------------------------------------------------------------------------

@pytest.mark.parametrize("status,message,expected", [
    # A 5xx is the server's until the evidence says otherwise, whatever its message reads as.
    (500, "[Errno 2] No such file or directory: '/data/v.mp4'", ("bad_media", True)),
    (500, "Failed to load video with backend torchcodec", ("bad_media", True)),
    (500, "This model's maximum context length is 32768 tokens.", ("server_error", True)),
    (500, "The decoder prompt contains a(n) video item with 9000 embedding tokens, which exceeds the "
          "pre-allocated encoder cache size 8192", ("server_error", True)),
    (400, "The file path /etc/x.mp4 must be a subpath of `--allowed-local-media-path` /data.", ("bad_media", False)),
    (400, "This model's maximum context length is 32768 tokens. However, your prompt contains at least "
          "40000 input tokens.", ("too_long", False)),
    (400, "The number of multimodal tokens (9000) exceeds the pre-allocated encoder cache size (8192).",
     ("encoder_cache", False)),
    (503, "The engine is currently busy and cannot accept new requests.", ("server_overloaded", True)),
    (429, "Too many requests", ("server_overloaded", True)),
    (500, "Internal server error", ("server_error", True)),
    (502, "Bad gateway", ("server_error", True)),
    (504, "Gateway timeout", ("timeout", True)),
    (None, "Connection error.", ("connection", True)),
    (400, "Unknown parameter foo", ("server_error", False)),
    # vLLM V1 before 0.26 (its input processor), and vLLM 0.26's own wordings of a prompt over the context.
    (400, "The prompt (total length 43698) is too long to fit into the model (context length 32768). Make sure "
          "that `max_model_len` is no smaller than the number of text tokens plus multimodal tokens. For image "
          "inputs, the number of image tokens depends on the number of images, and possibly their aspect ratios "
          "as well.", ("too_long", False)),
    (400, "The decoder prompt (length 32768) plus the number of requested output tokens (at least 1) is longer "
          "than the maximum model length of 32768. Make sure that `max_model_len` is no smaller than the number "
          "of text tokens (prompt + requested output tokens).", ("too_long", False)),
    (400, "This model's maximum context length is 32768 tokens. However, you requested 64 output tokens and your "
          "prompt contains 40000 input tokens, for a total of 40064 tokens. Please reduce the length of the input "
          "prompt or the number of requested output tokens.", ("too_long", False)),
    # vLLM V1 before 0.26 refused an X-Request-Id still running: a collision, gone on a retry with a new id.
    (400, "Request id chatcmpl-0123456789abcdef01234567-ab12cd34-1 already running.", ("server_error", True)),
])
def test_error_kind_from_status_and_message(status, message, expected):
    assert classify_error(status, message) == expected


@pytest.mark.parametrize("status,message,admission", [
    (503, "The engine is currently busy and cannot accept new requests.", True),  # vLLM 0.26's admission
    (503, "Service Unavailable", False),  # a proxy's, a fault's: no word on the server's queue
    (429, "Too many requests", False),
    (500, "The engine is currently busy and cannot accept new requests.", False),
])
def test_only_vllms_admission_503_says_the_server_is_full(status, message, admission):
    assert admission_refusal(status, message) is admission


# Bodies measured on a real vLLM 0.26 server (issue 9), in vLLM's error format (docs/serving.md, "What
# vLLM answers"): a 4xx is the request's own at once; a 500 keeps its kind but is retried, and becomes
# terminal only on evidence (vidlabel.serve.client: the same body on every attempt while its peers answer).
VLLM_026_BODIES = [
    # An MP4 cut after its header: no frame decodes, so the prompt lost its video placeholder.
    (500, "Expected there to be 1 prompt placeholders corresponding to 1 video items, but instead found 0 "
          "prompt placeholders! Make sure the video can be decoded.", "bad_media", True),
    (500, "[Errno 2] No such file or directory: '/data/media/gone.mp4'", "bad_media", True),
    (500, "No module named 'PyNvVideoCodec'", "server_error", True),
    (400, "The file path /etc/passwd must be a subpath of `--allowed-local-media-path /data/media`.", "bad_media",
     False),
    (400, "Input length (129623) exceeds model's maximum context length (32768).", "too_long", False),
    (400, "Could not open video stream", "bad_media", False),
    (400, "The decoder prompt contains a(n) video item with 18720 embedding tokens, which exceeds the "
          "pre-allocated encoder cache size 8192", "encoder_cache", False),
]


@pytest.mark.parametrize("status,message,kind,transient", VLLM_026_BODIES)
@pytest.mark.parametrize("shape", ["vllm", "openai"])
def test_measured_vllm_error_bodies_keep_their_kind_and_the_status_decides_the_verdict(status, message, kind,
                                                                                      transient, shape):
    body = ({"object": "error", "message": message, "type": "BadRequestError", "param": None, "code": status}
            if shape == "vllm" else {"error": {"message": message, "type": "BadRequestError", "code": status}})
    parsed = response_message(json.dumps(body).encode())
    assert parsed == message
    assert classify_error(status, parsed) == (kind, transient)


def test_refused_key_stops_the_job_with_a_message_that_says_so():
    body = b'{"error":"Unauthorized"}'
    exc = fatal_error("http://gpu:8000/v1", 401, response_message(body))
    assert isinstance(exc, FatalClientError)
    assert "refused the API key" in str(exc) and "Unauthorized" in str(exc)
    assert "the key or the endpoint is wrong" in str(exc) and "classify.api_key_env" in str(exc)
    assert fatal_error("http://gpu:8000/v1", 404, "The model `x` does not exist.") is not None
    assert fatal_error("http://gpu:8000/v1", 500, "boom") is None


def test_retry_after_headers():
    assert retry_after_s({"retry-after": "3"}) == 3.0
    assert retry_after_s({"retry-after-ms": "250"}) == 0.25
    assert retry_after_s({"retry-after": "86400"}) == 600.0
    assert retry_after_s({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}) is None
    assert retry_after_s({}) is None and retry_after_s(None) is None


# ---- the in-flight limit and back-off ---------------------------------------------------------------

def test_backoff_is_full_jitter_capped_and_honours_retry_after():
    delays = [backoff_s(3, 1.0, 60.0, None) for _ in range(200)]
    assert 0 <= min(delays) and max(delays) <= 4.0 and max(delays) > 2.0
    assert all(backoff_s(20, 1.0, 5.0, None) <= 5.0 for _ in range(50))
    assert backoff_s(1, 1.0, 60.0, 30.0) >= 30.0


def test_scattered_503s_leave_the_limit_alone():
    async def scenario():
        lim = InFlightLimit(16)
        sent = [await lim.send() for _ in range(16)]  # the first burst, n = 1..16
        for n in (3, 9, 14):  # refused at once while the others are still at the server
            lim.returned(n)
            assert lim.refused(n, admission=False) is False  # no evidence of load: no back-off either
        assert lim.limit == 16
        for i in range(200):  # then one in five refused, whatever the number at the server
            n = await lim.send()
            lim.returned(n)
            lim.refused(n, admission=False) if i % 5 == 0 else lim.answered(n)
        assert lim.limit == 16 and len(sent) == 16
    asyncio.run(scenario())


def test_scattered_refusals_at_the_top_before_any_answer_leave_the_limit_alone():
    # A refusal comes back a round trip before the answers sent beside it, and a refused request is sent
    # again at once, at the top: three anonymous refusals there before the first answer are bad luck,
    # not load. The same three in vLLM's admission wording are the server saying it is full.
    async def scenario(admission: bool) -> tuple[list[bool], list[int], InFlightLimit]:
        lim = InFlightLimit(8)
        sent = [await lim.send() for _ in range(8)]
        verdicts, resends = [], []
        for n in (sent[7], sent[2]):  # two requests refused, each sent again at once and refused again
            lim.returned(n)
            verdicts.append(lim.refused(n, admission=admission))
            resends.append(await lim.send())
            lim.returned(resends[-1])
            verdicts.append(lim.refused(resends[-1], admission=admission))  # the second: it backs off
        return verdicts, resends, lim

    verdicts, resends, lim = asyncio.run(scenario(admission=True))
    assert resends == [8, 7]  # 3 refusals at 7 or more against 1 attempt there (sent[6]), no answer yet
    assert verdicts == [False, False, False, True] and lim.limit == 6

    verdicts, resends, lim = asyncio.run(scenario(admission=False))
    assert resends == [8, 7] and verdicts == [False] * 4 and lim.limit == 8

    async def refused_on(lim: InFlightLimit) -> list[bool]:
        verdicts = []
        for _ in range(4):  # refused on and on at 7: 6 more refusals than answers there
            resend = await lim.send()
            lim.returned(resend)
            verdicts.append(lim.refused(resend, admission=False))
        return verdicts
    assert asyncio.run(refused_on(lim)) == [False, False, False, True] and lim.limit == 6


def test_admission_503s_lower_the_limit_to_what_the_server_takes_and_answers_raise_it_again():
    async def scenario():
        lim = InFlightLimit(16)
        sent = [await lim.send() for _ in range(16)]
        for n in sent[6:]:  # the server takes 6 and refuses the 7th to 16th at once, in that order
            lim.returned(n)
            lim.refused(n, admission=True)
        assert lim.limit == 16  # each refusal alone at its level: no evidence yet
        retry = await lim.send()  # a retry: refused again at 7, with ten refusals at 7 or more
        lim.returned(retry)
        assert lim.refused(retry, admission=True) is True  # the server is full at 7: back off
        assert (retry, lim.limit) == (7, 6)
        for _ in range(7):  # answers: about one slot back per limit's worth
            lim.returned(6)
            lim.answered(6)
            await lim.send()
        assert lim.limit == 7
        probe = await lim.send()
        lim.returned(probe)
        lim.refused(probe, admission=True)  # the probe at 7 is refused: back to 6
        assert (probe, lim.limit) == (7, 6)
    asyncio.run(scenario())


def test_answers_with_the_limit_not_full_do_not_raise_it_past_where_the_server_refused():
    async def scenario():
        lim = InFlightLimit(16)
        sent = [await lim.send() for _ in range(16)]
        for n in reversed(sent[4:]):  # the server takes 4 and refuses the rest, the last sent first
            lim.returned(n)
            lim.refused(n, admission=True)
        assert lim.limit == 4
        for _ in range(40):  # a client that keeps only 2 at the server: its answers say nothing of a 5th
            lim.returned(2)
            lim.answered(2)
            await lim.send()
        assert lim.limit == 4
        for _ in range(5):  # answers sent with the limit full raise it, one slot per round trip
            lim.returned(4)
            lim.answered(4)
            await lim.send()
        assert lim.limit == 5
    asyncio.run(scenario())


def test_a_cancelled_waiter_for_a_place_at_the_server_leaves_quietly():
    async def scenario():
        lim = InFlightLimit(1)
        n = await lim.send()
        waiter = asyncio.create_task(lim.send())
        await asyncio.sleep(0)
        waiter.cancel()
        lim.returned(n)  # frees the place while the cancelled waiter has not run yet
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert lim.at_server == 0 and await lim.send() == 1
    asyncio.run(scenario())


def test_limit_is_a_semaphore_that_follows_its_ceiling():
    async def scenario():
        lim = InFlightLimit(2)
        await lim.acquire()
        await lim.acquire()
        third = asyncio.create_task(lim.acquire())
        await asyncio.sleep(0.01)
        assert not third.done()
        lim.set_ceiling(3)
        await asyncio.wait_for(third, 1)
        assert lim.in_flight == 3
        fourth = asyncio.create_task(lim.acquire())
        await asyncio.sleep(0)
        fourth.cancel()  # a cancelled waiter takes no slot
        await asyncio.gather(fourth, return_exceptions=True)
        lim.set_ceiling(1)
        for _ in range(3):
            lim.release()
        assert lim.in_flight == 0 and lim.limit == 1
    asyncio.run(scenario())


def test_adaptive_rule_keeps_a_short_queue():
    def rule(ceiling, waiting, preempted=False, in_flight=None):
        in_flight = ceiling if in_flight is None else in_flight
        return next_ceiling(ceiling, in_flight, {"vllm:num_requests_waiting": waiting}, preempted, 4, 64)
    assert rule(16, 0) > 16  # slots may idle: grow
    assert rule(16, 0, in_flight=8) == 16  # the client is not using what it has
    assert rule(16, 30) < 16  # deep queue: shrink
    assert rule(16, 2) == 16  # short queue: keep
    assert rule(16, 2, preempted=True) < 16  # preemption: shrink
    assert rule(4, 50, preempted=True) == 4  # floor
    assert rule(64, 0) == 64  # ceiling
    # An earlier cut still draining (more in flight than the ceiling): the deep queue is its cause, not a new one.
    assert rule(16, 30, in_flight=24) == 16
    assert rule(16, 2, preempted=True, in_flight=24) == 16
    # Until the last change has reached the engine (settled), neither a raise nor a cut.
    assert next_ceiling(16, 16, {"vllm:num_requests_waiting": 0}, False, 4, 64, settled=False) == 16
    assert next_ceiling(16, 16, {"vllm:num_requests_waiting": 30}, False, 4, 64, settled=False) == 16


@pytest.mark.parametrize("transit_s", [0.0, 3.0, 10.0])
def test_adaptive_concurrency_covers_the_api_servers_without_swinging(transit_s):
    # Qwen3-Omni on the GPU (heard video, ~10 s in the API servers): the ceiling went 9 -> 39 -> 4 in 40 s,
    # each raise read before the last one had reached the engine. benchmarks/adaptive_transit.py's model of
    # API servers that delay each request: the engine runs 4 at a time for 3 s each, so it needs 4 + (its
    # answer rate x the transit) in flight, a little more to keep a queue. (API servers slower than the
    # engine still make it swing: docs/serving.md.)
    s = adaptive_transit.summary(adaptive_transit.simulate(transit_s, slots=4, service_s=3.0, start=9), slots=4)
    needed = 4 + (4 / 3.0) * transit_s
    assert s["ceiling_min"] >= needed - 1  # never starves the engine by cutting below what covers the transit
    assert s["ceiling_max"] <= 1.5 * needed + 3  # nor climbs far past it
    assert s["busy"] >= 0.95  # the engine kept busy
    assert s["longest_queue"] <= 12  # and its queue short


@pytest.mark.parametrize("workers", [12, 8])
def test_adaptive_concurrency_swing_behind_slow_api_servers_costs_no_throughput(workers):
    # Qwen3-Omni on the GPU: API servers slower than the engine (3.9 CPU-s per answer) made the ceiling
    # climb 7 -> 33 and cut to 4 once their backlog reached the engine. benchmarks/adaptive_transit.py's
    # model of it: more in flight queue in the API servers and are served when lighter posts come, so the
    # swing must serve about what a fixed count that keeps them fed serves (docs/serving.md).
    def use(adaptive, start):
        trace = adaptive_transit.simulate(10.0, slots=4, service_s=3.0, start=start, workers=workers,
                                          adaptive=adaptive)
        return adaptive_transit.summary(trace, slots=4)["use"]

    fixed_16 = use(False, 16)
    assert use(True, 9) >= fixed_16 - 0.03
    assert fixed_16 > use(False, 9)  # the model is one where the count matters: 9 starves the engine


def test_parse_metrics_sums_label_sets_and_maps_old_names():
    text = ('# HELP x\nvllm:num_requests_waiting{engine="0"} 3.0\nvllm:num_requests_waiting{engine="1"} 2\n'
            'vllm:gpu_cache_usage_perc{engine="0"} 0.5\nvllm:num_preemptions_total 7\n')
    m = parse_metrics(text)
    assert m["vllm:num_requests_waiting"] == 5.0
    assert m["vllm:kv_cache_usage_perc"] == 0.5
    assert m["vllm:num_preemptions_total"] == 7.0


# ---- deadlines and the stall detector -------------------------------------------------------------------

class _Ep:
    healthy = True


def test_deadline_follows_the_shards_pace_between_floor_and_ceiling():
    d = Deadlines(ceiling_s=900, floor_s=10, adaptive=True)
    assert d.limit_s(1000) == 900  # no pace yet
    for _ in range(MIN_ANSWERS):
        d.answered(2.0, 1000)  # 2 ms per token
    assert d.limit_s(1000) == 10  # 4 x 2 s < floor
    assert d.limit_s(10_000) == pytest.approx(DEADLINE_FACTOR * 20.0)
    assert d.limit_s(10_000_000) == 900
    off = Deadlines(ceiling_s=900, floor_s=5, adaptive=False)
    for _ in range(MIN_ANSWERS):
        off.answered(2.0, 1000)
    assert off.limit_s(1000) == 900


def test_deadline_allows_for_the_requests_ahead_at_the_answer_rate():
    d = Deadlines(ceiling_s=900, floor_s=1, adaptive=True)
    for _ in range(MIN_ANSWERS):
        d.answered(0.1, 1000)  # 0.1 ms per token: a 1,000-token request takes 0.1 s once served
    d._answer_times = deque(float(t) for t in range(MIN_ANSWERS))  # the shard answers once a second
    assert d.answer_rate() == pytest.approx(1.0)
    assert d.limit_s(1000) == pytest.approx(DEADLINE_FACTOR * 1.0)  # its own turn: 1 s at that rate
    assert d.limit_s(1000, ahead=31) == pytest.approx(DEADLINE_FACTOR * 32.0)  # behind 31 others: 32 s
    assert d.limit_s(1000, ahead=10_000) == 900


async def _hang(d: Deadlines, tokens: int, ep=None):
    with d.attempt(tokens, ep or _Ep()):
        await asyncio.Event().wait()


def test_attempt_in_flight_is_cut_once_the_pace_is_known():
    async def scenario():
        d = Deadlines(ceiling_s=900, floor_s=1, adaptive=True)
        hung = asyncio.create_task(_hang(d, 100))
        await asyncio.sleep(0)
        d.check()
        assert not hung.done()  # no pace yet: only the ceiling applies
        for a in d._running:
            a.started -= 10  # in flight for 10 s
        for _ in range(MIN_ANSWERS):
            d.answered(0.1, 100)
        d.check()
        with pytest.raises(Expired, match="no answer within 1 s") as info:
            await hung
        assert info.value.kind == "timeout" and d.in_flight == 0
    asyncio.run(scenario())


def test_stall_cuts_every_attempt_at_the_smallest_deadline_when_nothing_is_answered():
    async def scenario():
        d = Deadlines(ceiling_s=900, floor_s=1, adaptive=True)
        for _ in range(MIN_ANSWERS):
            d.answered(0.01, 100)  # 0.1 ms per token: 100 tokens may take 1 s, 100,000 tokens 40 s
        sick = _Ep()
        sick.healthy = False
        small, big, on_sick = (asyncio.create_task(_hang(d, t, ep)) for t, ep in
                               ((100, None), (100_000, None), (100_000, sick)))
        await asyncio.sleep(0)
        ages = {100: 0.5, 100_000: 5.0}
        for a in d._running:
            a.started -= ages[a.tokens]
        d.check()  # every attempt is within its own deadline, and the shard answered lately
        await asyncio.sleep(0)
        assert not any(t.done() for t in (small, big, on_sick))
        d.last_answer -= 5  # nothing answered for 5 s, longer than the smallest one's 1 s: stalled
        d.check()
        await asyncio.sleep(0)
        with pytest.raises(Expired, match="stalled"):
            await big  # in flight for longer than the smallest deadline
        assert not small.done()  # itself not in flight for that long yet
        assert not on_sick.done()  # an unhealthy endpoint is the health check's business
        for t in (small, on_sick):
            t.cancel()
        await asyncio.gather(small, on_sick, return_exceptions=True)
    asyncio.run(scenario())


# ---- endpoint health --------------------------------------------------------------------------------------

def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _health_app(state: dict) -> web.AppRunner:
    async def health(_):
        return web.Response(status=200 if state["ok"] else 503)
    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", state["port"])
    await site.start()
    return runner


def test_unreachable_endpoint_goes_down_within_seconds_and_comes_back():
    async def scenario():
        state = {"ok": True, "port": _closed_port()}
        runner = await _health_app(state)
        downs, lost = [], []
        eps = Endpoints([(f"http://127.0.0.1:{state['port']}/v1", "k"), (f"http://127.0.0.1:{_closed_port()}/v1", "k")],
                        interval_s=0.3, on_down=downs.append, on_all_down=lost.append)
        live, dead = eps.all
        watcher = asyncio.create_task(eps.watch())
        t0 = time.monotonic()
        eps.unreachable(dead, "connection refused")  # a request could not connect
        assert dead.state == SUSPECT and {eps.pick() for _ in range(4)} == {live}
        while dead.state != DOWN and time.monotonic() - t0 < 10:
            await asyncio.sleep(0.05)
        assert dead.state == DOWN and time.monotonic() - t0 < 5 and downs == [dead]
        assert "/health failed 3 times in a row" in dead.reason and "Connect" in dead.reason
        assert live.state == UP and not lost
        state["ok"] = False  # the last one fails its health checks: nothing is left
        while not lost and time.monotonic() - t0 < 15:
            await asyncio.sleep(0.05)
        assert lost and "HTTP 503" in lost[0]
        with pytest.raises(NoLiveEndpoint):
            eps.pick()
        state["ok"] = True  # an external endpoint that answers again is used again
        while live.state != UP and time.monotonic() - t0 < 20:
            await asyncio.sleep(0.05)
        assert eps.pick() is live
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        await runner.cleanup()
    asyncio.run(scenario())


def test_exited_server_is_down_for_good():
    async def scenario():
        lost = []
        eps = Endpoints([("http://127.0.0.1:9/v1", "k")], interval_s=10, on_down=lambda ep: None,
                        on_all_down=lost.append)
        eps.mark_down(0, "server exited with status 3", final=True)
        assert lost == ["server exited with status 3"] and eps.all[0].final
        await asyncio.wait_for(eps.watch(), 1)  # nothing left to probe
    asyncio.run(scenario())


# ---- against the stand-in ----------------------------------------------------------------------------------

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


def _run(cfg, tmp_path, rows, faults=(), endpoints=None, settings=None):
    """Start stand-in(s) with ``faults`` and classify ``rows``; returns (records, request events, client)."""
    log = tmp_path / "requests.jsonl"
    cfg["classify"]["server_command"] = standin_command(sys.executable, log, *YES_IF, *faults)
    for row in rows:  # a test may have edited a row since it was made: its items and request anew
        row.pop("items", None)
    attach_requests(ServeSettings.from_config(cfg), rows)

    async def scenario():
        with VLLMServer(ServeSettings.from_config(cfg), tmp_path / "server.log") as server:
            await server.wait_ready()
            eps = endpoints(server) if endpoints else [(server.base_url, server.api_key)]
            async with ClassifyClient(eps, settings or ServeSettings.from_config(cfg).client) as client:
                recs = await asyncio.gather(*(client.classify(r) for r in rows))
                return recs, client

    recs, client = asyncio.run(scenario())
    events = [e for e in read_request_log(log) if e.get("request_id") and not is_probe(e["request_id"])]
    return recs, events, client


def test_request_body_names_the_video_as_a_file_uri(tmp_path, media):
    cfg = make_config(tmp_path, media)
    (row,) = manifest_rows(cfg, [{"post_id": "p", "media_path": str(media / "clip.mp4"), "caption": "é \"q\""}])
    client = ClassifyClient([("http://127.0.0.1:9/v1", "secret")], ServeSettings.from_config(cfg).client)
    body = json.loads(client._body(row, 64))
    assert body == row["request"].body(64)  # the body is the row's Request's, and nothing else
    assert body["messages"][0]["content"][0]["video_url"]["url"] == (media / "clip.mp4").as_uri()
    assert body["messages"][0]["content"][1]["text"] == row["prompt"] and 'é "q"' in row["prompt"]
    assert (body["model"], body["max_tokens"], body["temperature"]) == ("standin-model", 64, 0)
    assert body["response_format"]["json_schema"]["schema"]["required"] == [q["id"] for q in QUESTIONS]


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
    assert max_in_flight(events) == 2


def test_attempts_are_bounded(tmp_path, media):
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
    assert "classify.request_timeout_s" in recs[0]["error"]
    assert [e["event"] for e in events].count("cancelled") == 2


def test_hung_requests_are_cut_at_the_adaptive_deadline_not_the_ceiling(tmp_path, media):
    cfg = make_config(tmp_path, media, classify={"concurrency": 4, "request_timeout_s": 600,
                                                 "deadline_floor_s": 1, "max_attempts": 6})
    t0 = time.monotonic()
    recs, events, _ = _run(cfg, tmp_path, _rows(cfg, media, 60), ("--hang-rate", "0.1", "--seed", "3",
                                                                  "--latency", "0.02"))
    assert time.monotonic() - t0 < 120  # did not wait out a 600 s ceiling
    assert all(r["status"] == "ok" for r in recs)
    hung = [e for e in events if e["event"] == "hanging"]
    cancelled = [e for e in events if e["event"] == "cancelled"]
    assert hung and len(cancelled) == len(hung)
    assert sum(r["attempts"] for r in recs) == 60 + len(hung)


def test_a_queue_building_behind_the_first_answers_is_not_read_as_hangs(tmp_path, media):
    """The first answers come back before any queue has formed; the later ones wait behind the
    requests in flight (32 in flight, 2 at a time served). Their longer latency is the queue, not a
    hang: no attempt may be cut (measured on a real vLLM: 64 in flight, cut at the deadline the first
    answers suggested, fell to half the throughput of 32)."""
    cfg = make_config(tmp_path, media, classify={"concurrency": 32, "request_timeout_s": 600,
                                                 "deadline_floor_s": 0.3, "max_attempts": 6})
    rows = _rows(cfg, media, 64)
    for i, row in enumerate(rows):  # heaviest first, as the manifest orders a shard
        row["est_prompt_tokens"] = 30_000 if i < 16 else 1_000
    # Video tokens by file size: no decode in the first answers' latency, only the service time.
    recs, events, _ = _run(cfg, tmp_path, rows, ("--slots", "2", "--latency", "0.1", "--video-tokens", "bytes"))
    assert all(r["status"] == "ok" for r in recs)
    assert [e for e in events if e["event"] == "cancelled"] == []
    assert sum(r["attempts"] for r in recs) == 64
    assert max(r["latency_s"] for r in recs) > 10 * min(r["latency_s"] for r in recs)  # a queue did form


def test_a_file_missing_for_a_moment_is_sent_again_once_it_is_back(tmp_path, media, monkeypatch):
    """An NFS or autofs hiccup: the server answers "No such file" for a file that exists a moment later.
    The client looks again after a pause (and again) before recording bad_media."""
    import vidlabel.serve.client as client_mod

    monkeypatch.setattr(client_mod, "MEDIA_RECHECK_S", (0.5, 1.0))
    cfg = make_config(tmp_path, media)
    rows = _rows(cfg, media, 2)
    flaky = media / "flaky.mp4"
    rows[0]["media_path"] = str(flaky)
    rows[1]["media_path"] = str(media / "never-there.mp4")

    async def back_after(delay: float) -> None:
        await asyncio.sleep(delay)
        os.link(media / "clip.mp4", flaky)

    log = tmp_path / "requests.jsonl"
    cfg["classify"]["server_command"] = standin_command(sys.executable, log, *YES_IF)
    for row in rows:  # the rows' paths were edited: their items and requests anew
        row.pop("items", None)
    attach_requests(ServeSettings.from_config(cfg), rows)

    async def scenario():
        with VLLMServer(ServeSettings.from_config(cfg), tmp_path / "server.log") as server:
            await server.wait_ready()
            eps = [(server.base_url, server.api_key)]
            async with ClassifyClient(eps, ServeSettings.from_config(cfg).client) as client:
                comeback = asyncio.create_task(back_after(0.3))
                recs = await asyncio.gather(*(client.classify(r) for r in rows))
                await comeback
                return recs

    try:
        back, gone = asyncio.run(scenario())
    finally:
        flaky.unlink(missing_ok=True)
    assert (back["status"], back["sends"], back["attempts"]) == ("ok", 2, 1)  # the hiccup cost nothing
    assert (gone["status"], gone["error_kind"], gone["sends"]) == ("error", "bad_media", 1)
    assert "No such file or directory" in gone["error"]
    events = [e for e in read_request_log(log) if e["event"] == "completed" and not e["request_id"].startswith("smoke")]
    assert sorted(e["status"] for e in events if e["request_id"] == rows[0]["request_id"]) == [200, 500]


def test_two_jobs_sending_the_same_requests_to_one_server_do_not_collide(tmp_path, media):
    """Two classify.models entries of the same model on one endpoint send the same request ids at once.
    A vLLM V1 that refuses an id still running must not see the same X-Request-Id twice."""
    cfg = make_config(tmp_path, media, classify={"concurrency": 8, "max_attempts": 1})
    rows = _rows(cfg, media, 8)
    log = tmp_path / "requests.jsonl"
    cfg["classify"]["server_command"] = standin_command(sys.executable, log, *YES_IF, "--refuse-running-ids",
                                                        "--latency", "0.3")

    async def scenario():
        with VLLMServer(ServeSettings.from_config(cfg), tmp_path / "server.log") as server:
            await server.wait_ready()
            eps = [(server.base_url, server.api_key)]
            async with ClassifyClient(eps, ServeSettings.from_config(cfg).client) as one, \
                    ClassifyClient(eps, ServeSettings.from_config(cfg).client) as two:
                return await asyncio.gather(*(c.classify(r) for r in rows for c in (one, two)))

    recs = asyncio.run(scenario())
    assert [r["status"] for r in recs] == ["ok"] * 16
    events = [e for e in read_request_log(log) if e["event"] == "received" and not e["request_id"].startswith("smoke")]
    assert len(events) == 16 and len({e["send_id"] for e in events}) == 16


def test_wrong_key_is_fatal_with_a_clear_message(tmp_path, media):
    cfg = make_config(tmp_path, media)
    rows = _rows(cfg, media, 3)
    with pytest.raises(FatalClientError, match="401.*Unauthorized.*the key or the endpoint is wrong"):
        _run(cfg, tmp_path, rows, endpoints=lambda s: [(s.base_url, "wrong-key")])
    sent = [e for e in read_request_log(tmp_path / "requests.jsonl") if e.get("status") == 401]
    assert 1 <= len(sent) <= 3  # no retries of a refused key


def test_least_outstanding_requests_over_endpoints(tmp_path, media):
    cfg = make_config(tmp_path, media, classify={"concurrency": 8})
    slow_cfg = make_config(tmp_path, media)
    slow_log = tmp_path / "slow.jsonl"
    slow_cfg["classify"]["server_command"] = standin_command(sys.executable, slow_log, *YES_IF, "--latency", "0.4")
    rows = _rows(cfg, media, 40)

    async def scenario():
        with VLLMServer(ServeSettings.from_config(slow_cfg), tmp_path / "slow.log") as slow:
            await slow.wait_ready()
            with VLLMServer(ServeSettings.from_config(cfg), tmp_path / "fast.log") as fast:
                await fast.wait_ready()
                eps = [(slow.base_url, slow.api_key), (fast.base_url, fast.api_key)]
                async with ClassifyClient(eps, ServeSettings.from_config(cfg).client) as client:
                    recs = await asyncio.gather(*(client.classify(r) for r in rows))
                    return recs, [ep.sent for ep in client.endpoints.all]

    cfg["classify"]["server_command"] = standin_command(sys.executable, tmp_path / "fast.jsonl", *YES_IF,
                                                        "--latency", "0.02")
    recs, (slow_sent, fast_sent) = asyncio.run(scenario())
    assert all(r["status"] == "ok" for r in recs)
    assert slow_sent >= 1 and fast_sent > 2 * slow_sent
    assert slow_sent + fast_sent == 40


def test_refused_connections_are_connection_errors_and_traffic_moves_to_the_live_endpoint(tmp_path, media):
    cfg = make_config(tmp_path, media, classify={"concurrency": 4, "health_interval_s": 0.3})
    dead_url = f"http://127.0.0.1:{_closed_port()}/v1"
    recs, events, client = _run(cfg, tmp_path, _rows(cfg, media, 40), ("--latency", "0.1"),
                                endpoints=lambda s: [(dead_url, s.api_key), (s.base_url, s.api_key)])
    assert all(r["status"] == "ok" for r in recs)
    dead, live = client.endpoints.all
    assert dead.state == DOWN and live.state == UP and 1 <= dead.sent <= 4
    assert "ConnectionRefused" in dead.reason or "Connect call failed" in dead.reason
    resent = [r for r in recs if r["sends"] > 1]
    assert len(resent) == dead.sent  # each request the dead endpoint got was sent once more, no more
    assert all(r["attempts"] == 1 for r in recs)  # a refused connection is the server's fault: not charged


def test_scattered_503s_cost_one_round_trip_each_and_leave_the_limit_alone(tmp_path, media):
    # A 2 s back-off would show in the gaps: a scattered refusal is sent again at once.
    cfg = make_config(tmp_path, media, classify={"concurrency": 8, "max_attempts": 8,
                                                 "backoff_initial_s": 2, "backoff_max_s": 2})
    recs, events, client = _run(cfg, tmp_path, _rows(cfg, media, 120),
                                ("--random-503", "0.2", "--seed", "5", "--latency", "0.05"))
    assert all(r["status"] == "ok" for r in recs)
    refused = [e for e in events if e["event"] == "completed" and e["status"] == 503]
    assert len(refused) > 10
    assert sum(r["sends"] for r in recs) == 120 + len(refused)
    # A refused request's first resend is free (a second refusal in a row backs off and is charged).
    free = sum(r["sends"] for r in recs) - sum(r["attempts"] for r in recs)
    assert all(r["attempts"] <= r["sends"] for r in recs) and free >= len(refused) // 2
    assert client.limit.limit == 8
    received = sorted((e for e in events if e["event"] == "received"), key=lambda e: e["t"])
    gaps = [next(r["t"] for r in received if r["request_id"] == e["request_id"] and r["t"] > e["t"]) - e["t"]
            for e in refused]
    assert sorted(gaps)[len(gaps) // 2] < 0.2


def test_a_scattered_503_is_sent_again_at_once_without_spending_an_attempt(tmp_path, media):
    cfg = make_config(tmp_path, media, classify={"concurrency": 1, "max_attempts": 1, "backoff_initial_s": 30})
    # The first video request (chat request 2, after the smoke request) is refused once.
    recs, events, _ = _run(cfg, tmp_path, _rows(cfg, media, 3), ("--storm-503", "1:1"))
    assert [r["status"] for r in recs] == ["ok"] * 3
    assert sorted(r["sends"] for r in recs) == [1, 1, 2]  # with max_attempts 1
    assert all(r["attempts"] == 1 for r in recs)
    refused = next(e for e in events if e["event"] == "completed" and e["status"] == 503)
    resent = next(e for e in events if e["event"] == "received" and e["t"] > refused["t"])
    assert resent["request_id"] == refused["request_id"] and resent["t"] - refused["t"] < 1  # no back-off


def test_admission_503s_lower_the_limit_to_what_the_server_admits(tmp_path, media):
    # 2 running + 1 waiting: the stand-in refuses the 4th request at it, as vLLM's admission control does.
    cfg = make_config(tmp_path, media, classify={"concurrency": 12, "max_attempts": 10,
                                                 "backoff_initial_s": 0.1, "backoff_max_s": 1})
    recs, events, client = _run(cfg, tmp_path, _rows(cfg, media, 80),
                                ("--slots", "2", "--max-queued", "1", "--latency", "0.05"))
    assert all(r["status"] == "ok" for r in recs)
    assert client.limit.limit <= 4
    first_answer = min(e["t"] for e in events if e["event"] == "completed" and e["status"] == 200)
    refused = [e for e in events if e["event"] == "completed" and e["status"] == 503]
    later = [e for e in refused if e["t"] > first_answer + 0.5]
    # Once the limit has learnt the server's size, one probe per limit's worth of answers is refused
    # (each request retrying on its own would be refused over and over).
    assert len(later) <= 80 // 3


def test_adaptive_limits_are_per_copy_and_the_ceiling_is_concurrency_by_default(tmp_path, media):
    """On by default; floor and ceiling per server copy like classify.concurrency, so that a job of four
    copies may move between 4 x floor and 4 x ceiling (one job-wide ceiling of 64 would hold four 7B copies to
    a quarter of their 4 x 64)."""
    client = ServeSettings.from_config(make_config(tmp_path, media, classify={"concurrency": 6})).client
    assert (client.adaptive, client.adaptive_floor, client.adaptive_ceiling) == (True, 4, 6)
    four = client.for_copies(4)
    assert (four.concurrency, four.adaptive_floor, four.adaptive_ceiling) == (24, 16, 24)
    small = ServeSettings.from_config(make_config(tmp_path, media, classify={"concurrency": 2})).client
    assert (small.adaptive_floor, small.adaptive_ceiling) == (2, 2)  # the floor at most the ceiling
    set_ = ServeSettings.from_config(make_config(tmp_path, media, classify={
        "concurrency": 2, "adaptive_concurrency": {"ceiling": 12}})).client
    assert (set_.adaptive_floor, set_.adaptive_ceiling) == (4, 12)


def test_adaptive_concurrency_grows_to_fill_the_server(tmp_path, media):
    cfg = make_config(tmp_path, media, classify={
        "concurrency": 2, "adaptive_concurrency": {"enabled": True, "floor": 2, "ceiling": 12}})
    settings = dataclasses.replace(ServeSettings.from_config(cfg).client, adaptive_interval_s=0.1)
    recs, _, client = _run(cfg, tmp_path, _rows(cfg, media, 150), ("--slots", "8", "--latency", "0.1"),
                           settings=settings)
    limits = [lim for _, lim in client.limit_history]
    assert all(r["status"] == "ok" for r in recs)
    assert max(limits) >= 8  # grew from the floor until the 8 slots were busy
    assert max(limits) <= 12
