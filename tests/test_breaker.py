"""The breaker: a failure shared by many requests is the server's, stops the job once with its cause, and
journals nothing terminal for the requests it hit (issue 25). Stories on the stand-in, then the parts."""

from __future__ import annotations

import os
import time

import httpx
import pytest
from standin import read_request_log, vllm_shim
from standin.shards import YES_IF, make_video
from test_fault_matrix import _endpoint, _use_endpoints, make_shard, media  # noqa: F401 (fixtures)

from vidlabel.core.journal import iter_records
from vidlabel.serve import breaker as br
from vidlabel.serve.classify import ServerBelowPlan, ServerFailing
from vidlabel.serve.error_kinds import classify_error
from vidlabel.serve.server import BROKEN_SMOKE_TRIES, ServerError

PYNV = '{"video":{"fps":2,"backend":"pynvvideocodec"}}'


def sends(shard) -> list[dict]:
    return [e for e in shard.events() if e["event"] == "received"]


def terminal_errors(shard) -> list[dict]:
    return [r for r in iter_records(shard.journal) if r["status"] != "ok" and not r.get("retryable")]


# ---- stories -----------------------------------------------------------------------------------------

def test_a_server_failing_every_video_request_stops_each_run_and_the_fixed_server_labels_every_post(make_shard):
    """vLLM 0.26 with a video backend its Python cannot import answers every video request 500 "No module
    named 'PyNvVideoCodec'" (measured on an H200). Run three times, as the user and the profile's retries
    would: each run stops after two requests with the server's message and what to do; nothing is
    journaled; then the fixed server (the same command) labels every post."""
    shard = make_shard(30)
    for _ in range(3):
        before = len(sends(shard))
        with pytest.raises(ServerFailing) as info:
            shard.run(shard.config("--media-io-kwargs", PYNV))
        message = str(info.value)
        assert "No module named 'PyNvVideoCodec'" in message
        assert "pip install pynvvideocodec" in message and "server's Python" in message
        sent = sends(shard)[before:]
        # The first request alone, then one more to confirm: the same 500 twice, no answer in between.
        assert len({e["request_id"] for e in sent}) == 2
        assert len(sent) <= 4
    assert list(iter_records(shard.journal)) == []  # nothing journaled, so nothing terminal
    shard.run(shard.config())  # fixed; the same server command, so the same request fingerprints
    labels = shard.check_complete_labels()
    assert all(r["status"] == "ok" for r in labels.values())
    shard.check_journal_and_resends()


def test_an_endpoint_with_vllms_default_encoder_cache_stops_the_job_naming_its_size_and_the_fixes(
        make_shard, monkeypatch, tmp_path):
    """classify.endpoints at a vLLM started with its default flags (encoder cache 8192 tokens) while the
    plan assumes 32768: those answers describe the server, not the posts (26 of 41 holdout posts became
    terminal encoder_cache errors on a real server). The job stops at the first one, naming the server's
    figure and both fixes, with nothing terminal journaled; after a restart with the planned flag every
    post is labelled."""
    shard = make_shard(10)
    big = make_video(shard.media / "big-720p-12s.mp4", seconds=12, size="1280x720")  # 8,640 video tokens
    for i in (1, 3, 5, 7, 9):
        shard.posts[i]["media_path"] = str(big)
    shim = vllm_shim(tmp_path / "bin", *YES_IF, "--request-log", shard.request_log)
    monkeypatch.setenv("PATH", f"{shim.parent}{os.pathsep}{os.environ['PATH']}")
    # vidlabel's earlier media flags (no images, one flat pixel bound: vLLM's profiler then sizes its video
    # at 7 pairs of 24x32 cells; images enabled, or the image processor's own bound, would give a larger
    # cache: tests/standin/qwen_image.py), but vLLM's default --max-num-batched-tokens.
    vllm = ("vllm serve {model} --host 127.0.0.1 --port {port} --allowed-local-media-path {media_root} "
            "--limit-mm-per-prompt '{{\"image\":0,\"video\":1}}' "
            "--mm-processor-kwargs '{{\"min_pixels\":100352,\"max_pixels\":602112}}'")
    default_flags = _endpoint(shard, shard.config(server_command=vllm), "default", "k")
    try:
        cfg = _use_endpoints(shard.config(), monkeypatch, "k", default_flags)
        assert cfg["classify"]["max_num_batched_tokens"] == 32768  # the plan
        with pytest.raises(ServerBelowPlan) as info:
            shard.run(cfg)
    finally:
        default_flags.stop()
    message = str(info.value)
    assert "encoder cache" in message and "8192" in message and "32768" in message
    assert "--max-num-batched-tokens 32768" in message  # restart with the planned flag
    assert "classify.max_num_batched_tokens: 8192" in message  # or plan for the server's limit
    assert terminal_errors(shard) == []
    failed = [e for e in shard.events() if e["event"] == "completed" and e["status"] == 400]
    # Stopped at the first: at most the requests already in flight (classify.concurrency 4) of the 5 big ones.
    assert 1 <= len(failed) <= 4
    planned = _endpoint(shard, shard.config(server_command=vllm + " --max-num-batched-tokens 32768"), "planned", "k")
    try:
        shard.run(_use_endpoints(shard.config(), monkeypatch, "k", planned))
    finally:
        planned.stop()
    labels = shard.check_complete_labels()
    assert all(r["status"] == "ok" for r in labels.values())
    assert labels["post001"]["prompt_tokens"] > 8192


