"""Resume over a changed shard count (issue 34, part 2): every journal is read and each request's newest
record stands for it, whatever the journals are called and whichever is the job's own; the shard count
is a result setting of the manifest, so lowering it rewrites the manifest's shards.

The story: a run in 2 shards on a server that leaves a few posts unanswered (busy), a run in 3 shards
against another server (which answers them and, being another server, every post again: its answers
replace the first server's), then 6 shards and back to 2: nothing is sent twice, and every post reports
its newest answer with the server that gave it."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from standin import is_probe, read_request_log
from standin.shards import make_config, make_video, manifest_rows, write_manifest

from vidlabel.core import stage_settings
from vidlabel.core.journal import iter_records
from vidlabel.serve.classify import ShardIncomplete, run_shard

POSTS = 12
BUSY = "later"  # in the captions of the posts the first server leaves unanswered (one per shard of 3)


class Study:
    """One set of posts dealt to a given number of shards per run, every shard's journal in one folder
    (as results/models/<name>/journal/); the stand-in's faults file changes the server between runs
    while the job's server command stays the same."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.request_log = tmp / "requests.jsonl"
        media = tmp / "media"
        make_video(media / "clip.mp4")
        self.posts = [{"post_id": f"p{i:02d}", "media_path": str(media / "clip.mp4"),
                       "caption": ["buy now", "a quiet day", "pizza party"][i % 3] + (f" {BUSY}" if i < 3 else ""),
                       "transcript": None} for i in range(POSTS)]
        self.media = media
        self.runs = 0

    def config(self, *faults: str) -> dict:
        return make_config(self.tmp, self.media, self.request_log, faults, {"concurrency": 4, "max_attempts": 2})

    def run(self, shards: int, *faults: str) -> dict:
        """Every shard's job, posts dealt round robin (post i to shard i % shards); returns the labels by
        post of the shards that completed."""
        self.runs += 1
        cfg = self.config(*faults)
        rows = manifest_rows(cfg, self.posts)
        labels = {}
        for shard in range(shards):
            manifest = write_manifest(self.tmp / f"manifest-{self.runs}" / f"shard-{shard}.parquet",
                                      rows[shard::shards])
            out = self.tmp / f"labels-{self.runs}" / f"shard-{shard}.parquet"
            try:
                run_shard(cfg, manifest, out, self.tmp / "journal" / f"shard-{shard}.jsonl", self.tmp / "server.log",
                          shard)
            except ShardIncomplete:
                continue
            labels.update({r["post_id"]: r for r in pq.read_table(out).to_pylist()})
        return labels

    def sends(self) -> list[dict]:
        return [e for e in read_request_log(self.request_log)
                if e["event"] == "received" and not is_probe(e["request_id"])]


def test_shard_counts_up_and_down_send_nothing_twice_and_report_the_newest_answer(tmp_path):
    study = Study(tmp_path)
    assert study.run(2, "--error-on", f"{BUSY}=503:The engine is currently busy and cannot accept new requests.") == {}
    first = {r["post_id"]: r for path in (tmp_path / "journal").glob("*.jsonl") for r in iter_records(path)
             if r["status"] == "ok"}
    assert len(first) == POSTS - 3 and all(r["server"].startswith("vLLM 0.26.0,") for r in first.values())
    sent_first = len(study.sends())

    # Another server (another version, and it finds food in quiet days): it answers the busy posts and,
    # being another server, every answer of the first one again, once; each post's answer is now its.
    newer = ("--standin-version", "0.26.1", "--yes-if", "mentions_food=quiet")
    second = study.run(3, *newer)
    assert len(second) == POSTS
    again = [e["request_id"] for e in study.sends()[sent_first:]]
    assert sorted(again) == sorted(r["request_id"] for r in second.values())
    for pid, row in second.items():
        assert row["server"].startswith("vLLM 0.26.1,"), pid
        food = json.loads(row["answers"])["mentions_food"]
        assert food == ("yes" if "quiet" in row_caption(study, pid) or "pizza" in row_caption(study, pid) else "no")

    # 6 shards, then back to 2: the posts move to journals that hold the first server's older answers
    # ('shard-0' is read before 'shard-2' and is a job's own), yet the newest stands: nothing is sent.
    for shards in (6, 2):
        before = len(study.sends())
        labels = study.run(shards, *newer)
        assert len(labels) == POSTS and study.sends()[before:] == []
        for pid, row in labels.items():
            assert (row["server"], row["answers"], row["finished_at"], row["job_id"]) == (
                second[pid]["server"], second[pid]["answers"], second[pid]["finished_at"], second[pid]["job_id"]), pid
            assert row["shard"] == int(pid[1:]) % shards
    # Every journal's newest record of each request is the second server's; nothing was journaled twice
    # by a job (copies keep the job that made them).
    by_job: dict[tuple[str, str], int] = {}
    for path in sorted((tmp_path / "journal").glob("*.jsonl")):
        for rec in iter_records(path):
            if not rec.get("copied_from_shard_journal"):
                by_job[(rec["request_id"], rec["job_id"])] = by_job.get((rec["request_id"], rec["job_id"]), 0) + 1
    assert set(by_job.values()) == {1}


def row_caption(study: Study, post_id: str) -> str:
    return next(p["caption"] for p in study.posts if p["post_id"] == post_id)


@pytest.mark.parametrize("key, value", [("classify.shards", 2)])
def test_the_shard_count_is_a_result_setting_of_the_manifest_only(tmp_path, key, value):
    """Lowering classify.shards reruns the manifest (its shards are re-dealt and rewritten), not the
    answers: the classify fingerprint, and so every request's, stays the same."""
    cfg = make_config(tmp_path, tmp_path, classify={"shards": 3})
    lowered = make_config(tmp_path, tmp_path, classify={"shards": value})
    assert key in stage_settings.keys("manifest").results and key not in stage_settings.keys("manifest").operational
    assert stage_settings.fingerprint(lowered, "manifest") != stage_settings.fingerprint(cfg, "manifest")
    assert stage_settings.fingerprint(lowered, "classify") == stage_settings.fingerprint(cfg, "classify")
