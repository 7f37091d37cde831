"""vidlabel.serve.server: command template, key handling, readiness, watchdog and teardown on every path."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
from standin import standin_command
from standin.shards import make_config

from vidlabel.core import config as vconfig
from vidlabel.serve.command import (
    CommandError,
    ServerCopy,
    api_server_count,
    build_command,
    granted_cpus,
    server_copies,
    server_environment,
)
from vidlabel.serve.parallelism import Layout
from vidlabel.serve.server import BROKEN_SMOKE_TRIES, ServerBroken, ServerError, VLLMServer
from vidlabel.serve.settings import ServeSettings


def settings(cfg: dict) -> ServeSettings:
    return ServeSettings.from_config(cfg)


SRC = Path(__file__).resolve().parents[1] / "src"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        return False
    return state != "Z"


def _wait_gone(pid: int, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def _config(tmp_path: Path, **classify) -> dict:
    media = tmp_path / "media dir"
    media.mkdir(exist_ok=True)
    return make_config(tmp_path, media, tmp_path / "requests.jsonl", (), classify)


def _copy(tensor=1, data=1, cpus=16, api_servers=4, gpus=("0",)) -> ServerCopy:
    return ServerCopy(0, gpus, tensor, data, cpus, api_servers, Path("server.log"))


def test_default_command_fills_every_field_and_keeps_json_arguments(tmp_path):
    cfg = vconfig.validate({"posts": "p.csv", "media_root": str(tmp_path / "my media"),
                            "results": str(tmp_path / "results"),
                            "classify": {"max_model_len": 16384, "server_args": "--enforce-eager --seed 7"},
                            "planning": {"over_limit": "exclude"}})
    argv = build_command(settings(cfg).server, 8123, _copy(tensor=2, data=1, api_servers=3))
    assert argv[:3] == ["vllm", "serve", "Qwen/Qwen2.5-VL-72B-Instruct"]
    opt = {argv[i]: argv[i + 1] for i in range(3, len(argv) - 1) if argv[i].startswith("--")}
    assert opt["--host"] == "127.0.0.1" and opt["--port"] == "8123"
    assert opt["--tensor-parallel-size"] == "2" and opt["--data-parallel-size"] == "1"
    assert opt["--max-model-len"] == "16384"
    # The encoder cache follows --max-num-batched-tokens: by default as large as the context.
    assert opt["--max-num-batched-tokens"] == "16384"
    assert opt["--allowed-local-media-path"] == os.path.realpath(tmp_path / "my media")  # one argument
    assert json.loads(opt["--limit-mm-per-prompt"]) == {"image": 0, "video": 1}
    # Video frames and images each within their own bounds (vidlabel.serve.command.PIXEL_BOUNDS_FORM).
    assert json.loads(opt["--mm-processor-kwargs"]) == {
        "images_kwargs": {"min_pixels": 3136, "max_pixels": 12845056},
        "videos_kwargs": {"min_pixels": 100352, "max_pixels": 602112}}
    assert json.loads(opt["--media-io-kwargs"]) == {"video": {"fps": 2}}
    assert json.loads(opt["--structured-outputs-config"]) == {"backend": "xgrammar", "disable_any_whitespace": True}
    assert opt["--generation-config"] == "vllm" and opt["--api-server-count"] == "3"
    assert opt["--mm-processor-cache-gb"] == "0" and "--no-enable-prefix-caching" in argv
    assert argv[-3:] == ["--enforce-eager", "--seed", "7"]  # classify.server_args, appended
    assert "--api-key" not in argv
    # Re-planned videos are transcoded under results/: the server may then read the common parent.
    cfg["planning"]["over_limit"] = "replan"
    argv = build_command(settings(cfg).server, 8123, _copy())
    assert argv[argv.index("--allowed-local-media-path") + 1] == os.path.realpath(tmp_path)


def test_bad_template_field_and_bad_server_args_are_named(tmp_path):
    cfg = vconfig.validate({"posts": "p.csv", "media_root": str(tmp_path), "results": str(tmp_path / "r"),
                            "classify": {"server_command": "vllm serve {modle} --port {port}"}})
    with pytest.raises(CommandError, match="classify.server_command.*modle"):
        build_command(settings(cfg).server, 1, _copy())
    cfg = vconfig.validate({"posts": "p.csv", "media_root": str(tmp_path), "results": str(tmp_path / "r"),
                            "classify": {"server_args": "--seed 'unclosed"}})
    with pytest.raises(CommandError, match="classify.server_args"):
        build_command(settings(cfg).server, 1, _copy())


def test_api_servers_and_media_threads_follow_the_cpus_of_each_copy(tmp_path):
    cfg = vconfig.validate({"posts": "p.csv", "media_root": str(tmp_path), "results": str(tmp_path / "r")})
    assert [api_server_count(settings(cfg).server, n) for n in (2, 4, 8, 16, 32, 64)] == [1, 2, 4, 8, 8, 8]
    cfg["classify"]["api_server_count"] = 2
    assert api_server_count(settings(cfg).server, 64) == 2
    cfg["classify"]["api_server_count"] = None
    env = {"SLURM_CPUS_PER_GPU": "8", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    four = Layout(1, 4, ("4", "5", "6", "7"), "test")
    copies = server_copies(settings(cfg), four, tmp_path / "server-3.log", env)
    # One server per GPU, each with its GPU, its log, and a quarter of the job's 32 CPUs.
    assert [c.gpus for c in copies] == [("4",), ("5",), ("6",), ("7",)]
    assert [c.log_path.name for c in copies] == [f"server-3.copy-{i}.log" for i in range(4)]
    assert {(c.cpus, c.api_servers, c.tensor, c.data) for c in copies} == {(8, 4, 1, 1)}
    assert {c.media_threads for c in copies} == {2}
    cfg["classify"]["data_parallel_backend"] = "vllm"
    (one,) = server_copies(settings(cfg), four, tmp_path / "server-3.log", env)
    assert (one.gpus, one.tensor, one.data, one.cpus, one.api_servers) == (("4", "5", "6", "7"), 1, 4, 32, 8)
    assert one.log_path.name == "server-3.log"
    # Fake or absent GPUs are not pinned: the variable is left as the job had it.
    (unpinned,) = server_copies(settings(cfg), Layout(2, 1, ("0", "1"), "test"),
                                tmp_path / "s.log", {"SLURM_CPUS_PER_TASK": "8"})
    assert unpinned.gpus == ()


def test_key_in_environment_not_argv_and_required_by_the_server(tmp_path):
    cfg = _config(tmp_path)

    async def scenario():
        with VLLMServer(settings(cfg), tmp_path / "server.log") as server:
            await server.wait_ready()
            pid = server.proc.pid
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode()
            environ = Path(f"/proc/{pid}/environ").read_bytes().decode()
            assert server.api_key not in cmdline
            assert f"VLLM_API_KEY={server.api_key}" in environ.split("\0")
            async with httpx.AsyncClient() as http:
                open_health = await http.get(f"{server.root_url}/health")
                no_key = await http.get(f"{server.base_url}/models")
                wrong = await http.get(f"{server.base_url}/models", headers={"Authorization": "Bearer x"})
                right = await http.get(f"{server.base_url}/models",
                                       headers={"Authorization": f"Bearer {server.api_key}"})
            assert open_health.status_code == 200
            assert no_key.status_code == 401 and no_key.json() == {"error": "Unauthorized"}
            assert wrong.status_code == 401 and right.status_code == 200
            return pid, server.port

    pid, port = asyncio.run(scenario())
    assert _wait_gone(pid)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health")


def test_two_servers_get_different_ports_and_keys(tmp_path):
    cfg = _config(tmp_path)
    a, b = VLLMServer(settings(cfg), tmp_path / "a.log"), VLLMServer(settings(cfg), tmp_path / "b.log")
    assert a.port != b.port and a.api_key != b.api_key and len(a.api_key) >= 32


def test_exit_during_startup_fails_at_once_with_log_tail(tmp_path):
    script = tmp_path / "boom.py"
    script.write_text("import sys\nprint('loading weights... out of memory', flush=True)\nsys.exit(7)\n")
    cfg = _config(tmp_path, server_command=f"{shlex.quote(sys.executable)} {script} --port {{port}}",
                  startup_timeout_s=120)
    # Fails on the exit itself, not on the (long) startup timeout.
    with pytest.raises(ServerError, match="exited during startup") as info:
        with VLLMServer(settings(cfg), tmp_path / "server.log") as server:
            asyncio.run(server.wait_ready())
    assert "status 7" in str(info.value) and "out of memory" in str(info.value)


def test_slow_start_is_waited_for(tmp_path):
    cfg = _config(tmp_path, server_command=standin_command(sys.executable, None, "--slow-start", "1.5"))
    with VLLMServer(settings(cfg), tmp_path / "server.log") as server:
        with pytest.raises(httpx.ConnectError):  # still loading
            httpx.get(f"{server.root_url}/health")
        asyncio.run(server.wait_ready())
        assert httpx.get(f"{server.root_url}/health").status_code == 200


def test_smoke_request_failure_fails_readiness(tmp_path):
    # /health is fine but the model name does not match: the smoke request answers 404.
    cmd = standin_command(sys.executable, None).replace("--served-model {model}", "--served-model other")
    cfg = _config(tmp_path, server_command=cmd)
    with pytest.raises(ServerError, match="smoke request .* answered 404"):
        with VLLMServer(settings(cfg), tmp_path / "server.log") as server:
            asyncio.run(server.wait_ready())


@pytest.mark.parametrize("fault, says", [
    (("--fail-all-with", "500:Internal server error"), "smoke request .* answered 500: Internal server error"),
    (("--health-error",), "/health answered 500: Internal Server Error"),
])
def test_a_500_at_startup_means_broken_not_starting(tmp_path, fault, says):
    """vLLM opens its port once its engine is up: a 500 from /health or the smoke request is a broken
    server, reported with its log tail after a few tries, not after startup_timeout_s of polling."""
    cfg = _config(tmp_path, server_command=standin_command(sys.executable, None, *fault), startup_timeout_s=30)
    with pytest.raises(ServerBroken, match=says) as info:
        with VLLMServer(settings(cfg), tmp_path / "server.log") as server:
            asyncio.run(server.wait_ready())
    assert f"{BROKEN_SMOKE_TRIES} times in a row" in str(info.value)
    assert "stand-in: listening on" in str(info.value)  # the server log's tail


STUBBORN = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    print("child", child.pid, flush=True)
    time.sleep(600)
""")


