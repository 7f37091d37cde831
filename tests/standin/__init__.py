"""The stand-in vLLM server used by tests and benchmarks, and a helper that builds its command template."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

SERVER_SCRIPT = Path(__file__).resolve().with_name("server.py")
DEFAULT_VERSION = "0.26.0"  # what the stand-in's /version and the shim's `vllm --version` answer


def _quote_for_template(text: str) -> str:
    """Shell-quote ``text`` and double its braces so str.format leaves it unchanged."""
    return shlex.quote(str(text)).replace("{", "{{").replace("}", "}}")


def standin_command(python: str | None = None, request_log: str | Path | None = None, *faults: str,
                    faults_name: str = "faults") -> str:
    """A ``classify.server_command`` template that launches the stand-in instead of ``vllm serve``.

    ``faults`` are extra stand-in arguments, e.g. ``"--yes-if", "promotes_product=buy"``,
    ``"--crash-after", "5"`` (see ``tests/standin/server.py --help``). The template keeps the
    server fields ``{port}``, ``{media_root}`` and ``{model}`` for vidlabel.serve.server to fill in.
    """
    parts = [_quote_for_template(python or sys.executable), _quote_for_template(SERVER_SCRIPT),
             "--host 127.0.0.1 --port {port} --allowed-local-media-path {media_root}",
             "--served-model {model}"]
    if request_log is not None:
        # The faults go to a file beside the request log, so that a rerun with other faults (or none)
        # runs the same server command, as a user's rerun does, and reuses the journaled answers.
        # Two commands of one test that differ in their faults need two names (``faults_name``). Both
        # files are named in one JSON argument (--control), which is no file itself: vidlabel ties
        # answers to the content of every file a server argument names.
        faults_file = Path(request_log).with_suffix(f".{faults_name}.json")
        faults_file.parent.mkdir(parents=True, exist_ok=True)
        faults_file.write_text(json.dumps([str(f) for f in faults]))
        control = {"request_log": str(request_log), "faults_file": str(faults_file)}
        parts += ["--control", _quote_for_template(json.dumps(control))]
    else:
        parts += [_quote_for_template(f) for f in faults]
    return " ".join(parts)


# Requests of vidlabel's own probes (the readiness smoke request, the calibration videos), not of a job's traffic.
PROBE_PREFIXES = ("smoke-", "calibrate-")


def is_probe(request_id: str | None) -> bool:
    return (request_id or "").startswith(PROBE_PREFIXES)


def read_request_log(path: str | Path) -> list[dict]:
    """The stand-in's request events (received / media / completed / cancelled / hanging / crash), in order."""
    path = Path(path)
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # torn last line of a killed stand-in
    return events


def max_in_flight(events: list[dict]) -> int:
    """The most requests the stand-in held at once, from its request events (received, completed, cancelled)."""
    depth = best = 0
    for e in sorted(events, key=lambda e: e["t"]):
        if e["event"] == "received":
            depth += 1
            best = max(best, depth)
        elif e["event"] in ("completed", "cancelled"):
            depth -= 1
    return best


def vllm_shim(directory: str | Path, *standin_args: str, python: str | None = None) -> Path:
    """Write an executable ``directory/vllm`` that answers ``vllm serve MODEL [vLLM flags]`` by
    starting the stand-in with vLLM's own command line and its Qwen2.5-VL token and encoder-cache
    rules (``--video-tokens qwen``), plus ``standin_args`` (faults, ``--yes-if``, ``--request-log``).

    Put ``directory`` first on PATH and keep vidlabel's default ``classify.server_command``: the test
    then runs exactly the command a user's job runs. ``vllm --version`` prints the stand-in's version
    (``--standin-version`` among ``standin_args``), as the real command line does.
    """
    path = Path(directory) / "vllm"
    path.parent.mkdir(parents=True, exist_ok=True)
    fixed = [str(SERVER_SCRIPT), "--video-tokens", "qwen", *map(str, standin_args)]
    version = standin_args[list(standin_args).index("--standin-version") + 1] \
        if "--standin-version" in standin_args else DEFAULT_VERSION
    path.write_text(
        f"#!{python or sys.executable}\n"
        '"""vllm serve MODEL [flags] -> the stand-in server; vllm --version -> its version (tests only)."""\n'
        "import os, sys\n"
        "if sys.argv[1:] in (['--version'], ['-v']):\n"
        f"    print({str(version)!r})\n"
        "    sys.exit(0)\n"
        "if len(sys.argv) < 3 or sys.argv[1] != 'serve':\n"
        "    sys.exit('usage: vllm serve MODEL [options]')\n"
        f"fixed = {fixed!r}\n"
        "os.execv(sys.executable, [sys.executable, fixed[0], '--served-model', sys.argv[2], *fixed[1:], *sys.argv[3:]])\n")
    path.chmod(0o755)
    return path