def test_vllm_0_33_s_cap_on_decoded_media_is_lifted_on_the_job_s_server_and_a_capped_one_stops_the_job(
        make_shard, monkeypatch):
    """vLLM 0.33 refuses (400) a request whose decoded frames exceed VLLM_MAX_MEDIA_REQUEST_DECODE_BYTES (its
    default: ~58 s of 1080p at 2 frames a second), a limit 0.26 did not have and the plan does not know. The
    job's own server runs without it; a cap set in the job's environment is kept, and the job stops before its
    traffic (a calibration video meets it first here; a post's, on the breaker's limits rule) naming it, nothing
    terminal journaled; unset, the rerun labels every post."""
    shard = make_shard(6)
    capped = ("--standin-version", "0.33.0", "--decode-bytes-default", "100000")  # under every test video
    monkeypatch.setenv("VLLM_MAX_MEDIA_REQUEST_DECODE_BYTES", "100000")
    with pytest.raises((ServerBelowPlan, ServerError)) as info:
        shard.run(shard.config(*capped))
    message = str(info.value)
    assert "VLLM_MAX_MEDIA_REQUEST_DECODE_BYTES=100000" in message
    assert "VLLM_MAX_MEDIA_REQUEST_DECODE_BYTES=0" in message  # the fix
    assert terminal_errors(shard) == []
    monkeypatch.delenv("VLLM_MAX_MEDIA_REQUEST_DECODE_BYTES")
    shard.run(shard.config(*capped))
    labels = shard.check_complete_labels()
    assert all(r["status"] == "ok" for r in labels.values())


def test_a_server_answering_500_to_everything_fails_at_once_with_its_message(make_shard):
    """vLLM opens its port only once the engine is up: a 500 to the smoke request means broken, not
    starting. The job fails after a few smoke requests, not after startup_timeout_s of polling."""
    shard = make_shard(4)
    with pytest.raises(ServerError) as info:
        shard.run(shard.config("--fail-all-with", "500:Internal server error", startup_timeout_s=20))
    message = str(info.value)
    assert "answered 500" in message and "Internal server error" in message
    assert "stand-in: listening on" in message  # the tail of the server's log
    smoke = [e for e in read_request_log(shard.request_log)
             if e["event"] == "received" and e["request_id"].startswith("smoke-")]
    assert len(smoke) == BROKEN_SMOKE_TRIES
    assert sends(shard) == []
    assert not shard.journal.exists() or not list(iter_records(shard.journal))


def test_an_endpoint_answering_500_to_its_smoke_request_is_not_used(make_shard, monkeypatch):
    """Its /health answers 200, so the health checks would bring it back: it stays down for the job."""
    shard = make_shard(24)
    broken = _broken_endpoint(shard, "k")
    live = _endpoint(shard, shard.config("--latency", "0.2"), "live", "k")
    try:
        shard.run(_use_endpoints(shard.config(health_interval_s=0.2), monkeypatch, "k", broken, live))
    finally:
        broken.stop()
        live.stop()
    assert all(r["status"] == "ok" for r in shard.check_complete_labels().values())
    assert {e["pid"] for e in sends(shard)} == {live.proc.pid}  # not one video request to the broken one
    smoke = [e for e in read_request_log(shard.request_log)
             if e["event"] == "received" and e["request_id"].startswith("smoke-") and e["pid"] == broken.proc.pid]
    assert len(smoke) == BROKEN_SMOKE_TRIES


def _broken_endpoint(shard, key: str):
    """A running endpoint whose /health answers 200 and every chat request, the smoke request included, 500."""
    from vidlabel.serve.server import VLLMServer
    from vidlabel.serve.settings import ServeSettings

    server = VLLMServer(ServeSettings.from_config(shard.config("--fail-all-with", "500:Internal server error")),
                        shard.tmp / "broken.log", api_key=key).start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{server.root_url}/health").status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    server.stop()
    raise AssertionError("the broken endpoint did not start")


