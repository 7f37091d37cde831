"""The shipped SLURM profile against a real one-node SLURM cluster (.ci/slurm-cluster.sh).

The profile is used as shipped except for a test overlay: the account and partition placeholders
filled in with the test cluster's names and short status polling. Every Snakemake run is wrapped in
`timeout -s KILL` (a SIGTERMed Snakemake may wait forever for jobs whose status it cannot learn).

The cluster: started here when it is not running and the tests run as root on Debian (the start is
idempotent, ~10 s); otherwise the SLURM tests fail and say why. To switch them off explicitly, set
VIDLABEL_SLURM_TESTS=0 and VIDLABEL_SLURM_TESTS_REASON="<why>".

Part 1 runs a tiny standalone Snakefile written here (GPU jobs, a time limit, a failed job and
its rerun); part 2 runs the vidlabel workflow on the demo posts with the stand-in server.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from conftest import run_snakemake, write_overlay
from standin import read_request_log, standin_command

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CLUSTER_SCRIPT = REPO / ".ci" / "slurm-cluster.sh"
SHIPPED_PROFILE = REPO / "profiles" / "slurm" / "config.yaml"
PLACEHOLDERS = ("YOUR_ACCOUNT", "YOUR_CPU_PARTITION", "YOUR_GPU_PARTITION")

slurm = pytest.mark.slurm


# ------------------------------------------------------------------------------------ cluster


@dataclass
class Cluster:
    directory: Path
    slurm_conf: Path
    account: str
    partition: str

    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.slurm_conf), "PATH": f"{BIN}:{os.environ['PATH']}"}


def _cluster_script(action: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["timeout", "-s", "KILL", str(int(timeout)), "bash", str(CLUSTER_SCRIPT), action],
                          capture_output=True, text=True)


@pytest.fixture(scope="session")
def slurm_cluster():
    """The running test cluster; started when needed and possible, else a failure that says why."""
    if os.environ.get("VIDLABEL_SLURM_TESTS", "1") == "0":
        reason = os.environ.get("VIDLABEL_SLURM_TESTS_REASON", "").strip()
        if not reason:
            pytest.fail("VIDLABEL_SLURM_TESTS=0 switches the SLURM tests off only with a reason: "
                        "set VIDLABEL_SLURM_TESTS_REASON too")
        pytest.skip(f"SLURM tests switched off (VIDLABEL_SLURM_TESTS=0): {reason}")
    directory = Path(os.environ.get("VIDLABEL_SLURM_DIR", "/tmp/vidlabel-slurm"))
    cluster = Cluster(directory, directory / "etc" / "slurm.conf",
                      os.environ.get("VIDLABEL_SLURM_ACCOUNT", "vidlabel"),
                      os.environ.get("VIDLABEL_SLURM_PARTITION", "gpu"))
    started_here = False
    if _cluster_script("status", 60).returncode != 0:
        if os.geteuid() != 0:
            pytest.fail(f"the SLURM test cluster is not running and these tests are not root, so they cannot "
                        f"start it: run `sudo {CLUSTER_SCRIPT.relative_to(REPO)} start` first (or set "
                        f"VIDLABEL_SLURM_TESTS=0 with VIDLABEL_SLURM_TESTS_REASON)")
        if not Path("/etc/debian_version").exists():
            pytest.fail("the SLURM test cluster needs Debian packages (munge, slurmctld, slurmd, slurmdbd, "
                        "mariadb-server); this is not Debian. Set VIDLABEL_SLURM_TESTS=0 with "
                        "VIDLABEL_SLURM_TESTS_REASON to switch the SLURM tests off.")
        start = _cluster_script("start", 600)
        if start.returncode != 0:
            pytest.fail(f"{CLUSTER_SCRIPT.relative_to(REPO)} start failed:\n{start.stdout}\n{start.stderr[-4000:]}")
        started_here = True
    yield cluster
    if started_here:
        _cluster_script("stop", 120)


def sacct_jobs(cluster: Cluster, run_id: str) -> list[dict[str, str]]:
    """The SLURM jobs of one Snakemake run (the plugin names every job after the run ID)."""
    fields = ["JobID", "Comment", "State", "AllocTRES", "Partition", "Account", "Start", "End", "ExitCode"]
    proc = subprocess.run(["sacct", "-X", "-P", "-n", "-S", "now-1days", "--name", run_id,
                           "-o", ",".join(fields)], capture_output=True, text=True, env=cluster.env(), check=True)
    return [dict(zip(fields, line.split("|"))) for line in proc.stdout.splitlines() if line.strip()]


def tres(job: dict[str, str]) -> dict[str, str]:
    return dict(item.split("=", 1) for item in job["AllocTRES"].split(",") if "=" in item)


def megabytes(value: str) -> int:
    """sacct's memory figures (250G, 4000M) in MB."""
    number, unit = float(value[:-1]), value[-1]
    return round(number * {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024**2}[unit])


