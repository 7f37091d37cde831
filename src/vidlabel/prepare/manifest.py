"""Manifest: one request per post, with token estimates, the context gate and token-balanced shards.

Inputs: the inventory, the transcript chunks, the (optional) transcode chunks. Outputs (atomic):
``manifest/shard-{i}.parquet``, ``manifest/excluded.parquet``, ``manifest/plan.csv`` (per shard),
``manifest/post_plans.csv`` (every post re-planned or excluded as too long, with the reason) and
``manifest/media_limits.json`` (what the data need of the server: ``post_plan.write_media_limits``);
docs/outputs.md. A post is excluded for a probe error (no usable item: ``probe_error``), a context
overflow that re-planning cannot fix or that has no transcoded media (``too_long``), a failed
transcode of a re-planned item (``transcode_error``), or a transcript that is missing (its
transcription failed for good, or no chunk has it: ``transcript_error``). With ``transcribe.on_error:
classify_without`` such a post is classified with a prompt that says its transcript is unavailable,
never "(no speech)", and its ``transcript_status`` says so; without any transcript chunk (a run
without transcription) every post is. A failed transcode of a post that fits as-is falls back to the
original file.

A post that is one video alone (the usable items: ``vidlabel.prepare.item_targets.split_posts``) is
planned here, vectorised over pyarrow/numpy (the only per-row Python is prompt rendering and the
request-id hash); every other post by ``vidlabel.prepare.mixed_rows``. Every row has ``items``, what
the classify stage sends in order: a one-video post's one video, unlabelled, as it was always sent.

One manifest per plan (vidlabel.core.models.plans: a model family and how it takes the audio), built
under the plan's config. A plan whose model hears the audio (``classify.audio: native``) has no
transcripts: a video with sound is a post of two items (the video, then its sound, a WAV the transcode
stage writes), planned with the posts of several items, and a post's ``transcript_status`` is ``heard``.
"""

from __future__ import annotations

import logging
import re
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from vidlabel import families
from vidlabel.core.io import write_parquet, write_text
from vidlabel.prepare import item_targets, mixed_rows, planning, post_plan
from vidlabel.prepare.inventory_schema import items_table
from vidlabel.prepare.prompt_batch import prompt_text_tokens, render_prompts, request_ids

log = logging.getLogger(__name__)

SHARD_SCHEMA = pa.schema([
    ("request_id", pa.string()),
    ("post_id", pa.string()),
    ("video_path", pa.string()),
    ("media_path", pa.string()),
    ("caption", pa.string()),
    ("transcript", pa.string()),
    # ok | no_audio | unavailable (the prompt says so), and what the transcript was made from.
    ("transcript_status", pa.string()),
    ("transcript_id", pa.string()),
    ("prompt", pa.string()),
    ("est_visual_tokens", pa.int64()),
    ("est_text_tokens", pa.int64()),
    ("est_prompt_tokens", pa.int64()),
    ("plan", pa.string()),
    # What the classify stage sends, in order (mixed_rows.ITEM_TYPE), and the post's shape.
    ("items", pa.list_(mixed_rows.ITEM_TYPE)),
    ("post_type", pa.string()),
    ("n_videos", pa.int64()),
    ("n_images", pa.int64()),
    ("n_audio", pa.int64()),
    ("est_video_tokens", pa.int64()),
    ("est_image_tokens", pa.int64()),
    ("est_audio_tokens", pa.int64()),
    ("items_dropped", pa.string()),
])
POST_PLANS_COLUMNS = ("post_id", "post_type", "status", "plan")
EXCLUDED_SCHEMA = pa.schema([
    ("post_id", pa.string()),
    ("video_path", pa.string()),
    ("reason", pa.string()),
    ("detail", pa.string()),
])


def _read_many(paths, columns) -> pa.Table | None:
    tables = []
    for path in paths or []:
        names = pq.read_schema(path).names
        tables.append(pq.read_table(path, columns=[c for c in columns if c in names]))
    if not tables:
        return None
    return pa.concat_tables(tables, promote_options="default")


