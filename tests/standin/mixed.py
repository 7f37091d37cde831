"""Manifest shards of posts of several media items, in the manifest's contract (docs/outputs.md), made
from real media files: for the classify stage's tests and benchmarks, and for the GPU check while no
manifest of the prepare stage writes items.

Each post is a caption, an optional transcript per item and an ordered list of files. Every file is
probed for real (``vidlabel.prepare.item_probe.probe_item``: Pillow for stills, PyAV for the rest), its
tokens are estimated by the plan's rule (``post_plan.item_tokens``: images within the image bounds,
videos by the model family's rule, two vision markers each), labelled (``post_prompt.item_labels``)
and typed (``post_plan.post_type``). The prompt is the config's template with the caption and the
transcripts, each under its item's label. The text estimate counts the labels and the prompt, with
the chat template's overhead less the one pair of vision markers it holds (each item counts its own).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow as pa

from vidlabel.core.io import write_parquet
from vidlabel.prepare import post_plan
from vidlabel.prepare import tokens as tk
from vidlabel.prepare.item_probe import probe_item
from vidlabel.prepare.post_prompt import item_labels
from vidlabel.core.prompt import render_prompt, request_id

ITEM_TYPE = pa.struct([("index", pa.int64()), ("kind", pa.string()), ("path", pa.string()),
                       ("media_path", pa.string()), ("label", pa.string()), ("est_tokens", pa.int64()),
                       ("transcript_id", pa.string())])
SCHEMA = pa.schema([
    ("request_id", pa.string()), ("post_id", pa.string()), ("items", pa.list_(ITEM_TYPE)), ("prompt", pa.string()),
    ("post_type", pa.string()), ("n_videos", pa.int64()), ("n_images", pa.int64()), ("n_audio", pa.int64()),
    ("est_video_tokens", pa.int64()), ("est_image_tokens", pa.int64()), ("est_text_tokens", pa.int64()),
    ("est_prompt_tokens", pa.int64()), ("plan", pa.string()), ("items_dropped", pa.string()),
    ("caption", pa.string()), ("transcript_status", pa.string()),
])
LIMITS_FILE = "media_limits.json"  # what tests write for server_media_limits where a test needs one


def _transcript_id(path: str, text: str) -> str:
    return hashlib.sha256(f"{path}\0{text}".encode()).hexdigest()[:16]


def post_row(config: dict, post_id: str, files: list[str | Path], caption: str = "",
             transcripts: dict[int, str] | None = None) -> dict:
    """The manifest row of a post of ``files`` (in order); ``transcripts`` by item position."""
    transcripts = transcripts or {}
    infos = [probe_item(str(f)) for f in files]
    bad = [(i, info["probe_error"]) for i, info in enumerate(infos) if info.get("probe_error")]
    if bad:
        raise ValueError(f"post {post_id}: items {bad} cannot be probed")
    kinds = [info["kind"] for info in infos]
    tokens, embeds = post_plan.item_tokens(config, kinds, [i.get("width") or 0 for i in infos],
                                      [i.get("height") or 0 for i in infos], [i.get("duration_s") or 0 for i in infos],
                                      [i.get("fps") or 0 for i in infos])
    labels = item_labels(kinds)
    items = [{"index": j, "kind": kind, "path": str(Path(f).resolve()),
              "media_path": None if kind == "audio" else str(Path(f).resolve()), "label": label,
              "est_tokens": int(t), "est_embeds": int(e), "part": None,
              "transcript_id": _transcript_id(str(f), transcripts[j]) if j in transcripts else None}
             for j, (f, kind, label, t, e) in enumerate(zip(files, kinds, labels, tokens, embeds))]
    spoken = "\n".join(f"{labels[j]}: {text}" for j, text in sorted(transcripts.items()))
    c = config["classify"]
    prompt = render_prompt(c["prompt_template"], caption, spoken, c["questions"])
    text_parts = [f"{i['label']}:" for i in items if i["media_path"]] + [prompt]
    sent = sum(1 for i in items if i["media_path"])
    text = int(tk.estimate_text(config, ["".join(text_parts)])[0])
    by_kind = {k: sum(i["est_tokens"] for i in items if i["kind"] == k) for k in post_plan.KINDS}
    return {"request_id": request_id(post_id, c["prompt_template"], c["questions"]), "post_id": post_id,
            "items": items, "prompt": prompt, "post_type": post_plan.post_type(kinds),
            "n_videos": kinds.count("video"), "n_images": kinds.count("image"), "n_audio": kinds.count("audio"),
            "est_video_tokens": by_kind["video"], "est_image_tokens": by_kind["image"], "est_text_tokens": text,
            "est_prompt_tokens": by_kind["video"] + by_kind["image"] + text, "plan": "as-is", "items_dropped": None,
            "caption": caption, "transcript_status": "ok" if transcripts else "no_audio"}


def write_shard(path: str | Path, rows: list[dict]) -> Path:
    cols = {f.name: [r.get(f.name) for r in rows] for f in SCHEMA}
    write_parquet(pa.table(cols, schema=SCHEMA), path)
    return Path(path)


def write_limits(manifest_dir: str | Path, rows: list[dict]) -> dict:
    """The data set's limits as server_media_limits gives them (the most items per kind, the largest
    item), written beside the shards for a manifest reader that looks for them."""
    limits = {"image": max(r["n_images"] for r in rows), "video": max(r["n_videos"] for r in rows),
              "audio": max(r["n_audio"] for r in rows),
              "largest_item_tokens": max(i["est_tokens"] for r in rows for i in r["items"])}
    (Path(manifest_dir) / LIMITS_FILE).write_text(json.dumps(limits))
    return limits