def rule_of(job: dict[str, str]) -> str:
    """Rule name and wildcard values from the comment the plugin sets (rule_<name>[_wildcards_<values>])."""
    return job["Comment"].removeprefix("rule_")


# ------------------------------------------------------------------------------------ profile overlay


def _fill(value, names: dict[str, str], seen: set[str]):
    if isinstance(value, dict):
        return {k: _fill(v, names, seen) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, names, seen) for v in value]
    if isinstance(value, str) and value in names:
        seen.add(value)
        return names[value]
    return value


def overlay_profile(cluster: Cluster, directory: Path, **changes) -> Path:
    """The shipped profile with the cluster's account/partition and short polling, in ``directory``."""
    shipped = yaml.safe_load(SHIPPED_PROFILE.read_text())
    names = {"YOUR_ACCOUNT": cluster.account, "YOUR_CPU_PARTITION": cluster.partition,
             "YOUR_GPU_PARTITION": cluster.partition}
    seen: set[str] = set()
    profile = _fill(shipped, names, seen)
    assert seen == set(PLACEHOLDERS), f"placeholders missing from the shipped profile: {set(PLACEHOLDERS) - seen}"
    profile["slurm-init-seconds-before-status-checks"] = 1
    profile["seconds-between-status-checks"] = 1
    profile.update(changes)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.yaml").write_text(yaml.safe_dump(profile, sort_keys=False))
    return directory


@dataclass
class Run:
    proc: subprocess.CompletedProcess
    run_id: str
    seconds: float
    outputs: list[str] | None = None

    @property
    def output(self) -> str:
        return self.proc.stdout + self.proc.stderr


def run_slurm(cluster: Cluster, workdir: Path, snakefile: Path, profile: Path, *args: str,
              timeout: int = 600) -> Run:
    """`snakemake --profile <overlay>` from ``workdir`` (SLURM logs land in workdir/logs/slurm)."""
    command = ["timeout", "-s", "KILL", str(timeout), str(BIN / "snakemake"), "-s", str(snakefile),
               "-d", str(workdir), "--profile", str(profile), *args]
    t0 = time.monotonic()
    proc = subprocess.run(command, cwd=workdir, capture_output=True, text=True, env=cluster.env())
    seconds = time.monotonic() - t0
    assert proc.returncode not in (124, 137, -9), f"snakemake killed after {timeout} s:\n{proc.stderr[-6000:]}"
    match = re.search(r"SLURM run ID: (\S+)", proc.stdout + proc.stderr)
    assert match, f"no SLURM run ID in the output (not run through the plugin?):\n{proc.stderr[-6000:]}"
    return Run(proc, match.group(1), seconds)


# ------------------------------------------------------------------------------------ the shipped profile (static)


def test_shipped_profile_keys_are_known_and_commented():
    """Every key is a Snakemake 9 / SLURM plugin option, and has a comment right above it."""
    help_text = subprocess.run([str(BIN / "snakemake"), "--help"], capture_output=True, text=True,
                               check=True).stdout
    options = set(re.findall(r"--([a-z][a-z0-9-]+)", help_text))
    lines = SHIPPED_PROFILE.read_text().splitlines()
    profile = yaml.safe_load("\n".join(lines))
    for key in profile:
        assert key in options, f"profile key {key!r} is not an option of `snakemake --help`"
    comments = " ".join(line for line in lines if line.lstrip().startswith("#"))
    for i, line in enumerate(lines):
        key = re.match(r"^( {0,2})([a-z_-]+):", line)
        if key:  # options and rules: a comment right above
            assert lines[i - 1].lstrip().startswith("#"), f"line {i + 1} has no comment above it: {line!r}"
        resource = re.match(r"^ {4}([a-z_]+):", line)
        if resource:  # resource names: explained at least once
            assert resource.group(1) in comments, f"resource {resource.group(1)!r} is explained nowhere"
    assert profile["executor"] == "slurm"
    assert profile["slurm-status-command"] == "sacct"


