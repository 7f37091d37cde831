"""Pre-transcode: re-encode videos to the frame rate and pixel bound the model will sample, and convert
the images the server would misread.

The server (vLLM) decodes every frame of a video up to the last sampled one in its API process;
a 60 s 1080p clip costs seconds of CPU per request. Re-encoding once, in parallel CPU jobs away
from the server, to the planned fps and the size the family's processor would resize to (audio dropped,
faststart) leaves the server a few dozen small frames.

One chunk job handles the posts with ``stable_chunk(post_id, planning.transcode.chunks) == chunk``,
item by item (``vidlabel.prepare.inventory.items_table``; items with a probe error are left out).
Which items: a post that is one video alone is planned by ``vidlabel.prepare.planning.plan_posts``,
and its video is transcoded with ``planning.transcode.enabled``, or where it is re-planned (over a
limit: its new fps/pixel bound/trim exists only in a transcoded file) or its original cannot be read
by the server (a codec it does not decode, too few frames), so the rule can always run. A clip too
short for the planned rate is written with enough frames for the model
(``planning.transcode_target``); a file with fewer is an error record. Every other post (photos,
slideshows, carousels) is planned by ``vidlabel.prepare.item_targets``, which says for each item
whether it is transcoded, re-encoded from its animation frames or converted to JPEG. The rule plans
with the transcripts, as the manifest does, so that both make the same plan; called without them (a
benchmark, a test) a speech allowance by duration stands in for the transcripts' tokens.

Resume: every finished item (ok or error) is appended to the journal ``<output>.jsonl`` under its
transcode key (source file, size, modification time, the target: fps, size, trim, crf, kind of
output); a rerun redoes an item only when its key is new or, for ``ok``, its file is gone, and an item
two posts share is written once. Files are named ``<post_id-ish>-<key>.mp4`` (``.jpg`` for images) in
``media_dir``, written to a temporary name and renamed, so a half-written file is never taken for a
finished one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from pathlib import Path

import av
import ffmpeg
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from vidlabel.core import identity
from vidlabel.core.io import atomic_path, write_parquet
from vidlabel.core.journal import Journal, journal_beside
from vidlabel import families
from vidlabel.prepare import audio, images, item_targets, planning, post_plan
from vidlabel.prepare.inventory_schema import items_table
from vidlabel.prepare.item_targets import ItemWork
from vidlabel.prepare.sharding import stable_chunk

log = logging.getLogger(__name__)

SCHEMA = pa.schema([
    ("post_id", pa.string()),
    ("item_index", pa.int32()),  # the item's place in its post (0 for a one-video post)
    ("part", pa.string()),  # "" for the item itself, item_targets.SOUND_PART for a video's sound
    ("media_path", pa.string()),
    ("status", pa.string()),
    ("error", pa.string()),
    ("fps", pa.float64()),
    ("width", pa.int64()),
    ("height", pa.int64()),
    ("duration_s", pa.float64()),
    ("frames", pa.int64()),
    ("samples", pa.int64()),  # audio heard by the model: samples of the WAV
    ("plan_action", pa.string()),
    ("plan", pa.string()),
    ("key", pa.string()),
])

_STDERR_TAIL = 2000


def probe_output(path: str | Path) -> dict:
    """fps (frames / duration, what the server will count), size, duration and frame count."""
    with av.open(str(path)) as container:
        vs = container.streams.video[0]
        frames = vs.frames or sum(1 for _ in container.demux(vs) if _.size)
        if container.duration:
            duration = container.duration / av.time_base
        else:
            duration = float(vs.duration * vs.time_base)
        width, height = vs.codec_context.width, vs.codec_context.height
    fps = frames / duration if duration > 0 else float("nan")
    return {"fps": fps, "width": int(width), "height": int(height), "duration_s": float(duration),
            "frames": int(frames)}


def transcode_file(src: str, dst: str | Path, fps: float, width: int, height: int,
                   duration_s: float | None = None, crf: int = 23, tune: str | None = "fastdecode") -> None:
    """ffmpeg: ``-an``, fps, scale (area), libx264 veryfast, +faststart; atomic rename into place.

    ``tune=fastdecode`` (no CABAC, no deblocking filter) halves the server's decode CPU for ~10 %
    more bytes: the file is written once and decoded by the server on every attempt.

    Raises ``RuntimeError`` with ffmpeg's stderr on failure.
    """
    dst = Path(dst)
    in_kwargs = {"t": f"{duration_s:.3f}"} if duration_s else {}
    with atomic_path(dst) as tmp:
        stream = (ffmpeg.input(src, **in_kwargs).video
                  .filter("fps", fps=f"{fps:.6g}")
                  .filter("scale", int(width), int(height), flags="area"))
        extra = {"tune": tune} if tune else {}
        out = ffmpeg.output(stream, str(tmp), format="mp4", an=None, vcodec="libx264", preset="veryfast",
                            crf=int(crf), pix_fmt="yuv420p", movflags="+faststart", **extra)
        try:
            out.overwrite_output().global_args("-nostdin", "-v", "error").run(capture_stdout=True,
                                                                               capture_stderr=True)
        except ffmpeg.Error as exc:  # str(exc) says only "see stderr"
            msg = (exc.stderr or b"").decode("utf-8", "replace").strip()[-_STDERR_TAIL:]
            raise RuntimeError(f"ffmpeg failed: {msg or 'no message'}") from None
        if os.path.getsize(tmp) == 0:
            raise RuntimeError("ffmpeg wrote an empty file")


def _safe_name(post_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", str(post_id))[:80] or "post"


def _key(work: ItemWork, crf: int) -> str:
    """The item's transcode key: its source by path, size and modification time, and its target."""
    item = identity.media_item(work.path)
    ident = [item.get("size"), item.get("mtime_ns")]
    if work.action == "convert":
        target = ["jpeg", images.JPEG_QUALITY, work.width, work.height]
    elif work.action == "audio":
        target = ["wav", work.sample_rate]
    else:
        target = [round(work.fps, 6), work.width, work.height, None if work.trim_s is None else round(work.trim_s, 3),
                  crf, "fastdecode" if work.action == "transcode" else "animation"]
    return hashlib.sha256(json.dumps([work.path, ident, *target]).encode()).hexdigest()[:16]


