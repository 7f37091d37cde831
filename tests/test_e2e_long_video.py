"""A video that cannot fit the context never reaches the server as it is: re-planned or excluded."""

from __future__ import annotations

import csv
import sys

import pyarrow.parquet as pq
import pytest
from conftest import manifest_dir, model_dir, run_snakemake, write_overlay
from standin import read_request_log, standin_command

from vidlabel.demo import make_video
from vidlabel.prepare.media import probe

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def long_posts(tmp_path_factory):
    root = tmp_path_factory.mktemp("long")
    media = root / "media"
    make_video(media / "short.mp4", "Buy this now.", size=(640, 360), fps=15)
    make_video(media / "long.mp4", None, duration=30, size=(640, 360), fps=15, audio=False)
    with open(root / "posts.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["post_id", "video_path", "caption"])
        writer.writerow(["short", "media/short.mp4", "a short clip"])
        writer.writerow(["long", "media/long.mp4", "a long clip"])
    return root


def run_long(tmp_path, root, over_limit):
    command = standin_command(sys.executable, tmp_path / "requests.jsonl", "--yes-if", "promotes_product=buy")
    # 30 s at 2 fps and 640x360 is ~9k visual tokens: over a 4,096-token context with max_tokens 256.
    write_overlay(tmp_path, root, {
        "classify": {"server_command": command, "max_model_len": 4096, "max_tokens": 256, "shards": 1},
        "planning": {"over_limit": over_limit},
        "transcribe": {"chunks": 1},
    })
    run_snakemake(tmp_path)
    labels = {r["post_id"]: r for r in pq.read_table(model_dir(tmp_path / "results") / "labels.parquet").to_pylist()}
    manifest = {r["post_id"]: r for r in pq.read_table(manifest_dir(tmp_path / "results") / "shard-0.parquet").to_pylist()}
    return labels, manifest, read_request_log(tmp_path / "requests.jsonl")


def test_over_long_video_is_excluded_without_reaching_the_server(tmp_path, long_posts):
    labels, manifest, events = run_long(tmp_path, long_posts, "exclude")
    assert labels["long"]["status"] == "excluded" and labels["long"]["error_kind"] == "too_long"
    assert "long" not in manifest and labels["short"]["status"] == "ok"
    read = {e["path"] for e in events if e["event"] == "media"}
    assert str(long_posts / "media" / "long.mp4") not in read and read  # the server never decoded it
    excluded = pq.read_table(manifest_dir(tmp_path / "results") / "excluded.parquet").to_pylist()
    assert [r["reason"] for r in excluded if r["post_id"] == "long"] == ["too_long"]


def test_over_long_video_is_replanned_to_a_smaller_transcode(tmp_path, long_posts):
    labels, manifest, events = run_long(tmp_path, long_posts, "replan")
    assert labels["long"]["status"] == "ok" and labels["short"]["status"] == "ok"
    request = manifest["long"]
    transcoded = tmp_path / "results" / "transcoded" / "media"
    assert request["media_path"].startswith(str(transcoded)) and request["plan"].startswith("replan")
    assert request["video_path"] == str(long_posts / "media" / "long.mp4")  # the original stays on record
    assert request["est_prompt_tokens"] + 256 <= 4096
    read = {e["path"] for e in events if e["event"] == "media"}
    assert request["media_path"] in read and request["video_path"] not in read
    info = probe(request["media_path"])
    assert info["probe_error"] is None and info["has_audio"] is False and info["fps"] < 2
    # The short clip fits as it is and is read from its original file.
    assert manifest["short"]["media_path"] == manifest["short"]["video_path"] and manifest["short"]["plan"] == "as-is"
