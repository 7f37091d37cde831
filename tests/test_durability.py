"""Writes other steps read survive a node crash once they returned, and the journal's lock holds where
the journals live, or the job refuses to start (issue 34, part 6): atomic writes fsync the file before
the rename and its folder after it; the journal refuses a shared file system mounted so that its locks
stay on one node, saying which option and what to do."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

import pyarrow as pa
import pytest

from vidlabel.core import journal as jr
from vidlabel.core.io import write_parquet, write_text
from vidlabel.core.journal import Journal, JournalLockUnsafe


def _fsyncs(monkeypatch) -> list[tuple[str, str]]:
    """(what, path) of every fsync and rename from now on, in order."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("rename", str(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events


@pytest.mark.parametrize("write", [
    lambda path: write_text("hello\n", path),
    lambda path: write_parquet(pa.table({"a": [1, 2]}), path),
], ids=["text", "parquet"])
def test_an_atomic_write_is_durable_before_and_after_its_rename(tmp_path, monkeypatch, write):
    path = tmp_path / "out" / "file.bin"
    events = _fsyncs(monkeypatch)
    write(path)
    assert path.exists() and not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]
    (sync_tmp, rename, sync_dir) = events
    assert sync_tmp[0] == "fsync" and Path(sync_tmp[1]).parent == path.parent and sync_tmp[1].endswith(".tmp")
    assert rename == ("rename", str(path))
    assert sync_dir == ("fsync", str(path.parent))  # the rename itself is durable only once its folder is


def test_a_failed_atomic_write_leaves_no_file_and_syncs_nothing(tmp_path, monkeypatch):
    events = _fsyncs(monkeypatch)
    with pytest.raises(AttributeError):
        write_parquet("not a table", tmp_path / "x.parquet")  # fails inside the write
    assert list(tmp_path.iterdir()) == [] and events == []


def _mountinfo(tmp_path: Path, point: Path, fstype: str, options: str) -> Path:
    """A /proc/self/mountinfo with the root file system and ``point`` mounted as ``fstype``."""
    path = tmp_path / "mountinfo"
    point_field = str(point).replace(" ", "\\040")
    path.write_text("1 0 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
                    f"2 1 0:50 / {point_field} rw,relatime shared:2 - {fstype} server:/export {options}\n")
    return path


@pytest.mark.parametrize("fstype, options, refused", [
    ("nfs4", "rw,vers=4.2,rsize=1048576,hard,proto=tcp,local_lock=none,addr=10.0.0.1", None),
    ("nfs", "rw,vers=3,hard,proto=tcp,nolock,addr=10.0.0.1", "NFS mounted with nolock"),
    ("nfs4", "rw,vers=4.1,local_lock=flock,addr=10.0.0.1", "NFS mounted with local_lock=flock"),
    ("nfs4", "rw,vers=4.1,local_lock=all,addr=10.0.0.1", "NFS mounted with local_lock=all"),
    ("lustre", "rw,flock,lazystatfs", None),
    ("lustre", "rw,localflock,lazystatfs", "Lustre mounted localflock"),
    ("lustre", "rw,lazystatfs", "Lustre mounted without flock"),
    ("gpfs", "rw", None),
])
def test_the_journal_refuses_a_shared_file_system_whose_locks_stay_on_one_node(tmp_path, monkeypatch, fstype,
                                                                               options, refused):
    results = tmp_path / "shared results"  # a mount point with a space: mountinfo writes it as \040
    monkeypatch.setattr(jr, "MOUNTINFO", _mountinfo(tmp_path, results, fstype, options))
    path = results / "models" / "m" / "journal" / "shard-0.jsonl"
    mount = jr.mount_of(path)
    assert (mount.point, mount.fstype) == (str(results), fstype)
    if refused is None:
        with Journal(path, key="k") as journal:
            journal.append({"k": 1})
        assert jr.read_latest(path, "k") == {1: {"k": 1}}
        return
    with pytest.raises(JournalLockUnsafe) as info:
        Journal(path, key="k").__enter__()
    message = str(info.value)
    assert refused in message and str(path) in message and "two nodes" in message
    assert "docs/outputs.md" in message
    assert not path.exists()  # refused before anything was written


def test_an_unknown_network_file_system_is_warned_about(tmp_path, monkeypatch, caplog):
    results = tmp_path / "results"
    monkeypatch.setattr(jr, "MOUNTINFO", _mountinfo(tmp_path, results, "beegfs", "rw,cfgFile=/etc/beegfs.conf"))
    with Journal(results / "shard-0.jsonl", key="k"):
        pass
    assert "beegfs" in caplog.text and "two jobs of one shard" in caplog.text


def test_a_file_system_that_takes_no_lock_is_refused(tmp_path, monkeypatch):
    def no_locks(fh, how):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(JournalLockUnsafe, match="takes no lock .*No locks available"):
        Journal(tmp_path / "shard-0.jsonl", key="k").__enter__()


def test_the_mount_of_a_path_is_its_deepest_mount_point(tmp_path):
    info = tmp_path / "mountinfo"
    info.write_text("1 0 8:1 / / rw - ext4 /dev/sda1 rw\n"
                    "2 1 0:50 / /scratch rw - lustre mgs@tcp:/fs rw,flock\n"
                    "3 2 0:51 / /scratch/local rw - xfs /dev/nvme0n1 rw\n"
                    "4 1 0:52 / /scratchy rw - nfs4 srv:/x rw,local_lock=all\n")
    assert jr.mount_of("/scratch/a/b", info).fstype == "lustre"
    assert jr.mount_of("/scratch/local/a", info).fstype == "xfs"
    assert jr.mount_of("/scratchy/a", info).fstype == "nfs4"
    assert jr.mount_of("/home/a", info).fstype == "ext4"
    assert "flock" in jr.mount_of("/scratch", info).options
    assert jr.mount_of("/x", tmp_path / "absent") is None  # not Linux: nothing is refused
