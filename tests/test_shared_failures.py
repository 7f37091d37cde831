"""A failure shared by one media kind is the job's failure (issue 34): a server that answers every photo
post and fails every video post the same way stops each run once, with its message, and leaves nothing
terminal, whatever the order of the post types; after the fix every post is labelled. On the stand-in
started through vLLM's own command line, with mixed posts made from real files in three shards."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from standin import read_request_log, vllm_shim
from standin.mixed import post_row, write_shard
from standin.shards import QUESTIONS, YES_IF
from test_mixed_serve import media  # noqa: F401 (fixture)

from vidlabel.core import config as vconfig
from vidlabel.core.journal import iter_records
from vidlabel.serve.classify import ClassifyError, MediaUnreachable, ServerFailing, run_shard

MODEL = "standin-model"
SHARDS = 3
# Each shard: photo posts first, then videos between photos (the GPU benchmark's videos-first order hid it).
SHARD_ORDER = ["photo", "photo", "video", "photo", "video", "photo", "video", "photo"]
PYNV = '{"video":{"fps":2,"backend":"pynvvideocodec"}}'
# A 500 whose body reads like a broken file ("failed to decode") but is the server's decoder failing
# every video: it used to become a terminal bad_media fact about each post.
DECODER_500 = "Failed to decode video with the torchcodec backend: Could not open input file"
STOP_WITHIN_S = 60.0


class MixedShards:
    """Manifest shards of mixed posts and the classify jobs over them, with the stand-in as `vllm`; the
    faults file changes between runs while the server command, and so the requests, stay the same."""

    def __init__(self, tmp: Path, media_root: Path, files: dict, monkeypatch):
        self.tmp = tmp
        self.request_log = tmp / "requests.jsonl"
        self.faults = tmp / "faults.json"
        self.faults.write_text("[]")
        shim = vllm_shim(tmp / "bin", *YES_IF, "--request-log", self.request_log, "--faults-file", self.faults)
        monkeypatch.setenv("PATH", f"{shim.parent}{os.pathsep}{os.environ['PATH']}")
        self.config = vconfig.validate({
            "posts": str(tmp / "posts.csv"), "media_root": str(media_root), "results": str(tmp / "results"),
            "planning": {"model_family": "qwen2_5_vl"},
            "classify": {"model": MODEL, "questions": QUESTIONS, "concurrency": 4, "max_attempts": 2,
                         "backoff_initial_s": 0.01, "backoff_max_s": 0.05, "startup_timeout_s": 60,
                         "shutdown_grace_s": 2, "health_interval_s": 0.5}})
        photos = [files["portrait"], files["feed"], files["small"], files["sideways"]]
        self.rows: list[list[dict]] = []
        for shard in range(SHARDS):
            rows = []
            for i, kind in enumerate(SHARD_ORDER):
                n = shard * len(SHARD_ORDER) + i
                caption = ["buy it now", "a quiet day", "pizza night"][n % 3]
                item = files["clip"] if kind == "video" else photos[n % len(photos)]
                rows.append(post_row(self.config, f"{kind}-{n:02d}", [str(item)], caption))
            write_shard(self.shard_path(shard), rows)
            self.rows.append(rows)

    def shard_path(self, shard: int) -> Path:
        return self.tmp / "manifest" / f"shard-{shard}.parquet"

    def journal(self, shard: int) -> Path:
        return self.tmp / "journal" / f"shard-{shard}.jsonl"

    def labels(self, shard: int) -> Path:
        return self.tmp / "labels" / f"shard-{shard}.parquet"

    def run(self, *faults: str) -> list[tuple[BaseException | None, float]]:
        """Every shard's job once under ``faults``: (its error or None, seconds from its server's readiness
        to the job's end)."""
        self.faults.write_text(json.dumps(list(faults)))
        outcomes = []
        for shard in range(SHARDS):
            start = time.time()
            error = None
            try:
                run_shard(self.config, self.shard_path(shard), self.labels(shard), self.journal(shard),
                          self.tmp / f"server-{shard}.log", shard)
            except ClassifyError as exc:
                error = exc
            end = time.time()
            ready = max((e["t"] for e in read_request_log(self.request_log) if e["t"] >= start
                         and e["event"] == "completed" and (e["request_id"] or "").startswith("smoke-")),
                        default=start)  # a shard with nothing left to send starts no server
            outcomes.append((error, end - ready))
        return outcomes

    def records(self) -> list[dict]:
        return [r for shard in range(SHARDS) for r in iter_records(self.journal(shard))]

    def terminal_errors(self) -> list[dict]:
        return [r for r in self.records() if r["status"] != "ok" and not r.get("retryable")]

    def sent_after_answered(self) -> list[str]:
        """Requests sent again after an answer of theirs was journaled (a request in flight when a job
        stopped was not finished, and may be sent again)."""
        answered = {}
        for rec in self.records():
            if rec["status"] == "ok":
                answered.setdefault(rec["request_id"], rec["finished_at"])
        return sorted({e["request_id"] for e in read_request_log(self.request_log) if e["event"] == "received"
                       and e["request_id"] in answered and e["t"] > answered[e["request_id"]] + 1e-3})

    def labelled(self) -> dict[str, dict]:
        return {r["post_id"]: r for shard in range(SHARDS) for r in pq.read_table(self.labels(shard)).to_pylist()}


