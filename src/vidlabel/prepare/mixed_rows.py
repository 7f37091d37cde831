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

from vidlabel import families
from vidlabel.prepare import item_targets, planning, post_plan
from vidlabel.prepare.inventory_schema import SOUND_KINDS
from vidlabel.prepare.item_targets import MixedPost, item_key

ITEM_TYPE = pa.struct([("index", pa.int64()), ("kind", pa.string()), ("path", pa.string()),
                       ("media_path", pa.string()), ("label", pa.string()), ("est_tokens", pa.int64()),
                       ("transcript_id", pa.string()), ("part", pa.string()), ("est_embeds", pa.int64())])


@dataclass
class Rows:
    """The kept posts' rows and the excluded posts' (post_id, video_path, reason, detail)."""

    kept: list[dict[str, Any]] = field(default_factory=list)
    excluded: list[tuple[str, str | None, str, str]] = field(default_factory=list)


def _sent_tokens(config: dict, item: dict, transcoded: dict | None,
                 planned: post_plan.ItemPlan) -> tuple[int, int]:
    """The item's (prompt tokens, markers included; encoder-cache tokens) as the server will count the file
    it reads."""
    if transcoded is None:
        return int(planned.tokens), int(planned.embeds)
    family = families.of_config(config)
    if item["kind"] == "image":
        embeds = int(family.image_embeds([transcoded["width"]], [transcoded["height"]],
                                         planning.image_bounds(config))[0])
        return embeds + family.item_markers, embeds
    if item["kind"] == "audio":
        samples = [transcoded["samples"]]
        return int(family.audio_tokens(samples)[0]), int(family.audio_embeds(samples)[0])
    est = planning.video_estimate(config, [transcoded["duration_s"]], [transcoded["fps"]], [transcoded["width"]],
                                  [transcoded["height"]], [transcoded.get("frames") or 0] if transcoded.get("frames")
                                  else None)
    return int(est.tokens[0]), int(est.embeds[0])


def _first_video(items: list[dict], key: str) -> str | None:
    return next((i[key] for i in items if i["kind"] == "video"), None)


def post_rows(config: dict, posts: list[MixedPost], transcripts: dict[tuple[str, int], dict] | None,
              transcoded: dict[tuple[str, int, str], dict], dropped: dict[str, str | None],
              exclude_unavailable: bool) -> Rows:
    """Plan and match every post of ``posts`` (module docstring). ``transcripts``: the transcribe stage's rows
    by (post_id, item_index), None for a plan without transcripts (the model hears the audio);
    ``transcoded``: the transcode stage's rows by ``item_targets.item_key``; ``dropped``: the inventory's
    items_dropped by post_id."""
    out = Rows()
    problems = item_targets.video_problems(config, posts)
    cache = int(config["classify"]["max_num_batched_tokens"])
    heard = post_plan.hears_audio(config)
    for post in posts:
        spoken, status = item_targets.spoken_text(post, transcripts)
        if transcripts is None and heard and "audio" in (i["kind"] for i in post.items):
            status = "heard"  # no transcript: the model hears the audio
        prompt, text_tokens = item_targets.prompt_and_text_tokens(config, post, spoken)
        first_path = _first_video(post.items, "path") or post.items[0]["path"]
        if status == "unavailable" and exclude_unavailable:
            missing = []
            for item in post.items:
                row = transcripts.get((post.post_id, item["index"])) or {}
                if item["kind"] in SOUND_KINDS and not item.get("part") and \
                        row.get("status") not in item_targets.KNOWN_TRANSCRIPT:
                    why = row.get("error") or "no transcript in the transcript chunks"
                    missing.append(f"item {item['index']}: {why}")
            out.excluded.append((post.post_id, first_path, "transcript_error", "; ".join(missing)))
            continue
        plan = item_targets.plan(config, post, text_tokens)
        if plan.action == "too_long":
            out.excluded.append((post.post_id, first_path, "too_long", plan.plan))
            continue
        needed = {(w.index, w.part): w for w in item_targets.work(config, post, plan, problems)}
        items, notes, refusal = [], [], None
        for item, label, planned in zip(post.items, post.labels, plan.items):
            key = item_key(post.post_id, item)
            tc = transcoded.get(key)
            ok = tc if tc is not None and tc["status"] == "ok" else None
            work = needed.get(key[1:])
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
            transcript = {} if item.get("part") or transcripts is None else \
                transcripts.get((post.post_id, item["index"])) or {}
            sent = item["kind"] != "audio" or heard
            tokens, embeds = _sent_tokens(config, item, ok, planned) if sent else (0, 0)
            items.append({"index": int(item["index"]), "kind": item["kind"], "path": item["path"],
                          "media_path": media_path, "label": label, "est_tokens": tokens,
                          "transcript_id": transcript.get("transcript_id"), "part": item.get("part"),
                          "est_embeds": embeds})
        if refusal is not None:
            out.excluded.append((post.post_id, first_path, *refusal))
            continue
        by_kind = {k: sum(i["est_tokens"] for i in items if i["kind"] == k) for k in post_plan.KINDS}
        visual = sum(by_kind.values())
        largest = max((i["est_embeds"] for i in items if i["media_path"]), default=0)
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
            "est_audio_tokens": by_kind["audio"], "items_dropped": dropped.get(post.post_id),
        })
    return out


def limits(rows: list[dict], one_video_largest: int, one_video_posts: int) -> dict[str, int]:
    """What the server must accept for the kept posts (``post_plan.write_media_limits``): the most items of
    each kind one request sends (audio only where it is sent: heard by the model), and the largest item."""
    counts = {kind: max([sum(1 for i in r["items"] if i["kind"] == kind and i["media_path"]) for r in rows],
                        default=0) for kind in post_plan.KINDS}
    if one_video_posts:
        counts["video"] = max(counts["video"], 1)
    largest = max([one_video_largest, *(i["est_tokens"] for r in rows for i in r["items"])], default=0)
    return {**counts, "largest_item_tokens": int(largest)}