def test_teardown_kills_the_whole_group_after_grace(tmp_path):
    script = tmp_path / "stubborn.py"
    script.write_text(STUBBORN)
    cfg = _config(tmp_path, server_command=f"{shlex.quote(sys.executable)} {script} {{port}}",
                  shutdown_grace_s=0.5)
    server = VLLMServer(settings(cfg), tmp_path / "server.log").start()
    log = tmp_path / "server.log"
    deadline = time.monotonic() + 10
    while "child" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(log.read_text().split("child ")[1].split()[0])
    leader = server.proc.pid
    server.stop()
    assert server.proc.returncode == -signal.SIGKILL  # it ignored SIGTERM: killed after the grace period
    assert _wait_gone(leader) and _wait_gone(child)
    server.stop()  # idempotent


def test_watchdog_reports_process_exit(tmp_path):
    cfg = _config(tmp_path)

    async def scenario():
        with VLLMServer(settings(cfg), tmp_path / "server.log") as server:
            await server.wait_ready()
            reasons = []
            task = asyncio.create_task(server.watchdog(reasons.append))
            server.proc.kill()
            await asyncio.wait_for(task, 5)
            return reasons

    reasons = asyncio.run(scenario())
    assert len(reasons) == 1 and "server exited" in reasons[0]


JOB_THAT_DIES = textwrap.dedent("""
    import asyncio, json, os, signal, sys
    from vidlabel.serve.server import VLLMServer
    from vidlabel.serve.settings import ServeSettings
    cfg = json.load(open(sys.argv[1]))
    server = VLLMServer(ServeSettings.from_config(cfg), sys.argv[2]).start()
    asyncio.run(server.wait_ready())
    print(server.proc.pid, flush=True)
    if sys.argv[3] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(0)  # no stop(): atexit must do it
""")


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_server_does_not_outlive_its_job(tmp_path, how):
    cfg = _config(tmp_path)
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    script = tmp_path / "job.py"
    script.write_text(JOB_THAT_DIES)
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "cfg.json"), str(tmp_path / "s.log"), how],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(SRC)})
    assert out.stdout.strip(), out.stderr
    pid = int(out.stdout.split()[0])
    assert _wait_gone(pid), f"server {pid} outlived its job ({how})"


