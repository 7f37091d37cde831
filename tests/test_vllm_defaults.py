"""The default server command against vLLM's own rules (issue: 13 of 21 requests failed on a real vLLM).

A holdout-style set (21 videos of 3-27 s, 720p and 1080p, portrait and landscape, plus broken files)
goes through inventory, transcode, manifest and the classify job with vidlabel's *default*
``classify.server_command``. ``vllm`` on PATH is the stand-in started with vLLM's command line and
its Qwen2.5-VL rules (``tests/standin/qwen_video.py``, written independently of vidlabel's
estimator): frames at the server's fps, frames resized to the pixel bound, an encoder cache of
max(--max-num-batched-tokens, the profiler's largest item; 8192 when the flag is absent), and a
model with random weights (whitespace runaways under a JSON schema unless the server disables them).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from planning_helpers import make_clip
from standin import is_probe, read_request_log, vllm_shim
from standin.shards import QUESTIONS

from vidlabel.core import config as vconfig
from vidlabel.prepare import manifest, transcode
from vidlabel.prepare.inventory import build_inventory
from vidlabel.serve.classify import ServerBelowPlan, run_shard

MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"
# (width, height): 720p and 1080p, portrait and landscape.
SIZES = [(720, 1280), (1280, 720), (1080, 1920), (1920, 1080)]
# The flags the default command gained for a real vLLM; without them it is the old default.
NEW_FLAGS = (" --max-num-batched-tokens {max_num_batched_tokens}",
             " --structured-outputs-config '{{\"backend\":\"xgrammar\",\"disable_any_whitespace\":true}}'")
# The old default's one flat pixel bound (before images had their own): vLLM's profiler then sized its
# video by it (7 pairs of 24x32 cells), so the encoder cache was --max-num-batched-tokens' 8192.
OLD_PIXEL_BOUNDS = "'{{\"min_pixels\":{min_pixels},\"max_pixels\":{max_pixels}}}'"


@pytest.fixture(scope="module")
def holdout(tmp_path_factory):
    """Inventory, transcode and manifest of the holdout-style set, run once for the module."""
    root = tmp_path_factory.mktemp("holdout")
    media = root / "media"
    media.mkdir()
    rows = []
    for i in range(21):
        width, height = SIZES[i % len(SIZES)]
        seconds = 3 + round(i * 24 / 20)  # 3 .. 27 s
        # 10 fps sources are cheap to make; the server samples 2 fps whatever the source rate.
        path = make_clip(media / f"v{i:02d}.mp4", width, height, seconds, rate=10)
        rows.append((f"v{i:02d}", path.name, f"caption {i}: buy now" if i % 2 else f"caption {i}"))
    (media / "empty.mp4").write_bytes(b"")
    (media / "text.mp4").write_text("not a video\n")
    cut = (media / "v00.mp4").read_bytes()
    (media / "cut.mp4").write_bytes(cut[: len(cut) // 2])
    rows += [("empty", "empty.mp4", ""), ("text", "text.mp4", ""), ("cut", "cut.mp4", ""),
             ("missing", "missing.mp4", "")]
    (root / "posts.csv").write_text("post_id,video_path,caption\n" + "".join(
        f"{pid},media/{name},{caption}\n" for pid, name, caption in rows))
    config = vconfig.validate({"posts": str(root / "posts.csv"), "media_root": str(media),
                               "results": str(root / "results"),
                               "classify": {"model": MODEL, "questions": QUESTIONS, "shards": 1,
                                            "startup_timeout_s": 60, "health_interval_s": 0.5,
                                            "progress_interval_s": 5, "backoff_initial_s": 0.05,
                                            "backoff_max_s": 0.5, "shutdown_grace_s": 2},
                               "planning": {"transcode": {"chunks": 1}}})
    results = root / "results"
    build_inventory(config, results / "inventory.parquet")
    transcode.run_chunk(config, results / "inventory.parquet", 0, results / "transcoded" / "chunk-0.parquet",
                        results / "transcoded" / "media")
    shard = results / "manifest" / "shard-0.parquet"
    manifest.build(config, results / "inventory.parquet", [], [results / "transcoded" / "chunk-0.parquet"],
                   [shard], results / "manifest" / "excluded.parquet", results / "manifest" / "plan.csv")
    return root, config, shard


def classify(root: Path, config: dict, shard: Path, name: str, *standin_args: str,
             server_command: str | None = None, monkeypatch=None) -> tuple[dict, list[dict], str]:
    """Run the shard job with ``vllm`` = the stand-in; labels by post, the server's request log, its log."""
    shim_dir = root / f"bin-{name}"
    requests = root / f"requests-{name}.jsonl"
    vllm_shim(shim_dir, "--request-log", str(requests), *standin_args)
    monkeypatch.setenv("PATH", f"{shim_dir}{os.pathsep}{os.environ['PATH']}")
    cfg = json.loads(json.dumps(config))
    if server_command is not None:
        cfg["classify"]["server_command"] = server_command
    out = root / f"labels-{name}.parquet"
    server_log = root / f"server-{name}.log"
    try:
        run_shard(cfg, shard, out, root / f"journal-{name}.jsonl", server_log, 0)
    finally:
        monkeypatch.setenv("PATH", os.environ["PATH"].split(os.pathsep, 1)[1])
    labels = {r["post_id"]: r for r in pq.read_table(out).to_pylist()}
    return labels, read_request_log(requests), server_log.read_text()