def _item_keys(post_id: pa.Array, index: pa.Array | None, part: pa.Array | None = None) -> pa.Array:
    """One key per (post_id, item_index, part) (a table written before items: index 0; before parts: "")."""
    index = pa.array(np.zeros(len(post_id), np.int64)) if index is None else pc.fill_null(index.cast(pa.int64()), 0)
    part = pa.array([""] * len(post_id), pa.string()) if part is None else pc.fill_null(part.cast(pa.string()), "")
    return pc.binary_join_element_wise(post_id.cast(pa.string()), index.cast(pa.string()), part, "\x1f")


def _keyed(table: pa.Table | None) -> pa.Table | None:
    """A transcript or transcode table with its item key (``_item_keys``)."""
    if table is None:
        return None
    index = table.column("item_index").combine_chunks() if "item_index" in table.column_names else None
    part = table.column("part").combine_chunks() if "part" in table.column_names else None
    return table.append_column("item_key", _item_keys(table.column("post_id").combine_chunks(), index, part))


def _by_item(table: pa.Table | None, post_ids: list[str], parts: bool = False) -> dict[tuple, dict]:
    """The rows of ``post_ids`` by (post_id, item_index) (``parts``: by (post_id, item_index, part)), the last
    row of each winning."""
    if table is None or not post_ids:
        return {}
    mine = table.filter(pc.is_in(table.column("post_id"), value_set=pa.array(post_ids, pa.string())))
    if parts:
        return {(r["post_id"], int(r.get("item_index") or 0), r.get("part") or ""): r for r in mine.to_pylist()}
    return {(r["post_id"], int(r.get("item_index") or 0)): r for r in mine.to_pylist()}


def _rows_of(keys: pa.Array, table: pa.Table | None) -> pa.Array:
    """For each item key, the row of ``table`` that holds it (the last row per key wins, so a later chunk
    overrides an earlier one), null when absent. Found once per table: every column looked up takes it."""
    if table is None or table.num_rows == 0:
        return pa.nulls(len(keys), pa.int64())
    ids = table.column("item_key").combine_chunks()
    rev = pa.array(np.arange(len(ids))[::-1])
    ids_rev = ids.take(rev)
    uniq_ids = ids_rev.unique()
    uniq_idx = pc.index_in(uniq_ids, value_set=ids_rev)  # first in reversed order = last row
    return rev.take(uniq_idx).take(pc.index_in(keys, value_set=uniq_ids))


def _lookup(rows: pa.Array, table: pa.Table | None, column: str, dtype) -> pa.Array:
    """Value of ``column`` at each of ``rows`` (``_rows_of``), null where absent."""
    if table is None or table.num_rows == 0 or column not in table.column_names:
        return pa.nulls(len(rows), dtype)
    return table.column(column).combine_chunks().take(rows).cast(dtype)


def _excluded_table(post_id, video_path, reason, detail) -> pa.Table:
    return pa.table({"post_id": pa.array(post_id, pa.string()), "video_path": pa.array(video_path, pa.string()),
                     "reason": pa.array(reason, pa.string()), "detail": pa.array(detail, pa.string())},
                    schema=EXCLUDED_SCHEMA)


