"""Building blocks for classify tests and benchmarks: tiny real videos, manifest shards, configs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow as pa

from vidlabel.core import config as vconfig
from vidlabel.core.io import write_parquet
from vidlabel.core.prompt import render_prompt, request_id
from vidlabel.serve.classify import attach_requests
from vidlabel.serve.settings import ServeSettings

from . import standin_command

QUESTIONS = [
    {"id": "promotes_product", "text": "Does the post promote a product?"},
    {"id": "mentions_food", "text": "Is food mentioned?"},
]
# The stand-in's answer rule used with these questions (see tests/standin/server.py --yes-if).
YES_IF = ["--yes-if", "promotes_product=buy", "--yes-if", "mentions_food=pizza"]
MODEL = "standin-model"


def make_video(path: Path, seconds: float = 1.0, size: str = "64x64") -> Path:
    """A real H.264 MP4 (ffmpeg lavfi testsrc)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["ffmpeg", "-v", "error", "-y", "-f", "lavfi", "-i", f"testsrc=size={size}:rate=10",
                    "-t", str(seconds), "-c:v", "libx264", "-preset", "ultrafast", "-pix_fmt", "yuv420p",
                    str(path)], check=True)
    return path


def make_config(tmp: Path, media_root: Path, request_log: Path | None = None, faults=(),
                classify: dict | None = None, python: str | None = None) -> dict:
    """A validated config whose server command launches the stand-in; small timeouts for tests."""
    cfg = {
        "posts": str(tmp / "posts.csv"), "media_root": str(media_root), "results": str(tmp / "results"),
        "classify": {
            "model": MODEL, "questions": QUESTIONS,
            "server_command": standin_command(python or sys.executable, request_log, *YES_IF, *faults),
            "concurrency": 4, "max_tokens": 64, "request_timeout_s": 10, "max_attempts": 4,
            "backoff_initial_s": 0.01, "backoff_max_s": 0.2, "startup_timeout_s": 60,
            "shutdown_grace_s": 2, "health_interval_s": 0.5, "progress_interval_s": 1,
            **(classify or {}),
        },
        "planning": {"model_family": "qwen2_5_vl"},  # the stand-in's model, named freely, serves as Qwen2.5-VL
    }
    return vconfig.validate(cfg)


def manifest_rows(config: dict, posts: list[dict]) -> list[dict]:
    """Manifest rows for ``posts`` (dicts with post_id, media_path, caption, transcript), each with the request
    and fingerprint a classify job gives it (vidlabel.serve.classify.attach_requests)."""
    c = config["classify"]
    rows = []
    for p in posts:
        prompt = render_prompt(c["prompt_template"], p.get("caption"), p.get("transcript"), c["questions"])
        rows.append({
            "request_id": request_id(p["post_id"], c["prompt_template"], c["questions"]),
            "post_id": p["post_id"], "video_path": p["media_path"], "media_path": p["media_path"],
            "caption": p.get("caption"), "transcript": p.get("transcript"), "prompt": prompt,
            "est_visual_tokens": 100, "est_text_tokens": len(prompt) // 4,
            "est_prompt_tokens": 100 + len(prompt) // 4, "plan": "as-is",
        })
    attach_requests(ServeSettings.from_config(config), rows)  # the body each is sent: its Request's
    return rows


MANIFEST_SCHEMA = pa.schema([
    ("request_id", pa.string()), ("post_id", pa.string()), ("video_path", pa.string()),
    ("media_path", pa.string()), ("caption", pa.string()), ("transcript", pa.string()),
    ("prompt", pa.string()), ("est_visual_tokens", pa.int64()), ("est_text_tokens", pa.int64()),
    ("est_prompt_tokens", pa.int64()), ("plan", pa.string()),
])


def write_manifest(path: Path, rows: list[dict]) -> Path:
    cols = {f.name: [r[f.name] for r in rows] for f in MANIFEST_SCHEMA}
    write_parquet(pa.table(cols, schema=MANIFEST_SCHEMA), path)
    return path


def expected_answers(caption: str | None, transcript: str | None) -> dict[str, str]:
    """The stand-in's rule (with YES_IF), computed independently of it."""
    text = f"{caption or ''} {transcript or ''}".lower()
    return {"promotes_product": "yes" if "buy" in text else "no",
            "mentions_food": "yes" if "pizza" in text else "no"}
