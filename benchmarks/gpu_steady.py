"""The classify job's steady state on a real GPU: throughput, GPU busy and what holds the GPU back.

A short run is mostly its ramp (32 videos preprocessed at once before anything finishes) and its
drain; at 35k requests per job only the steady state matters. This runs one shard job per variant
exactly as ``benchmarks/gpu_classify.py run`` does (same media, ``prepare`` and variant words, same
``gpu_classify.json``, so that ``gpu_classify.py estimate --compare VARIANT`` sets the pilot's
projection against it), until every request is answered or ``--max-request-phase-s`` has passed
(then SIGINT: the job stops sending and journals what finished), and reports over the middle 80 % of
completions (from the 10th to the 90th percentile of finish times), with the ramp and drain apart:

- prompt tok/s, req/s, GPU busy (mean nvidia-smi utilisation, share of 1 s samples under 5 %);
- the engine's running and waiting requests (vLLM ``/metrics``, every second), the client's requests
  in flight (from the records); each request's time in the engine's waiting queue (vLLM's histogram
  ``vllm:request_queue_time_seconds`` at the job's end: how many waited over 60 s, the 90th percentile
  and the longest, each as its bucket's upper bound);
- API-server CPU per request (``/proc/<pid>/task/*/stat`` of the server's processes, every second:
  processes titled ``VLLM::APIServer_i`` and, with one API server, vLLM's own front process), split into
  the main thread (the event loop: HTTP, chat template, tokenisation hand-off) and the thread pools
  (vLLM 0.26 runs video loading in ``vllm.multimodal.media.connector.global_thread_pool`` and the
  multimodal processor in the renderer's ``ThreadPoolExecutor``; neither names its threads, so /proc
  cannot tell them apart), and the decode part measured by replaying the window's videos through
  vLLM's own loader with the job's backend after the job (``decode_indices.vllm_loader``); the rest is
  the HF processor (resize, normalise) and request handling;
- the engine core's CPU per request;
- per post type (video, photo, slideshow, carousel: the shard sends each type in a phase of its own,
  gpu_classify.py ``prepare``): the type's own steady window (the middle 80 % of its completions), its
  prompt tok/s, req/s and GPU busy there, how many of the window's completions were of another type
  (the overlap at the phase's edges), its status counts and the estimate over served prompt tokens
  (every request, and how many within ±2 %).

Variants are ``gpu_classify.py`` variant words (``default``, ``transcoded``, ``decgpu``, ``dectorchcodec``,
``fp8``, ``apiN``, ``concN``, ``adaptN``, ...). ``--cpus 0-7`` pins the job (and the servers it starts) to those
cores first; vidlabel sizes its API servers from the pinned count (``vidlabel.serve.server.job_cpus``).

    python benchmarks/gpu_classify.py media --workdir /tmp/steady --sources 60 --posts 600
    python benchmarks/gpu_steady.py --workdir /tmp/steady --variants default --cpus 0-15

The media step reuses its sources across posts; vLLM's prefix and multimodal caches are off in the
default server command, so every request is decoded, processed and prefilled in full.
``--standin`` runs the test stand-in as ``vllm`` (no GPU).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import logging
import multiprocessing
import os
import re
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode_indices  # noqa: E402
import gpu_classify as gc  # noqa: E402
from vidlabel.serve import probe  # noqa: E402  (gpu_classify puts src on the path)

TICK = os.sysconf("SC_CLK_TCK")
SAMPLE_S = 1.0
MIDDLE = (0.10, 0.90)  # share of completions before the steady window starts and where it ends


def parse_cpus(text: str) -> set[int]:
    """``0-7,16`` -> {0..7, 16}."""
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


# ------------------------------------------------------------------------------------- samplers

class _Sampler(threading.Thread):
    def __init__(self):
        super().__init__(daemon=True)
        self.halt = threading.Event()
        self.samples: list = []

    def stop(self) -> None:
        self.halt.set()
        self.join(timeout=5)

    def run(self) -> None:
        while not self.halt.wait(SAMPLE_S):
            try:
                self.samples.append(self.sample())
            except Exception:  # a process that exited between listing and reading: next second
                continue


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                ppid = int(Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _cpu_s(stat_path: str) -> float:
    fields = Path(stat_path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def process_role(cmdline: str) -> str:
    """api (an API server process), engine (engine core or GPU worker) or front (vLLM's launching process,
    which is the API server itself when there is only one; or a stand-in)."""
    if "APIServer" in cmdline:
        return "api"
    if "EngineCore" in cmdline or "Worker" in cmdline or "DPCoordinator" in cmdline:
        return "engine"
    return "front"


class ProcSampler(_Sampler):
    """Every second, CPU seconds so far of every process the job started and of its main thread."""

    def __init__(self, root: int | None = None):
        super().__init__()
        self.root = root or os.getpid()
        self.cmdlines: dict[int, str] = {}

    def sample(self):
        now, threads = time.time(), {}
        for pid in _descendants(self.root):
            if "VLLM::" not in self.cmdlines.get(pid, ""):  # a spawned process sets its title after starting
                try:
                    self.cmdlines[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
                        errors="replace")
                except OSError:
                    continue
            try:
                # The process's own total holds the threads that exited between samples too; its main
                # thread apart (the pools are the difference). Summing the live threads lost the CPU of
                # pool threads that ended: one reason the decode replay came out above the measured total
                # (a negative "rest"); the others were the replay's (see replay_decode).
                threads[(pid, None)] = _cpu_s(f"/proc/{pid}/stat")
                threads[(pid, pid)] = _cpu_s(f"/proc/{pid}/task/{pid}/stat")
            except OSError:
                continue
        return now, threads


class MetricsSampler(_Sampler):
    """Every second, the engines' running and waiting requests from each server's /metrics (the port
    is read from the server logs' start lines), and the last reading of the engines' queue-time histogram
    (``queue_buckets``: upper bound in seconds -> requests that waited at most that long, summed over the
    servers; vLLM counts a request when it finishes)."""

    _PORT = re.compile(r"starting: .*?--port (\d+)")
    _GAUGE = re.compile(r"^vllm:num_requests_(running|waiting)\{[^}]*\} ([0-9.e+]+)$", re.M)

    def __init__(self, log_dir: Path):
        super().__init__()
        self.log_dir = log_dir
        self.queue_buckets: dict[float, float] = {}
        self.kv_tokens: int | None = None  # the servers' KV caches together (vllm:cache_config_info)

    def ports(self) -> list[int]:
        found = []
        for path in sorted(self.log_dir.glob("server*.log")):
            ports = self._PORT.findall(path.read_text(errors="replace"))
            if ports:
                found.append(int(ports[-1]))
        return found

    def sample(self):
        import httpx

        running = waiting = 0.0
        buckets: dict[float, float] = {}
        kv_tokens = None
        for port in self.ports():
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2.0).text
            for kind, value in self._GAUGE.findall(text):
                if kind == "running":
                    running += float(value)
                else:
                    waiting += float(value)
            for bound, n in queue_time_buckets(text).items():
                buckets[bound] = buckets.get(bound, 0.0) + n
            kv_tokens = (kv_tokens or 0) + (probe.kv_cache_tokens(text) or 0)
        if buckets:
            self.queue_buckets = buckets
        if kv_tokens:
            self.kv_tokens = kv_tokens
        return time.time(), running, waiting


_QUEUE_BUCKET = re.compile(r'^vllm:request_queue_time_seconds_bucket\{[^}]*le="([^"]+)"[^}]*\} ([0-9.e+]+)$', re.M)


def queue_time_buckets(text: str) -> dict[float, float]:
    """vLLM's ``vllm:request_queue_time_seconds`` histogram in Prometheus text: upper bound (s; +Inf as inf)
    -> cumulative count, summed over the label sets (engines)."""
    out: dict[float, float] = {}
    for bound, n in _QUEUE_BUCKET.findall(text):
        key = float(bound)  # "+Inf" parses as inf
        out[key] = out.get(key, 0.0) + float(n)
    return out


def queue_waits(buckets: dict[float, float], limit_s: float = 60.0) -> dict | None:
    """The engine queue's waits from a cumulative histogram: requests counted, how many waited over
    ``limit_s`` (a bucket bound), and the 90th percentile and the longest as the bound of their bucket."""
    if not buckets or not buckets.get(float("inf")):
        return None
    bounds = sorted(buckets)
    total = buckets[float("inf")]

    def at_most(share: float) -> float:
        return next(b for b in bounds if buckets[b] >= share * total)

    at_limit = max((buckets[b] for b in bounds if b <= limit_s), default=0.0)
    return {"requests": int(total), f"over_{limit_s:g}_s": int(total - at_limit),
            "p90_at_most_s": at_most(0.9), "longest_at_most_s": at_most(1.0)}


class RequestPhaseLimit(_Sampler):
    """SIGINT to this process ``limit_s`` after the job's first answer is journaled: the job stops
    sending, lets the requests in flight finish (classify.shutdown_grace_s) and journals them."""

    def __init__(self, journal: Path, limit_s: float):
        super().__init__()
        self.journal, self.limit_s, self.first = journal, limit_s, None
        self.fired = False

    def sample(self):
        if self.first is None and self.journal.exists() and self.journal.stat().st_size:
            self.first = time.time()
        if self.first is not None and not self.fired and time.time() - self.first >= self.limit_s:
            self.fired = True
            os.kill(os.getpid(), signal.SIGINT)
        return None


# ------------------------------------------------------------------------------------- analysis

def window_bounds(finished: list[float]) -> tuple[float, float]:
    f = sorted(finished)
    return f[int(MIDDLE[0] * len(f))], f[max(int(MIDDLE[1] * len(f)) - 1, 0)]


def phase(records: list[dict], lo: float, hi: float) -> dict:
    """Throughput of the answers that finished in (lo, hi]."""
    done = [r for r in records if r["status"] == "ok" and lo < r["finished_at"] <= hi]
    span = hi - lo
    tokens = sum(r["prompt_tokens"] or 0 for r in done)
    return {"seconds": span, "answers": len(done), "prompt_tok_s": tokens / span if span > 0 else 0.0,
            "req_s": len(done) / span if span > 0 else 0.0}


def in_flight(records: list[dict], times) -> np.ndarray:
    starts = np.sort([r["started_at"] for r in records if r.get("started_at") is not None])
    ends = np.sort([r["finished_at"] for r in records if r.get("finished_at") is not None])
    t = np.asarray(times, dtype=float)
    return np.searchsorted(starts, t, side="right") - np.searchsorted(ends, t, side="right")


def cpu_split(proc: ProcSampler, lo: float, hi: float, answers: int) -> dict:
    """CPU seconds per answer in the window, by process role, and for the API processes by thread kind."""
    inside = [(t, s) for t, s in proc.samples if lo <= t <= hi]
    if len(inside) < 2 or not answers:
        return {}
    (_, first), (_, last) = inside[0], inside[-1]
    out: dict[str, float] = {}
    for (pid, tid), cpu in last.items():
        if tid is not None:  # the main thread, counted within its process's total
            continue
        used = cpu - first.get((pid, None), 0.0)  # a process born inside: all of it
        # Read a moment apart from the total, the main thread can show a 10 ms tick the total does not yet.
        main = min(used, last.get((pid, pid), 0.0) - first.get((pid, pid), 0.0))
        role = process_role(proc.cmdlines.get(pid, ""))
        out[role] = out.get(role, 0.0) + used
        if role in ("api", "front"):
            out["api_main_thread"] = out.get("api_main_thread", 0.0) + main
            out["api_pool_threads"] = out.get("api_pool_threads", 0.0) + used - main
    out["api"] = out.pop("api", 0.0) + out.pop("front", 0.0)
    return {k: v / answers for k, v in out.items()}


def _shard(config: dict):
    import pyarrow.parquet as pq

    return pq.read_table(Path(config["results"]) / "manifest" / "shard-0.parquet")


def shard_videos(config: dict) -> dict[str, list[str]]:
    """The video files each request sends (its items', or a one-video manifest's media_path)."""
    rows = _shard(config).to_pylist()
    return {r["request_id"]: [i["media_path"] for i in r["items"] if i["kind"] == "video" and i["media_path"]]
            if r.get("items") is not None else [r["media_path"]] for r in rows}


def by_post_type(records: list[dict], gpu_samples, config: dict) -> dict:
    """Each post type's steady state (module docstring), where the shard names the types."""
    table = _shard(config)
    if "post_type" not in table.column_names:
        return {}
    kind = dict(zip(table.column("request_id").to_pylist(), table.column("post_type").to_pylist()))
    finished = [r for r in records if r["status"] == "ok" and r.get("finished_at")]
    out = {}
    for post_type in sorted({kind.get(r["request_id"]) for r in records} - {None}):
        mine = [r for r in records if kind.get(r["request_id"]) == post_type]
        ok = [r for r in mine if r["status"] == "ok" and r.get("finished_at")]
        statuses: dict[str, int] = {}
        for r in mine:
            key = "ok" if r["status"] == "ok" else r.get("error_kind") or "error"
            statuses[key] = statuses.get(key, 0) + 1
        ratios = sorted(r["est_prompt_tokens"] / r["prompt_tokens"] for r in ok if r.get("prompt_tokens"))
        entry = {"requests": len(mine), "by_status": statuses,
                 "est_over_served": {"min": ratios[0], "median": statistics.median(ratios), "max": ratios[-1]}
                 if ratios else None, "within_2pct": sum(abs(x - 1) <= 0.02 for x in ratios)}
        if len(ok) >= 10:
            lo, hi = window_bounds([r["finished_at"] for r in ok])
            win = phase(mine, lo, hi)
            gpu = [u for t, u in gpu_samples if lo <= t <= hi]
            others = sum(1 for r in finished if lo < r["finished_at"] <= hi and kind.get(r["request_id"]) != post_type)
            entry.update(window=win, gpu_busy=statistics.mean(gpu) if gpu else None,
                         gpu_idle_share=sum(u < 5 for u in gpu) / len(gpu) if gpu else None,
                         other_types_in_window=others)
        out[post_type] = entry
    return out


def replay_decode(records: list[dict], lo: float, hi: float, config: dict) -> dict:
    """Decode CPU-s per answer of the window: each distinct video through vLLM's loader with the job's
    backend (the re-implementation where vLLM is not importable), weighted by how often the window sent it,
    over the window's answers (those without a video and carousels of several count as they are, so that the
    figure sits beside the API servers' CPU per answer).

    The window is one of answers, but a server decodes a request's media when the request arrives: the
    decodes whose CPU the window's samples hold are those of the requests sent in it (``started_at``), not
    of those answered in it. Counting the answered ones charged the window with the decodes of the ramp's
    first requests, done before it began, and the "rest" came out negative on short jobs (a 102-request
    job: 80 answers in its window, 60 sends)."""
    from vidlabel.core import decode as vdecode

    backend, fps = vdecode.backend(config), float(config["planning"]["fps"])
    media = shard_videos(config)
    sent: dict[str, int] = {}
    first_path: dict[tuple[int, int], str] = {}  # posts that share a file (hard links) decode it once
    answers = sum(1 for r in records if r["status"] == "ok" and lo < r["finished_at"] <= hi)
    for r in records:
        if not (r.get("started_at") and lo < r["started_at"] <= hi):
            continue
        for path in media.get(r["request_id"], []):
            st = os.stat(path)
            path = first_path.setdefault((st.st_dev, st.st_ino), path)
            sent[path] = sent.get(path, 0) + 1
    if not sent or not answers:
        return {}
    # One file per process, in parallel (a file's CPU seconds are its own process's): a mixed set's window
    # holds dozens of distinct files, seconds each, which one after the other cost minutes of a GPU lease.
    paths = list(sent)
    workers = max(1, min(len(paths), len(os.sched_getaffinity(0))))
    # Each worker decodes the smallest file once, unmeasured, before it measures: a process's first decode
    # imports the loader's modules and initialises the decoder (1.4 of 2.7 CPU-s for a 12 s 1080p clip with
    # the re-implementation on a 2-core machine), which a server pays once at start-up, not per request.
    smallest = min(paths, key=lambda p: os.stat(p).st_size)
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                                initializer=_replay_one, initargs=(smallest, backend, fps)) as pool:
        measured = list(pool.map(_replay_one, paths, [backend] * len(paths), [fps] * len(paths)))
    cpu = wall = 0.0
    replayed = 0
    for (cpu_s, wall_s, _, _), count in zip(measured, sent.values()):
        if cpu_s is not None:
            cpu += cpu_s * count
            wall += wall_s * count
            replayed += count
    failed = [(path, error) for path, (_, _, _, error) in zip(paths, measured) if error]
    # The sends whose replay failed cost what the replayed ones did on average.
    per_answer = sum(sent.values()) / replayed / answers if replayed else None
    out = {"decode_cpu_s_per_answer": cpu * per_answer if replayed else None,
           "decode_wall_s_per_answer": wall * per_answer if replayed else None,
           "decode_cpu_s_per_video": cpu / replayed if replayed else None,
           "videos_per_answer": sum(sent.values()) / answers, "decoded_files": len(sent) - len(failed),
           "how": sorted({how for _, _, how, _ in measured})[0], "processes": workers}
    if failed:  # such a file's request was answered, so the server decoded it: the replay, not the file, failed
        out["failed_files"] = len(failed)
        out["first_failure"] = f"{Path(failed[0][0]).name}: {failed[0][1]}"
    return out


