"""What an answer depends on (vidlabel.core.identity): every input that can change an answer makes the
job send the request again, also where the input changed in place (a file edited, a folder
overwritten, a server restarted with other flags) and also for a shard that had nothing left to send.
The stand-in plays vLLM; the request log shows what was sent."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from standin import vllm_shim
from standin.shards import YES_IF
from test_fault_matrix import _endpoint, _use_endpoints, make_shard, media  # noqa: F401 (fixtures)

from vidlabel.core import config as vconfig
from vidlabel.core.journal import read_latest
from vidlabel.serve.probe import CalibrationUnlikePlan

DEFAULT_COMMAND = vconfig.load_schema()["properties"]["classify"]["properties"]["server_command"]["default"]


def sends(shard) -> list[dict]:
    return [e for e in shard.events() if e["event"] == "received"]


def test_an_external_endpoint_restarted_with_other_fps_keeps_no_old_answer(make_shard, monkeypatch):
    shard = make_shard(6)
    first = _endpoint(shard, shard.config("--video-tokens", "qwen"), "fps2", "k")
    try:
        shard.run(_use_endpoints(shard.config(), monkeypatch, "k", first))
        shard.run(_use_endpoints(shard.config(), monkeypatch, "k", first))  # the same server: nothing again
    finally:
        first.stop()
    assert len(sends(shard)) == 6
    before = shard.labels_by_post()
    # The endpoint restarted with another frame rate (--media-io-kwargs): it samples otherwise than the plan, so
    # the job refuses it before any post (vidlabel.serve.probe.CalibrationUnlikePlan), and keeps no old answer.
    second = _endpoint(shard, shard.config("--video-tokens", "qwen", "--media-io-kwargs", '{"video": {"fps": 1}}'),
                       "fps1", "k")
    try:
        with pytest.raises(CalibrationUnlikePlan, match="fps and lower pixel bound"):
            shard.run(_use_endpoints(shard.config(), monkeypatch, "k", second))
    finally:
        second.stop()
    assert len(sends(shard)) == 6  # not one request to the other server
    assert shard.labels_by_post() == before  # and the labels still say which server gave them


def test_a_fully_journaled_shard_notices_a_server_upgrade(make_shard, monkeypatch, tmp_path):
    """A shard with nothing left to send starts no server, yet the job sees that `vllm` is another
    version now: the shard's answers are sent again, so the table never mixes two servers."""
    shard = make_shard(4)
    path = os.environ["PATH"]

    def use_vllm(version: str) -> dict:
        shim_dir = tmp_path / f"bin-{version}"
        vllm_shim(shim_dir, "--standin-version", version, "--request-log", str(shard.request_log), *YES_IF)
        monkeypatch.setenv("PATH", f"{shim_dir}{os.pathsep}{path}")
        return shard.config(server_command=DEFAULT_COMMAND)

    shard.run(use_vllm("0.26.0"))
    shard.run(use_vllm("0.26.0"))
    assert len(sends(shard)) == 4
    shard.run(use_vllm("0.27.0"))
    assert len(sends(shard)) == 8
    assert {r["server"] for r in shard.check_complete_labels().values()} == {"vLLM 0.27.0, model standin-model"}


def test_a_file_valued_server_argument_edited_in_place_is_sent_again(make_shard, tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    shard = make_shard(4)

    def config() -> dict:
        return shard.config(server_args=f"--chat-template {template}")

    shard.run(config())
    shard.run(config())
    assert len(sends(shard)) == 4  # unchanged: nothing again
    stat = template.stat()
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}!")
    os.utime(template, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # even with the old modification time
    shard.run(config())
    assert len(sends(shard)) == 8


QWEN_7B_CONFIG = json.loads((Path(__file__).parent / "data" / "qwen2_5_vl_7b" / "config.json").read_text())


def _checkpoint(folder, fine_tune: int, weights: bytes) -> None:
    """A local model folder: Qwen2.5-VL-7B's config.json (marked with the fine-tune) and a weights file."""
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**QWEN_7B_CONFIG, "fine_tune": fine_tune}))
    (folder / "model.safetensors").write_bytes(weights)