def chunk_items(config: dict, inventory: pa.Table, chunk: int) -> pa.Table:
    """The usable media items of this transcode chunk's posts, one row each."""
    n_chunks = config["planning"]["transcode"]["chunks"]
    items = items_table(inventory)
    ids = items.column("post_id").to_pylist()
    usable = items.column("probe_error").is_null().to_numpy(zero_copy_only=False)
    mask = np.fromiter((stable_chunk(pid, n_chunks) == chunk for pid in ids), bool, len(ids)) & usable
    return items.filter(pa.array(mask))


def read_transcripts(paths) -> dict[tuple[str, int], dict]:
    """Transcript rows by (post_id, item_index) (a chunk written before items: index 0)."""
    out: dict[tuple[str, int], dict] = {}
    for path in paths or []:
        names = pq.read_schema(path).names
        t = pq.read_table(path, columns=[c for c in ("post_id", "item_index", "text", "status") if c in names])
        for row in t.to_pylist():
            out[(row["post_id"], int(row.get("item_index") or 0))] = row
    return out


def one_video_work(config: dict, videos: pa.Table, texts: dict | None) -> list[ItemWork]:
    """The transcodes of the posts that are one video alone (module docstring)."""
    n = videos.num_rows
    if n == 0:
        return []
    cols = {c: videos.column(c).to_pylist() for c in
            ("post_id", "index", "path", "caption", "duration_s", "fps", "width", "height")}
    if texts is not None or post_plan.hears_audio(config):  # heard: a video alone has no sound, no transcript
        spoken = [(texts or {}).get((pid, idx), {}).get("text") for pid, idx in zip(cols["post_id"], cols["index"])]
        text_tokens = planning.text_tokens_for(config, cols["caption"], spoken)
    else:
        text_tokens = planning.text_tokens_for(config, cols["caption"], None, cols["duration_s"])
    plan = planning.plan_posts(config, cols["duration_s"], _nan(cols["fps"]), cols["width"], cols["height"],
                               text_tokens, formats=planning.formats_from_table(videos))
    out_fps, out_w, out_h = planning.transcode_target(config, plan.fps, plan.max_pixels,
                                                      np.asarray(cols["width"], float),
                                                      np.asarray(cols["height"], float), _nan(cols["fps"]),
                                                      plan.duration_s)
    enabled = bool(config["planning"]["transcode"]["enabled"])
    codecs = videos.column("video_codec").to_pylist()
    work = []
    for i in range(n):
        if not (plan.action[i] == "replan" or (enabled and plan.action[i] == "as-is")):
            continue
        trim = float(plan.duration_s[i]) if plan.duration_s[i] < (cols["duration_s"][i] or 0) else None
        animated = (codecs[i] or "").lower() in item_targets.ANIMATION_CODECS
        work.append(ItemWork(cols["post_id"][i], int(cols["index"][i]), "video", cols["path"][i],
                             "animation" if animated else "transcode", plan.plan[i], float(out_fps[i]),
                             int(out_w[i]), int(out_h[i]), trim, plan.action[i]))
    return work