# ---- the breaker's rules -----------------------------------------------------------------------------

PLAN = br.PlannedLimits(context=32768, encoder_cache=32768)
VIDEO, IMAGE = frozenset({"video"}), frozenset({"image"})


class Trips(list):
    def __call__(self, trip: br.Trip) -> None:
        self.append(trip)


def _breaker(**kw) -> tuple[br.Breaker, Trips]:
    trips = Trips()
    return br.Breaker(PLAN, trips, **kw), trips


def test_the_same_500_on_the_first_request_and_one_more_before_any_answer_trips():
    b, trips = _breaker()
    b.attempt("r1", "server_error", 500, "No module named 'PyNvVideoCodec'")
    assert not trips
    b.attempt("r1", "server_error", 500, "No module named 'PyNvVideoCodec'")  # its own retry: still one request
    assert not trips
    b.attempt("r2", "server_error", 500, "No module named 'PyNvVideoCodec'")
    (trip,) = trips
    assert trip.kind == "server" and "pip install pynvvideocodec" in trip.message
    assert "2 requests" in trip.message and "before any answer" in trip.message


def test_before_any_answer_requests_of_different_kinds_failing_alike_trip():
    b, trips = _breaker()
    b.attempt("v1", "server_error", 500, "EngineCore died", kinds=VIDEO, server="http://a")
    b.attempt("p1", "server_error", 500, "EngineCore died", kinds=IMAGE, server="http://a")
    (trip,) = trips
    assert "2 requests failed the same way before any answer" in trip.message
    assert "the server's engine died" in trip.message


def test_a_first_request_failing_alone_is_its_own_once_another_is_answered():
    b, trips = _breaker()
    b.attempt("r1", "server_error", 500, "division by zero", kinds=VIDEO)
    b.attempt("r2", None, 200, None, kinds=VIDEO)  # the server answers other videos
    for i in range(3, 3 + br.FAILURE_RUN - 1):
        b.attempt(f"r{i}", "server_error", 500, "division by zero", kinds=VIDEO)
        b.attempt(f"p{i}", None, 200, None, kinds=IMAGE)  # photo answers say nothing about the videos
    assert not trips  # fewer than a run of distinct video requests since the last video answered
    b.attempt("r99", "server_error", 500, "division by zero", kinds=VIDEO)
    assert len(trips) == 1 and f"{br.FAILURE_RUN} requests with a video in a row" in trips[0].message


def test_a_video_answered_in_between_resets_the_run():
    b, trips = _breaker()
    b.attempt("r0", None, 200, None, kinds=VIDEO)
    for i in range(3 * br.FAILURE_RUN):
        b.attempt(f"r{i}", "server_error", 500, "division by zero", kinds=VIDEO)
        if i % (br.FAILURE_RUN - 1) == 0:
            b.attempt(f"ok{i}", None, 200, None, kinds=VIDEO)
    assert not trips


@pytest.mark.parametrize("order", ["photos first", "interleaved", "videos first"])
def test_every_video_failing_while_photos_answer_trips_whatever_the_order(order):
    """A server whose video decoder cannot load answers every photo and fails every video the same way:
    the second video failing trips, with the server's message, however the post types come."""
    posts = {"photos first": ["p", "p", "p", "v", "p", "v", "p", "v"], "interleaved": ["p", "v", "p", "v", "p", "v"],
             "videos first": ["v", "v", "p", "p"]}[order]
    b, trips = _breaker()
    for i, post in enumerate(posts):
        if post == "p":
            b.attempt(f"p{i}", None, 200, None, kinds=IMAGE, server="http://a")
        else:
            for _ in range(3):  # a request's retries are one request
                b.attempt(f"v{i}", "bad_media", 500, "Failed to load video with backend torchcodec: no decoder",
                          kinds=VIDEO, server="http://a")
    (trip,) = trips
    assert trip.kind == "media" and "Failed to load video with backend torchcodec" in trip.message
    assert f"{br.FIRST_CONTACT_RUN} requests with a video, none of which the server answered" in trip.message


def test_a_carousel_answered_proves_videos_and_photos():
    b, trips = _breaker()
    b.attempt("c1", None, 200, None, kinds=frozenset({"image", "video"}))
    for i in range(br.FAILURE_RUN - 1):
        b.attempt(f"v{i}", "server_error", 500, "division by zero", kinds=VIDEO)
    assert not trips  # videos were answered (in the carousel): fewer than a run
    b.attempt("v99", "server_error", 500, "division by zero", kinds=VIDEO)
    assert len(trips) == 1


