"""The resume journal: torn tails, dedupe, the single-writer lock."""

import json
import multiprocessing
import os
import signal

import pytest

from vidlabel.core.journal import Journal, JournalLocked, iter_records, read_latest


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
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append(fd) or real_fsync(fd))
    with Journal(tmp_path / "a.jsonl", key="k", fsync="record") as journal:
        for i in range(5):
            journal.append({"k": i})
        per_record = len(calls)
    calls.clear()
    with Journal(tmp_path / "b.jsonl", key="k", fsync="batch", fsync_interval_s=3600) as journal:
        journal.append({"k": 0})
        for i in range(1, 5):
            journal.append({"k": i})
        batched = len(calls)
    assert per_record == 5
    assert batched == 1  # the first append syncs, the rest wait for the interval (and close)


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