def test_shipped_profile_gpu_rules_and_resource_names():
    """classify gets 4 GPUs without tasks (the plugin would add --ntasks-per-gpu); only resource
    names the plugin reads are used; account and partition are placeholders."""
    profile = yaml.safe_load(SHIPPED_PROFILE.read_text())
    known = {"slurm_account", "slurm_partition", "mem_mb", "runtime", "gpu", "gpu_model", "cpus_per_gpu",
             "cpus_per_task", "tmpdir", "disk_mb"}
    for rule, resources in [("default", profile["default-resources"]), *profile["set-resources"].items()]:
        assert set(resources) <= known, (rule, set(resources) - known)
    classify = profile["set-resources"]["classify"]
    assert classify["gpu"] == 4 and classify["cpus_per_gpu"] >= 1 and classify["mem_mb"] > 0
    assert "tasks" not in classify and "tasks_per_gpu" not in classify
    assert profile["set-resources"]["transcribe"]["gpu"] == 1
    assert profile["default-resources"]["slurm_account"] == "YOUR_ACCOUNT"
    rules = set(re.findall(r"^rule (\w+):", "".join(p.read_text() for p in (REPO / "workflow" / "rules").glob("*.smk")),
                           re.MULTILINE))
    assert set(profile["set-resources"]) <= rules, set(profile["set-resources"]) - rules


# ------------------------------------------------------------------------------------ part 1: a tiny workflow

TINY_SNAKEFILE = textwrap.dedent(r'''
    rule all:
        input:
            expand("labels/shard-{shard}.txt", shard=[0, 1, 2]),
            "sleepy.txt",

    # Named like the workflow's rule so that the shipped profile's classify resources apply.
    # Shard 1 fails until the file "fixed" exists.
    rule classify:
        output:
            "labels/shard-{shard}.txt",
        shell:
            """
            if [ {wildcards.shard} = 1 ] && [ ! -e fixed ]; then echo "shard 1 is broken" >&2; exit 3; fi
            echo "$CUDA_VISIBLE_DEVICES $SLURM_JOB_ID" > {output}
            """

    # Runs into its one-minute time limit; SLURM's SIGTERM reaches the job, whose trap leaves a
    # marker. The retry (the profile's retries: 1) finds the marker and finishes.
    rule sleepy:
        output:
            "sleepy.txt",
        resources:
            runtime=1,
        shell:
            """
            if [ -e sigterm-marker ]; then echo "retry after SIGTERM" > {output}; exit 0; fi
            trap 'echo "SIGTERM in job $SLURM_JOB_ID" > sigterm-marker; exit 143' TERM
            sleep 600 & wait $!
            """
''')


@pytest.fixture(scope="module")
def tiny(slurm_cluster, tmp_path_factory):
    """Two runs of the tiny workflow: the first with shard 1 broken, the second after fixing it."""
    workdir = tmp_path_factory.mktemp("slurm-tiny")
    snakefile = workdir / "Snakefile"
    snakefile.write_text(TINY_SNAKEFILE)
    profile = overlay_profile(slurm_cluster, workdir / "profile")
    first = run_slurm(slurm_cluster, workdir, snakefile, profile)
    first_jobs = sacct_jobs(slurm_cluster, first.run_id)
    first.outputs = sorted(p.name for p in (workdir / "labels").glob("*.txt"))
    (workdir / "fixed").touch()
    second = run_slurm(slurm_cluster, workdir, snakefile, profile)
    second_jobs = sacct_jobs(slurm_cluster, second.run_id)
    return workdir, (first, first_jobs), (second, second_jobs)


