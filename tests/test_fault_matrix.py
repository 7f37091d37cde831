"""Fault matrix of the classify job (issue 3): each fault checks the job outcome, the journal, the
final labels, and from the stand-in's request log that nothing that finished was sent again."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from standin import is_probe, max_in_flight, read_request_log
from standin.shards import (
    expected_answers,
    make_config,
    make_video,
    manifest_rows,
    write_manifest,
)

from vidlabel.core.journal import iter_records, read_latest
from vidlabel.prepare.planning import allowed_media_path
from vidlabel.serve.classify import ShardIncomplete, ShardLocked, run_shard
from vidlabel.serve.error_kinds import FatalClientError
from vidlabel.serve.server import ServerError, VLLMServer
from vidlabel.serve.settings import ServeSettings

JOB_SCRIPT = Path(__file__).resolve().parent / "standin" / "job.py"
SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("media")
    make_video(root / "clip.mp4")
    return root


class Shard:
    """One shard's files plus the checks every fault test makes."""

    def __init__(self, tmp: Path, media: Path, posts: list[dict]):
        self.tmp, self.media, self.posts = tmp, media, posts
        self.manifest = tmp / "manifest" / "shard-0.parquet"
        self.labels = tmp / "labels" / "shard-0.parquet"
        self.journal = tmp / "journal" / "shard-0.jsonl"
        self.server_log = tmp / "logs" / "server-0.log"
        self.request_log = tmp / "requests.jsonl"
        self.rows: list[dict] = []

    def config(self, *faults: str, **classify) -> dict:
        cfg = make_config(self.tmp, self.media, self.request_log, faults, classify)
        if not self.rows:
            self.rows = manifest_rows(cfg, self.posts)
            write_manifest(self.manifest, self.rows)
        return cfg

    def run(self, cfg: dict) -> None:
        run_shard(cfg, self.manifest, self.labels, self.journal, self.server_log, 0)

    def start_job(self, cfg: dict) -> subprocess.Popen:
        cfg_path = self.tmp / f"config-{time.monotonic_ns()}.json"
        cfg_path.write_text(json.dumps(cfg))
        env = {**os.environ, "PYTHONPATH": str(SRC)}
        out = open(self.tmp / "job.log", "ab")
        return subprocess.Popen([sys.executable, str(JOB_SCRIPT), str(cfg_path), str(self.manifest),
                                 str(self.labels), str(self.journal), str(self.server_log), "0"],
                                stdout=out, stderr=subprocess.STDOUT, env=env)

    def rid(self, post_id: str) -> str:
        return next(r["request_id"] for r in self.rows if r["post_id"] == post_id)

    def events(self) -> list[dict]:
        return [e for e in read_request_log(self.request_log) if e.get("request_id") and not is_probe(e["request_id"])]

    def labels_by_post(self) -> dict[str, dict]:
        table = pq.read_table(self.labels)
        return {r["post_id"]: r for r in table.to_pylist()}

    def check_journal_and_resends(self) -> dict[str, dict]:
        """Each request has at most one terminal record, and no request was sent after it finished."""
        raw = list(iter_records(self.journal))
        terminal: dict[str, dict] = {}
        for rec in raw:
            if rec["status"] == "ok" or not rec.get("retryable"):
                assert rec["request_id"] not in terminal, f"second terminal record for {rec['request_id']}"
                terminal[rec["request_id"]] = rec
        for ev in self.events():
            rec = terminal.get(ev["request_id"])
            if ev["event"] == "received" and rec is not None:
                assert ev["t"] <= rec["finished_at"] + 1e-3, f"{ev['request_id']} was sent again after it finished"
        return terminal

    def check_complete_labels(self) -> dict[str, dict]:
        """The labels hold one terminal row per request; ok rows carry the stand-in rule's answers."""
        labels = self.labels_by_post()
        assert sorted(labels) == sorted(p["post_id"] for p in self.posts)
        latest = read_latest(self.journal, "request_id")
        for p in self.posts:
            row = labels[p["post_id"]]
            assert row["request_id"] == self.rid(p["post_id"])
            assert row["status"] in ("ok", "error")
            assert row["status"] == latest[row["request_id"]]["status"]
            if row["status"] == "ok":
                assert row["error_kind"] is None
                assert json.loads(row["answers"]) == expected_answers(p.get("caption"), p.get("transcript"))
                assert row["prompt_tokens"] > 0 and row["completion_tokens"] > 0
            else:
                assert row["error_kind"] and row["error"]
        return labels


