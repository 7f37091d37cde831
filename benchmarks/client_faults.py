"""The client under faults (issue 11): 400 video requests, concurrency 16, against the stand-in.

    .venv/bin/python benchmarks/client_faults.py [--clients vidlabel before openai] [--scenarios ...]
        [--before DIR] [--requests 400] [--repeat 1] [--cap 1500]
    .venv/bin/python benchmarks/client_faults.py --fault-run [--before DIR]

Clients, each in its own process:

- ``vidlabel``: this checkout's classify job (``run_shard``) with ``classify.endpoints`` set to the
  stand-in(s), every other setting at its default;
- ``before``: the same job from another checkout (``--before``), e.g. the code before issue 11:
  ``git worktree add /tmp/vidlabel-before 4194d88``;
- ``openai``: plain ``openai.AsyncOpenAI`` with its defaults (2 retries, 600 s timeout) under an
  ``asyncio.Semaphore(16)``, round robin over the endpoints.

Scenarios (stand-in service time 1 s per request; the stand-in runs one request per slot without a
queue unless a capacity model is given): fault-free; 20 % random 503s; 10 % random 500s; an
admission-503 storm (8 running, 2 waiting, 503 above that, as vLLM's ``--max-num-queued-reqs``);
a crash after 100 requests with two endpoints and with one; 3 % of requests hanging.

Printed per run: wall time until the client returned, % answered (client side), 503s the stand-ins
sent, and duplicate answers (requests the stand-ins answered 200 more than once). A client still
running after ``--cap`` seconds is stopped and shown as "> cap".

``--fault-run``: the acceptance run of issue 11, a shard job with its own (stand-in) server under
3 % hangs, 10 % 500s, 20 % 503s and a crash after 200 requests, then one rerun without the crash:
wall time of both runs, % labelled after the rerun, duplicate answers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
MODEL = "standin-model"
KEY = "bench-key"
LATENCY = ("--latency", "1")
SCENARIOS = {
    "fault-free": [LATENCY],
    "503 random 20%": [("--random-503", "0.2", "--seed", "1", *LATENCY)],
    "500 random 10%": [("--random-500", "0.1", "--seed", "1", *LATENCY)],
    "admission 503 storm": [("--slots", "8", "--max-queued", "2", *LATENCY)],
    "crash after 100, 2 endpoints": [("--crash-after", "100", *LATENCY), LATENCY],
    "crash after 100, 1 endpoint": [("--crash-after", "100", *LATENCY)],
    "hangs 3%": [("--hang-rate", "0.03", "--seed", "1", *LATENCY)],
}
FAULT_RUN = ("--hang-rate", "0.03", "--random-500", "0.1", "--random-503", "0.2", "--seed", "1", *LATENCY)


# ---- the child: one client, one run ---------------------------------------------------------------

def _child(spec: dict) -> dict:
    """Runs in a process whose PYTHONPATH selects the checkout under test."""
    t0 = time.monotonic()
    if spec["client"] == "openai":
        answered, error = asyncio.run(_plain_openai(spec)), None
    else:
        from vidlabel.core import config as vconfig
        from vidlabel.core.journal import read_latest
        from vidlabel.serve.classify import run_shard

        cfg = vconfig.validate({"posts": "unused.csv", "media_root": spec["media_root"],
                                "results": spec["workdir"], "classify": spec["classify"],
                                # the stand-in's model, named freely, serves as Qwen2.5-VL (tests/standin)
                                "planning": {"model_family": "qwen2_5_vl"}})
        work = Path(spec["workdir"])
        error = None
        try:
            run_shard(cfg, spec["manifest"], work / "labels.parquet", work / "journal.jsonl", work / "server.log", 0)
        except Exception as exc:  # the job's outcome is part of the figure
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        answered = sum(r["status"] == "ok" for r in read_latest(work / "journal.jsonl", "request_id").values())
    return {"wall": time.monotonic() - t0, "answered": answered, "error": error}


async def _plain_openai(spec: dict) -> int:
    import openai
    import pyarrow.parquet as pq

    rows = pq.read_table(spec["manifest"]).to_pylist()
    clients = [openai.AsyncOpenAI(base_url=url, api_key=KEY) for url in spec["classify"]["endpoints"]]
    sem = asyncio.Semaphore(spec["classify"]["concurrency"])

    async def one(i: int, row: dict) -> bool:
        async with sem:
            try:
                await clients[i % len(clients)].chat.completions.create(
                    model=MODEL, max_tokens=64, extra_headers={"X-Request-Id": row["request_id"]},
                    messages=[{"role": "user", "content": [
                        {"type": "video_url", "video_url": {"url": Path(row["media_path"]).as_uri()}},
                        {"type": "text", "text": row["prompt"]}]}])
                return True
            except openai.OpenAIError:
                return False

    results = await asyncio.gather(*(one(i, r) for i, r in enumerate(rows)))
    for c in clients:
        await c.close()
    return sum(results)


# ---- the parent: stand-ins, clients, figures ---------------------------------------------------------

def _standin(port: int, allowed: Path, log: Path, faults) -> subprocess.Popen:
    """A stand-in on ``port`` that reads media under ``allowed`` (the posts' media and the job's
    calibration media, which it writes into its results folder)."""
    from standin import SERVER_SCRIPT
    from standin.shards import YES_IF

    proc = subprocess.Popen([sys.executable, str(SERVER_SCRIPT), "--host", "127.0.0.1", "--port", str(port),
                             "--allowed-local-media-path", str(allowed), "--served-model", MODEL,
                             "--request-log", str(log), *YES_IF, *faults],
                            env={**os.environ, "VLLM_API_KEY": KEY}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return proc
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("stand-in did not start")


def _run_child(client: str, checkout: Path, spec: dict, cap: float) -> dict:
    spec_path = Path(spec["workdir"]) / "spec.json"
    spec_path.write_text(json.dumps({**spec, "client": client}))
    env = {**os.environ, "PYTHONPATH": f"{checkout / 'src'}:{checkout / 'tests'}", "MY_VLLM_KEY": KEY}
    err_path = Path(spec["workdir"]) / f"child-{client}.err"
    with err_path.open("w") as err:
        proc = subprocess.Popen([sys.executable, str(HERE), "--child", str(spec_path)], env=env,
                                stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=cap)
        lines = out.strip().splitlines()
        if proc.returncode or not lines:  # the child itself failed: its last words are the outcome
            tail = err_path.read_text().strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
            return {"wall": None, "answered": None, "error": f"client process failed: {tail[0][:160]}"}
        return json.loads(lines[-1])
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return {"wall": None, "answered": None, "error": f"still running after {cap:.0f} s"}


def _server_figures(logs: list[Path]) -> tuple[int, int]:
    from standin import is_probe, read_request_log

    events = [e for log in logs for e in read_request_log(log) if e.get("request_id") and not is_probe(e["request_id"])]
    refused = sum(1 for e in events if e["event"] == "completed" and e.get("status") == 503)
    answers = Counter(e["request_id"] for e in events if e["event"] == "completed" and e.get("status") == 200)
    return refused, sum(n - 1 for n in answers.values())


def _setup(work: Path, n: int) -> tuple[Path, Path, dict]:
    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(ROOT / "src"))
    from standin.shards import (
        QUESTIONS,
        make_config,
        make_video,
        manifest_rows,
        write_manifest,
    )

    media = work / "media"
    make_video(media / "clip.mp4")
    cfg = make_config(work, media)
    posts = [{"post_id": f"p{i:05d}", "media_path": str(media / "clip.mp4"), "caption": "buy now" if i % 2 else "hi",
              "transcript": "pizza" if i % 3 == 0 else ""} for i in range(n)]
    manifest = write_manifest(work / "manifest.parquet", manifest_rows(cfg, posts))
    classify = {"model": MODEL, "questions": QUESTIONS, "concurrency": 16, "progress_interval_s": 5}
    return media, manifest, classify


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scenarios(args) -> None:
    checkouts = {"vidlabel": ROOT, "before": Path(args.before), "openai": ROOT}
    with tempfile.TemporaryDirectory() as tmp:
        media, manifest, classify = _setup(Path(tmp), args.requests)
        print(f"client_faults: {args.requests} video requests, concurrency 16, stand-in service time 1 s; "
              f"repeat {args.repeat}, cap {args.cap:.0f} s")
        print(f"  {'scenario':30s} {'client':9s} {'wall s':>8s} {'answered':>9s} {'503s':>6s} {'dup':>4s}  outcome")
        runs = 0
        for name in args.scenarios:
            for client in args.clients:
                walls = []
                for _ in range(args.repeat):
                    runs += 1
                    work = Path(tmp) / f"run-{runs}"
                    work.mkdir()
                    logs = [work / f"requests-{i}.jsonl" for i in range(len(SCENARIOS[name]))]
                    ports = [_free_port() for _ in SCENARIOS[name]]
                    servers = [_standin(p, Path(tmp), log, f) for p, log, f in zip(ports, logs, SCENARIOS[name])]
                    try:
                        spec = {"workdir": str(work), "manifest": str(manifest), "media_root": str(media),
                                "classify": {**classify, "api_key_env": "MY_VLLM_KEY",
                                             "endpoints": [f"http://127.0.0.1:{p}/v1" for p in ports]}}
                        last = _run_child(client, checkouts[client], spec, args.cap)
                    finally:
                        for s in servers:
                            _stop(s)
                    refused, dup = _server_figures(logs)
                    walls.append(last["wall"])
                    wall = "> cap" if last["wall"] is None else f"{last['wall']:.1f}"
                    answered = "?" if last["answered"] is None else f"{100 * last['answered'] / args.requests:.1f}%"
                    print(f"  {name:30s} {client:9s} {wall:>8s} {answered:>9s} {refused:6d} {dup:4d}  "
                          f"{last['error'] or 'completed'}", flush=True)
                if args.repeat > 1 and None not in walls:
                    print(f"  {'':30s} {client:9s} median wall {statistics.median(walls):.1f} s", flush=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    proc.wait()


def fault_run(args) -> None:
    from standin import standin_command
    from standin.shards import YES_IF

    checkouts = {"vidlabel": ROOT, "before": Path(args.before)}
    with tempfile.TemporaryDirectory() as tmp:
        media, manifest, classify = _setup(Path(tmp), args.requests)
        print(f"client_faults --fault-run: {args.requests} requests, own stand-in server, concurrency 16, "
              f"faults {' '.join(FAULT_RUN)}; first run crashes after 200 requests, then one rerun")
        for client in args.clients:
            if client == "openai":
                continue
            work = Path(tmp) / client
            work.mkdir()
            log = work / "requests.jsonl"
            walls, outcomes = [], []
            for crash in (("--crash-after", "200"), ()):
                spec = {"workdir": str(work), "manifest": str(manifest), "media_root": str(media),
                        "classify": {**classify, "server_command": standin_command(
                            sys.executable, log, *YES_IF, *FAULT_RUN, *crash)}}
                result = _run_child(client, checkouts[client], spec, args.cap)
                walls.append(result["wall"])
                outcomes.append(result["error"] or "completed")
            refused, dup = _server_figures([log])
            wall = " + ".join("> cap" if w is None else f"{w:.1f}" for w in walls)
            answered = "?" if result["answered"] is None else f"{100 * result['answered'] / args.requests:.1f}%"
            print(f"  {client:9s} wall {wall} s; labelled after the rerun {answered}; 503s {refused}; "
                  f"duplicate answers {dup}; runs: {' / '.join(outcomes)}", flush=True)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(_child(json.loads(Path(sys.argv[2]).read_text()))))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", nargs="+", default=["vidlabel", "before", "openai"])
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    ap.add_argument("--before", default="/tmp/vidlabel-before")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--cap", type=float, default=1500)
    ap.add_argument("--fault-run", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    if "before" in args.clients and not (Path(args.before) / "src" / "vidlabel").is_dir():
        sys.exit(f"--before {args.before}: no checkout there (git worktree add {args.before} 4194d88)")
    (fault_run if args.fault_run else scenarios)(args)


if __name__ == "__main__":
    main()