@slurm
def test_gpu_jobs_get_four_gpus_through_the_shipped_profile(slurm_cluster, tiny):
    workdir, (first, jobs), _ = tiny
    classify = {rule_of(j): j for j in jobs if rule_of(j) in ("classify_wildcards_0", "classify_wildcards_2")}
    assert len(classify) == 2, jobs
    profile = yaml.safe_load(SHIPPED_PROFILE.read_text())["set-resources"]["classify"]
    for job in classify.values():
        assert job["State"] == "COMPLETED", job
        allocated = tres(job)
        assert allocated.get("gres/gpu") == "4", job
        assert allocated["cpu"] == str(4 * profile["cpus_per_gpu"]), job
        assert megabytes(allocated["mem"]) == profile["mem_mb"], job
        assert job["Partition"] == slurm_cluster.partition and job["Account"] == slurm_cluster.account, job
    for shard in (0, 2):
        devices, job_id = (workdir / "labels" / f"shard-{shard}.txt").read_text().split()
        gpus = devices.split(",")
        assert len(set(gpus)) == 4, devices  # four GPUs granted; alone on the node that is 0,1,2,3
        assert job_id == classify[f"classify_wildcards_{shard}"]["JobID"]
    # The logs land where the profile says, one directory per shard.
    assert list((workdir / "logs" / "slurm" / "rule_classify" / "0").glob("*.log"))


@slurm
def test_time_limit_sends_sigterm_to_the_job_and_the_retry_finishes(tiny):
    workdir, (first, jobs), _ = tiny
    sleepy = [j for j in jobs if rule_of(j) == "sleepy"]
    assert [j["State"] for j in sleepy] == ["TIMEOUT", "COMPLETED"], sleepy
    marker = (workdir / "sigterm-marker").read_text()
    assert f"SIGTERM in job {sleepy[0]['JobID']}" in marker
    assert (workdir / "sleepy.txt").read_text().strip() == "retry after SIGTERM"


@slurm
def test_failed_job_keeps_going_then_the_same_command_reruns_only_it(tiny):
    workdir, (first, first_jobs), (second, second_jobs) = tiny
    assert first.proc.returncode != 0
    broken = [j for j in first_jobs if rule_of(j) == "classify_wildcards_1"]
    assert [j["State"] for j in broken] == ["FAILED", "FAILED"], first_jobs  # the profile's retries: 1
    assert first.outputs == ["shard-0.txt", "shard-2.txt"]  # keep-going: the others finished

    assert second.proc.returncode == 0, second.output[-6000:]
    assert [(rule_of(j), j["State"]) for j in second_jobs] == [("classify_wildcards_1", "COMPLETED")]
    assert (workdir / "labels" / "shard-1.txt").exists()


# ------------------------------------------------------------------------------------ part 2: the workflow

# Columns of labels.parquet that differ between any two runs (wall-clock times).
TIMING_COLUMNS = {"latency_s", "started_at", "finished_at"}
YES_IF = ["--yes-if", "promotes_product=buy", "--yes-if", "sales_interaction=link"]


def workflow_args(workdir: Path) -> list[str]:
    return ["--configfile", str(REPO / "config" / "config.yaml"), str(workdir / "test-config.yaml")]


def run_workflow(cluster: Cluster, workdir: Path, profile: Path, *args: str, timeout: int = 900) -> Run:
    return run_slurm(cluster, workdir, REPO / "Snakefile", profile, *workflow_args(workdir), *args,
                     timeout=timeout)


def job_stats(output: str) -> dict[str, int]:
    """Snakemake's "Job stats" table: jobs per rule planned for this run."""
    match = re.search(r"Job stats:\n(?:job\s+count\n[-\s]+\n)((?:\S+\s+\d+\n)+)", output)
    assert match, f"no job stats in the output:\n{output[-3000:]}"
    stats = dict((name, int(count)) for name, count in re.findall(r"^(\S+)\s+(\d+)$", match.group(1), re.MULTILINE))
    stats.pop("total", None)
    return stats


def local_rules() -> set[str]:
    text = (REPO / "Snakefile").read_text() + "".join(p.read_text() for p in (REPO / "workflow" / "rules").glob("*.smk"))
    return {name for names in re.findall(r"^localrules:\s*(.+)$", text, re.MULTILINE)
            for name in re.split(r"[,\s]+", names) if name}