def test_a_checkpoint_folder_overwritten_in_place_is_sent_again(make_shard, tmp_path):
    folder = tmp_path / "checkpoint"
    _checkpoint(folder, 1, b"\0" * 4096)
    shard = make_shard(4)

    def config() -> dict:
        return shard.config(model=str(folder))

    shard.run(config())
    shard.run(config())
    assert len(sends(shard)) == 4
    first = shard.labels_by_post()
    # A new fine-tune written over the old one: another config.json.
    _checkpoint(folder, 2, b"\0" * 4096)
    shard.run(config())
    assert len(sends(shard)) == 8
    second = shard.labels_by_post()
    # New weights of the same size in the same file.
    time.sleep(0.01)
    (folder / "model.safetensors").write_bytes(b"\1" * 4096)
    shard.run(config())
    assert len(sends(shard)) == 12
    third = shard.check_complete_labels()
    revisions = [{r["model_revision"] for r in labels.values()} for labels in (first, second, third)]
    assert all(len(r) == 1 for r in revisions) and len(set().union(*revisions)) == 3
    assert {r["model"] for r in third.values()} == {str(folder)}
    latest = read_latest(shard.journal, "request_id")
    assert {r["model_revision"] for r in latest.values()} == revisions[2]


def test_the_content_media_identity_sees_a_file_rewritten_with_its_old_size_and_time(make_shard, tmp_path):
    clip = tmp_path / "own-media" / "clip.mp4"
    clip.parent.mkdir()
    shard = make_shard(2)
    clip.write_bytes((shard.media / "clip.mp4").read_bytes())
    for post in shard.posts:
        post["media_path"] = str(clip)
    shard.media = clip.parent
    shard.run(shard.config(media_identity="content"))
    shard.run(shard.config(media_identity="content"))
    assert len(sends(shard)) == 2
    stat = clip.stat()
    data = bytearray(clip.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte of the frames changed: same size, same time, other content
    clip.write_bytes(bytes(data))
    os.utime(clip, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (clip.stat().st_size, clip.stat().st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)
    shard.run(shard.config(media_identity="content"))
    assert len(sends(shard)) == 4


def test_the_docs_table_is_the_declaration():
    """docs/outputs.md's "What identifies an answer" is vidlabel.core.identity.INPUTS, row for row."""
    from vidlabel.core.identity import INPUTS, markdown_table

    docs = (Path(__file__).resolve().parents[1] / "docs" / "outputs.md").read_text()
    assert markdown_table() in docs
    assert {"prompt", "media", "transcript", "plan", "model", "server command", "server program", "generation",
            "answer schema", "running server"} == {i.name for i in INPUTS}


def _launcher(path: Path, shebang: str, version_output: str) -> Path:
    """A `vllm` launcher whose `--version` prints ``version_output`` (what asking it would say)."""
    path.write_text(f"#!{shebang}\nimport sys\nprint({version_output!r})\n")
    path.chmod(0o755)
    return path


def test_the_server_program_is_its_installed_version_read_without_running_it(tmp_path, monkeypatch):
    """A Python launcher: the version from its package's metadata by its own Python, `--version` never run
    (it imports torch: 22-31 s on a GPU node); another launcher, or no metadata: `--version`."""
    import sys

    from vidlabel.core import identity
    from vidlabel.core.launcher import launcher_python

    site = tmp_path / "site"
    (site / "vllm-0.26.0.dist-info").mkdir(parents=True)
    (site / "vllm-0.26.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.26.0\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    launcher = _launcher(bin_dir / "vllm", sys.executable, "asked")
    monkeypatch.setenv("PYTHONPATH", str(site))
    assert identity.program_version([str(launcher), "serve", "m"]) == "vllm 0.26.0"
    (site / "vllm-0.26.0.dist-info").rename(site / "vllm-0.27.1.dist-info")
    (site / "vllm-0.27.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.27.1\n")
    assert identity.program_version([str(launcher), "serve", "m"]) == "vllm 0.27.1"
    monkeypatch.delenv("PYTHONPATH")  # no package metadata where the launcher's Python looks
    assert identity.program_version([str(launcher), "serve", "m"]) == "vllm asked"
    via_env = _launcher(bin_dir / "vllm-env", "/usr/bin/env -S python3 -u", "asked")
    assert Path(launcher_python(str(via_env))).name == "python3"
    shell = bin_dir / "vllm-sh"
    shell.write_text("#!/bin/sh\necho 1\n")
    assert launcher_python(str(shell)) is None
