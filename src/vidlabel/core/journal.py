"""Append-only JSON-lines journal that survives kills: the resume point of every chunk/shard job.

One record per finished item (success or terminal error), appended and flushed as it finishes.
On open, a torn last line (the process died mid-write) is cut off; on read, records are
deduplicated by key (the last record wins). A lock file refuses a second writer on the same journal.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Container, Iterator


class JournalLocked(RuntimeError):
    """Another process holds this journal (a second job on the same shard or chunk)."""


def journal_beside(output_path: str | Path) -> Path:
    """The resume journal of a chunk job's output: the same name with `.jsonl` (undeclared to Snakemake)."""
    output_path = Path(output_path)
    return output_path.with_name(output_path.name.removesuffix(".parquet") + ".jsonl")


def iter_records(path: str | Path, key: str | None = None, wanted: Container[str] | None = None
                 ) -> Iterator[dict[str, Any]]:
    """Yield the complete records of a journal; a torn or unparsable line is skipped.

    With ``key`` and ``wanted``, records whose first field is ``key`` with a value not in ``wanted``
    are skipped before they are parsed (a job scans every shard's journal for its own requests)."""
    path = Path(path)
    if not path.exists():
        return
    head = b'{"' + key.encode() + b'":"' if key else None
    with open(path, "rb") as fh:
        for line in fh:
            if not line.endswith(b"\n"):
                break  # torn tail of a killed writer
            if head is not None and wanted is not None and line.startswith(head):
                end = line.find(b'"', len(head))
                if end > 0 and line[len(head):end].decode(errors="replace") not in wanted:
                    continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def read_latest(path: str | Path, key: str) -> dict[str, dict[str, Any]]:
    """Records by ``key``, the last one for each key winning."""
    return {rec[key]: rec for rec in iter_records(path) if key in rec}


class Journal:
    """Writer side. Use as a context manager: it takes the lock and repairs a torn tail."""

    def __init__(self, path: str | Path, key: str, fsync: str = "batch", fsync_interval_s: float = 1.0):
        if fsync not in ("record", "batch"):
            raise ValueError(f"fsync must be 'record' or 'batch', not {fsync!r}")
        self.path = Path(path)
        self.key = key
        self.fsync = fsync
        self.fsync_interval_s = fsync_interval_s
        self._fh = None
        self._lock_fh = None
        self._last_sync = float("-inf")  # the first record is synced at once

    @property
    def lock_path(self) -> Path:
        return self.path.with_name(self.path.name + ".lock")

    def __enter__(self) -> "Journal":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock_fh = open(self.lock_path, "a+")
        try:
            fcntl.flock(self._lock_fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_fh.seek(0)
            holder = self._lock_fh.read().strip() or "another process"
            self._lock_fh.close()
            self._lock_fh = None
            raise JournalLocked(f"{self.path} is in use by {holder}; refusing a second job on it") from None
        self._lock_fh.seek(0)
        self._lock_fh.truncate()
        self._lock_fh.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        self._lock_fh.flush()
        self._repair_tail()
        self._fh = open(self.path, "ab")
        return self

    def _repair_tail(self) -> None:
        if not self.path.exists():
            return
        with open(self.path, "r+b") as fh:
            size = fh.seek(0, os.SEEK_END)
            if size == 0:
                return
            fh.seek(size - 1)
            if fh.read(1) == b"\n":
                return
            # Walk back to the last newline and cut the partial record after it.
            pos = size - 1
            block = 65536
            while pos > 0:
                start = max(0, pos - block)
                fh.seek(start)
                chunk = fh.read(pos - start)
                idx = chunk.rfind(b"\n")
                if idx >= 0:
                    fh.truncate(start + idx + 1)
                    return
                pos = start
            fh.truncate(0)

    def read(self) -> dict[str, dict[str, Any]]:
        return read_latest(self.path, self.key)

    def append(self, record: dict[str, Any]) -> None:
        if self._fh is None:
            raise RuntimeError("journal is not open")
        if self.key not in record:
            raise KeyError(f"journal record lacks its key {self.key!r}")
        self._fh.write(json.dumps(record, separators=(",", ":"), default=str).encode() + b"\n")
        self._fh.flush()  # in the page cache now: survives a killed process
        now = time.monotonic()
        if self.fsync == "record" or now - self._last_sync >= self.fsync_interval_s:
            os.fsync(self._fh.fileno())  # on disk: survives a node crash
            self._last_sync = now

    def close(self) -> None:
        if self._fh is not None:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()
            self._fh = None
        if self._lock_fh is not None:
            fcntl.flock(self._lock_fh, fcntl.LOCK_UN)
            self._lock_fh.close()
            self._lock_fh = None

    def __exit__(self, *exc) -> None:
        self.close()