def labels_by_post(workdir: Path) -> dict[str, dict]:
    rows = pq.read_table(workdir / "results" / "labels.parquet").to_pylist()
    return {r["post_id"]: {k: v for k, v in r.items() if k not in TIMING_COLUMNS} for r in rows}


def journal_ok_ids(path: Path) -> set[str]:
    if not path.exists():
        return set()
    records = [json.loads(line) for line in path.read_bytes().splitlines(keepends=True) if line.endswith(b"\n")]
    return {r["request_id"] for r in records if r.get("status") == "ok"}


def prepared_workdir(name, tmp_path_factory, demo_set, reference: Path, server_command,
                     classify: dict | None = None) -> Path:
    """A workflow directory whose inventory, transcripts and manifest are copied from the local
    reference run (so only classify, merge and aggregate run); ``server_command(workdir)`` gives
    the classify server command."""
    workdir = tmp_path_factory.mktemp(name)
    demo_root, _ = demo_set
    for part in ("inventory.parquet", "transcripts", "transcoded", "manifest"):
        source = reference / "results" / part
        target = workdir / "results" / part
        if source.is_dir():
            shutil.copytree(source, target)  # copy2 keeps the times: nothing upstream looks stale
        elif source.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    write_overlay(workdir, demo_root, {"classify": {"server_command": server_command(workdir), **(classify or {})}})
    return workdir


def crash_once_command(workdir: Path, crash_after: int) -> str:
    """The stand-in; the first server to start (whichever shard) exits when chat request
    ``crash_after``+1 arrives (the readiness check counts as one), every later one works."""
    standin = standin_command(sys.executable, workdir / "requests.jsonl", *YES_IF, "--latency", "0.2")
    marker = workdir / "crashed-once"
    script = (f"mkdir {shlex.quote(str(marker))} 2>/dev/null && exec {standin} --crash-after {crash_after}"
              f" || exec {standin}")
    return f"sh -c {shlex.quote(script)}"


def barrier_command(workdir: Path, server: str, servers: int) -> str:
    """``server`` once ``servers`` such commands have started (each leaves a file in a barrier
    directory); gives up after 50 s, within the job's startup timeout, if the others never start."""
    barrier = shlex.quote(str(workdir / "server-barrier"))
    script = (f"mkdir -p {barrier} && touch {barrier}/$$ && n=0 && "
              f"while [ $(ls {barrier} | wc -l) -lt {servers} ]; do "
              f"n=$((n + 1)); [ $n -lt 250 ] || exit 4; sleep 0.2; done; exec {server}")
    return f"sh -c {shlex.quote(script)}"


@pytest.fixture(scope="module")
def local_reference(demo_set, tmp_path_factory):
    """The whole workflow with the local profile: the results SLURM must reproduce."""
    workdir = tmp_path_factory.mktemp("local-reference")
    demo_root, _ = demo_set
    command = standin_command(sys.executable, workdir / "requests.jsonl", *YES_IF, "--latency", "0.05")
    # The SLURM profile pre-transcodes every video; so does the reference, for equal inputs.
    write_overlay(workdir, demo_root, {"classify": {"server_command": command},
                                       "planning": {"transcode": {"enabled": True}}})
    run_snakemake(workdir)
    return workdir


@pytest.fixture(scope="module")
def slurm_e2e(slurm_cluster, demo_set, tmp_path_factory, local_reference):
    """The whole workflow through the shipped SLURM profile. Each shard's server waits until both
    have started (so the two shard jobs must run at the same time), then answers slowly enough
    (concurrency 2, 1 s per request) that both serve at the same time."""
    workdir = tmp_path_factory.mktemp("slurm-e2e")
    demo_root, _ = demo_set
    command = barrier_command(workdir, standin_command(sys.executable, workdir / "requests.jsonl", *YES_IF,
                                                       "--latency", "1.0"), servers=2)
    write_overlay(workdir, demo_root, {"classify": {"server_command": command, "concurrency": 2}})
    profile = overlay_profile(slurm_cluster, workdir / "profile")
    run = run_workflow(slurm_cluster, workdir, profile)
    print(f"SLURM e2e wall time: {run.seconds:.1f} s")
    assert run.proc.returncode == 0, run.output[-8000:]
    return workdir, run, sacct_jobs(slurm_cluster, run.run_id)