def _posts(media: Path, n: int, special: dict[int, dict] | None = None) -> list[dict]:
    posts = []
    for i in range(n):
        p = {"post_id": f"post{i:03d}", "media_path": str(media / "clip.mp4"),
             "caption": "buy this now" if i % 2 else "a quiet day",
             "transcript": "we ate pizza" if i % 3 == 0 else "nothing to say"}
        p.update((special or {}).get(i, {}))
        posts.append(p)
    return posts


@pytest.fixture
def make_shard(tmp_path, media):
    def make(n: int = 12, special: dict[int, dict] | None = None) -> Shard:
        return Shard(tmp_path, media, _posts(media, n, special))
    return make


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _journal_count(path: Path) -> int:
    return sum(1 for _ in iter_records(path)) if path.exists() else 0


def _assert_process_gone(server_log: Path) -> None:
    pids = [int(line.split("pid ")[1].split(")")[0]) for line in server_log.read_text().splitlines()
            if line.startswith("stand-in: starting (pid ")]
    assert pids
    for pid in pids:
        _wait_for(lambda: not Path(f"/proc/{pid}").exists() or
                  Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z", 10, f"server pid {pid} to exit")


# ---- transient faults: the job completes in one run ------------------------------------------------

def test_503_storm_is_retried_and_slows_the_client(make_shard):
    shard = make_shard(12)
    # Chat requests 3..14 answer 503 with Retry-After (1 is the smoke request, 2 the media check,
    # which goes alone).
    shard.run(shard.config("--storm-503", "2:12", "--retry-after", "0.2", max_attempts=10))
    labels = shard.check_complete_labels()
    assert all(r["status"] == "ok" for r in labels.values())
    events = shard.events()
    busy = [e for e in events if e["event"] == "completed" and e["status"] == 503]
    assert len(busy) == 12
    assert sum(r["attempts"] for r in labels.values()) == 12 + 12
    # The shared gate: after the first 503s nobody sent for the Retry-After period, so the storm
    # was absorbed in a few waves instead of one retry per request as fast as possible.
    first_503 = min(e["t"] for e in busy)
    oks = [e["t"] for e in events if e["event"] == "completed" and e["status"] == 200 and e["t"] > first_503]
    assert min(oks) >= first_503 + 0.2 - 0.05
    shard.check_journal_and_resends()


def test_random_500s_are_retried(make_shard, caplog):
    shard = make_shard(16)
    with caplog.at_level("INFO", logger="vidlabel.serve.classify"):
        shard.run(shard.config("--random-500", "0.3", "--seed", "7", max_attempts=12))
    progress = [r.getMessage() for r in caplog.records if "req/s" in r.getMessage()]
    assert progress and re.fullmatch(
        r"shard 0: 16/16 done \(16 ok, 0 error this run\), [\d.]+ req/s, \d+ input tok/s, "
        r"[\d.]+ output tok/s, ETA [\d.]+ min", progress[-1])
    labels = shard.check_complete_labels()
    assert all(r["status"] == "ok" for r in labels.values())
    failures = [e for e in shard.events() if e["event"] == "completed" and e["status"] == 500]
    assert failures, "the fault was not injected"
    assert sum(r["attempts"] for r in labels.values()) == 16 + len(failures)
    shard.check_journal_and_resends()


def test_progress_line_says_stalled_rather_than_an_eta_while_nothing_finishes():
    from vidlabel.serve.progress import Progress

    progress = Progress(total=10, already=2, shard=3, interval_s=10)
    progress.in_flight = lambda: 4
    progress.last_finish -= 25  # nothing has answered yet this run: a slow start, not a stall
    assert progress.line().endswith("first answers pending for 25 s (4 in flight)")
    progress.finished({"status": "ok", "prompt_tokens": 500, "completion_tokens": 9})
    assert progress.line().endswith("ETA ?")  # one answer: no rate yet
    progress.finished({"status": "ok", "prompt_tokens": 500, "completion_tokens": 9})
    assert re.search(r"4/10 done .*, 4 in flight, ETA [\d.]+ min$", progress.line())
    progress.in_flight_limit = lambda: 9  # the client's limit, fitted or adaptive: said beside the count
    assert re.search(r", 4 in flight \(limit 9\), ETA [\d.]+ min$", progress.line())
    progress.last_finish -= 30
    assert progress.line().endswith("stalled for 30 s (4 in flight, none finished)")
    progress.in_flight = lambda: 0  # nothing in flight: waiting for nothing is not a stall
    assert "ETA" in progress.line()


def test_connection_reset_mid_response_is_retried(make_shard):
    shard = make_shard(8, {1: {"caption": "buy resetword"}, 4: {"caption": "resetword"}})
    shard.run(shard.config("--reset-on", "resetword:1"))
    labels = shard.check_complete_labels()
    assert all(r["status"] == "ok" for r in labels.values())
    assert labels["post001"]["attempts"] == 2 and labels["post004"]["attempts"] == 2
    assert {r["attempts"] for k, r in labels.items() if k not in ("post001", "post004")} == {1}
    resets = [e for e in shard.events() if e["event"] == "completed" and e["status"] == 0]
    assert {e["request_id"] for e in resets} == {shard.rid("post001"), shard.rid("post004")}
    shard.check_journal_and_resends()


def test_hang_on_one_request_times_out_and_is_retried(make_shard):
    shard = make_shard(8, {3: {"caption": "hangword"}})
    shard.run(shard.config("--hang-on", "hangword:1", request_timeout_s=1.5))
    labels = shard.check_complete_labels()
    assert all(r["status"] == "ok" for r in labels.values())
    assert labels["post003"]["attempts"] == 2
    rid = shard.rid("post003")
    # (the stand-in also logs which media file it read: not part of this sequence)
    events = [e["event"] for e in shard.events() if e["request_id"] == rid and e["event"] != "media"]
    assert events[:3] == ["received", "hanging", "cancelled"]  # the client went away; vLLM cancels
    shard.check_journal_and_resends()


def test_request_that_always_hangs_ends_as_timeout_after_a_rerun(make_shard):
    shard = make_shard(6, {2: {"caption": "hangword"}})
    cfg = shard.config("--hang-on", "hangword", request_timeout_s=1.5, max_attempts=2)
    with pytest.raises(ShardIncomplete, match="1 requests still need a retry"):
        shard.run(cfg)
    assert not shard.labels.exists()
    rec = read_latest(shard.journal, "request_id")[shard.rid("post002")]
    assert rec["error_kind"] == "timeout" and rec["retryable"] and rec["attempts"] == 2
    shard.run(cfg)  # the rerun tries it again, then gives up with a clear record
    labels = shard.check_complete_labels()
    row = labels["post002"]
    assert (row["status"], row["error_kind"], row["attempts"]) == ("error", "timeout", 4)
    # Only the hanging request was sent in the second run, and one answered request as a control: with
    # nothing else to send, it shows that the server answers (else the attempts would not count).
    second = [e for e in shard.events() if e["event"] == "received"]
    assert sum(e["request_id"] == shard.rid("post002") for e in second) == 4
    assert len(second) == 6 - 1 + 4 + 1
    assert len([e for e in second if e["request_id"].startswith("control-")]) == 1
    shard.check_journal_and_resends()


# ---- permanent per-request errors: clear records, no retry ------------------------------------------

def test_invalid_json_keeps_raw_text(make_shard):
    shard = make_shard(6, {2: {"caption": "badjson please"}})
    shard.run(shard.config("--invalid-json-on", "badjson"))
    labels = shard.check_complete_labels()
    row = labels["post002"]
    assert (row["status"], row["error_kind"], row["attempts"]) == ("error", "invalid_output", 1)
    assert row["raw_text"].startswith("Sure! Here are the answers")
    assert row["answers"] is None
    assert sum(r["status"] == "ok" for r in labels.values()) == 5
    shard.check_journal_and_resends()


def test_truncated_output_gets_one_retry_at_twice_the_tokens(make_shard):
    shard = make_shard(6, {1: {"caption": "longword"}, 4: {"caption": "rambleword"}})
    shard.run(shard.config("--verbose-on", "longword=100", "--verbose-on", "rambleword=100000", max_tokens=64))
    labels = shard.check_complete_labels()
    # The retry at twice the tokens is one more send, not an attempt charged to the request.
    assert (labels["post001"]["status"], labels["post001"]["attempts"], labels["post001"]["sends"]) == ("ok", 1, 2)
    row = labels["post004"]
    assert (row["status"], row["error_kind"], row["attempts"], row["sends"], row["finish_reason"]) == \
        ("error", "truncated", 1, 2, "length")
    assert row["raw_text"] and row["completion_tokens"] == 64 * 2  # the one retry, at 2x max_tokens
    sent = [e for e in shard.events() if e["request_id"] == shard.rid("post004") and e["event"] == "completed"]
    assert [e["completion_tokens"] for e in sent] == [64, 128]  # what a runaway answer cost in all
    shard.check_journal_and_resends()


def test_too_long_and_encoder_cache_are_permanent(make_shard):
    """Refusals at the server's planned limits are the posts' own (below the plan they are the server's:
    test_breaker.py)."""
    shard = make_shard(6, {0: {"transcript": "word " * 4000}})
    big = shard.media / "big.mp4"
    if not big.exists():
        make_video(big, seconds=2, size="320x240")
    shard.posts[5]["media_path"] = str(big)
    cache = 300  # video tokens: the clip's fit, the big one's not (file size / 64 in this stand-in mode)
    assert 2 + (shard.media / "clip.mp4").stat().st_size // 64 < cache < 2 + big.stat().st_size // 64
    cfg = shard.config("--video-tokens", "bytes", "--max-model-len", "3000", "--encoder-cache-tokens", str(cache),
                       max_model_len=3000, max_num_batched_tokens=cache)
    shard.run(cfg)
    labels = shard.check_complete_labels()
    assert (labels["post000"]["error_kind"], labels["post000"]["http_status"], labels["post000"]["attempts"]) == \
        ("too_long", 400, 1)
    assert (labels["post005"]["error_kind"], labels["post005"]["http_status"], labels["post005"]["attempts"]) == \
        ("encoder_cache", 400, 1)
    assert sum(r["status"] == "ok" for r in labels.values()) == 4
    shard.check_journal_and_resends()


def test_missing_video_and_path_outside_media_root_are_bad_media(make_shard):
    shard = make_shard(5)
    shard.posts[1]["media_path"] = str(shard.media / "gone.mp4")
    # Outside the one directory the server may read (the parent of media_root and the transcoded media).
    elsewhere = Path(tempfile.mkdtemp(prefix="vidlabel-outside-"))
    shard.posts[3]["media_path"] = str(make_video(elsewhere / "x.mp4"))
    config = shard.config()  # writes the manifest
    assert not str(elsewhere).startswith(allowed_media_path(config) + os.sep)
    try:
        shard.run(config)
    finally:
        shutil.rmtree(elsewhere)
    labels = shard.check_complete_labels()
    assert (labels["post001"]["error_kind"], labels["post001"]["http_status"], labels["post001"]["attempts"]) == \
        ("bad_media", 500, 1)
    assert "No such file or directory" in labels["post001"]["error"]
    assert (labels["post003"]["error_kind"], labels["post003"]["http_status"]) == ("bad_media", 400)
    assert "subpath" in labels["post003"]["error"]
    shard.check_journal_and_resends()


# ---- the server fails: the job stops quickly, the rerun completes ------------------------------------

def test_server_crash_stops_the_job_and_the_rerun_completes(make_shard):
    shard = make_shard(20)
    with pytest.raises(ServerError, match="server exited with status 3"):
        shard.run(shard.config("--crash-after", "8", "--latency", "0.05", request_timeout_s=30, max_attempts=50,
                               backoff_initial_s=0.5, backoff_max_s=1))
    assert not shard.labels.exists()
    first = read_latest(shard.journal, "request_id")
    # The watchdog stopped the job: the requests cut off by the crash were not recorded as
    # connection errors one by one; only answered requests are in the journal.
    assert 1 <= len(first) <= 7 and all(r["status"] == "ok" for r in first.values())
    _assert_process_gone(shard.server_log)
    shard.run(shard.config())
    shard.check_complete_labels()
    shard.check_journal_and_resends()


def test_health_failing_stops_the_job(make_shard, caplog):
    shard = make_shard(60)
    with caplog.at_level("ERROR", logger="asyncio"):
        with pytest.raises(ServerError, match="/health failed"):
            shard.run(shard.config("--unhealthy-after", "4", "--latency", "0.2", health_interval_s=0.2))
        gc.collect()
    assert not shard.labels.exists()
    _assert_process_gone(shard.server_log)
    assert len(read_latest(shard.journal, "request_id")) < 60
    # The requests cut off in flight leave no "_GatheringFuture exception was never retrieved".
    assert "never retrieved" not in caplog.text


def test_dead_server_copy_moves_its_traffic_to_the_live_copy(make_shard):
    shard = make_shard(40)
    job = shard.start_job(shard.config("--latency", "0.1", parallelism={"tensor": 1, "data": 2}, concurrency=2))
    copy1 = shard.server_log.with_name("server-0.copy-1.log")
    _wait_for(lambda: _journal_count(shard.journal) >= 6, 60, "6 finished requests")
    pid = int(copy1.read_text().split("stand-in: starting (pid ")[1].split(")")[0])
    os.kill(pid, signal.SIGKILL)
    killed_at = time.time()
    assert job.wait(timeout=120) == 0
    assert "copy 1: server exited" in (shard.tmp / "job.log").read_text()
    labels = shard.check_complete_labels()
    assert all(r["status"] == "ok" for r in labels.values())
    shard.check_journal_and_resends()
    late = {e["pid"] for e in shard.events() if e["event"] == "received" and e["t"] > killed_at + 0.5}
    assert late and pid not in late  # the live copy took the rest


# ---- external endpoints: a dead one is noticed within seconds ---------------------------------------

def _endpoint(shard: Shard, cfg: dict, name: str, key: str) -> VLLMServer:
    """A running server for endpoints mode (the stand-in of ``cfg``'s server command)."""
    server = VLLMServer(ServeSettings.from_config(cfg), shard.tmp / f"{name}.log", api_key=key).start()
    asyncio.run(server.wait_ready())
    return server


def _use_endpoints(cfg: dict, monkeypatch, key: str, *servers: VLLMServer) -> dict:
    monkeypatch.setenv("MY_VLLM_KEY", key)
    cfg["classify"].update(endpoints=[s.base_url for s in servers], api_key_env="MY_VLLM_KEY",
                           server_command="false never started {port}")
    return cfg


def test_crashed_endpoint_moves_its_traffic_to_the_live_one(make_shard, monkeypatch):
    shard = make_shard(40)
    # The arrivals count the two smoke requests: the crash comes with the 7th request of the job.
    crashing = _endpoint(shard, shard.config("--crash-after", "8", "--latency", "0.1"), "a", "k")
    live = _endpoint(shard, shard.config("--latency", "0.1"), "b", "k")
    try:
        # The health checks' period is long: a refused request, not the period, gets the dead one checked.
        cfg = _use_endpoints(shard.config(request_timeout_s=600, health_interval_s=60), monkeypatch, "k",
                             crashing, live)
        t0 = time.monotonic()
        shard.run(cfg)
        elapsed = time.monotonic() - t0
    finally:
        crashing.stop()
        live.stop()
    labels = shard.check_complete_labels()
    assert all(r["status"] == "ok" for r in labels.values())
    assert elapsed < 30  # not a request timeout per request
    shard.check_journal_and_resends()
    assert [e for e in read_request_log(shard.request_log) if e["event"] == "crash"]


def test_classify_concurrency_is_per_endpoint(make_shard, monkeypatch):
    """Two external servers get classify.concurrency each, as two copies of the job's own server do
    (and as pilot.request_slots plans): 3 in flight per endpoint, 6 in all."""
    shard = make_shard(30)
    # Slow answers and slots for all: only the client's limit bounds what the servers hold at once.
    servers = [_endpoint(shard, shard.config("--latency", "0.4", "--slots", "32"), name, "k") for name in "ab"]
    try:
        shard.run(_use_endpoints(shard.config(concurrency=3), monkeypatch, "k", *servers))
    finally:
        for server in servers:
            server.stop()
    assert all(r["status"] == "ok" for r in shard.check_complete_labels().values())
    events = shard.events()
    assert max_in_flight(events) == 2 * 3
    by_server = {pid: [e for e in events if e["pid"] == pid] for pid in {e["pid"] for e in events}}
    assert len(by_server) == 2 and all(max_in_flight(e) == 3 for e in by_server.values())


def test_lone_endpoint_crash_stops_the_job_quickly_and_the_rerun_completes(make_shard, monkeypatch):
    shard = make_shard(40)
    crashing = _endpoint(shard, shard.config("--crash-after", "8", "--latency", "0.1"), "a", "k")
    try:
        cfg = _use_endpoints(shard.config(request_timeout_s=600, health_interval_s=60, max_attempts=50),
                             monkeypatch, "k", crashing)
        t0 = time.monotonic()
        with pytest.raises(ServerError, match=rf"{crashing.base_url}: /health failed 3 times"):
            shard.run(cfg)
        assert time.monotonic() - t0 < 30
    finally:
        crashing.stop()
    first = read_latest(shard.journal, "request_id")
    assert 1 <= len(first) < 40 and all(r["status"] == "ok" for r in first.values())  # journal flushed
    live = _endpoint(shard, shard.config(), "b", "k")
    try:
        shard.run(_use_endpoints(shard.config(), monkeypatch, "k", live))
    finally:
        live.stop()
    shard.check_complete_labels()
    shard.check_journal_and_resends()


def test_endpoint_busy_at_the_start_is_asked_again(make_shard, monkeypatch):
    shard = make_shard(6)
    # Chat requests 2 and 3 (the job's smoke request and its first retry) answer 503.
    busy = _endpoint(shard, shard.config("--storm-503", "1:2"), "a", "k")
    try:
        shard.run(_use_endpoints(shard.config(), monkeypatch, "k", busy))
    finally:
        busy.stop()
    assert all(r["status"] == "ok" for r in shard.check_complete_labels().values())


def test_wrong_api_key_stops_the_job_at_once_with_a_clear_message(make_shard, monkeypatch):
    shard = make_shard(6)
    external = _endpoint(shard, shard.config(), "a", "the-key")
    try:
        cfg = _use_endpoints(shard.config(), monkeypatch, "not-the-key", external)
        with pytest.raises(FatalClientError, match=r"refused the API key \(HTTP 401: Unauthorized\): the key or "
                                                   r"the endpoint is wrong.*classify.api_key_env"):
            shard.run(cfg)
    finally:
        external.stop()
    assert _journal_count(shard.journal) == 0 and not shard.labels.exists()
    assert shard.events() == []  # no request was sent, let alone retried


# ---- the acceptance fault run (issue 11) --------------------------------------------------------------

def test_fault_run_labels_every_post_after_one_rerun_without_duplicate_answers(make_shard):
    shard = make_shard(60)
    faults = ("--hang-rate", "0.05", "--random-500", "0.1", "--random-503", "0.2", "--seed", "11",
              "--latency", "0.05")
    settings = dict(request_timeout_s=600, deadline_floor_s=2, max_attempts=10)
    t0 = time.monotonic()
    with pytest.raises(ServerError, match="server exited"):
        shard.run(shard.config(*faults, "--crash-after", "50", **settings))
    shard.run(shard.config(*faults, **settings))  # the one rerun
    assert time.monotonic() - t0 < 120  # no hung request waited out the 600 s ceiling
    labels = shard.check_complete_labels()
    assert all(r["status"] == "ok" for r in labels.values())
    shard.check_journal_and_resends()
    events = shard.events()
    assert [e for e in events if e["event"] == "hanging"] and [e for e in events if e["event"] == "crash"]
    answers = Counter(e["request_id"] for e in events if e["event"] == "completed" and e["status"] == 200)
    assert sorted(answers) == sorted(r["request_id"] for r in shard.rows)
    assert set(answers.values()) == {1}  # no post was answered twice


def test_server_never_healthy_fails_with_the_log_tail(make_shard):
    shard = make_shard(4)
    with pytest.raises(ServerError) as info:
        shard.run(shard.config("--never-healthy", startup_timeout_s=2))
    assert "not ready after 2 s" in str(info.value)
    assert "stand-in: listening on" in str(info.value)  # the tail of the server log
    assert not shard.labels.exists() and _journal_count(shard.journal) == 0
    assert shard.events() == []
    _assert_process_gone(shard.server_log)


# ---- the job is killed, or started twice ----------------------------------------------------------

def _received_after_kill_and_before(shard: Shard, first_run: dict) -> int:
    return sum(1 for e in shard.events() if e["event"] == "received" and e["request_id"] in first_run)


def test_sigterm_mid_shard_drains_in_flight_and_rerun_completes(make_shard):
    shard = make_shard(40)
    cfg = shard.config("--latency", "0.3", shutdown_grace_s=5)
    job = shard.start_job(cfg)
    _wait_for(lambda: _journal_count(shard.journal) >= 8, 60, "8 finished requests")
    job.send_signal(signal.SIGTERM)
    assert job.wait(timeout=30) != 0
    assert "JobInterrupted" in (shard.tmp / "job.log").read_text()
    assert not shard.labels.exists()
    _assert_process_gone(shard.server_log)
    first = read_latest(shard.journal, "request_id")
    assert 8 <= len(first) < 40
    # Grace: every request the server answered during the first run is in the journal (none was
    # abandoned, as the grace period exceeds the service time).
    answered = {e["request_id"] for e in shard.events() if e["event"] == "completed" and e["status"] == 200}
    assert answered == set(first)
    assert not [e for e in shard.events() if e["event"] == "cancelled"]
    shard.run(shard.config("--latency", "0.01"))
    shard.check_complete_labels()
    shard.check_journal_and_resends()


def test_sigkill_mid_shard_rerun_completes_without_duplicates(make_shard):
    shard = make_shard(40)
    job = shard.start_job(shard.config("--latency", "0.2"))
    _wait_for(lambda: _journal_count(shard.journal) >= 10, 60, "10 finished requests")
    job.send_signal(signal.SIGKILL)
    job.wait(timeout=10)
    _assert_process_gone(shard.server_log)  # the server followed its parent (PDEATHSIG)
    first = read_latest(shard.journal, "request_id")
    received_first = {e["request_id"] for e in shard.events() if e["event"] == "received"}
    shard.run(shard.config("--latency", "0.01"))
    labels = shard.check_complete_labels()
    assert len(pq.read_table(shard.labels)) == 40
    shard.check_journal_and_resends()
    sent_twice = {e["request_id"] for e in shard.events()
                  if e["event"] == "received" and e["request_id"] in received_first} - set(first)
    resent = [e for e in shard.events() if e["event"] == "received" and e["request_id"] in sent_twice]
    assert len(sent_twice) <= cfg_concurrency(shard) and all(labels[p]["status"] == "ok" for p in labels)
    assert len(resent) == 2 * len(sent_twice)


def cfg_concurrency(shard: Shard) -> int:
    return shard.config()["classify"]["concurrency"]


def test_second_job_on_the_same_shard_is_refused(make_shard):
    shard = make_shard(30)
    job = shard.start_job(shard.config("--latency", "0.1"))
    lock = shard.journal.with_name(shard.journal.name + ".lock")
    _wait_for(lambda: lock.exists() and f"pid {job.pid}" in lock.read_text(), 30, "the first job's lock")
    with pytest.raises(ShardLocked, match=rf"shard 0: .* in use by pid {job.pid}"):
        shard.run(shard.config())
    assert job.wait(timeout=60) == 0
    shard.check_complete_labels()
    shard.check_journal_and_resends()


def test_empty_shard_writes_empty_labels_without_a_server(make_shard):
    shard = make_shard(0)
    shard.run(shard.config())
    table = pq.read_table(shard.labels)
    assert table.num_rows == 0
    assert "answers" in table.column_names and "error_kind" in table.column_names
    assert not shard.server_log.exists()


def test_finished_shard_rerun_sends_nothing(make_shard):
    shard = make_shard(6)
    shard.run(shard.config())
    shard.labels.unlink()
    before = len(shard.events())
    shard.run(shard.config())
    assert len(shard.events()) == before
    shard.check_complete_labels()


def test_external_endpoints_mode_starts_no_server(make_shard, monkeypatch):
    shard = make_shard(10)
    cfg = shard.config()
    import asyncio

    from vidlabel.serve.server import VLLMServer

    with VLLMServer(ServeSettings.from_config(cfg), shard.tmp / "external.log") as external:
        asyncio.run(external.wait_ready())
        monkeypatch.setenv("MY_VLLM_KEY", external.api_key)
        cfg["classify"].update(endpoints=[external.base_url], api_key_env="MY_VLLM_KEY",
                               server_command="false never started {port}")
        shard.run(cfg)
    assert not shard.server_log.exists()
    shard.check_complete_labels()
    shard.check_journal_and_resends()