def build(config: dict, inventory_path, transcript_paths, transcode_paths, shard_paths, excluded_path,
          plan_path) -> None:
    started = time.monotonic()
    c = config["classify"]
    template, questions = c["prompt_template"], c["questions"]
    n_shards = len(shard_paths)
    if n_shards < 1:
        raise ValueError("manifest.build needs at least one shard path")

    inv = pq.read_table(inventory_path)
    probe_error = inv.column("probe_error").combine_chunks() if "probe_error" in inv.column_names \
        else pa.nulls(inv.num_rows, pa.string())
    bad = pc.is_valid(probe_error)
    excluded = [_excluded_table(inv.column("post_id").filter(bad), inv.column("video_path").filter(bad),
                                ["probe_error"] * int(pc.sum(bad).as_py() or 0), probe_error.filter(bad))]
    items = items_table(inv.filter(pc.invert(bad)))
    heard = post_plan.hears_audio(config)
    one_video, mixed = item_targets.split_posts(items, heard)
    ok = items.take(pa.array(one_video, pa.int64()))  # the posts of one video alone, one item row each
    post_id = ok.column("post_id").combine_chunks().cast(pa.string())
    item_index = ok.column("index").combine_chunks()
    keys = _item_keys(post_id, item_index)
    video_path = ok.column("path").combine_chunks().cast(pa.string())
    caption = ok.column("caption").combine_chunks().cast(pa.string())
    num = {k: np.nan_to_num(ok.column(k).combine_chunks().cast(pa.float64()).to_numpy(zero_copy_only=False),
                            nan=0.0) for k in ("duration_s", "fps", "width", "height")}
    dropped: dict[str, str] = {}
    if "items_dropped" in inv.column_names:
        some = inv.select(["post_id", "items_dropped"]).filter(pc.is_valid(inv.column("items_dropped")))
        dropped = dict(zip(some.column("post_id").to_pylist(), some.column("items_dropped").to_pylist()))

    # Transcripts: ok -> the text; no_audio -> none; error or missing -> unavailable (module docstring). A plan
    # whose model hears the audio has none: its one-video posts are the videos without sound.
    tr = _keyed(_read_many(transcript_paths, ["post_id", "item_index", "text", "status", "error", "transcript_id"]))
    tr_rows = _rows_of(keys, tr)
    tr_status = _lookup(tr_rows, tr, "status", pa.string())
    if heard and not transcript_paths:
        tr_status = pa.array(["no_audio"] * len(keys), pa.string())
    transcript = pc.fill_null(pc.if_else(pc.equal(pc.fill_null(tr_status, ""), "ok"),
                                         _lookup(tr_rows, tr, "text", pa.string()), pa.scalar(None, pa.string())), "")
    status = np.asarray(pc.fill_null(tr_status, "").to_pylist(), dtype=object)
    unavailable = ~np.isin(status, ["ok", "no_audio"])
    transcript_status = np.where(unavailable, "unavailable", status).astype(object)
    available = pa.array(~unavailable)
    transcript_id = _lookup(tr_rows, tr, "transcript_id", pa.string())
    exclude_unavailable = bool(transcript_paths) and transcript_on_error(config) == "exclude"
    tr_error = np.asarray(_lookup(tr_rows, tr, "error", pa.string()).to_pylist(), dtype=object)

    text_tokens = prompt_text_tokens(config, caption, transcript, available)

    # The codec and format decide whether the server's decoder reads the file as it is
    # (planning.SERVER_CODECS, vidlabel.core.decode.unreadable).
    plan = planning.plan_posts(config, num["duration_s"], num["fps"], num["width"], num["height"], text_tokens,
                               formats=planning.formats_from_table(ok))
    action = plan.action
    unread = Counter(re.sub(r"(?:(?<![A-Za-z\d.])|(?<=\dx))\d+(?:\.\d+)?", "N", str(p))  # not h264's or vp9's digits
                     for p in plan.plan if str(p).startswith("transcode to"))
    for why, count in unread.most_common():
        log.info("manifest: %d post(s) planned for the transcode: %s", count, why)
    plan_str = plan.plan.copy()
    visual = plan.visual_tokens.copy()

    # Transcoded media, where present, is what the server reads: estimate on its real properties.
    tc = _keyed(_read_many(transcode_paths, ["post_id", "item_index", "part", "media_path", "status", "error", "fps",
                                             "width", "height", "duration_s", "frames", "samples", "plan"]))
    tc_rows = _rows_of(keys, tc)
    tc_status = np.asarray(_lookup(tc_rows, tc, "status", pa.string()).to_pylist(), dtype=object)
    has_tc = tc_status == "ok"
    tc_failed = tc_status == "error"
    reason = np.full(len(post_id), None, dtype=object)
    detail = np.full(len(post_id), None, dtype=object)
    if has_tc.any():
        idx = np.flatnonzero(has_tc)
        tcv = {k: np.nan_to_num(_lookup(tc_rows, tc, k, pa.float64()).to_numpy(zero_copy_only=False)[idx], nan=0.0)
               for k in ("duration_s", "fps", "width", "height", "frames")}
        est = planning.video_estimate(config, tcv["duration_s"], tcv["fps"], tcv["width"], tcv["height"],
                                      np.where(tcv["frames"] > 0, tcv["frames"], np.round(tcv["duration_s"] * tcv["fps"])))
        visual[idx] = est.tokens
        tc_plan = np.asarray(_lookup(tc_rows, tc, "plan", pa.string()).to_pylist(), dtype=object)[idx]
        plan_str[idx] = np.where(tc_plan == None, plan_str[idx], tc_plan)  # noqa: E711 (elementwise)
        over = visual[idx] > planning.visual_token_budget(config, text_tokens[idx])
        for j in idx[over]:
            reason[j] = "too_long"
            detail[j] = (f"transcoded media still estimated at {int(visual[j])} visual + {int(text_tokens[j])} "
                         f"text tokens, over the limits: {planning.limits_text(config)} ({plan_str[j]})")
    replan_missing = (action == "replan") & ~has_tc
    tc_error = np.asarray(_lookup(tc_rows, tc, "error", pa.string()).to_pylist(), dtype=object)
    for j in np.flatnonzero(replan_missing & tc_failed):
        reason[j], detail[j] = "transcode_error", f"{plan.plan[j]}; transcode failed: {tc_error[j]}"
    for j in np.flatnonzero(replan_missing & ~tc_failed):
        reason[j] = "too_long"
        detail[j] = f"needs re-planning ({plan.plan[j]}) but has no transcoded media: run the transcode rule"
    for j in np.flatnonzero(action == "too_long"):
        if not has_tc[j]:
            reason[j], detail[j] = "too_long", plan.plan[j]
    for j in np.flatnonzero((action == "as-is") & tc_failed):
        plan_str[j] = f"as-is (transcode failed, original media: {str(tc_error[j])[:200]})"
    if exclude_unavailable:
        # A missing transcript is the post's reason before any other, as for posts of several items
        # (vidlabel.prepare.mixed_rows): its length was planned with a text it does not have.
        for j in np.flatnonzero(unavailable):
            reason[j] = "transcript_error"
            detail[j] = (tr_error[j] if status[j] == "error" else
                         "no transcript for this post in the transcript chunks (transcribe did not cover it)")

    out_mask = reason != None  # noqa: E711 (elementwise)
    if out_mask.any():
        m = pa.array(out_mask)
        excluded.append(_excluded_table(post_id.filter(m), video_path.filter(m), reason[out_mask].tolist(),
                                        detail[out_mask].tolist()))
    keep = np.flatnonzero(~out_mask)
    # The server reads the transcoded file where one exists, else the original.
    media_path = pc.if_else(pa.array(has_tc), _lookup(tc_rows, tc, "media_path", pa.string()), video_path)

    # Posts of several items (vidlabel.prepare.mixed_rows), after the posts of one video.
    mixed_ids = [p.post_id for p in mixed]
    many = mixed_rows.post_rows(config, mixed, None if heard and not transcript_paths else _by_item(tr, mixed_ids),
                                _by_item(tc, mixed_ids, parts=True), dropped, exclude_unavailable)
    if many.excluded:
        excluded.append(_excluded_table(*map(list, zip(*many.excluded))))
    n_one = len(keep)
    kept_ids = post_id.take(pa.array(keep)).to_pylist() + [r["post_id"] for r in many.kept]
    ids = np.asarray(request_ids(kept_ids, template, questions), dtype=object)
    visual_kept = np.concatenate([visual[keep], [r["est_visual_tokens"] for r in many.kept]]).astype(np.int64)
    text_kept = np.concatenate([text_tokens[keep], [r["est_text_tokens"] for r in many.kept]]).astype(np.int64)
    plan_kept = np.concatenate([plan_str[keep], np.asarray([r["plan"] for r in many.kept], dtype=object)])
    prompt_tokens = visual_kept + text_kept
    shard = planning.balance_shards(prompt_tokens, ids, n_shards)

    # Within a shard the heaviest requests go first (shortens the tail of the job), ties by request_id.
    order = np.lexsort((ids.astype(str), -prompt_tokens, shard))
    bounds = np.searchsorted(shard[order], np.arange(n_shards + 1))
    one = {"post_id": post_id, "video_path": video_path, "media_path": media_path, "caption": caption,
           "transcript": transcript, "transcript_id": transcript_id, "item_index": item_index}
    status_kept = transcript_status[keep]
    for i, path in enumerate(shard_paths):
        sel = order[bounds[i]:bounds[i + 1]]  # positions among kept posts, one-video posts first
        write_parquet(_shard_table(config, sel, n_one, keep, one, available, status_kept, many.kept, ids, visual_kept,
                                   text_kept, plan_kept, dropped), path)
    excluded_table = pa.concat_tables(excluded)
    write_parquet(excluded_table, excluded_path)
    planning.write_plan_csv(planning.plan_table(config, shard, prompt_tokens, n_shards), plan_path)
    _write_post_plans(Path(plan_path).with_name("post_plans.csv"), plan_kept, kept_ids, n_one, many.kept,
                      excluded_table, inv)
    one_largest = int(visual[keep].max()) if n_one else 0
    post_plan.write_media_limits(mixed_rows.limits(many.kept, one_largest, n_one), Path(plan_path).parent)
    elapsed = time.monotonic() - started
    reasons = Counter(excluded_table.column("reason").to_pylist())
    types = Counter(["video"] * n_one + [r["post_type"] for r in many.kept])
    log.info("manifest: %d posts -> %d requests in %d shards (%.0f est. prompt tokens each on average; by post type "
             "%s), %d excluded %s, in %.2f s (%.0f posts/s)", inv.num_rows, len(ids), n_shards,
             float(prompt_tokens.mean()) if len(ids) else 0.0, dict(types), excluded_table.num_rows, dict(reasons),
             elapsed, inv.num_rows / max(elapsed, 1e-9))