@slurm
@pytest.mark.slow
def test_e2e_every_rule_ran_as_a_slurm_job(slurm_e2e):
    workdir, run, jobs = slurm_e2e
    planned = job_stats(run.output)
    expected = {rule: count for rule, count in planned.items() if rule != "all" and rule not in local_rules()}
    ran: dict[str, int] = {}
    for job in jobs:
        assert job["State"] == "COMPLETED", job
        rule = rule_of(job).split("_wildcards_")[0]
        ran[rule] = ran.get(rule, 0) + 1
    assert ran == expected
    assert {"inventory", "transcribe", "manifest", "classify", "merge", "aggregate"} <= set(ran)
    for job in jobs:
        gpus = tres(job).get("gres/gpu")
        rule = rule_of(job).split("_wildcards_")[0]
        assert gpus == {"classify": "4", "transcribe": "1"}.get(rule), job


@slurm
@pytest.mark.slow
def test_e2e_results_equal_the_local_profile(slurm_e2e, local_reference):
    workdir, _, _ = slurm_e2e
    slurm_labels, local_labels = labels_by_post(workdir), labels_by_post(local_reference)
    assert slurm_labels == local_labels
    assert any(r["status"] == "ok" for r in slurm_labels.values())
    for name in ("prevalence.csv", "tokens.csv", "errors.csv"):
        assert (workdir / "results" / "summary" / name).read_text() == \
            (local_reference / "results" / "summary" / name).read_text(), name


@slurm
@pytest.mark.slow
def test_server_media_threads_follow_the_cpus_granted(slurm_e2e):
    """classify asks for 4 GPUs x cpus_per_gpu CPUs; the server decodes media on all but two."""
    workdir, _, _ = slurm_e2e
    profile = yaml.safe_load((REPO / "profiles" / "slurm" / "config.yaml").read_text())
    cpus = profile["set-resources"]["classify"]["cpus_per_gpu"] * profile["set-resources"]["classify"]["gpu"]
    for log in sorted((workdir / "logs" / "classify").glob("server-*.log")):
        assert f"media loading threads {cpus - 2}" in log.read_text(), log


@slurm
@pytest.mark.slow
def test_two_shard_jobs_at_once_use_different_ports(slurm_e2e):
    """Both shard jobs ran on the one node at the same time, each with its own server port and its
    own GPUs, and both succeeded."""
    workdir, _, jobs = slurm_e2e
    classify = [j for j in jobs if rule_of(j).startswith("classify_")]
    assert len(classify) == 2 and all(j["State"] == "COMPLETED" for j in classify)
    ports = {}
    for shard in (0, 1):
        log = (workdir / "logs" / "classify" / f"server-{shard}.log").read_text()
        found = re.findall(r"listening on http://127\.0\.0\.1:(\d+)", log)
        assert len(found) == 1, log
        ports[shard] = found[0]
    assert ports[0] != ports[1]
    # The two servers (one stand-in process each) answered requests during overlapping intervals.
    spans: dict[int, list[float]] = {}
    for event in read_request_log(workdir / "requests.jsonl"):
        spans.setdefault(event["pid"], []).append(event["t"])
    assert len(spans) == 2, spans.keys()
    (a0, a1), (b0, b1) = [(min(t), max(t)) for t in spans.values()]
    assert max(a0, b0) < min(a1, b1), "the two shard servers never ran at the same time"


def crashing_workdir(name, tmp_path_factory, demo_set, reference: Path) -> Path:
    # Concurrency 1: requests go one after another, so the crash comes after whole requests.
    return prepared_workdir(name, tmp_path_factory, demo_set, reference,
                            lambda workdir: crash_once_command(workdir, crash_after=3), {"concurrency": 1})


def crashed_shard(jobs: list[dict[str, str]]) -> int:
    failed = {int(rule_of(j).split("_wildcards_")[1]) for j in jobs
              if rule_of(j).startswith("classify_") and j["State"] != "COMPLETED"}
    assert len(failed) == 1, jobs
    return failed.pop()