@pytest.mark.parametrize("faults, error, message", [
    # The exact vLLM 0.26 answer to a video backend its Python cannot import (the calibration videos fail too).
    (("--media-io-kwargs", PYNV), ServerFailing, "No module named 'PyNvVideoCodec'"),
    # A decoder failing the posts' videos but not the calibration videos (a codec they do not use).
    (("--fail-video", f"500:{DECODER_500}"), MediaUnreachable, DECODER_500),
    # Every video request's connection closed mid-answer while photos are answered.
    (("--drop-video",), ServerFailing, "dropped the connection of"),
], ids=["no-module", "decoder-500", "drop-video"])
def test_a_server_failing_every_video_while_photos_answer_stops_each_run_and_leaves_nothing_terminal(
        media, tmp_path, monkeypatch, faults, error, message):  # noqa: F811 (fixture)
    root, files = media
    shards = MixedShards(tmp_path, root, files, monkeypatch)
    for run in range(2):  # the user's run and the profile's retry, both on the broken server
        for shard, (exc, after_ready) in enumerate(shards.run(*faults)):
            assert isinstance(exc, error), (shard, exc)
            assert message in str(exc)
            # The first run answers photos between the videos; the second has only the videos left.
            assert ("requests with a video" if run == 0 else "request") in str(exc)
            assert after_ready < STOP_WITHIN_S
            assert not shards.labels(shard).exists()
    assert shards.terminal_errors() == []
    assert not [r for r in shards.records() if r["post_id"].startswith("video") and r["status"] != "ok"
                and r.get("attempts")]  # no failure of the broken server was charged to a video post
    for shard, (exc, _) in enumerate(shards.run()):  # fixed: the same command, the same requests
        assert exc is None, (shard, exc)
    labels = shards.labelled()
    assert len(labels) == SHARDS * len(SHARD_ORDER)
    assert {pid: r["status"] for pid, r in labels.items()} == dict.fromkeys(labels, "ok")
    for pid, row in labels.items():
        caption = json.loads(row["answers"])
        assert caption["promotes_product"] == ("yes" if int(pid[-2:]) % 3 == 0 else "no"), pid
    if "--media-io-kwargs" not in faults:
        # The broken server measured the calibration videos as the fixed one does: its photo answers are
        # the same server's and are kept (the missing module failed the calibration too: another server,
        # whose answers are sent again).
        assert shards.sent_after_answered() == []


def test_a_video_failing_alone_among_answered_videos_is_its_own(media, tmp_path, monkeypatch):  # noqa: F811
    """The same 500 on every attempt of one video while the server answers other videos: that post's own
    failure (the evidence: its peers answered), terminal with the message's kind, and the shards complete:
    in the first run where a video was answered between its attempts, else in the second, where an
    answered video sent again as a control shows that the server answers videos."""
    root, files = media
    shards = MixedShards(tmp_path, root, files, monkeypatch)
    bad = shards.rows[0][4]
    word = "zeroword"  # the stand-in matches it in the prompt: only this post's caption carries it
    shards.rows[0][4] = post_row(shards.config, bad["post_id"], [bad["items"][0]["path"]], f"{word} clip")
    write_shard(shards.shard_path(0), shards.rows[0])
    fault = ("--error-on", f"{word}=500:{DECODER_500}")
    outcomes = shards.run(*fault)
    assert [exc for exc, _ in outcomes[1:]] == [None] * (SHARDS - 1)
    if outcomes[0][0] is not None:
        assert "still need a retry" in str(outcomes[0][0])
        assert shards.terminal_errors() == []
        assert [exc for exc, _ in shards.run(*fault)] == [None] * SHARDS
    row = shards.labelled()[bad["post_id"]]
    assert (row["status"], row["error_kind"]) == ("error", "bad_media") and DECODER_500 in row["error"]
    assert all(r["status"] == "ok" for pid, r in shards.labelled().items() if pid != bad["post_id"])