def test_port_taken_before_the_server_binds_is_retried(tmp_path, monkeypatch):
    import socket

    import vidlabel.serve.server as server_mod

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    taken = busy.getsockname()[1]
    ports = iter([taken])
    real_free_port = server_mod.free_port
    monkeypatch.setattr(server_mod, "free_port", lambda: next(ports, None) or real_free_port())
    cfg = _config(tmp_path)
    try:
        with VLLMServer(settings(cfg), tmp_path / "server.log") as server:
            assert server.port == taken
            asyncio.run(server.wait_ready())
            assert server.port != taken
            assert httpx.get(f"{server.root_url}/health").status_code == 200
    finally:
        busy.close()
    assert "address already in use" in (tmp_path / "server.log").read_text().lower()


def test_media_decoding_threads_follow_the_cpus_slurm_granted():
    assert granted_cpus({}) is None
    assert granted_cpus({"SLURM_CPUS_PER_TASK": "12"}) == 12
    assert granted_cpus({"SLURM_CPUS_PER_GPU": "8", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}) == 32
    assert granted_cpus({"SLURM_CPUS_ON_NODE": "16", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}) == 16
    copy = _copy(tensor=4, cpus=32, api_servers=8, gpus=("0", "1", "2", "3"))
    env = server_environment("k", copy, {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"})
    # 32 CPUs / 8 API servers, each with its own decoding pool.
    assert env["VLLM_API_KEY"] == "k" and env["VLLM_MEDIA_LOADING_THREAD_COUNT"] == "4"
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    mine = server_environment("k", copy, {"VLLM_MEDIA_LOADING_THREAD_COUNT": "2"})
    assert mine["VLLM_MEDIA_LOADING_THREAD_COUNT"] == "2"  # the user's own setting wins
    # vLLM 0.33's cap on a request's decoded media: lifted, unless the user set it.
    assert env["VLLM_MAX_MEDIA_REQUEST_DECODE_BYTES"] == "0"
    assert server_environment("k", copy, {"VLLM_MAX_MEDIA_REQUEST_DECODE_BYTES": "9"})[
        "VLLM_MAX_MEDIA_REQUEST_DECODE_BYTES"] == "9"