@pytest.fixture(scope="module")
def crash_then_rerun(slurm_cluster, demo_set, tmp_path_factory, local_reference):
    """One shard's server crashes, no retries (--retries 0): the run fails; then the same command again."""
    workdir = crashing_workdir("slurm-rerun", tmp_path_factory, demo_set, local_reference)
    profile = overlay_profile(slurm_cluster, workdir / "profile")
    first = run_workflow(slurm_cluster, workdir, profile, "--retries", "0")
    first_jobs = sacct_jobs(slurm_cluster, first.run_id)
    first.outputs = sorted(p.name for p in (workdir / "results" / "labels").glob("*.parquet"))
    shard = crashed_shard(first_jobs)
    finished = journal_ok_ids(workdir / "results" / "journal" / f"shard-{shard}.jsonl")
    events_before = len(read_request_log(workdir / "requests.jsonl"))
    second = run_workflow(slurm_cluster, workdir, profile, "--retries", "0")
    second_jobs = sacct_jobs(slurm_cluster, second.run_id)
    return workdir, shard, (first, first_jobs, finished, events_before), (second, second_jobs)


@slurm
@pytest.mark.slow
def test_crashed_shard_fails_alone_and_the_same_command_resumes_it(crash_then_rerun, local_reference):
    workdir, shard, (first, first_jobs, finished, events_before), (second, second_jobs) = crash_then_rerun
    other = 1 - shard
    assert first.proc.returncode != 0
    # keep-going: the other shard finished; merge and aggregate could not run.
    states = {rule_of(j): j["State"] for j in first_jobs}
    assert states == {f"classify_wildcards_{shard}": "FAILED", f"classify_wildcards_{other}": "COMPLETED"}, states
    assert first.outputs == [f"shard-{other}.parquet"]
    assert finished, "the crashed shard finished no request before the crash"

    assert second.proc.returncode == 0, second.output[-8000:]
    assert sorted(rule_of(j) for j in second_jobs) == sorted([f"classify_wildcards_{shard}", "merge", "aggregate"])
    assert job_stats(second.output).get("classify") == 1
    events = read_request_log(workdir / "requests.jsonl")
    resent = {e.get("request_id") for e in events[events_before:] if e.get("event") == "received"} & finished
    assert resent == set(), "requests finished before the crash were sent again"
    assert labels_by_post(workdir) == labels_by_post(local_reference)


@pytest.fixture(scope="module")
def crash_with_retry(slurm_cluster, demo_set, tmp_path_factory, local_reference):
    """The same crash with the shipped profile's retries: 1: one invocation."""
    workdir = crashing_workdir("slurm-retry", tmp_path_factory, demo_set, local_reference)
    profile = overlay_profile(slurm_cluster, workdir / "profile")
    run = run_workflow(slurm_cluster, workdir, profile)
    return workdir, run, sacct_jobs(slurm_cluster, run.run_id)


@slurm
@pytest.mark.slow
def test_crashed_shard_is_resubmitted_and_resumes_in_the_same_run(crash_with_retry, local_reference):
    workdir, run, jobs = crash_with_retry
    assert yaml.safe_load(SHIPPED_PROFILE.read_text())["retries"] == 1
    assert run.proc.returncode == 0, run.output[-8000:]
    shard = crashed_shard(jobs)
    attempts = [j["State"] for j in jobs if rule_of(j) == f"classify_wildcards_{shard}"]
    assert attempts == ["FAILED", "COMPLETED"]
    # Every request was answered once: nothing finished by the crashed attempt was sent again.
    completed = [e["request_id"] for e in read_request_log(workdir / "requests.jsonl")
                 if e.get("event") == "completed" and e.get("status") == 200 and e.get("request_id")]
    manifest_ids = {r["request_id"] for p in (workdir / "results" / "manifest").glob("shard-*.parquet")
                    for r in pq.read_table(p).to_pylist()}
    requests = [rid for rid in completed if rid in manifest_ids]
    assert sorted(requests) == sorted(manifest_ids)
    assert labels_by_post(workdir) == labels_by_post(local_reference)


