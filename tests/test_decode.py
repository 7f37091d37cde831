"""planning.decode and classify.quantization: into the server command, into every answer's identity,
and the decoder's requirements checked before the server starts."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from vidlabel.core import config as vconfig
from vidlabel.core import identity, models
from vidlabel.core import decode
from vidlabel.core import stage_settings
from vidlabel.prepare import planning
from vidlabel.serve.command import CommandError, ServerCopy, build_command
from vidlabel.serve.items import post_items
from vidlabel.serve.provenance import JobIdentity
from vidlabel.serve.server import ServerError, ServerGroup
from vidlabel.serve.settings import ServeSettings


def cfg(decode_choice: str | None = None, **classify) -> dict:
    raw = {"posts": "p.csv", "media_root": "/data/media", "results": "/data/results", "classify": classify}
    if decode_choice is not None:
        raw["planning"] = {"decode": decode_choice}
    return vconfig.validate(raw)


def argv(config: dict) -> list[str]:
    return build_command(ServeSettings.from_config(config).server, 8000, ServerCopy(0, (), 1, 1, 16, 8,
                                                                                  Path("server.log")))


def media_io(words: list[str]) -> dict:
    return json.loads(words[words.index("--media-io-kwargs") + 1])


def test_the_backend_is_merged_into_the_media_io_kwargs_keeping_fps():
    assert media_io(argv(cfg("gpu"))) == {"video": {"fps": 2, "backend": "pynvvideocodec"}}
    assert media_io(argv(cfg("torchcodec"))) == {"video": {"fps": 2, "backend": "torchcodec"}}
    # The default decoder adds nothing: the command is the one vidlabel ran before the choice existed.
    assert media_io(argv(cfg("cpu"))) == {"video": {"fps": 2}}
    # auto is the measured choice, and the default.
    assert argv(cfg(decode.AUTO_DECODE)) == argv(cfg()) == argv(cfg("auto"))
    assert decode.AUTO_DECODE in decode.CHOICES and cfg()["planning"]["decode"] == decode.AUTO_DECODE


def test_merging_keeps_other_keys_and_adds_the_flag_where_there_is_none():
    words = ["vllm", "serve", "m", "--media-io-kwargs={\"video\": {\"fps\": 1, \"num_ffmpeg_threads\": 2}}"]
    out = decode.with_backend(words, "torchcodec")
    assert json.loads(out[-1].split("=", 1)[1]) == {"video": {"fps": 1, "num_ffmpeg_threads": 2,
                                                              "backend": "torchcodec"}}
    assert decode.with_backend(["vllm", "serve", "m"], "pynvvideocodec")[-2:] == [
        "--media-io-kwargs", '{"video":{"backend":"pynvvideocodec"}}']
    with pytest.raises(ValueError, match="video_backend"):  # would swap Qwen2-VL's sampler
        decode.with_backend(["vllm", "--media-io-kwargs", '{"video":{"video_backend":"opencv"}}'], "torchcodec")
    for choice in ("gpu", "cpu"):
        with pytest.raises(CommandError, match="video_backend"):
            argv(cfg(choice, server_args="--media-io-kwargs '{\"video\":{\"video_backend\":\"x\"}}'"))


def test_decoder_and_quantization_are_in_every_answers_identity(tmp_path, monkeypatch):
    from standin import vllm_shim

    monkeypatch.setenv("PATH", f"{vllm_shim(tmp_path / 'bin').parent}{os.pathsep}{os.environ['PATH']}")
    configs = {c: cfg(c) for c in (*decode.CHOICES, "auto")}
    configs["fp8"] = cfg("cpu", quantization="fp8")
    # The classify stage's fingerprint (the rule's params): planning and server keys are in it.
    fingerprints = {name: stage_settings.fingerprint(c, "classify") for name, c in configs.items()}
    # auto is resolved before fingerprints are taken: the same answers as the choice it stands for.
    assert fingerprints["auto"] == fingerprints[decode.AUTO_DECODE]
    assert len({fingerprints[k] for k in (*decode.CHOICES, "fp8")}) == 4
    for stage in ("transcode", "manifest"):  # the decoder decides which posts are transcoded
        assert stage_settings.fingerprint(configs["cpu"], stage) != stage_settings.fingerprint(configs["gpu"], stage)
    # And the request fingerprint a journaled answer is reused under.
    row = {"request_id": "r", "post_id": "p", "media_path": "/nonexistent.mp4", "prompt": "x",
           "est_prompt_tokens": 10, "items": post_items({"media_path": "/nonexistent.mp4"})}
    jobs = {name: JobIdentity.resolve(ServeSettings.from_config(c)) for name, c in configs.items()}
    media = {row["media_path"]: identity.media_item(row["media_path"])}
    prints = {name: job.request(row, media).fingerprint() for name, job in jobs.items()}
    assert prints["auto"] == prints[decode.AUTO_DECODE]
    assert len({prints[k] for k in (*decode.CHOICES, "fp8")}) == 4
    assert "--quantization" in dict(jobs["fp8"].answering.server)["command"]


def test_quantization_goes_into_the_command_and_may_differ_per_model():
    words = argv(cfg(quantization="fp8"))
    assert words[words.index("--quantization") + 1] == "fp8" and words.count("--quantization") == 1
    assert "--quantization" not in argv(cfg())
    # The same method in server_args is not repeated; another one is a conflict, named.
    assert argv(cfg(quantization="fp8", server_args="--quantization fp8")).count("--quantization") == 1
    with pytest.raises(CommandError, match="classify.quantization"):
        argv(cfg(quantization="fp8", server_args="-q awq"))
    both = cfg(models=["Qwen/Qwen2.5-VL-72B-Instruct",
                       {"model": "Qwen/Qwen2.5-VL-72B-Instruct", "name": "72b-fp8", "quantization": "fp8"}])
    bf16, fp8 = (models.model_config(both, n) for n in models.names(both))
    assert "--quantization" not in argv(bf16) and "--quantization" in argv(fp8)
    assert stage_settings.fingerprint(both, "classify", "72b-fp8") != stage_settings.fingerprint(
        both, "classify", "Qwen2.5-VL-72B-Instruct")
    with pytest.raises(vconfig.ConfigError, match="quantization"):
        cfg(quantization="int3")


def test_install_hint_names_what_to_install_for_the_servers_messages():
    hint = decode.install_hint("No module named 'PyNvVideoCodec'")
    assert "pynvvideocodec" in hint and "server's own Python" in hint
    assert "FFmpeg" in decode.install_hint("Could not load libtorchcodec. Likely causes: 1. FFmpeg is not ...")
    assert "torchcodec" in decode.install_hint("ModuleNotFoundError: No module named 'torchcodec'")
    assert "vllm[" in decode.install_hint("Please install vllm[video] for video support")
    for other in ("No module named 'cv2x'", "[Errno 2] No such file or directory: '/m/a.mp4'",
                  "Could not open video stream", ""):
        assert decode.install_hint(other) is None, other


def fake_server(tmp_path: Path, name: str = "vllm") -> Path:
    """A `vllm` console script whose interpreter is this Python, as pip installs one."""
    script = tmp_path / "bin" / name
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(f"#!{sys.executable}\nimport sys\nsys.exit(0)\n")
    script.chmod(0o755)
    return script


def test_preflight_fails_when_the_servers_python_cannot_import_the_decoder(tmp_path):
    script = fake_server(tmp_path)
    env = {**os.environ, "PATH": f"{script.parent}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": ""}
    words = decode.with_backend(["vllm", "serve", "m"], "pynvvideocodec")
    message = decode.preflight(words, env)
    assert message and "cannot import PyNvVideoCodec" in message and "pip install pynvvideocodec" in message
    assert sys.executable in message
    # Installed where the server's Python finds it: nothing to say.
    site = tmp_path / "site"
    site.mkdir()
    (site / "PyNvVideoCodec.py").write_text("")
    assert decode.preflight(words, {**env, "PYTHONPATH": str(site)}) is None
    # The default decoder needs nothing; a shell wrapper cannot be looked into (the first request tells).
    assert decode.preflight(["vllm", "serve", "m"], env) is None
    wrapper = tmp_path / "bin" / "vllm-wrapper"
    wrapper.write_text("#!/usr/bin/env bash\nexec python3 -m vllm.entrypoints.cli.main \"$@\"\n")
    wrapper.chmod(0o755)
    assert decode.preflight(["vllm-wrapper", *words[1:]], env) is None


def test_the_job_stops_before_the_server_starts_when_the_decoder_is_missing(tmp_path, monkeypatch):
    script = fake_server(tmp_path)
    monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("PYTHONPATH", "")
    config = cfg("gpu")
    copies = [ServerCopy(0, (), 1, 1, 16, 8, tmp_path / "server.log")]
    group = ServerGroup(ServeSettings.from_config(config), copies)
    with pytest.raises(ServerError, match="cannot import PyNvVideoCodec"):
        group.start()
    assert all(s.proc is None for s in group.servers)  # nothing was started


def test_the_planner_says_why_a_file_goes_to_the_transcode_for_the_chosen_decoder():
    n = 3
    formats = decode.Formats(
        codec=np.array(["h264", "h264", "hevc"], dtype=object),
        pix_fmt=np.array(["yuv420p", "yuv444p", "yuv420p10le"], dtype=object),
        width=np.array([720, 720, 720], dtype=object), height=np.array([1280, 1280, 1280], dtype=object),
        rotation=np.zeros(n, dtype=object), container=np.array(["mov,mp4,m4a,3gp,3g2,mj2"] * n, dtype=object),
        header_frames=np.array([300] * n, dtype=object), fps=np.array([30.0] * n, dtype=object),
        base_fps=np.array([30.0] * n, dtype=object), duration_s=np.array([10.0] * n, dtype=object))
    args = ([10.0] * n, [30.0] * n, [720] * n, [1280] * n, [300] * n)
    gpu = planning.plan_posts(cfg("gpu"), *args, formats=formats)
    assert list(gpu.action) == ["as-is", "replan", "as-is"]
    assert gpu.plan[1].startswith("transcode to h264: NVDEC cannot decode h264 yuv444p")
    cpu = planning.plan_posts(cfg("cpu"), *args, formats=formats)
    assert list(cpu.action) == ["as-is"] * n
    # An inventory made before the decoder's columns existed: a clear message, not a silent guess.
    old = decode.Formats(codec=formats.codec)
    with pytest.raises(decode.InventoryTooOld, match="forcerun inventory"):
        planning.plan_posts(cfg("gpu"), *args, formats=old)
    assert list(planning.plan_posts(cfg("cpu"), *args, formats=old).action) == ["as-is"] * n