def _shard_table(config, sel, n_one, keep, one, available, status_kept, many, ids, visual, text, plans,
                 dropped) -> pa.Table:
    """One shard's rows: the one-video posts among ``sel`` (vectorised) and the posts of several items,
    in ``sel``'s order."""
    c = config["classify"]
    first = sel[sel < n_one]  # positions among the kept one-video posts
    rows = pa.array(keep[first], pa.int64())  # positions among the one-video posts
    caps, trs, avail = one["caption"].take(rows), one["transcript"].take(rows), available.take(rows)
    # Prompts are rendered per shard so the whole set's prompts are never in memory at once.
    prompts = render_prompts(c["prompt_template"], caps, trs, c["questions"], avail)
    n = len(first)
    single = pa.StructArray.from_arrays(
        [one["item_index"].take(rows).cast(pa.int64()), pa.array(["video"] * n, pa.string()),
         one["video_path"].take(rows), one["media_path"].take(rows), pa.nulls(n, pa.string()),
         pa.array(visual[first], pa.int64()), one["transcript_id"].take(rows), pa.nulls(n, pa.string()),
         pa.array(visual[first] - families.of_config(config).item_markers, pa.int64())],
        fields=list(mixed_rows.ITEM_TYPE))
    post_ids = one["post_id"].take(rows)
    columns = {
        "post_id": post_ids, "video_path": one["video_path"].take(rows), "media_path": one["media_path"].take(rows),
        "caption": caps, "transcript": trs, "transcript_status": pa.array(status_kept[first].tolist(), pa.string()),
        "transcript_id": one["transcript_id"].take(rows), "prompt": prompts,
        "items": pa.ListArray.from_arrays(pa.array(np.arange(n + 1), pa.int32()), single),
        "post_type": pa.array(["video"] * n, pa.string()), "n_videos": pa.array(np.ones(n, np.int64)),
        "n_images": pa.array(np.zeros(n, np.int64)), "n_audio": pa.array(np.zeros(n, np.int64)),
        "est_video_tokens": pa.array(visual[first], pa.int64()), "est_image_tokens": pa.array(np.zeros(n, np.int64)),
        "est_audio_tokens": pa.array(np.zeros(n, np.int64)),
        "items_dropped": pa.array([dropped.get(p) for p in post_ids.to_pylist()] if dropped else [None] * n,
                                  pa.string()),
    }
    table = pa.table({name: columns[name] for name in columns})
    others = [many[j - n_one] for j in sel[sel >= n_one]]
    if others:
        fields = [f for f in SHARD_SCHEMA if f.name in columns]
        table = pa.concat_tables([table.cast(pa.schema(fields)), pa.Table.from_pylist(
            [{f.name: r[f.name] for f in fields} for r in others], schema=pa.schema(fields))])
        # Back into sel's order: the one-video rows came first, the others after them.
        position = np.concatenate([np.flatnonzero(sel < n_one), np.flatnonzero(sel >= n_one)])
        table = table.take(pa.array(np.argsort(position, kind="stable")))
    extra = {"request_id": pa.array(ids[sel].tolist(), pa.string()), "est_visual_tokens": pa.array(visual[sel]),
             "est_text_tokens": pa.array(text[sel]), "est_prompt_tokens": pa.array(visual[sel] + text[sel]),
             "plan": pa.array(plans[sel].tolist(), pa.string())}
    return pa.table({f.name: (extra[f.name] if f.name in extra else table.column(f.name)).cast(f.type)
                     for f in SHARD_SCHEMA}, schema=SHARD_SCHEMA)