_LOADERS: dict = {}


def _replay_one(path: str, backend: str, fps: float) -> tuple[float | None, float | None, str, str | None]:
    """(CPU s, wall s, how, error) of one file through vLLM's loader with ``backend`` (the re-implementation
    where vLLM is not importable), in a worker process."""
    if (backend, fps) not in _LOADERS:
        try:
            _LOADERS[backend, fps] = decode_indices.vllm_loader(backend, fps), "vLLM's loader"
        except Exception:
            _LOADERS[backend, fps] = decode_indices.reference_loader(backend, fps), "re-implementation (no vLLM here)"
    load, how = _LOADERS[backend, fps]
    res, _ = decode_indices.measure(Path(path), backend, load)
    return res.cpu_s, res.wall_s, how, res.error


def steady(records, gpu_samples, metrics: MetricsSampler, proc: ProcSampler, config: dict, replay: bool) -> dict:
    ok = [r for r in records if r["status"] == "ok" and r.get("finished_at")]
    if len(ok) < 10:
        return {"error": f"only {len(ok)} answers: no steady window"}
    lo, hi = window_bounds([r["finished_at"] for r in ok])
    first = min(r["started_at"] for r in records if r.get("started_at"))
    last = max(r["finished_at"] for r in ok)
    win = phase(records, lo, hi)
    gpu = [u for t, u in gpu_samples if lo <= t <= hi]
    engine = [(r, w) for t, r, w in metrics.samples if lo <= t <= hi]
    served = [r["prompt_tokens"] for r in ok if r.get("prompt_tokens")]
    ticks = np.arange(lo, hi, SAMPLE_S)
    flight = in_flight(records, ticks) if len(ticks) else np.zeros(0)
    from vidlabel.core import decode as vdecode

    out = {
        "window": win, "ramp": phase(records, first, lo), "drain": phase(records, hi, last),
        "answers_total": len(ok), "requests_total": len(records),
        "gpu_busy": statistics.mean(gpu) if gpu else None,
        "gpu_idle_share": sum(u < 5 for u in gpu) / len(gpu) if gpu else None,
        "engine_running_median": statistics.median(r for r, _ in engine) if engine else None,
        "engine_waiting_median": statistics.median(w for _, w in engine) if engine else None,
        "engine_running_max": max((r for r, _ in engine), default=None),
        "engine_queue": queue_waits(metrics.queue_buckets),
        "idle_seconds": idle_seconds(gpu_samples, metrics.samples, lo, hi),
        "kv_cache_tokens": metrics.kv_tokens,
        # How many of the job's mean requests the KV cache holds: the in-flight count past which requests
        # wait in the engine (its admission takes a whole prompt), docs/serving.md
        "kv_cache_requests": (metrics.kv_tokens / statistics.mean(served) if metrics.kv_tokens and served else None),
        "client_in_flight_median": float(np.median(flight)) if len(flight) else None,
        "cpu_s_per_answer": cpu_split(proc, lo, hi, win["answers"]),
        "cpus": len(os.sched_getaffinity(0)), "decode": vdecode.choice(config),
        "max_num_seqs": config["classify"]["max_num_seqs"],
    }
    out["by_post_type"] = by_post_type(records, gpu_samples, config)
    if replay:
        try:
            out["replay"] = replay_decode(records, lo, hi, config)
        except Exception as exc:  # a worker lost (BrokenProcessPool), say: the run's own figures still count
            out["replay"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            logging.getLogger("gpu_steady").warning("decode replay failed: %s", out["replay"]["error"])
        cpu, decoded = out["cpu_s_per_answer"], out["replay"].get("decode_cpu_s_per_answer")
        if "api" in cpu and decoded is not None:  # the multimodal processor and request handling
            cpu["api_besides_decode"] = cpu["api"] - decoded
    out["verdict"] = verdict(out)
    return out


def idle_seconds(gpu_samples, engine_samples, lo: float, hi: float) -> dict | None:
    """What the engine held in the window's idle GPU samples (under 5 %): each idle sample's nearest /metrics
    reading. Running 0 means the engine had nothing to run (the front end fed it nothing); running > 0 with an
    idle GPU means the engine core itself stalled (its own CPU work between steps)."""
    idle = [t for t, u in gpu_samples if lo <= t <= hi and u < 5]
    readings = sorted((t, r, w) for t, r, w in engine_samples if lo - 2 <= t <= hi + 2)
    if not idle or not readings:
        return None
    times = np.asarray([t for t, _, _ in readings])
    nearest = [readings[int(np.abs(times - t).argmin())] for t in idle]
    running = [r for _, r, _ in nearest]
    return {"samples": len(idle), "engine_running_median": statistics.median(running),
            "engine_empty": sum(r == 0 for r in running),
            "engine_waiting_median": statistics.median(w for _, _, w in nearest)}


def verdict(s: dict) -> str:
    """What the evidence says holds the GPU back, in one line."""
    busy, waiting, running = s.get("gpu_busy"), s.get("engine_waiting_median"), s.get("engine_running_median")
    if busy is None or waiting is None:
        return "no GPU or /metrics samples: cannot tell"
    if busy >= 90:
        return f"GPU {busy:.0f} % busy: the GPU sets the pace"
    if waiting >= 1:
        return (f"GPU {busy:.0f} % busy with {waiting:g} requests waiting in the engine: the engine's own "
                "scheduling (batch budget, KV cache), not the front end")
    return (f"GPU {busy:.0f} % busy, the engine running {running:g} and waiting for none: requests are held in the "
            "API servers' decoding and processing (their CPU per answer below), not by the GPU")


# -------------------------------------------------------------------------------------- running

def journal_state(path: Path) -> dict:
    """What a run's journal holds: records (deduplicated by request, the last wins, as the job reads them), by
    status, and how many are terminal errors (an error the job will not send again)."""
    from vidlabel.core.journal import iter_records

    last = {r.get("request_id", i): r for i, r in enumerate(iter_records(path))}
    by_status: dict[str, int] = {}
    for r in last.values():
        key = "ok" if r.get("status") == "ok" else r.get("error_kind") or "error"
        by_status[key] = by_status.get(key, 0) + 1
    return {"records": len(last), "by_status": by_status,
            "terminal": sum(r.get("status") != "ok" and not r.get("retryable") for r in last.values())}


def run_variant(args, name: str) -> dict:
    out = Path(args.workdir) / "runs" / name
    out.mkdir(parents=True, exist_ok=True)
    # A journal this run finds (an earlier run of the variant, or gpu_breaker.py --shared-run-dir's broken
    # runs): what it held before, so that a run after a broken server shows what the broken one left.
    before = journal_state(out / "journal.jsonl")
    proc, metrics = ProcSampler(), MetricsSampler(out)
    limit = RequestPhaseLimit(out / "journal.jsonl", args.max_request_phase_s)
    row, records, config, gpu_samples = gc.run_job(args, name, samplers=(proc, metrics, limit))
    try:
        row["steady"] = steady(records, gpu_samples, metrics, proc, config, not args.no_replay)
    except Exception as exc:  # the analysis, not the job: keep the row (and the check below) all the same
        logging.getLogger("gpu_steady").exception("steady-state analysis failed")
        row["steady"] = {"error": f"analysis failed: {type(exc).__name__}: {exc}"[:300]}
    row["stopped_by_time_limit"] = limit.fired
    row["journal_before"] = before
    # The 1 s series behind the figures, for reading a run again elsewhere (what the engine held while the
    # GPU idled, the in-flight count over time): unix time, value(s).
    (out / "samples.json").write_text(json.dumps({
        "gpu_util": [[round(t, 2), u] for t, u in gpu_samples],
        "engine_running_waiting": [[round(t, 2), r, w] for t, r, w in metrics.samples]}))
    row["check"] = check(row, records, _shard(config).num_rows)
    return row


def check(row: dict, records: list[dict], shard_requests: int) -> dict:
    """The mixed set's check (docs/serving.md, "Mixed posts, per post type"): every request of the shard
    answered ``ok``, every estimate within ±2 % of the served prompt tokens."""
    ok = [r for r in records if r["status"] == "ok"]
    within = sum(abs(r["est_prompt_tokens"] / r["prompt_tokens"] - 1) <= 0.02 for r in ok if r.get("prompt_tokens"))
    return {"shard_requests": shard_requests, "records": len(records), "ok": len(ok), "within_2pct": within,
            "all_ok": len(ok) == shard_requests and row["error"] is None,
            "all_within_2pct": within == shard_requests}


def check_lines(row: dict, workdir: Path) -> list[str]:
    """The check in words; and where gpu_breaker.py --shared-run-dir journaled its broken runs into this
    variant's folder, the breaker's acceptance with this run as its fixed run."""
    c, before, name = row["check"], row["journal_before"], row["variant"]
    lines = [f"{name}: the journal held {before['records']} records before this run ({before['terminal']} terminal; "
             f"{before['by_status'] or 'none'})",
             f"{name}: {c['ok']} of the shard's {c['shard_requests']} requests ended ok"
             + ("" if c["all_ok"] else
                (" (every request answered, but the job ended before it wrote its labels" if
                 c["ok"] == c["shard_requests"] else f" (NOT every request: {row['by_kind']}")
                + ("; stopped by --max-request-phase-s" if row.get("stopped_by_time_limit") else "")
                + (f"; {row['error']}" if row["error"] else "") + ")")
             + f"; {c['within_2pct']} of {c['shard_requests']} estimates within ±2 % of the served prompt tokens"]
    replay = (row.get("steady") or {}).get("replay") or {}
    if replay.get("failed_files"):
        lines.append(f"{name}: the decode replay ({replay['how']}) failed on {replay['failed_files']} of "
                     f"{replay['failed_files'] + replay['decoded_files']} files, e.g. {replay['first_failure'][:300]}")
    breaker_path = workdir / "gpu_breaker.json"
    if breaker_path.exists():
        b = json.loads(breaker_path.read_text())
        if b.get("run_dir") and Path(b["run_dir"]) == workdir / "runs" / name:
            runs = b.get("broken_runs") or []
            stops = ", ".join(f"{r['ready_to_stop_s']:.1f} s" if r.get("ready_to_stop_s") is not None else "no stop"
                              for r in runs)
            passed = bool(b.get("broken_passed")) and before["terminal"] == 0 and c["all_ok"]
            lines.append(
                f"breaker acceptance ({name} is the fixed run): {len(runs)} broken run(s) stopped {stops} after the "
                f"server's readiness with the server's message: {'yes' if b.get('broken_passed') else 'NO'}; "
                f"terminal records they left: {before['terminal']}; the fixed server labelled every post: "
                f"{'yes' if c['all_ok'] else 'NO'} -> {'PASSED' if passed else 'FAILED'}")
            row["breaker_acceptance"] = passed
    return lines


def fmt(x, spec=",.0f", unit="") -> str:
    return "-" if x is None else f"{x:{spec}}{unit}"


def table(rows: list[dict]) -> str:
    head = ("| variant | CPUs | decode | answers (window) | steady prompt tok/s | steady req/s | GPU busy (idle) | "
            "ramp s / tok/s | drain s / tok/s | engine running / waiting | client in flight | API CPU-s per answer "
            "(main / pools; decode replayed, rest: processor) | engine CPU-s per answer |\n" + "|---" * 13 + "|")
    lines = [head]
    for r in rows:
        s = r.get("steady") or {}
        if "window" not in s:
            lines.append(f"| {r['variant']} | - | - | {r.get('error') or s.get('error')} |" + " - |" * 9)
            continue
        w, cpu, rep = s["window"], s["cpu_s_per_answer"], s.get("replay") or {}
        lines.append(
            f"| {r['variant']} | {s['cpus']} | {s['decode']} | {s['answers_total']} ({w['answers']}) | "
            f"{w['prompt_tok_s']:,.0f} | {w['req_s']:.2f} | {fmt(s['gpu_busy'], '.0f', ' %')} "
            f"({fmt(s['gpu_idle_share'], '.0%')}) | {s['ramp']['seconds']:.0f} / {s['ramp']['prompt_tok_s']:,.0f} | "
            f"{s['drain']['seconds']:.0f} / {s['drain']['prompt_tok_s']:,.0f} | "
            f"{fmt(s['engine_running_median'], 'g')} / {fmt(s['engine_waiting_median'], 'g')} | "
            f"{fmt(s['client_in_flight_median'], 'g')} | {fmt(cpu.get('api'), '.2f')} ({fmt(cpu.get('api_main_thread'), '.2f')}"
            f" / {fmt(cpu.get('api_pool_threads'), '.2f')}; decode {fmt(rep.get('decode_cpu_s_per_answer'), '.2f')}, "
            f"rest {fmt(cpu.get('api_besides_decode'), '.2f')}) | "
            f"{fmt(cpu.get('engine'), '.2f')} |")
    lines += [f"{r['variant']}: {(r.get('steady') or {}).get('verdict', '-')}" for r in rows]
    for r in rows:
        if idle := (r.get("steady") or {}).get("idle_seconds"):
            lines.append(f"{r['variant']}: the window's {idle['samples']} idle GPU samples: the engine ran nothing in "
                         f"{idle['engine_empty']} (the front end had fed it nothing), running "
                         f"{idle['engine_running_median']:g} and waiting {idle['engine_waiting_median']:g} (median) in the others: running > 0 with the "
                         "GPU idle is the engine core's own CPU time between steps")
        st = r.get("steady") or {}
        if st.get("kv_cache_tokens"):
            lines.append(f"{r['variant']}: KV cache {st['kv_cache_tokens']:,} tokens (vllm:cache_config_info): "
                         f"{st['kv_cache_requests']:.1f} of the job's mean requests, against classify.concurrency "
                         f"{r.get('concurrency', '?')} (the client kept {fmt(st.get('client_in_flight_median'), 'g')} "
                         f"in flight, median) and max_num_seqs {st.get('max_num_seqs')}")
        q = st.get("engine_queue")
        if q:
            # Read every second while the servers run: what finished after the last reading is not counted.
            lines.append(f"{r['variant']}: engine queue (vllm:request_queue_time_seconds, whole job): {q['requests']} "
                         f"requests, {q['over_60_s']} waited over 60 s; 90 % within {q['p90_at_most_s']:g} s, the "
                         f"longest within {q['longest_at_most_s']:g} s (counted at the last 1 s reading; the job sent "
                         f"{r.get('requests')} and its calibration)")
    types = [(r["variant"], t, e) for r in rows for t, e in ((r.get("steady") or {}).get("by_post_type") or {}).items()]
    if types:
        lines += ["", "| variant | post type | requests: status | est/served tokens (min / median / max; within ±2 %) | "
                  "steady prompt tok/s | steady req/s | GPU busy (idle) | other types in the window |",
                  "|---" * 8 + "|"]
        for variant, post_type, e in types:
            ratio, win = e["est_over_served"], e.get("window") or {}
            lines.append(
                f"| {variant} | {post_type} | {e['requests']}: {e['by_status']} | "
                + (f"{ratio['min']:.3f} / {ratio['median']:.3f} / {ratio['max']:.3f}; {e['within_2pct']}" if ratio
                   else "-")
                + f" | {fmt(win.get('prompt_tok_s'))} | {fmt(win.get('req_s'), '.2f')} | "
                f"{fmt(e.get('gpu_busy'), '.0f', ' %')} ({fmt(e.get('gpu_idle_share'), '.0%')}) | "
                f"{fmt(e.get('other_types_in_window'), 'd')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="/tmp/vidlabel-steady")
    ap.add_argument("--variants", default="default")
    ap.add_argument("--jobs", type=int, default=None, help="prepare's parallel jobs (default: the CPUs used)")
    ap.add_argument("--cpus", default=None, help="pin the job and its servers to these cores first, e.g. 0-7")
    ap.add_argument("--max-request-phase-s", type=float, default=600.0,
                    help="stop sending this long after the first answer (the rest of the set is not sent)")
    ap.add_argument("--min-requests", type=int, default=600, help="warn when the set has fewer requests")
    ap.add_argument("--no-replay", action="store_true", help="skip the decode replay after each job")
    for flag, default in (("--posts", None), ("--media-root", None), ("--model", gc.DEFAULT_MODEL),
                          ("--tokenizer", None), ("--server-args", ""), ("--out", None)):
        ap.add_argument(flag, default=default)
    ap.add_argument("--audio", default="transcript", choices=("transcript", "native", "both"),
                    help="classify.audio: how the model takes the posts' audio")
    ap.add_argument("--transcripts", nargs="*", default=[])
    ap.add_argument("--startup-timeout", type=float, default=1200)
    ap.add_argument("--standin", action="store_true", help="the test stand-in as `vllm` (no GPU needed)")
    ap.add_argument("--standin-args", default="", help="extra stand-in flags, e.g. '--slots 2 --latency 0.5'")
    args = ap.parse_args(argv)
    if args.cpus:
        os.sched_setaffinity(0, parse_cpus(args.cpus))  # inherited by the servers the job starts
    args.jobs = args.jobs or len(os.sched_getaffinity(0))
    gc.use_standin(args)
    results = Path(args.out) if args.out else Path(args.workdir) / "gpu_classify.json"
    rows = []
    for name in args.variants.split(","):
        row = run_variant(args, name)
        if row["requests"] < args.min_requests and not row["stopped_by_time_limit"]:
            print(f"{name}: only {row['requests']} requests, fewer than {args.min_requests}: the window is not a "
                  "steady state (make more posts: gpu_classify.py media --posts N)", flush=True)
        rows.append(row)
        previous = json.loads(results.read_text()) if results.exists() else []
        previous = [r for r in previous if r["variant"] != name] + [row]
        results.write_text(json.dumps(previous, indent=1))  # what gpu_classify.py estimate --compare reads
        print(json.dumps({"variant": name, "steady": row["steady"]}), flush=True)
    print(table(rows), flush=True)
    for row in rows:
        for line in check_lines(row, Path(args.workdir)):
            print(line, flush=True)
    results.write_text(json.dumps([r for r in json.loads(results.read_text()) if r["variant"] not in
                                   {row["variant"] for row in rows}] + rows, indent=1))  # with the acceptance
    return 0 if all(r["error"] is None or r["stopped_by_time_limit"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