def test_the_same_500_on_videos_while_photos_answer_names_what_is_shared():
    b, trips = _breaker()
    b.attempt("p1", None, 200, None, kinds=IMAGE, server="http://a")
    b.attempt("v1", "server_error", 500, "No module named 'PyNvVideoCodec'", kinds=VIDEO, server="http://a")
    assert not trips
    b.attempt("v2", "server_error", 500, "No module named 'PyNvVideoCodec'", kinds=VIDEO, server="http://a")
    (trip,) = trips
    assert trip.kind == "server" and "2 requests with a video failed the same way on http://a" in trip.message
    assert "while it answered 1 other requests" in trip.message and "pip install pynvvideocodec" in trip.message


def test_failures_are_judged_per_server():
    """Videos answered on one server prove nothing about another: the one failing every video trips."""
    b, trips = _breaker()
    for i in range(5):
        b.attempt(f"a{i}", None, 200, None, kinds=VIDEO, server="http://a")
    b.attempt("v1", "server_error", 500, "Internal server error", kinds=VIDEO, server="http://b")
    assert not trips
    b.attempt("v2", "server_error", 500, "Internal server error", kinds=VIDEO, server="http://b")
    assert len(trips) == 1 and "on http://b" in trips[0].message


def test_connections_dropped_on_every_video_while_photos_answer_trip():
    b, trips = _breaker()
    b.attempt("v1", "connection", None, "http://a: Server disconnected", kinds=VIDEO, server="http://a")
    b.attempt("v2", "connection", None, "http://a: Server disconnected", kinds=VIDEO, server="http://a")
    assert not trips  # not yet known whether the server is still up
    b.attempt("p1", None, 200, None, kinds=IMAGE, server="http://a")  # it is: the drops were about the videos
    (trip,) = trips
    assert trip.kind == "server" and "dropped the connection of 2 requests with a video" in trip.message


def test_connections_dropped_by_a_server_that_went_away_are_not_counted():
    b, trips = _breaker()
    b.attempt("p1", None, 200, None, kinds=IMAGE, server="http://a")
    for i in range(10):  # the server died: everything in flight dropped, nothing answered after
        b.attempt(f"v{i}", "connection", None, "http://a: Server disconnected", kinds=VIDEO, server="http://a")
    b.attempt("r1", "connection", None, "http://a: Cannot connect", charged=False, kinds=VIDEO, server="http://a")
    b.attempt("p2", None, 200, None, kinds=IMAGE, server="http://b")  # another server answers
    assert not trips


def test_evidence_by_server_and_kind():
    e = br.Evidence()
    e.answered("http://a", IMAGE)
    e.answered("http://a", frozenset({"image", "video"}))
    assert e.peers("http://a", IMAGE) == 2 and e.peers("http://a", VIDEO) == 1 and e.peers("http://b", IMAGE) == 0
    assert e.peers("http://a", frozenset({"image", "video"})) == 1
    assert e.proven(VIDEO) and e.proven(VIDEO, "http://a") and not e.proven(VIDEO, "http://b")
    assert not e.proven(frozenset({"text"}))


def test_busy_and_unreachable_are_not_the_breakers_business():
    b, trips = _breaker()
    for i in range(50):
        b.attempt(f"r{i}", "server_overloaded", 503, "The engine is currently busy and cannot accept new requests.")
        b.attempt(f"r{i}", "connection", None, "Connection refused")
    assert not trips and not b.answered_any


def test_a_server_that_answers_nothing_within_the_deadline_trips():
    b, trips = _breaker()
    b.attempt("r1", "timeout", None, "no answer within 900 s (classify.request_timeout_s)")
    b.attempt("r2", "timeout", None, "no answer within 900 s (classify.request_timeout_s)")
    assert len(trips) == 1 and "answered nothing" in trips[0].message


