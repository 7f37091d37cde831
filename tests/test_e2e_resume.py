"""Resume through Snakemake: a job killed with SIGKILL mid-run, then the same command again.

Nothing that finished before the kill is lost or computed again; the final outputs have every
post exactly once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import (
    BIN,
    default_model_dir,
    run_snakemake,
    snakemake_command,
    write_overlay,
)
from standin import read_request_log, standin_command

pytestmark = pytest.mark.slow


def job_processes(workdir: Path, script: str) -> list[int]:
    """PIDs of the Snakemake script jobs (`.snakemake/scripts/tmp*.<script>`) running in ``workdir``."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            cwd = os.readlink(proc / "cwd")
        except OSError:
            continue
        if cwd == str(workdir) and any(arg.endswith(script.encode()) and b".snakemake/scripts" in arg
                                       for arg in cmdline):
            pids.append(int(proc.name))
    return pids


def journal_lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_bytes().splitlines(keepends=True) if line.endswith(b"\n")]


def kill_job_when(workdir: Path, script: str, journal: Path, min_records: int, timeout: float = 300) -> int:
    """Start the user's command, SIGKILL the job running ``script`` once its journal has records."""
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
    run = subprocess.Popen(snakemake_command(workdir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, env=env)
    deadline = time.monotonic() + timeout
    killed = 0
    while time.monotonic() < deadline and run.poll() is None:
        if len(journal_lines(journal)) >= min_records:
            for pid in job_processes(workdir, script):
                os.kill(pid, signal.SIGKILL)
                killed += 1
            if killed:
                break
        time.sleep(0.05)
    output, _ = run.communicate(timeout=timeout)
    assert killed, f"the {script} job was never seen with {min_records} journal records:\n{output[-4000:]}"
    assert run.returncode != 0, output[-4000:]  # the killed job failed the run
    return killed


@pytest.fixture
def slow_standin_dir(tmp_path, demo_set):
    demo_root, info = demo_set
    command = standin_command(sys.executable, tmp_path / "requests.jsonl", "--yes-if", "promotes_product=buy",
                              "--latency", "0.6")
    write_overlay(tmp_path, demo_root, {"transcribe": {"chunks": 1},
                                         "classify": {"shards": 1, "concurrency": 2, "server_command": command}})
    yield tmp_path, info
    # A SIGKILLed job cannot stop its server; make sure no stand-in outlives the test.
    subprocess.run(["pkill", "-f", str(tmp_path / "requests.jsonl")], check=False)


def test_classify_job_killed_then_same_command_resumes(slow_standin_dir):
    workdir, info = slow_standin_dir
    model = default_model_dir(workdir / "results")
    journal = model / "journal" / "shard-0.jsonl"
    kill_job_when(workdir, "classify.py", journal, min_records=3)

    finished_before = {r["request_id"] for r in journal_lines(journal)}
    assert len(finished_before) >= 3
    events_before = len(read_request_log(workdir / "requests.jsonl"))
    assert not (model / "labels" / "shard-0.parquet").exists()

    run_snakemake(workdir)

    events_after = read_request_log(workdir / "requests.jsonl")[events_before:]
    resent = {e.get("request_id") for e in events_after if e.get("event") == "received"} & finished_before
    assert resent == set()  # nothing that had finished was sent again

    labels = pq.read_table(model / "labels.parquet").to_pylist()
    assert sorted(r["post_id"] for r in labels) == sorted(info)
    shard = pq.read_table(model / "labels" / "shard-0.parquet").to_pylist()
    ids = [r["request_id"] for r in shard]
    assert len(ids) == len(set(ids)) and finished_before <= set(ids)
    assert all(r["status"] == "ok" for r in shard)


def test_transcribe_job_killed_then_same_command_resumes(tmp_path, demo_set):
    demo_root, info = demo_set
    write_overlay(tmp_path, demo_root, {"transcribe": {"chunks": 1, "beam_size": 5}})
    journal = tmp_path / "results" / "transcripts" / "chunk-0.jsonl"
    kill_job_when(tmp_path, "transcribe.py", journal, min_records=1)
    done_before = [r["post_id"] for r in journal_lines(journal)]
    assert done_before

    run_snakemake(tmp_path, "--until", "transcribe")

    records = [r["post_id"] for r in journal_lines(journal)]
    assert records[: len(done_before)] == done_before
    assert len(records) == len(set(records))  # no post transcribed twice
    table = pq.read_table(tmp_path / "results" / "transcripts" / "chunk-0.parquet").to_pylist()
    assert sorted(r["post_id"] for r in table) == sorted(p for p, e in info.items() if e["probe_ok"])