def _write_post_plans(path: Path, plans, kept_ids, n_one, many, excluded: pa.Table, inv: pa.Table) -> None:
    """``post_plans.csv``: every post re-planned (kept) or excluded as too long, with the reason."""
    types = dict(zip(inv.column("post_id").to_pylist(), inv.column("post_type").to_pylist())) \
        if "post_type" in inv.column_names else {}
    rows = [(pid, types.get(pid, "video"), "kept", p) for pid, p in zip(kept_ids, plans.tolist())
            if p != "as-is" and not str(p).startswith("as-is (")]
    for pid, why, text in zip(*(excluded.column(c).to_pylist() for c in ("post_id", "reason", "detail"))):
        if why in ("too_long", "transcode_error"):
            rows.append((pid, types.get(pid, "video"), f"excluded: {why}", text))
    table = pa.table(dict(zip(POST_PLANS_COLUMNS, map(list, zip(*rows)))) if rows else
                     {name: pa.array([], pa.string()) for name in POST_PLANS_COLUMNS})
    buffer = pa.BufferOutputStream()
    pacsv.write_csv(table, buffer)
    write_text(buffer.getvalue().to_pybytes().decode(), path)


def describe(manifest_dir: str | Path) -> str:
    """The manifest by post type, in words: requests, items and estimated tokens per kind, exclusions."""
    manifest_dir = Path(manifest_dir)
    shards = pa.concat_tables([pq.read_table(p, columns=["post_type", "n_videos", "n_images", "n_audio",
                                                         "est_video_tokens", "est_image_tokens", "est_audio_tokens",
                                                         "est_text_tokens"])
                               for p in sorted(manifest_dir.glob("shard-*.parquet"))])
    lines = [f"{'post type':<10} {'requests':>8} {'videos':>6} {'photos':>6} {'audio':>5} "
             f"{'video tok':>9} {'image tok':>9} {'audio tok':>9} {'text tok':>8}"]
    by_type: dict[str, list] = {}
    for row in shards.to_pylist():
        by_type.setdefault(row["post_type"], []).append(row)
    for kind, rows in sorted(by_type.items()):
        total = {k: sum(r[k] for r in rows) for k in rows[0] if k != "post_type"}
        lines.append(f"{kind:<10} {len(rows):>8} {total['n_videos']:>6} {total['n_images']:>6} {total['n_audio']:>5} "
                     f"{total['est_video_tokens']:>9} {total['est_image_tokens']:>9} {total['est_audio_tokens']:>9} "
                     f"{total['est_text_tokens']:>8}")
    excluded = Counter(pq.read_table(manifest_dir / "excluded.parquet").column("reason").to_pylist())
    lines.append("excluded: " + (", ".join(f"{n} {why}" for why, n in sorted(excluded.items())) or "none"))
    return "\n".join(lines)


def transcript_on_error(config: dict) -> str:
    """What becomes of a post whose transcript is missing (transcribe.on_error)."""
    return config["transcribe"]["on_error"]