@pytest.mark.parametrize("kind, message, figure, flag, key", [
    ("encoder_cache", "The decoder prompt contains a(n) video item with 18720 embedding tokens, which exceeds the "
                      "pre-allocated encoder cache size 8192. Please reduce the input size or increase the encoder "
                      "cache size by setting --limit-mm-per-prompt at startup.", 8192,
     "--max-num-batched-tokens 32768", "classify.max_num_batched_tokens: 8192"),
    ("too_long", "This model's maximum context length is 16384 tokens. However, you requested 64 output tokens "
                 "and your prompt contains 20000 input tokens, for a total of 20064 tokens. Please reduce the "
                 "length of the input prompt or the number of requested output tokens.", 16384,
     "--max-model-len 32768", "classify.max_model_len: 16384"),
    ("too_long", "Input length (20000) exceeds model's maximum context length (16384).", 16384,
     "--max-model-len 32768", "classify.max_model_len: 16384"),
    ("too_long", "The decoder prompt (length 20000) is longer than the maximum model length of 16384. Make sure "
                 "that `max_model_len` is no smaller than the number of text tokens plus multimodal tokens.",
     16384, "--max-model-len 32768", "classify.max_model_len: 16384"),
    ("too_long", "The prompt (total length 43698) is too long to fit into the model (context length 16384). Make "
                 "sure that `max_model_len` is no smaller than the number of text tokens plus multimodal tokens.",
     16384, "--max-model-len 32768", "classify.max_model_len: 16384"),
])
def test_limits_below_the_plan_trip_at_once_naming_the_figure_and_both_fixes(kind, message, figure, flag, key):
    assert br.server_limit(kind, message) == figure
    b, trips = _breaker()
    b.attempt("r1", None, 200, None)
    b.attempt("r2", kind, 400, message)
    (trip,) = trips
    assert trip.kind == "limits" and str(figure) in trip.message and flag in trip.message and key in trip.message


def test_a_refusal_under_vllm_0_33_s_decoded_media_cap_trips_at_once_naming_the_variable():
    message = ("Request decoded media exceeds VLLM_MAX_MEDIA_REQUEST_DECODE_BYTES=715827880 (746496000 bytes).")
    assert classify_error(400, message, ["/data/a.mp4"]) == ("decode_cap", False)
    b, trips = _breaker()
    b.attempt("r1", None, 200, None)
    b.attempt("r2", "decode_cap", 400, message)
    (trip,) = trips
    assert trip.kind == "limits" and "715,827,880 bytes" in trip.message
    assert "VLLM_MAX_MEDIA_REQUEST_DECODE_BYTES=0" in trip.message and "planning.transcode.enabled" in trip.message


def test_a_too_long_post_under_the_planned_limit_is_its_own():
    b, trips = _breaker()
    for i in range(br.FAILURE_RUN * 2):
        b.attempt(f"r{i}", "too_long", 400, "Input length (40000) exceeds model's maximum context length (32768).")
        b.attempt(f"e{i}", "encoder_cache", 400, "The decoder prompt contains a(n) video item with 40000 embedding "
                                                  "tokens, which exceeds the pre-allocated encoder cache size 32768.")
    assert not trips


def test_held_records_are_journaled_once_an_answer_of_their_kind_shows_the_server_works():
    b, _ = _breaker()
    err = {"request_id": "r1", "status": "error", "http_status": 400, "error_kind": "server_error"}
    ok = {"request_id": "r2", "status": "ok", "http_status": 200, "error_kind": None}
    photo = {"request_id": "p1", "status": "ok", "http_status": 200, "error_kind": None}
    assert b.settle(err, VIDEO, answered=False) == []
    assert b.settle(photo, IMAGE, answered=True) == [photo]  # a photo answered shows nothing about videos
    assert b.settle(ok, VIDEO, answered=True) == [err, ok]
    carousel = dict(err, request_id="c1")
    assert b.settle(carousel, frozenset({"image", "video"}), answered=False) == []
    assert b.settle(photo, IMAGE, answered=True) == [photo]
    assert b.settle(ok, VIDEO, answered=True) == [carousel, ok]  # both its kinds answered since
    assert b.settle(dict(err, request_id="r3"), VIDEO, answered=False) == []
    assert b.release() == [dict(err, request_id="r3")]  # the job ended without a trip: the request's own
    b.settle(dict(err, request_id="r4"), VIDEO, answered=False)
    b.trip(br.Trip("server", "broken"))
    assert b.settle(dict(err, request_id="r5"), VIDEO, answered=False) == [] and b.release() == []
    assert b.settle(ok, VIDEO, answered=True) == [ok]  # an answer that finished as the job stopped is kept


@pytest.mark.parametrize("message, cause", [
    ("No module named 'PyNvVideoCodec'", "pip install pynvvideocodec"),
    ("No module named 'foo_bar'", "install the package that provides foo_bar"),
    ("Internal server error", "the server fails every request: its log says why"),
])
def test_probable_cause(message, cause):
    assert cause in br.probable_cause("server_error", 500, message)


def test_error_signature_ignores_paths_and_numbers():
    a = br.signature(500, "[Errno 2] No such file or directory: '/data/a/1.mp4'")
    assert a == br.signature(500, "[Errno 2] No such file or directory: '/data/b/22.mp4'")
    assert a != br.signature(400, "[Errno 2] No such file or directory: '/data/a/1.mp4'")

