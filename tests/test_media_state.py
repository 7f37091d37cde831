"""The media's state (vidlabel.core.identity.media_state): the same digest on one thread and on many,
and a file replaced at its path (size or modification time) changes it; a missing file is part of it."""

from __future__ import annotations

import os

from vidlabel.core.identity import media as media_identity


def test_one_thread_and_many_give_the_same_digest_and_a_replaced_file_changes_it(tmp_path, monkeypatch):
    monkeypatch.setattr(media_identity, "STAT_BATCH", 7)  # several batches from a few files
    paths = []
    for i in range(30):
        path = tmp_path / f"d{i % 3}" / f"{i}.mp4"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"x" * i)
        paths.append(str(path))
    paths.append(str(tmp_path / "missing.mp4"))
    local = media_identity.media_state(paths)
    monkeypatch.setattr(media_identity, "LOCAL_STAT_S", -1.0)  # every stat "slow": the threads take the rest
    assert media_identity.media_state(paths, threads=4) == local
    st = os.stat(paths[20])
    os.utime(paths[20], ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert media_identity.media_state(paths, threads=4) != local
    os.utime(paths[20], ns=(st.st_atime_ns, st.st_mtime_ns))
    assert media_identity.media_state(paths, threads=1) == local
    (tmp_path / "missing.mp4").write_bytes(b"")  # the missing file appears
    assert media_identity.media_state(paths) != local
    assert media_identity.media_state([]) == media_identity.media_state([None])
