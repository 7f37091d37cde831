"""The resume journal: torn tails, dedupe, the newest record over several journals, the single-writer lock."""

import json
import multiprocessing
import os
import signal

import pytest

from vidlabel.core.journal import Journal, JournalLocked, iter_records, newest, read_latest


def test_append_and_read_back(tmp_path):
    path = tmp_path / "j.jsonl"
    with Journal(path, key="request_id") as journal:
        journal.append({"request_id": "a", "status": "ok"})
        journal.append({"request_id": "b", "status": "error"})
    assert [r["request_id"] for r in iter_records(path)] == ["a", "b"]


def test_last_record_wins_on_read(tmp_path):
    path = tmp_path / "j.jsonl"
    with Journal(path, key="request_id") as journal:
        journal.append({"request_id": "a", "status": "error", "error_kind": "timeout"})
        journal.append({"request_id": "a", "status": "ok"})
    assert read_latest(path, "request_id") == {"a": {"request_id": "a", "status": "ok"}}


def test_torn_tail_is_cut_before_new_appends(tmp_path):
    path = tmp_path / "j.jsonl"
    path.write_bytes(b'{"request_id":"a","status":"ok"}\n{"request_id":"b","sta')
    assert [r["request_id"] for r in iter_records(path)] == ["a"]
    with Journal(path, key="request_id") as journal:
        assert set(journal.read()) == {"a"}
        journal.append({"request_id": "c", "status": "ok"})
    lines = path.read_bytes().splitlines()
    assert [json.loads(line)["request_id"] for line in lines] == ["a", "c"]


def test_torn_file_without_any_newline_is_emptied(tmp_path):
    path = tmp_path / "j.jsonl"
    path.write_bytes(b'{"request_id":"a"')
    with Journal(path, key="request_id") as journal:
        journal.append({"request_id": "b"})
    assert [r["request_id"] for r in iter_records(path)] == ["b"]


def test_record_without_key_is_refused(tmp_path):
    with Journal(tmp_path / "j.jsonl", key="post_id") as journal:
        with pytest.raises(KeyError):
            journal.append({"request_id": "x"})


def _hold_lock(path, ready, release):
    with Journal(path, key="k"):
        ready.set()
        release.wait(30)


def test_second_writer_is_refused_and_lock_frees_on_exit(tmp_path):
    path = tmp_path / "j.jsonl"
    ctx = multiprocessing.get_context("spawn")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_lock, args=(path, ready, release))
    holder.start()
    assert ready.wait(30)
    with pytest.raises(JournalLocked, match=f"pid {holder.pid}"):
        with Journal(path, key="k"):
            pass
    # A killed holder releases its lock with its file descriptors: the rerun can proceed.
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(10)
    with Journal(path, key="k") as journal:
        journal.append({"k": 1})
    assert read_latest(path, "k") == {1: {"k": 1}}


def test_fsync_policy_validated(tmp_path):
    with pytest.raises(ValueError):
        Journal(tmp_path / "j.jsonl", key="k", fsync="never")


def test_record_policy_fsyncs_every_append(tmp_path, monkeypatch):
    calls = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append(os.readlink(f"/proc/self/fd/{fd}")) or real_fsync(fd))
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    with Journal(a, key="k", fsync="record") as journal:
        for i in range(5):
            journal.append({"k": i})
        per_record = calls.count(str(a))
    calls.clear()
    with Journal(b, key="k", fsync="batch", fsync_interval_s=3600) as journal:
        journal.append({"k": 0})
        for i in range(1, 5):
            journal.append({"k": i})
        batched = calls.count(str(b))
    assert per_record == 5
    assert batched == 1  # the first append syncs, the rest wait for the interval (and close)
    assert calls.count(str(tmp_path)) == 1  # a new journal's folder, once: its name survives a crash
    calls.clear()
    with Journal(b, key="k") as journal:  # reopened: its name is on disk already
        journal.append({"k": 5})
    assert calls == [str(b), str(b)]  # the append, and the close


def test_newest_record_wins_whatever_the_journals_are_called(tmp_path):
    """A classify job reads every shard's journal: each request's newest record (by the time it was
    made) stands for it, not the one of the first journal by name ('shard-10' sorts before 'shard-2')
    nor the job's own."""
    ten, two, own = tmp_path / "shard-10.jsonl", tmp_path / "shard-2.jsonl", tmp_path / "shard-0.jsonl"
    for path, records in [
        (ten, [{"request_id": "a", "finished_at": 1.0, "v": "old"},
               {"request_id": "b", "finished_at": 5.0, "v": "new"}]),
        (two, [{"request_id": "a", "finished_at": 3.0, "v": "new"},
               {"request_id": "b", "finished_at": 2.0, "v": "old"}]),
        (own, [{"request_id": "a", "finished_at": 2.0, "v": "mid"}, {"request_id": "c", "finished_at": None, "v": "x"},
               {"request_id": "c", "finished_at": None, "v": "rewritten"}]),
    ]:
        with Journal(path, key="request_id") as j:
            for rec in records:
                j.append(rec)
    for order in ([own, ten, two], [two, ten, own], [ten, own, two]):
        found = newest(order, "request_id")
        assert {k: (rec["v"], path.name) for k, (rec, path) in found.items()} == {
            "a": ("new", "shard-2.jsonl"), "b": ("new", "shard-10.jsonl"), "c": ("rewritten", "shard-0.jsonl")}
    # A copy (the same time) in the job's own journal wins the tie when its journal comes first.
    with Journal(own, key="request_id") as j:
        j.append({"request_id": "a", "finished_at": 3.0, "v": "copy"})
    assert newest([own, ten, two], "request_id")["a"][0]["v"] == "copy"
    assert newest([two, own, ten], "request_id")["a"][0]["v"] == "new"
    # Only the wanted keys, and only the records ``accept`` takes (another fingerprint's are not candidates).
    found = newest([own, ten, two], "request_id", {"a"}, accept=lambda rec: rec["v"] != "copy")
    assert {k: rec["v"] for k, (rec, _) in found.items()} == {"a": "new"}


def test_iter_records_skips_unwanted_keys_before_parsing(tmp_path):
    path = tmp_path / "j.jsonl"
    with Journal(path, key="request_id") as j:
        for rid in ("a", "b", "c"):
            j.append({"request_id": rid, "n": 1})
    with open(path, "ab") as fh:
        fh.write(b'{"other":1,"request_id":"b"}\n')  # not led by the key: parsed, kept
    got = list(iter_records(path, "request_id", {"b"}))
    assert got == [{"request_id": "b", "n": 1}, {"other": 1, "request_id": "b"}]
    assert len(list(iter_records(path))) == 4