def test_default_command_labels_every_valid_post(holdout, monkeypatch):
    root, config, shard = holdout
    excluded = {r["post_id"]: r for r in pq.read_table(root / "results" / "manifest" / "excluded.parquet").to_pylist()}
    assert set(excluded) == {"empty", "text", "cut", "missing"}
    assert {r["reason"] for r in excluded.values()} == {"probe_error"}
    requests = pq.read_table(shard).to_pylist()
    assert len(requests) == 21
    # The set needs the larger encoder cache: several videos carry more than vLLM's default 8192 tokens.
    assert sum(r["est_visual_tokens"] > 8192 for r in requests) >= 5

    labels, events, server_log = classify(root, config, shard, "default", "--random-weights", monkeypatch=monkeypatch)
    assert {pid: r["status"] for pid, r in labels.items()} == {r["post_id"]: "ok" for r in requests}
    assert all(r["attempts"] == 1 for r in labels.values())
    assert {e["status"] for e in events if e["event"] == "completed" and e["request_id"]
            and not is_probe(e["request_id"])} == {200}
    # Estimated and served prompt tokens agree within 2 % for every request.
    ratios = [r["est_prompt_tokens"] / r["prompt_tokens"] for r in labels.values()]
    assert all(abs(x - 1) <= 0.02 for x in ratios), sorted(ratios)
    # Answers fit the schema-sized budget: no runaway, nothing truncated.
    assert max(r["completion_tokens"] for r in labels.values()) <= config["classify"]["max_tokens"]
    assert "max_num_batched_tokens 32768" in server_log


def test_the_old_default_command_stops_at_the_first_encoder_cache_refusal(holdout, monkeypatch):
    """Without the encoder-cache budget the stand-in refuses the long videos as the real server did (13 of
    21 there). Those refusals describe the server, not the posts: the job stops at the first, naming the
    server's 8192 and both fixes, and journals nothing terminal."""
    root, config, shard = holdout
    old = _without(*NEW_FLAGS).replace("{mm_processor_kwargs}", OLD_PIXEL_BOUNDS)
    with pytest.raises(ServerBelowPlan) as info:
        classify(root, config, shard, "old", "--random-weights", server_command=old, monkeypatch=monkeypatch)
    assert "encoder cache holds 8192 tokens" in str(info.value)
    assert "--max-num-batched-tokens 32768" in str(info.value)
    assert "classify.max_num_batched_tokens: 8192" in str(info.value)
    journal = [json.loads(x) for x in (root / "journal-old.jsonl").read_text().splitlines() if x.strip()]
    assert [r for r in journal if r["status"] != "ok" and not r.get("retryable")] == []
    videos = [e for e in read_request_log(root / "requests-old.jsonl")
              if e["event"] == "completed" and not is_probe(e["request_id"])]
    refused = [e for e in videos if e["status"] == 400 and "encoder cache" in e.get("error", "")]
    assert refused and len(videos) <= config["classify"]["concurrency"]  # not one per long video


def test_without_the_whitespace_flag_random_weights_run_to_max_tokens(holdout, monkeypatch):
    """The other half of what the real server did: under a JSON schema, answers of whitespace up to
    max_tokens, truncated after the one retry at twice the tokens."""
    root, config, shard = holdout
    labels, _, _ = classify(root, config, shard, "spaces", "--random-weights", server_command=_without(NEW_FLAGS[1]),
                            monkeypatch=monkeypatch)
    assert {r["error_kind"] for r in labels.values()} == {"truncated"}
    assert all(r["http_status"] == 200 and r["sends"] == 2 for r in labels.values())


def _without(*flags: str) -> str:
    """The default server command without ``flags`` (each of which it must have)."""
    command = vconfig.load_schema()["properties"]["classify"]["properties"]["server_command"]["default"]
    for flag in flags:
        assert flag in command
        command = command.replace(flag, "")
    return command