def slow_once_command(workdir: Path) -> str:
    """The stand-in; the first server to start answers slowly (25 s per request) and leaves its
    SLURM job ID in ``workdir/slow-once/job``; every later server answers at once."""
    slow = standin_command(sys.executable, workdir / "requests.jsonl", *YES_IF, "--latency", "25")
    fast = standin_command(sys.executable, workdir / "requests.jsonl", *YES_IF, "--latency", "0.05")
    marker = shlex.quote(str(workdir / "slow-once"))
    script = (f"if mkdir {marker} 2>/dev/null; then echo $SLURM_JOB_ID > {marker}/job.tmp && "
              f"mv {marker}/job.tmp {marker}/job && exec {slow}; else exec {fast}; fi")
    return f"sh -c {shlex.quote(script)}"


@pytest.fixture(scope="module")
def time_limit_run(slurm_cluster, demo_set, tmp_path_factory, local_reference):
    """A shard job whose time limit is cut to one minute while it runs (scontrol), with the shipped
    profile's retries: 1: SLURM's SIGTERM ends the job, the retry resumes the shard."""
    workdir = prepared_workdir("slurm-timelimit", tmp_path_factory, demo_set, local_reference, slow_once_command,
                               {"concurrency": 1, "request_timeout_s": 60})
    profile = overlay_profile(slurm_cluster, workdir / "profile")
    command = ["timeout", "-s", "KILL", "600", str(BIN / "snakemake"), "-s", str(REPO / "Snakefile"),
               "-d", str(workdir), "--profile", str(profile), *workflow_args(workdir)]
    t0 = time.monotonic()
    proc = subprocess.Popen(command, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=slurm_cluster.env())
    job_file = workdir / "slow-once" / "job"
    slow_job = None
    while proc.poll() is None and time.monotonic() - t0 < 300:
        if job_file.exists():
            slow_job = job_file.read_text().strip()
            subprocess.run(["scontrol", "update", f"jobid={slow_job}", "TimeLimit=1"], check=True,
                           env=slurm_cluster.env())
            break
        time.sleep(0.2)
    output, _ = proc.communicate(timeout=600)
    assert slow_job, f"the slow shard's server never started:\n{output[-6000:]}"
    match = re.search(r"SLURM run ID: (\S+)", output)
    assert match, output[-6000:]
    run = Run(subprocess.CompletedProcess(command, proc.returncode, output, ""), match.group(1),
              time.monotonic() - t0)
    return workdir, slow_job, run, sacct_jobs(slurm_cluster, match.group(1))


@slurm
@pytest.mark.slow
def test_time_limit_sigterm_keeps_the_journal_and_the_retry_resumes(time_limit_run, local_reference):
    workdir, slow_job, run, jobs = time_limit_run
    assert run.proc.returncode == 0, run.output[-8000:]
    timed_out = [j for j in jobs if j["JobID"] == slow_job]
    assert timed_out and timed_out[0]["State"] == "TIMEOUT", jobs
    shard = int(rule_of(timed_out[0]).split("_wildcards_")[1])
    attempts = [j for j in jobs if rule_of(j) == f"classify_wildcards_{shard}"]
    assert [j["State"] for j in attempts] == ["TIMEOUT", "COMPLETED"]
    # The rule's log holds the last attempt only (Snakemake clears it before a job starts); the
    # SLURM log of each job keeps its attempt.
    log = (workdir / "logs" / "slurm" / "rule_classify" / str(shard) / f"{slow_job}.log").read_text()
    assert "JobInterrupted" in log and "stopped by SIGTERM" in log, log[-3000:]
    # Requests answered before the time limit were journaled and not sent again by the retry.
    retry_start = time.mktime(time.strptime(attempts[1]["Start"], "%Y-%m-%dT%H:%M:%S"))
    events = read_request_log(workdir / "requests.jsonl")
    before = {e["request_id"] for e in events if e["t"] < retry_start and e.get("event") == "completed"
              and e.get("status") == 200 and e.get("request_id")}
    after = {e["request_id"] for e in events if e["t"] >= retry_start and e.get("event") == "received"}
    assert before, "no request finished before the time limit"
    assert before & after == set()
    assert labels_by_post(workdir) == labels_by_post(local_reference)
