"""Append-only JSON-lines journal that survives kills: the resume point of every chunk/shard job.

One record per finished item (success or terminal error), appended and flushed as it finishes, and
fsynced at most ``fsync_interval_s`` apart (``fsync="record"``: every record); a new journal's folder
is fsynced too, so that its name survives a node crash. On open, a torn last line (the process died
mid-write) is cut off. On read, records are deduplicated by key: within one journal the last record
wins (``read_latest``); over several journals (a classify job reads every shard's) the newest by the
time it was made wins (``newest``), whatever the files are called.

A lock refuses a second writer on the same journal: ``flock`` on a lock file beside it. It holds
between processes of one node on any file system, and between nodes where the file system keeps
locks for the whole cluster: NFS (Linux makes an flock a whole-file lock of NFS's lock manager) unless
mounted with ``nolock`` or ``local_lock=flock|all``, Lustre mounted with ``flock``, GPFS, CephFS. Where
the mount options say it would hold on this node only (NFS ``nolock`` / ``local_lock``, Lustre
``localflock``, Lustre without ``flock``) the journal refuses to open (``JournalLockUnsafe``, saying
which option and what to do); on a network file system not known either way it warns.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Container, Iterable, Iterator

from vidlabel.core.io import fsync_directory

log = logging.getLogger(__name__)

MOUNTINFO = Path("/proc/self/mountinfo")
# File systems whose flock holds across nodes when their mount options allow it (module docstring).
CLUSTER_LOCKING = frozenset({"nfs", "nfs4", "lustre", "gpfs", "ceph"})
# File systems of one node, where every job that can open the journal shares its lock.
LOCAL = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "tmpfs", "overlay", "f2fs", "reiserfs", "jfs",
                   "ramfs", "bcachefs", "apfs", "hfs", "vfat", "exfat", "ntfs3"})


class JournalLocked(RuntimeError):
    """Another process holds this journal (a second job on the same shard or chunk)."""


class JournalLockUnsafe(RuntimeError):
    """The journal's file system would not keep a second job on another node out: refused."""


@dataclass(frozen=True)
class Mount:
    point: str
    fstype: str
    options: frozenset[str]  # the mount's and the file system's options together


def _unescape(field: str) -> str:
    """A mountinfo path field: spaces and the like are written as octal escapes (\\040)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mount_of(path: str | Path, mountinfo: Path | None = None) -> Mount | None:
    """The mount that holds ``path`` (its deepest mount point above it), from /proc/self/mountinfo;
    None where that cannot be read (not Linux)."""
    try:
        lines = (mountinfo or MOUNTINFO).read_text().splitlines()
    except OSError:
        return None
    target = os.path.realpath(path)
    best: Mount | None = None
    for line in lines:
        head, sep, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if not sep or len(fields) < 6 or len(rest) < 3:
            continue
        point = _unescape(fields[4])
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best.point)):
            best = Mount(point, rest[0], frozenset(fields[5].split(",")) | frozenset(rest[2].split(",")))
    return best


def lock_unsafe(mount: Mount | None) -> str | None:
    """Why an flock on ``mount`` would hold on this node only (the option that says so), else None."""
    if mount is None:
        return None
    kind, options = mount.fstype, mount.options
    if kind in ("nfs", "nfs4"):
        local = sorted(o for o in options if o in ("nolock", "local_lock=flock", "local_lock=all"))
        if local:
            return (f"NFS mounted with {local[0]}, so its locks are kept on this node only; remount without it "
                    "(the default, local_lock=none, takes locks on the NFS server)")
    if kind == "lustre" and "flock" not in options:
        how = ("localflock, so its locks are kept on this node only" if "localflock" in options
               else "without flock, so it takes no locks at all")
        return f"Lustre mounted {how}; mount it with -o flock (cluster-wide locks)"
    return None


def check_lock_scope(path: str | Path) -> None:
    """Refuse a journal whose lock would not hold across nodes; warn where that is not known."""
    mount = mount_of(Path(path).parent)
    why = lock_unsafe(mount)
    if why:
        raise JournalLockUnsafe(
            f"{path} is on {mount.point} ({why}). Two jobs of one shard on two nodes (a rerun submitted "
            "while the first still runs) could then both write this journal. Either fix the mount, or put "
            "`results` on a file system whose locks hold across nodes or on the job's own node (docs/outputs.md, "
            "\"The journal on a shared file system\").")
    if mount is not None and mount.fstype not in CLUSTER_LOCKING | LOCAL:
        log.warning("%s is on %s (%s), which vidlabel does not know to keep file locks across nodes: do not "
                    "start two jobs of one shard at once (docs/outputs.md)", path, mount.point, mount.fstype)


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


def newest(paths: Iterable[str | Path], key: str, wanted: Container[str] | None = None,
           accept: Callable[[dict[str, Any]], bool] | None = None, when: str = "finished_at",
           ) -> dict[str, tuple[dict[str, Any], Path]]:
    """Per ``key``, the newest record of all ``paths`` that ``accept`` takes, with the journal it is in.

    Newest is the latest ``when`` (the time the record was made, which a copy into another journal
    keeps), so neither the files' names nor their order decide. On a tie (a record and its copy) the
    first of ``paths`` holding one wins, and within a journal the later line (a record rewritten)."""
    found: dict[str, tuple[dict[str, Any], Path, float]] = {}
    for path in map(Path, paths):
        for rec in iter_records(path, key, wanted):
            k = rec.get(key)
            if k is None or (wanted is not None and k not in wanted) or (accept is not None and not accept(rec)):
                continue
            t = rec.get(when)
            t = float(t) if isinstance(t, (int, float)) else float("-inf")
            held = found.get(k)
            if held is None or t > held[2] or (t == held[2] and held[1] == path):
                found[k] = (rec, path, t)
    return {k: (rec, path) for k, (rec, path, _) in found.items()}


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
        check_lock_scope(self.path)
        self._lock_fh = open(self.lock_path, "a+")
        try:
            fcntl.flock(self._lock_fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_fh.seek(0)
            holder = self._lock_fh.read().strip() or "another process"
            self._lock_fh.close()
            self._lock_fh = None
            raise JournalLocked(f"{self.path} is in use by {holder}; refusing a second job on it") from None
        except OSError as exc:  # ENOLCK, ENOSYS, EOPNOTSUPP: the file system takes no locks
            self._lock_fh.close()
            self._lock_fh = None
            raise JournalLockUnsafe(f"{self.path}: its file system takes no lock ({exc}), so nothing would keep "
                                    "a second job of this shard out; put `results` on a file system that does "
                                    "(docs/outputs.md, \"The journal on a shared file system\")") from None
        self._lock_fh.seek(0)
        self._lock_fh.truncate()
        self._lock_fh.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        self._lock_fh.flush()
        self._repair_tail()
        created = not self.path.exists()
        self._fh = open(self.path, "ab")
        if created:
            fsync_directory(self.path.parent)  # the new name, so that a later step finds the journal
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
