"""Shared set-up for the classify benchmarks: a media dir with one tiny video, a config, manifest rows; and a
run of vidlabel's client through them against its own server."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "src"))

from standin.shards import make_config, make_video, manifest_rows  # noqa: E402


async def run_client(cfg: dict, rows: list[dict], settings, server_log: Path, fit: bool = False) -> list[int]:
    """Every row through vidlabel's client against the configured server (started and stopped here); every
    answer must be ok. The client's in-flight limits over the run (adaptive concurrency), in order; with
    ``fit``, first the limit fitted to the server's KV cache as a shard job fits it (classify.run_shard)."""
    from vidlabel.serve.client import ClassifyClient
    from vidlabel.serve.server import VLLMServer
    from vidlabel.serve.settings import ServeSettings

    with VLLMServer(ServeSettings.from_config(cfg), server_log) as server:
        await server.wait_ready()
        async with ClassifyClient([(server.base_url, server.api_key)], settings) as client:
            fitted = []
            if fit:
                client.fit_in_flight(sum(r["est_prompt_tokens"] for r in rows) / len(rows) + settings.max_tokens)
                fitted = [client.limit.ceiling]
            records = await asyncio.gather(*(client.classify(r) for r in rows))
            assert all(r["status"] == "ok" for r in records), "some requests failed"
            return fitted + [limit for _, limit in client.limit_history]


def setup(work: Path, n: int, faults=(), classify=None, request_log=None, caption_len=None):
    media = work / "media"
    if not (media / "clip.mp4").exists():
        make_video(media / "clip.mp4")
    cfg = make_config(work, media, request_log, faults, classify)
    posts = []
    for i in range(n):
        cap = "buy now" if i % 2 else "hello"
        if caption_len is not None:
            cap = cap + " " + "x" * caption_len(i)
        posts.append({"post_id": f"p{i:07d}", "media_path": str(media / "clip.mp4"), "caption": cap,
                      "transcript": "pizza" if i % 3 == 0 else ""})
    return cfg, manifest_rows(cfg, posts)
