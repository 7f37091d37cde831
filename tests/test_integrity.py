"""Every answer tied to what produced it: journal fingerprints, server identity, errors that are the
server's and not the video's, and the error kinds (the stand-in plays vLLM)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time

import aiohttp
import pytest
from standin import read_request_log
from test_fault_matrix import _endpoint, _use_endpoints, make_shard, media  # noqa: F401 (fixtures)

from vidlabel.core.journal import iter_records, read_latest
from vidlabel.serve.breaker import FAILURE_RUN as MEDIA_FAILURE_RUN
from vidlabel.serve.classify import MediaUnreachable, ServerFailing
from vidlabel.serve.deadline import Deadlines, Expired
from vidlabel.serve.endpoints import DOWN, UP, Endpoints
from vidlabel.serve.error_kinds import FatalClientError, classify_error


def sends(shard) -> list[dict]:
    return [e for e in shard.events() if e["event"] == "received"]


# ---- error kinds -------------------------------------------------------------------------------------

@pytest.mark.parametrize("status, message, media, expected", [
    # "Not now" statuses first, whatever the text says.
    (429, "Rate limit reached: too many tokens per minute", None, ("server_overloaded", True)),
    (503, "Failed to open /data/x.mp4", "/data/x.mp4", ("server_overloaded", True)),
    (504, "Could not decode video", None, ("timeout", True)),
    (408, "Request Timeout", None, ("timeout", True)),
    # A file the message names that is not the request's media: the server's own trouble.
    (500, "[Errno 2] No such file or directory: '/dev/shm/psm_1234'", "/data/x.mp4", ("server_error", True)),
    (500, "[Errno 2] No such file or directory: '/data/x.mp4'", "/data/x.mp4", ("bad_media", True)),
    (400, "The decoder prompt (length 40123) is longer than the maximum model length of 32768. Make sure "
          "that `max_model_len` is no smaller than the number of text tokens plus multimodal tokens.", None,
     ("too_long", False)),
    (400, "Input length (129623) exceeds model's maximum context length (32768).", None, ("too_long", False)),
    (400, "Could not open video stream", "/data/x.mp4", ("bad_media", False)),
    (400, "Request id abc-1 already running.", None, ("server_error", True)),  # vLLM V1 before 0.26: a collision
])
def test_error_kinds(status, message, media, expected):
    assert classify_error(status, message, media) == expected


# ---- attempts, sends and request ids -----------------------------------------------------------------

def test_every_send_has_its_own_request_id_and_retries_count_as_attempts(make_shard):
    shard = make_shard(8, {2: {"caption": "hangword"}})
    shard.run(shard.config("--hang-on", "hangword:1", "--reset-on", "buy:1", request_timeout_s=2,
                           adaptive_deadline=False))
    labels = shard.check_complete_labels()
    received = sends(shard)
    send_ids = [e["send_id"] for e in received]
    assert len(send_ids) == len(set(send_ids))  # vLLM refuses an id that is still running
    assert all(e["send_id"].startswith(e["request_id"] + "-") for e in received)
    hung = labels["post002"]
    assert (hung["status"], hung["attempts"], hung["sends"]) == ("ok", 2, 2)  # its own deadline: charged
    assert sum(r["sends"] for r in labels.values()) == len(received)


def test_a_stall_cut_is_not_charged_to_the_request():
    """A small request past its own deadline is charged; a big one cut because the whole shard stopped
    answering is not."""
    async def scenario():
        deadlines = Deadlines(ceiling_s=60, floor_s=0.5, adaptive=True)
        endpoint = type("Ep", (), {"healthy": True})()
        for _ in range(10):
            deadlines.answered(0.01, 100)
        deadlines.last_answer -= 10  # nothing answered for a while
        outcomes = {}

        async def attempt(name, tokens):
            try:
                with deadlines.attempt(tokens, endpoint):
                    await asyncio.sleep(5)
            except Expired as exc:
                outcomes[name] = exc

        tasks = [asyncio.create_task(attempt("small", 100)), asyncio.create_task(attempt("big", 100_000))]
        await asyncio.sleep(0.7)
        deadlines.check()
        await asyncio.gather(*tasks)
        return outcomes

    outcomes = asyncio.run(scenario())
    assert outcomes["small"].charged is True and "no answer within" in str(outcomes["small"])
    assert outcomes["big"].charged is False and "stalled" in str(outcomes["big"])


def test_a_slow_health_probe_means_busy_for_the_jobs_own_server(make_shard):
    shard = make_shard(1)
    server = _endpoint(shard, shard.config("--slow-health", "3"), "slow", "k")

    async def probe(owned: bool) -> str:
        eps = Endpoints([(server.base_url, "k")], 0.2, lambda ep: None, lambda why: None, owned=owned)
        watcher = asyncio.create_task(eps.watch())
        await asyncio.sleep(4.5)
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        return eps.all[0].state

    try:
        assert asyncio.run(probe(owned=True)) == UP
        assert asyncio.run(probe(owned=False)) == DOWN  # an external server that does not answer is down
    finally:
        server.stop()


# ---- the journal reuses only answers made under the same fingerprint --------------------------------

def test_changed_max_tokens_or_media_resends_and_the_job_says_why(make_shard, caplog):
    shard = make_shard(6)
    shard.run(shard.config())
    first = len(sends(shard))
    assert first == 6
    with caplog.at_level(logging.INFO, logger="vidlabel.serve.resume"):
        shard.run(shard.config(max_tokens=80))
    assert len(sends(shard)) == 12  # another max_tokens: every request again
    assert any("passed over the journaled answers of 6 request(s), made under another prompt, media" in r.getMessage()
               for r in caplog.records)
    shard.run(shard.config(max_tokens=80))
    assert len(sends(shard)) == 12  # unchanged: nothing
    clip = shard.media / "clip.mp4"
    os.utime(clip, ns=(time.time_ns(), time.time_ns() + 10**9))  # the video was replaced (re-transcoded)
    shard.run(shard.config(max_tokens=80))
    assert len(sends(shard)) == 18
    shard.run(shard.config())  # back to the first settings: their answers are still in the journal, but
    assert len(sends(shard)) == 24  # made from the video before it changed
    labels = shard.check_complete_labels()
    assert {r["server"] for r in labels.values()} == {"vLLM 0.26.0, model standin-model"}
    latest = read_latest(shard.journal, "request_id")
    assert all(labels[r["post_id"]]["request_fingerprint"] == r["request_fingerprint"] for r in latest.values())


def test_a_record_of_another_server_version_is_sent_again_once_a_server_is_up(make_shard):
    shard = make_shard(4)
    shard.run(shard.config())
    # One request is added: the job needs a server, and the server is another vLLM version.
    shard.posts.append(dict(shard.posts[0], post_id="post-new"))
    shard.rows = []
    shard.run(shard.config("--standin-version", "0.27.0"))
    labels = shard.labels_by_post()
    assert {r["server"] for r in labels.values()} == {"vLLM 0.27.0, model standin-model"}
    assert len(sends(shard)) == 4 + 5


# ---- a server that cannot see the media is the server's fault -------------------------------------

def test_endpoint_that_cannot_see_the_media_stops_before_its_traffic(make_shard, monkeypatch, tmp_path_factory):
    shard = make_shard(10)
    cfg = shard.config()
    # A server whose --allowed-local-media-path is elsewhere (another deployment's setting).
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    other = dict(cfg, media_root=str(elsewhere), results=str(elsewhere / "results"))
    server = _endpoint(shard, other, "elsewhere", "k")
    try:
        with pytest.raises(MediaUnreachable, match="allowed-local-media-path"):
            shard.run(_use_endpoints(shard.config(), monkeypatch, "k", server))
    finally:
        server.stop()
    assert len(sends(shard)) == 0  # its calibration videos showed it: no post was sent
    assert not [r for r in iter_records(shard.journal)]  # nothing journaled, nothing terminal
    right = _endpoint(shard, shard.config(), "right", "k")
    try:
        shard.run(_use_endpoints(shard.config(), monkeypatch, "k", right))
    finally:
        right.stop()
    assert all(r["status"] == "ok" for r in shard.check_complete_labels().values())


def test_endpoint_that_sees_the_calibration_but_not_the_media_stops_at_the_media_check(make_shard, monkeypatch):
    shard = make_shard(10)
    cfg = shard.config()
    # It may read the results directory (where the calibration videos are), not the media.
    server = _endpoint(shard, dict(cfg, media_root=str(shard.tmp)), "results-only", "k")
    try:
        with pytest.raises(MediaUnreachable, match="the first request .the media check.*allowed-local-media-path"):
            shard.run(_use_endpoints(shard.config(), monkeypatch, "k", server))
    finally:
        server.stop()
    assert len(sends(shard)) == 1  # the media check alone
    assert not [r for r in iter_records(shard.journal)]


def test_own_server_without_the_media_mounted_stops_with_the_probable_cause(make_shard):
    shard = make_shard(6)
    with pytest.raises(MediaUnreachable, match="mount the media at the same path"):
        shard.run(shard.config("--media-invisible-after", "0"))
    assert not list(iter_records(shard.journal))
    shard.run(shard.config())
    assert all(r["status"] == "ok" for r in shard.check_complete_labels().values())


def test_media_vanishing_mid_shard_journals_nothing_terminal(make_shard):
    shard = make_shard(MEDIA_FAILURE_RUN + 10)
    # The smoke request and 5 videos are answered, then the files vanish for the server.
    with pytest.raises(Exception):
        shard.run(shard.config("--media-invisible-after", "6", concurrency=2))
    records = list(iter_records(shard.journal))
    assert [r for r in records if r["status"] == "ok"]
    assert all(r["status"] == "ok" or r.get("retryable") for r in records)  # nothing terminal but answers
    shard.run(shard.config())
    assert all(r["status"] == "ok" for r in shard.check_complete_labels().values())


def test_a_row_of_undecodable_videos_stops_the_job(make_shard, tmp_path):
    broken = tmp_path / "broken.mp4"
    good = (make_shard(1).media / "clip.mp4").read_bytes()
    broken.write_bytes(good[: len(good) // 3])
    shard = make_shard(MEDIA_FAILURE_RUN + 2)
    # The media check passes on a good video; then every video fails the same way with no answer between.
    for p in shard.posts[1:]:
        p["media_path"] = str(shard.media / f"{p['post_id']}.mp4")
        (shard.media / f"{p['post_id']}.mp4").write_bytes(broken.read_bytes())
    cfg = shard.config("--video-tokens", "qwen", concurrency=1)
    with pytest.raises(MediaUnreachable, match="cannot decode these videos"):
        shard.run(cfg)
    terminal = [r for r in iter_records(shard.journal) if r["status"] != "ok" and not r.get("retryable")]
    assert terminal == []
    failed = [e for e in read_request_log(shard.request_log) if e["event"] == "completed" and e["status"] != 200]
    assert MEDIA_FAILURE_RUN <= len(failed) <= MEDIA_FAILURE_RUN + 1


# A failing request's answers take 1 s, the others 1.5 s: every other answer lands between its first and
# second failure.
BETWEEN_FAILURES = ("--error-latency", "1.0", "--latency", "1.5")


def test_a_request_failing_the_same_way_every_time_ends_terminal_without_blocking_the_shard(make_shard):
    """A 1-frame video made vLLM's frame sampler divide by zero on every attempt: a retry no rerun
    could ever finish. With the server answering the others, it becomes a terminal record."""
    shard = make_shard(6, {3: {"caption": "zeroword"}})
    # The others are answered between its first and second failure, whatever the machine's load: the
    # evidence that the server answers while this request fails (instant answers raced its failures).
    shard.run(shard.config("--error-on", "zeroword=500:division by zero", *BETWEEN_FAILURES, max_attempts=3))
    labels = shard.check_complete_labels()  # no ShardIncomplete: the shard is done
    row = labels["post003"]
    assert (row["status"], row["error_kind"], row["attempts"]) == ("error", "server_error", 3)
    assert "division by zero" in row["error"] and "the same answer on all 3 attempts" in row["error"]
    assert all(labels[p]["status"] == "ok" for p in labels if p != "post003")


def test_the_same_500_from_a_server_that_answers_nothing_stops_the_job_and_journals_nothing(make_shard):
    shard = make_shard(3)
    # Every video request fails alike: the server, not the request, is broken.
    with pytest.raises(ServerFailing, match=r"2 requests failed the same way before any answer \(HTTP 500: "
                                            r"EngineCore died\)\. Probable cause: the server's engine died"):
        shard.run(shard.config("--error-on", "post=500:EngineCore died", max_attempts=2))
    assert not list(iter_records(shard.journal))
    assert len({e["request_id"] for e in sends(shard)}) == 2  # the first request and one to confirm


def test_a_lone_unfinished_request_is_decided_by_a_control(make_shard):
    """The rerun of a shard whose only unfinished request fails again: nothing else is left to show
    whether the server answers at all, so one answered request is sent again as a control (never
    journaled); the server answers it, so the attempts count, and with those of the first run the
    request ends terminal instead of failing the shard for ever."""
    shard = make_shard(4, {2: {"caption": "zeroword"}})
    cfg = shard.config("--error-on", "zeroword=500:division by zero", *BETWEEN_FAILURES, max_attempts=2)
    shard.run(cfg)
    # As if the first run had been cut short: post002 retryable, with the first run's 2 attempts.
    records = list(iter_records(shard.journal))
    shard.journal.write_text("".join(json.dumps(dict(r, retryable=True, attempts=2) if r["post_id"] == "post002"
                                                else r) + "\n" for r in records))
    shard.labels.unlink()
    before = len(sends(shard))
    shard.run(cfg)
    row = shard.check_complete_labels()["post002"]
    assert (row["status"], row["error_kind"], row["attempts"]) == ("error", "server_error", 4)
    assert "attempts over several runs, giving up" in row["error"]
    again = sends(shard)[before:]
    assert len(again) == 2 + 1 and len([e for e in again if e["request_id"].startswith("control-")]) == 1
    assert not [r for r in iter_records(shard.journal) if r["request_id"].startswith("control-")]


def test_answer_probabilities_and_a_server_that_allows_fewer_logprobs(make_shard):
    shard = make_shard(4)
    with pytest.raises(FatalClientError, match="classify.top_logprobs"):
        shard.run(shard.config("--max-logprobs", "5"))
    assert not list(iter_records(shard.journal))
    shard.run(shard.config("--max-logprobs", "5", "--answer-confidence", "0.8", top_logprobs=5))
    labels = shard.check_complete_labels()
    for row in labels.values():
        probs = json.loads(row["answer_probs"])
        for qid, answer in json.loads(row["answers"]).items():
            assert probs[qid][answer] == pytest.approx(0.8) and sum(probs[qid].values()) == pytest.approx(1)
    shard.run(shard.config(top_logprobs=0))  # another request: sent again, without log-probabilities
    assert all(r["answer_probs"] is None for r in shard.check_complete_labels().values())


# ---- provenance in labels.parquet and summary.md -------------------------------------------------

def _fabricate(tmp_path, servers, models):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from vidlabel.serve.record import Record, labels_table

    ids = [f"p{i}" for i in range(len(servers))]
    pq.write_table(pa.table({"post_id": ids, "video_path": [f"/m/{i}.mp4" for i in ids]}), tmp_path / "inv.parquet")
    pq.write_table(pa.table({"post_id": pa.array([], pa.string()), "video_path": pa.array([], pa.string()),
                             "reason": pa.array([], pa.string()), "detail": pa.array([], pa.string())}),
                   tmp_path / "excluded.parquet")
    records = [{"request_id": f"r{i}", "post_id": pid, "status": "ok", "attempts": 1, "sends": 1,
                "answers": {"q": "yes" if i % 2 else "no"}, "answer_probs": {"q": {"yes": 0.7, "no": 0.3}},
                "prompt_tokens": 100, "completion_tokens": 9, "started_at": 1.0 + i, "finished_at": 2.0 + i,
                "latency_s": 1.0, "model": model, "server": server, "settings_fingerprint": "s1",
                "prompt_hash": "h1", "request_fingerprint": f"f{i}"}
               for i, (pid, server, model) in enumerate(zip(ids, servers, models))]
    pq.write_table(labels_table([Record.from_journal(r) for r in records], 0), tmp_path / "shard-0.parquet")


def _config():
    from vidlabel.core.config import validate

    return validate({"posts": "posts.csv", "media_root": "/m",
                     "classify": {"questions": [{"id": "q", "text": "Q?"}]}})


def test_labels_and_summary_say_what_made_them_and_mixtures_are_loud(tmp_path, caplog):
    from vidlabel.analyze import aggregate, merge

    _fabricate(tmp_path, ["vLLM 0.26.0, model a"] * 3 + ["vLLM 0.27.0, model a"], ["m"] * 4)
    out = tmp_path / "labels.parquet"
    with caplog.at_level(logging.WARNING, logger="vidlabel.analyze.merge"):
        merge.merge(_config(), tmp_path / "inv.parquet", tmp_path / "excluded.parquet",
                    [tmp_path / "shard-0.parquet"], out)
    assert any("2 provenances" in r.getMessage() for r in caplog.records)
    import pyarrow.parquet as pq
    rows = pq.read_table(out).to_pylist()
    assert {r["server"] for r in rows} == {"vLLM 0.26.0, model a", "vLLM 0.27.0, model a"}
    assert all(r["model"] == "m" and r["prompt_hash"] == "h1" for r in rows)
    aggregate.run(_config(), out, None, tmp_path / "summary")
    summary = (tmp_path / "summary" / "summary.md").read_text()
    assert "## Provenance" in summary and "WARNING: the answers come from 2 different servers" in summary
    assert "3 requests answered by vLLM 0.26.0, model a for model `m`" in summary


def test_merge_refuses_labels_of_two_models(tmp_path):
    from vidlabel.analyze import merge

    _fabricate(tmp_path, ["vLLM 0.26.0, model a"] * 4, ["m", "m", "other", "m"])
    with pytest.raises(merge.MergeError, match="more than one model or question set"):
        merge.merge(_config(), tmp_path / "inv.parquet", tmp_path / "excluded.parquet",
                    [tmp_path / "shard-0.parquet"], tmp_path / "labels.parquet")


def test_terminal_records_a_server_could_have_caused_without_evidence_are_sent_again(make_shard):
    """A journal from before this rule: a broken server's failures recorded as the posts' own (the same
    500 on every attempt while it answered other kinds, a dropped connection over two runs), so the shard
    looked complete and no server was started for it. Without the evidence they are not terminal: the
    next job starts a server and the fixed one answers them. A refusal (4xx) and a failure judged on
    evidence stay as they are."""
    shard = make_shard(6)
    shard.run(shard.config())
    records = {r["post_id"]: r for r in iter_records(shard.journal)}
    legacy = {
        "post000": dict(error_kind="server_error", http_status=500, error="No module named 'PyNvVideoCodec' (the same "
                        "answer on all 4 attempts while the server answered other requests: this request's own "
                        "failure)"),
        "post001": dict(error_kind="connection", http_status=None, error="Server disconnected; 8 attempts over several "
                        "runs, giving up"),
        "post002": dict(error_kind="bad_media", http_status=500, error="Failed to load video"),
        "post003": dict(error_kind="bad_media", http_status=400, error="Could not open video stream"),
        "post004": dict(error_kind="server_error", http_status=500, error="division by zero (the same answer on all 4 "
                        "attempts while the server answered other requests of its media kinds: this request's own "
                        "failure)", own_failure=True),
    }
    shard.journal.write_text("".join(
        json.dumps(dict(rec, status="error", answers=None, raw_text=None, retryable=False, **legacy[pid])
                   if pid in legacy else rec) + "\n" for pid, rec in records.items()))
    shard.labels.unlink()
    before = len(sends(shard))
    shard.run(shard.config())
    again = {e["request_id"] for e in sends(shard)[before:]}
    assert again == {shard.rid(p) for p in ("post000", "post001", "post002")}
    labels = shard.labels_by_post()
    assert {p: labels[p]["status"] for p in ("post000", "post001", "post002", "post005")} == dict.fromkeys(
        ("post000", "post001", "post002", "post005"), "ok")
    assert (labels["post003"]["status"], labels["post004"]["status"]) == ("error", "error")
