"""The manifest rows of posts of several media items (photos, slideshows, carousels, several clips).

Each post (``vidlabel.prepare.item_targets.MixedPost``) is planned with its real transcripts
(``item_targets.plan``), then every item is matched with the file the server reads: the transcode
stage's file where it wrote one (its real size, frame rate and duration give the item's tokens), else
the original, unless the plan needs a file the transcode stage did not write (``too_long``: "run the
transcode rule") or failed to write (``transcode_error``). The post is checked once more against the
context and the encoder cache with the items as they will be sent. A post whose transcript is missing
is excluded (``transcript_error``) unless ``transcribe.on_error: classify_without``.

A row holds the manifest's columns (docs/outputs.md); its ``items`` (``ITEM_TYPE``) are what the
classify stage sends, in order, each with its label.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from vidlabel.prepare import item_targets, planning, post_plan
from vidlabel.prepare import tokens as tk
from vidlabel.prepare.inventory_schema import SOUND_KINDS
from vidlabel.prepare.item_targets import MixedPost

ITEM_TYPE = pa.struct([("index", pa.int64()), ("kind", pa.string()), ("path", pa.string()),
                       ("media_path", pa.string()), ("label", pa.string()), ("est_tokens", pa.int64()),
                       ("transcript_id", pa.string())])


@dataclass
class Rows:
    """The kept posts' rows and the excluded posts' (post_id, video_path, reason, detail)."""

    kept: list[dict[str, Any]] = field(default_factory=list)
    excluded: list[tuple[str, str | None, str, str]] = field(default_factory=list)


def _sent_tokens(config: dict, item: dict, transcoded: dict | None, planned: post_plan.ItemPlan) -> int:
    """The item's prompt tokens (markers included) as the server will count the file it reads."""
    if transcoded is None:
        return int(planned.tokens)
    if item["kind"] == "image":
        bounds = tk.ImageBounds.from_config(config)
        return int(tk.image_tokens([transcoded["width"]], [transcoded["height"]], bounds)[0])
    est = tk.estimate_visual(config, [transcoded["duration_s"]], [transcoded["fps"]], [transcoded["width"]],
                             [transcoded["height"]])
    return int(est.tokens[0]) + tk.IMAGE_MARKER_TOKENS


def _first_video(items: list[dict], key: str) -> str | None:
    return next((i[key] for i in items if i["kind"] == "video"), None)


def post_rows(config: dict, posts: list[MixedPost], transcripts: dict[tuple[str, int], dict],
              transcoded: dict[tuple[str, int], dict], dropped: dict[str, str | None],
              exclude_unavailable: bool) -> Rows:
    """Plan and match every post of ``posts`` (module docstring). ``transcripts`` and ``transcoded``: the
    stages' rows by (post_id, item_index); ``dropped``: the inventory's items_dropped by post_id."""
    out = Rows()
    problems = item_targets.video_problems(config, posts)
    cache = int(config["classify"]["max_num_batched_tokens"])
    for post in posts:
        spoken, status = item_targets.spoken_text(post, transcripts)
        prompt, text_tokens = item_targets.prompt_and_text_tokens(config, post, spoken)
        first_path = _first_video(post.items, "path") or post.items[0]["path"]
        if status == "unavailable" and exclude_unavailable:
            missing = []
            for item in post.items:
                row = transcripts.get((post.post_id, item["index"])) or {}
                if item["kind"] in SOUND_KINDS and row.get("status") not in item_targets.KNOWN_TRANSCRIPT:
                    why = row.get("error") or "no transcript in the transcript chunks"
                    missing.append(f"item {item['index']}: {why}")
            out.excluded.append((post.post_id, first_path, "transcript_error", "; ".join(missing)))
            continue
        plan = item_targets.plan(config, post, text_tokens)
        if plan.action == "too_long":
            out.excluded.append((post.post_id, first_path, "too_long", plan.plan))
            continue
        needed = {w.index: w for w in item_targets.work(config, post, plan, problems)}
        items, notes, refusal = [], [], None
        for item, label, planned in zip(post.items, post.labels, plan.items):
            tc = transcoded.get((post.post_id, item["index"]))
            ok = tc if tc is not None and tc["status"] == "ok" else None
            work = needed.get(item["index"])
            if ok is None and work is not None and work.required:
                refusal = (("transcode_error", f"item {item['index']}: {work.why}; transcode failed: {tc['error']}")
                           if tc is not None else
                           ("too_long", f"item {item['index']} needs a new file ({work.why}) but the transcode stage "
                                        "has none: run the transcode rule"))
                break
            if work is not None and ok is None:
                notes.append(f"item {item['index']} as-is (transcode failed: {str(tc['error'])[:200]})"
                             if tc is not None else f"item {item['index']} as-is")
            media_path = ok["media_path"] if ok else (None if item["kind"] == "audio" else item["path"])
            transcript = transcripts.get((post.post_id, item["index"])) or {}
            items.append({"index": int(item["index"]), "kind": item["kind"], "path": item["path"],
                          "media_path": media_path, "label": label,
                          "est_tokens": _sent_tokens(config, item, ok, planned) if item["kind"] != "audio" else 0,
                          "transcript_id": transcript.get("transcript_id")})
        if refusal is not None:
            out.excluded.append((post.post_id, first_path, *refusal))
            continue
        by_kind = {k: sum(i["est_tokens"] for i in items if i["kind"] == k) for k in post_plan.KINDS}
        visual = by_kind["video"] + by_kind["image"]
        largest = max((i["est_tokens"] - tk.IMAGE_MARKER_TOKENS for i in items if i["media_path"]), default=0)
        if visual > post_plan.visual_budget(config, text_tokens) or largest > cache:
            out.excluded.append((post.post_id, first_path, "too_long",
                                 f"the items as sent are estimated at {visual} visual + {text_tokens} text tokens "
                                 f"(largest item {largest}), over the limits: {planning.limits_text(config)} "
                                 f"({plan.plan})"))
            continue
        kinds = post.kinds
        out.kept.append({
            "post_id": post.post_id, "video_path": _first_video(items, "path"),
            "media_path": _first_video(items, "media_path"), "caption": post.caption, "transcript": spoken,
            "transcript_status": status, "transcript_id": None, "prompt": prompt,
            "est_visual_tokens": visual, "est_text_tokens": text_tokens, "est_prompt_tokens": visual + text_tokens,
            "plan": "; ".join([plan.plan, *notes]), "items": items, "post_type": post_plan.post_type(kinds),
            "n_videos": kinds.count("video"), "n_images": kinds.count("image"), "n_audio": kinds.count("audio"),
            "est_video_tokens": by_kind["video"], "est_image_tokens": by_kind["image"],
            "items_dropped": dropped.get(post.post_id),
        })
    return out


def limits(rows: list[dict], one_video_largest: int, one_video_posts: int) -> dict[str, int]:
    """What the server must accept for the kept posts (``post_plan.write_media_limits``)."""
    columns = {"image": "n_images", "video": "n_videos", "audio": "n_audio"}
    counts = {kind: max([r[column] for r in rows], default=0) for kind, column in columns.items()}
    if one_video_posts:
        counts["video"] = max(counts["video"], 1)
    largest = max([one_video_largest, *(i["est_tokens"] for r in rows for i in r["items"])], default=0)
    return {**counts, "largest_item_tokens": int(largest)}