def mixed_work(config: dict, posts: list[item_targets.MixedPost], texts: dict | None) -> list[ItemWork]:
    """The conversions and transcodes of the posts of several items (``vidlabel.prepare.item_targets``)."""
    problems = item_targets.video_problems(config, posts)
    work = []
    for post in posts:
        spoken, _ = item_targets.spoken_text(post, texts)
        # before transcription, speech stands in for the transcripts; a model that hears the audio has none
        allowance = item_targets.sound_seconds(post) if texts is None and not post_plan.hears_audio(config) else 0.0
        _, text_tokens = item_targets.prompt_and_text_tokens(config, post, spoken, allowance)
        work.extend(item_targets.work(config, post, item_targets.plan(config, post, text_tokens), problems))
    return work


def make_item(work: ItemWork, dst: Path, crf: int) -> dict:
    """Write one item's file at ``dst``; its properties (fps, width, height, duration_s, frames; samples)."""
    if work.action == "audio":
        return audio.to_wav(work.path, dst, work.sample_rate)
    if work.action == "convert":
        size = (work.width, work.height) if work.width else None
        return {**images.convert_image(work.path, dst, size), "fps": None, "duration_s": None, "frames": 1}
    if work.action == "animation":
        return images.convert_animation(work.path, dst, work.fps, (work.width, work.height), crf)
    transcode_file(work.path, dst, work.fps, work.width, work.height, work.trim_s, crf)
    return probe_output(dst)


def run_chunk(config: dict, inventory_path, chunk: int, output_path, media_dir,
              transcript_paths=None) -> pa.Table:
    """Transcode and convert one chunk's items; write ``output_path`` (parquet, see docs/outputs.md) and
    return it. ``transcript_paths`` (optional): transcript chunk files; when given, the plan uses the
    real transcript tokens instead of the speech allowance.
    """
    crf = int(config["planning"]["transcode"]["crf"])
    media_dir = Path(media_dir).resolve()
    media_dir.mkdir(parents=True, exist_ok=True)
    items = chunk_items(config, pq.read_table(inventory_path), chunk)
    heard = post_plan.hears_audio(config)
    one_video, mixed = item_targets.split_posts(items, heard)
    # A plan whose model hears the audio has no transcripts (its rule takes none).
    texts = None if transcript_paths is None or (heard and not transcript_paths) else read_transcripts(transcript_paths)
    wanted = one_video_work(config, items.take(pa.array(one_video, pa.int64())), texts) + mixed_work(config, mixed,
                                                                                                       texts)
    rows = []
    t0 = time.monotonic()
    with Journal(journal_beside(output_path), key="key") as journal:
        done = journal.read()
        for count, work in enumerate(wanted, 1):
            key = _key(work, crf)
            prev = done.get(key)
            if prev and (prev["status"] == "error" or (prev.get("media_path") and os.path.exists(prev["media_path"]))):
                rows.append({**prev, "post_id": work.post_id, "item_index": work.index, "part": work.part,
                             "plan_action": work.plan_action, "plan": work.why})
                continue
            suffix = {"convert": ".jpg", "audio": ".wav"}.get(work.action, ".mp4")
            dst = media_dir / f"{_safe_name(work.post_id)}-{key}{suffix}"
            rec = {"post_id": work.post_id, "item_index": work.index, "part": work.part, "media_path": None,
                   "status": "ok", "error": None, "fps": None, "width": None, "height": None, "duration_s": None,
                   "frames": None, "samples": None, "plan_action": work.plan_action, "plan": work.why, "key": key}
            try:
                rec.update(make_item(work, dst, crf))
                least = families.of_config(config).min_file_frames
                if work.kind == "video" and rec["frames"] < least:
                    dst.unlink()
                    raise RuntimeError(f"the transcoded file has {rec['frames']} frame(s); the server's sampler "
                                       f"needs at least {least}")
                rec["media_path"] = str(dst)
            except Exception as exc:  # a per-item record, never a crash
                rec.update(status="error", error=f"{type(exc).__name__}: {exc}" if not isinstance(
                    exc, RuntimeError) else str(exc))
            journal.append(rec)
            done[key] = rec
            rows.append(rec)
            log.info("transcode chunk %d: %d/%d (%.1fs) %s item %d (%s) %s", chunk, count, len(wanted),
                     time.monotonic() - t0, work.post_id, work.index, work.action, rec["status"])
    table = pa.Table.from_pylist([{f.name: r.get(f.name) for f in SCHEMA} for r in rows], schema=SCHEMA)
    write_parquet(table, output_path)
    elapsed = time.monotonic() - t0
    log.info("transcode chunk %d: %d of %d items written (%d failed; %d posts of one video, %d of several items) "
             "in %.1f s (%.2f items/s)", chunk, sum(r["status"] == "ok" for r in rows), items.num_rows,
             sum(r["status"] == "error" for r in rows), len(one_video), len(mixed), elapsed,
             len(rows) / max(elapsed, 1e-9))
    return table


def _nan(values) -> np.ndarray:
    return np.asarray([np.nan if v is None else v for v in values], dtype=np.float64)
