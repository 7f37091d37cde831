"""Pre-transcode: re-encode videos to the frame rate and pixel bound the model will sample.

The server (vLLM) decodes every frame of a video up to the last sampled one in its API process;
a 60 s 1080p clip costs seconds of CPU per request. Re-encoding once, in parallel CPU jobs away
from the server, to the planned fps and a 28-multiple size within max_pixels (audio dropped,
faststart) leaves the server a few dozen small frames.

One chunk job handles the posts with ``stable_chunk(post_id, planning.transcode.chunks) == chunk``
and no probe error. Which posts: all of them with ``planning.transcode.enabled``; otherwise only the
posts the planner re-plans: those over a limit (their new fps/pixel bound/trim exists only in a
transcoded file) and those whose original the server cannot read (a codec it does not decode, too
few frames), so the rule can always run. A clip too short for the planned rate is written with
enough frames for the model (``planning.transcode_target``); a file with fewer is an error record.
Each post is planned by ``vidlabel.prepare.planning.plan_posts``; without transcripts (the rule may run
before transcription) a speech allowance by duration stands in for the transcript's tokens.

Resume: every finished post (ok or error) is appended to the journal ``<output>.jsonl`` (key
``post_id``); a rerun skips posts whose journal record has the same transcode key (source file,
size, modification time, target fps/size/trim, crf) and, for ``ok``, whose file still exists.
Files are named ``<post_id-ish>-<key>.mp4`` in ``media_dir``, written to a temporary name and
renamed, so a half-written file is never taken for a finished one.
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
from vidlabel.prepare import planning
from vidlabel.prepare import tokens as tk
from vidlabel.prepare.sharding import stable_chunk

log = logging.getLogger(__name__)

SCHEMA = pa.schema([
    ("post_id", pa.string()),
    ("media_path", pa.string()),
    ("status", pa.string()),
    ("error", pa.string()),
    ("fps", pa.float64()),
    ("width", pa.int64()),
    ("height", pa.int64()),
    ("duration_s", pa.float64()),
    ("frames", pa.int64()),
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


def _key(src: str, fps: float, width: int, height: int, duration_s: float | None, crf: int) -> str:
    item = identity.media_item(src)  # the source by path, size and modification time
    ident = [item.get("size"), item.get("mtime_ns")]
    payload = json.dumps([src, ident, round(fps, 6), width, height,
                          None if duration_s is None else round(duration_s, 3), crf, "fastdecode"])
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def chunk_posts(config: dict, inventory: pa.Table, chunk: int) -> pa.Table:
    """Posts of this transcode chunk that have no probe error."""
    n_chunks = config["planning"]["transcode"]["chunks"]
    ids = inventory.column("post_id").to_pylist()
    errs = inventory.column("probe_error").is_null().to_numpy(zero_copy_only=False)
    mask = np.fromiter((stable_chunk(pid, n_chunks) == chunk for pid in ids), bool, len(ids)) & errs
    return inventory.filter(pa.array(mask))


def read_transcripts(paths) -> dict[str, str]:
    out: dict[str, str] = {}
    for path in paths or []:
        t = pq.read_table(path, columns=["post_id", "text"])
        out.update(zip(t.column("post_id").to_pylist(), t.column("text").to_pylist()))
    return out


def run_chunk(config: dict, inventory_path, chunk: int, output_path, media_dir,
              transcript_paths=None) -> pa.Table:
    """Transcode one chunk; write ``output_path`` (parquet, see docs/outputs.md) and return it.

    ``transcript_paths`` (optional): transcript chunk files; when given, the plan uses the real
    transcript tokens instead of the speech allowance.
    """
    p = config["planning"]
    enabled = bool(p["transcode"]["enabled"])
    crf = int(p["transcode"]["crf"])
    media_dir = Path(media_dir).resolve()
    media_dir.mkdir(parents=True, exist_ok=True)
    posts = chunk_posts(config, pq.read_table(inventory_path), chunk)
    n = posts.num_rows
    cols = {c: posts.column(c).to_pylist() for c in
            ("post_id", "video_path", "caption", "duration_s", "fps", "width", "height")}
    if transcript_paths is not None:
        texts = read_transcripts(transcript_paths)
        text_tokens = planning.text_tokens_for(config, cols["caption"], [texts.get(x) for x in cols["post_id"]])
    else:
        text_tokens = planning.text_tokens_for(config, cols["caption"], None, cols["duration_s"])
    plan = planning.plan_posts(config, cols["duration_s"], _nan(cols["fps"]), cols["width"], cols["height"],
                               text_tokens, formats=planning.formats_from_table(posts))
    out_fps, out_w, out_h = planning.transcode_target(config, plan.fps, plan.max_pixels,
                                                      np.asarray(cols["width"], float),
                                                      np.asarray(cols["height"], float), _nan(cols["fps"]),
                                                      plan.duration_s)
    wanted = [i for i in range(n)
              if plan.action[i] == "replan" or (enabled and plan.action[i] == "as-is")]
    rows = []
    t0 = time.monotonic()
    with Journal(journal_beside(output_path), key="post_id") as journal:
        done = journal.read()
        for count, i in enumerate(wanted, 1):
            pid, src = cols["post_id"][i], cols["video_path"][i]
            trim = float(plan.duration_s[i]) if plan.duration_s[i] < (cols["duration_s"][i] or 0) else None
            fps, w, h = float(out_fps[i]), int(out_w[i]), int(out_h[i])
            key = _key(src, fps, w, h, trim, crf)
            prev = done.get(pid)
            if prev and prev.get("key") == key and (
                    prev["status"] == "error" or (prev.get("media_path") and os.path.exists(prev["media_path"]))):
                rows.append(prev)
                continue
            dst = media_dir / f"{_safe_name(pid)}-{key}.mp4"
            rec = {"post_id": pid, "media_path": None, "status": "ok", "error": None, "fps": None,
                   "width": None, "height": None, "duration_s": None, "frames": None,
                   "plan_action": plan.action[i], "plan": plan.plan[i], "key": key}
            try:
                transcode_file(src, dst, fps, w, h, trim, crf)
                rec.update(probe_output(dst))
                if rec["frames"] < tk.MIN_FILE_FRAMES:
                    dst.unlink()
                    raise RuntimeError(f"the transcoded file has {rec['frames']} frame(s); the server's sampler "
                                       f"needs at least {tk.MIN_FILE_FRAMES}")
                rec["media_path"] = str(dst)
            except Exception as exc:  # a per-item record, never a crash
                rec.update(status="error", error=f"{type(exc).__name__}: {exc}" if not isinstance(
                    exc, RuntimeError) else str(exc))
            journal.append(rec)
            rows.append(rec)
            log.info("transcode chunk %d: %d/%d (%.1fs) %s %s", chunk, count, len(wanted),
                     time.monotonic() - t0, pid, rec["status"])
    table = pa.Table.from_pylist([{f.name: r.get(f.name) for f in SCHEMA} for r in rows], schema=SCHEMA)
    write_parquet(table, output_path)
    elapsed = time.monotonic() - t0
    log.info("transcode chunk %d: %d of %d posts transcoded (%d failed) in %.1f s (%.2f posts/s)", chunk,
             sum(r["status"] == "ok" for r in rows), n, sum(r["status"] == "error" for r in rows), elapsed,
             len(rows) / max(elapsed, 1e-9))
    return table


def _nan(values) -> np.ndarray:
    return np.asarray([np.nan if v is None else v for v in values], dtype=np.float64)
