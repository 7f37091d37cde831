"""Atomic, durable writes: other steps only ever see complete files (temp file in the same directory +
rename), and a file a later step reads survives a node crash once the write returned (the temp file is
fsynced before the rename, the folder after it: a rename is durable only once its folder is)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

_UMASK = os.umask(0)
os.umask(_UMASK)


def fsync_directory(path: str | Path) -> None:
    """Make the names in folder ``path`` durable (a file created or renamed there)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | Path) -> None:
    """Make the contents of ``path`` durable (whoever wrote them, through whatever handle)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | Path):
    """Yield a temporary path next to ``path``; when the block succeeds, make it durable and rename it
    over ``path`` (module docstring)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600 files; outputs are shared like any other file
    try:
        yield Path(tmp)
        fsync_file(tmp)
        os.replace(tmp, path)
        fsync_directory(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_parquet(table: pa.Table, path: str | Path) -> None:
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression="zstd")


def write_text(text: str, path: str | Path) -> None:
    with atomic_path(path) as tmp:
        Path(tmp).write_text(text)
