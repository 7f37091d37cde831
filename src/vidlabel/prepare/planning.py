"""Planning: the context gate, re-planning of over-long videos, token-balanced shards, plan.csv.

Context gate. A request whose estimated prompt tokens plus ``classify.max_tokens`` exceed
``classify.max_model_len``, or whose visual tokens exceed the server's encoder cache
(``classify.max_num_batched_tokens``: vLLM sizes the cache from it and refuses a bigger video item
with a 400), never reaches the server (vLLM would decode the whole video and then reject it, or
silently cut max_tokens). With ``planning.over_limit: replan`` the post gets its
own transcode: among a ladder of lower frame rates (fps / 2^k), lower pixel bounds
(max_pixels / 2^j, down to min_pixels) and, when ``planning.max_duration_s`` is set, a trim to that
duration, the plan with the *most* visual tokens that still fits is chosen (ties: higher fps,
then more pixels), so as little information as possible is dropped; trimming drops content, so it
is tried only for posts that no fps/pixel plan fits. The server keeps
its global sampling; it simply finds fewer, smaller frames in the transcoded file (vLLM never
samples more frames than a file has). Nothing fits, or ``over_limit: exclude``: reason ``too_long``.

Media the server cannot read. vLLM decodes videos with OpenCV in its API server; what that decodes
was measured on a real vLLM 0.26 (``SERVER_CODECS``): H.264, HEVC and VP9 (8 and 10 bit, yuv420p and
yuv444p, in MP4, QuickTime, Matroska and WebM), while AV1 fails after the request reached the GPU
server. A post whose codec is not measured to decode, or whose file holds fewer frames than the
model samples at least (``tokens.MIN_FILE_FRAMES``), is planned for its own transcode to H.264
(action ``replan``, the reason in ``plan``) whether or not ``planning.transcode.enabled``; if the
transcode fails too, the manifest excludes it (``transcode_error``) before any GPU time. The same
holds for what the decoder chosen with ``planning.decode`` cannot read, or would sample other frames
of than the default decoder (``vidlabel.core.decode.unreadable``: NVDEC and 10-bit or 4:4:4 H.264,
a scanning decoder and variable frame rates, ...).

Shards. Requests go to shards by longest-processing-time greedy on ``est_prompt_tokens``
(largest first, ties by request_id; each to the currently lightest shard, ties by index): the
result depends only on the set of (request_id, cost) pairs, not on row order.

Cost model for ``plan.csv`` (``est_seconds``): one server instance (4 H100, Qwen2.5-VL-72B,
seed 000) sustained about 5,080 prompt+completion tokens/s with a prefill-heavy mix, so
``est_seconds = (est_prompt_tokens + requests * expected_completion_tokens) / 5080`` where
expected completion tokens = min(max_tokens, 8 per question + 16). This is a prior for planning;
the ``estimate`` target measures the real figure on a pilot.

Media paths. The server gets one ``--allowed-local-media-path``: ``allowed_media_path(config)``
returns media_root when no transcoded file can ever be sent (transcoding disabled and
``over_limit: exclude``), else the deepest common parent of media_root and the transcoded media
directory ``transcoded_media_dir(config)`` (= ``{results}/transcoded/media``). Put ``results``
inside or next to the media root; a common parent that is the filesystem root is refused.
"""

from __future__ import annotations

import heapq
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from vidlabel import families
from vidlabel.core.io import write_text
from vidlabel.families.base import file_frames
from vidlabel.prepare import tokens as tk
from vidlabel.core.prompt import render_prompt
from vidlabel.core import decode

SERVER_TOKENS_PER_S = 5080.0  # seed 000: prompt+completion tokens/s per 4-GPU instance
COMPLETION_TOKENS_PER_QUESTION = 8
COMPLETION_TOKENS_BASE = 16
# Without a transcript yet (the transcode step may run before transcription), reserve text tokens
# for speech: fast speech is ~3 words/s at ~1.3 tokens/word.
SPEECH_TOKENS_PER_S = 4.0
# Spare room in the gate: estimates were within 1 % of a real vLLM's prompt tokens (vLLM 0.26,
# Qwen2.5-VL), and a request over a limit by one token is refused after its video was decoded.
# The client still refuses a label whose answer the server cut for lack of room (over_context).
ESTIMATE_MARGIN = 0.02
FPS_LADDER_STEPS = 8  # fps, fps/2, ..., fps/128
PIXEL_LADDER_STEPS = 6


# What vLLM 0.26's video backend (OpenCV with its bundled FFmpeg) decodes, measured on a real server
# (docs/planning.md, "Codecs the server decodes"): codec -> what was checked. A codec not listed
# here has not been measured and is transcoded, which always yields H.264.
SERVER_CODECS = {
    "h264": "measured: 8 and 10 bit, yuv420p and yuv444p; MP4, QuickTime, Matroska; 60 fps, VFR, rotation flag",
    "hevc": "measured: 8 and 10 bit",
    "vp9": "measured: WebM",
}
# Codecs measured to fail on the server, with what happens.
SERVER_FAILS = {
    "av1": ("OpenCV has no software AV1 decoder (\"Your platform doesn't support hardware accelerated AV1 "
            "decoding\"); the request fails with HTTP 500 after reaching the server"),
}
# Decoder names some FFmpeg builds report instead of the codec's own name.
CODEC_ALIASES = {"libdav1d": "av1", "libaom-av1": "av1", "av1_cuvid": "av1", "av1_qsv": "av1",
                 "libvpx-vp9": "vp9", "libvpx": "vp8", "h264_cuvid": "h264", "hevc_cuvid": "hevc"}
TRANSCODE_CODEC = "h264"  # what transcode.transcode_file writes


class MediaPathError(ValueError):
    """media_root and the transcoded media directory have no usable common parent."""


def transcoded_media_dir(config: dict) -> Path:
    """Where transcoded videos are written (absolute)."""
    configured = config["planning"]["transcode"].get("media_dir")
    return Path(configured or Path(config.get("results", "results")) / "transcoded" / "media").resolve()


def transcode_possible(config: dict) -> bool:
    p = config["planning"]
    return bool(p["transcode"]["enabled"]) or p["over_limit"] == "replan"


def allowed_media_path(config: dict) -> str:
    """The one directory the server may read media from (its --allowed-local-media-path)."""
    return allowed_path(config["media_root"], transcoded_media_dir(config) if transcode_possible(config) else None)


def allowed_path(media_root: str | Path, transcoded_dir: str | Path | None) -> str:
    """media_root, or the deepest common parent of it and ``transcoded_dir`` (transcoded files may be sent)."""
    root = Path(media_root).resolve()
    if transcoded_dir is None:
        return str(root)
    common = Path(os.path.commonpath([root, transcoded_dir]))
    if common == Path(common.anchor):
        raise MediaPathError(
            f"media_root {root} and the transcoded media directory {transcoded_dir} share no "
            "parent but the filesystem root; the server may read from one directory only. Set "
            "planning.transcode.media_dir to a directory on media_root's tree (or disable planning.transcode "
            "and set planning.over_limit: exclude)")
    return str(common)


def visual_token_budget(config: dict, text_tokens) -> np.ndarray:
    """Most visual tokens a request may carry: the context left after its text and answer, and the
    server's encoder cache (one video item must fit it whole), less ``ESTIMATE_MARGIN``."""
    c = config["classify"]
    context = c["max_model_len"] - c["max_tokens"] - np.asarray(text_tokens, dtype=np.int64)
    limit = np.minimum(context, c["max_num_batched_tokens"])
    return np.floor(limit / (1 + ESTIMATE_MARGIN)).astype(np.int64)


def limits_text(config: dict) -> str:
    c = config["classify"]
    return (f"max_model_len {c['max_model_len']} (with max_tokens {c['max_tokens']}) and encoder cache "
            f"{c['max_num_batched_tokens']} (max_num_batched_tokens)")


def expected_completion_tokens(config: dict) -> int:
    c = config["classify"]
    return int(min(c["max_tokens"], COMPLETION_TOKENS_BASE + COMPLETION_TOKENS_PER_QUESTION * len(c["questions"])))


def est_seconds(config: dict, prompt_tokens, requests) -> np.ndarray:
    """Documented cost model (module docstring): server seconds for a set of requests."""
    prompt_tokens = np.asarray(prompt_tokens, dtype=np.float64)
    requests = np.asarray(requests, dtype=np.float64)
    return (prompt_tokens + requests * expected_completion_tokens(config)) / SERVER_TOKENS_PER_S


def canonical_codec(name) -> str | None:
    """The codec's own name for a codec or decoder name (``libdav1d`` -> ``av1``); None stays None."""
    if name is None:
        return None
    name = str(name).strip().lower()
    return CODEC_ALIASES.get(name, name) or None


def server_media_problem(family: families.Family, video_codec, duration_s, source_fps) -> np.ndarray:
    """Per post, why the server cannot be sent the original file (None: it can).

    ``video_codec`` None (unknown) is taken as readable: only what was probed is judged.
    """
    d = np.nan_to_num(np.asarray(duration_s, dtype=np.float64), nan=0.0)
    n = len(d)
    frames = file_frames(d, source_fps) if n else np.zeros(0, np.int64)
    known = (np.nan_to_num(np.asarray(source_fps, dtype=np.float64), nan=0.0) > 0) & (d > 0)
    out = np.full(n, None, dtype=object)
    if video_codec is not None:
        # Judged once per distinct codec name, not once per post (a million posts have a handful).
        by_name = {name: _codec_problem(canonical_codec(name)) for name in set(video_codec)}
        out[:] = [by_name[name] for name in video_codec]
    for i in np.flatnonzero(known & (frames < family.min_file_frames)):
        if out[i] is None:
            out[i] = (f"{int(frames[i])} frame(s) in the file; the server's sampler needs at least "
                      f"{family.min_file_frames}")
    return out


def _codec_problem(codec: str | None) -> str | None:
    """Why the server cannot decode ``codec`` (a canonical name; None: unknown, taken as readable)."""
    if codec is None or codec in SERVER_CODECS:
        return None
    return (f"the server cannot decode {codec}: {SERVER_FAILS[codec]}" if codec in SERVER_FAILS else
            f"codec {codec} is not among those measured to decode on the server "
            f"({', '.join(sorted(SERVER_CODECS))})")


def sampler_frames_problem(config: dict, formats: decode.Formats) -> np.ndarray:
    """Per post, why the default decoder would sample another number of frames than the estimate counts
    (None: the same). vLLM's OpenCV path takes a video's length as the header's frame count over its rate
    (``CAP_PROP_FRAME_COUNT / CAP_PROP_FPS``), the estimate the duration the container shows: an MP4 edit
    list that shows less than the header's frames, or a variable frame rate, can make the two sample
    counts differ (measured on vLLM 0.26: one edit-list file served 1.23x its estimate, all others within
    2 %). Such a file is transcoded, after which both count the same frames. Judged only for the default
    decoder (the others' frame counts: ``vidlabel.core.decode.unreadable``) and where the inventory has
    the header's count."""
    n = len(formats.codec)
    out = np.full(n, None, dtype=object)
    if decode.backend(config) != decode.DEFAULT_BACKEND or formats.header_frames is None or formats.duration_s is None:
        return out
    frames, fps, shown = (np.nan_to_num(np.asarray(a, dtype=np.float64), nan=0.0)
                          for a in (formats.header_frames, formats.fps, formats.duration_s))
    known = (frames > 0) & (fps > 0) & (shown > 0)
    header_s = np.divide(frames, fps, out=np.zeros(n), where=known)
    family, s = families.of_config(config), sampling(config)
    by_header = family.sampled_frames(frames, fps, s, header_s)
    by_shown = family.sampled_frames(file_frames(shown, fps), fps, s, shown)
    for i in np.flatnonzero(known & (by_header != by_shown)):
        out[i] = (f"the header's {frames[i]:.0f} frames at {fps[i]:.3f} fps ({header_s[i]:.2f} s) against the "
                  f"{shown[i]:.2f} s the file shows (an edit list or a variable frame rate): the server's decoder "
                  f"would sample {by_header[i]} frames where the estimate counts {by_shown[i]}")
    return out


# ------------------------------------------------------------------ text

def render_prompts(config: dict, captions, transcripts) -> list[str]:
    c = config["classify"]
    template, questions = c["prompt_template"], c["questions"]
    return [render_prompt(template, cap, tr, questions) for cap, tr in zip(captions, transcripts)]


def text_tokens_for(config: dict, captions, transcripts=None, durations=None) -> np.ndarray:
    """Text tokens per post; without transcripts, a speech allowance by duration replaces them."""
    n = len(captions)
    if transcripts is None:
        prompts = render_prompts(config, captions, [None] * n)
        allowance = np.ceil(np.nan_to_num(np.asarray(durations, dtype=np.float64), nan=0.0) * SPEECH_TOKENS_PER_S)
        return tk.estimate_text(config, prompts) + allowance.astype(np.int64)
    return tk.estimate_text(config, render_prompts(config, captions, transcripts))


# ------------------------------------------------------------------ gate and re-plan

@dataclass
class Plan:
    """Per-post arrays. action: 'as-is' | 'replan' (needs its own transcode: over a limit, or media
    the server cannot read) | 'too_long'."""

    action: np.ndarray  # object (str)
    plan: np.ndarray  # object (str): 'as-is', what changed, or the too_long detail
    fps: np.ndarray  # frame rate of the media the server reads (float)
    max_pixels: np.ndarray  # pixel bound the media is scaled to (int)
    duration_s: np.ndarray  # duration the server sees (float)
    visual_tokens: np.ndarray  # int
    text_tokens: np.ndarray  # int

    @property
    def prompt_tokens(self) -> np.ndarray:
        return self.visual_tokens + self.text_tokens

    def to_table(self) -> pa.Table:
        return pa.table({
            "plan_action": pa.array(self.action, pa.string()),
            "plan": pa.array(self.plan, pa.string()),
            "plan_fps": pa.array(self.fps, pa.float64()),
            "plan_max_pixels": pa.array(self.max_pixels, pa.int64()),
            "plan_duration_s": pa.array(self.duration_s, pa.float64()),
            "est_visual_tokens": pa.array(self.visual_tokens, pa.int64()),
            "est_text_tokens": pa.array(self.text_tokens, pa.int64()),
        })


def sampling(config: dict) -> families.Sampling:
    """How the server samples videos under ``config``'s (resolved) planning settings."""
    p = config["planning"]
    return families.Sampling(fps=float(p["fps"]), min_frames=int(p["min_frames"]), max_frames=int(p["max_frames"]),
                             min_pixels=int(p["min_pixels"]), max_pixels=int(p["max_pixels"]))


def image_bounds(config: dict) -> families.ImageBounds:
    """The image pixel bounds under ``config``'s (resolved) planning settings."""
    p = config["planning"]
    return families.ImageBounds(min_pixels=int(p["image_min_pixels"]), max_pixels=int(p["image_max_pixels"]))


def video_estimate(config: dict, duration_s, source_fps, width, height, total_frames=None) -> families.VideoEstimate:
    """Every video's frames, size and prompt tokens as the server will count them (the family's rule)."""
    return families.of_config(config).video_tokens(duration_s, source_fps, width, height, sampling(config),
                                                   total_frames)


def transcode_size(config: dict, duration_s, fps, width, height, max_pixels) -> tuple[np.ndarray, np.ndarray]:
    """The (height, width) a transcode at ``fps`` and the pixel bound ``max_pixels`` (scalar or per video)
    writes: the size the server's processor resizes such frames to, multiples of the family's cell, so
    that the server's own resize leaves them as they are."""
    family, s = families.of_config(config), sampling(config)
    d = np.nan_to_num(np.asarray(duration_s, dtype=np.float64), nan=0.0)
    frames = family.sampled_frames(file_frames(d, fps), fps, s, d)
    return family.frame_size(height, width, frames, s.with_(max_pixels=np.asarray(max_pixels)))


def media_estimate(config: dict, duration_s, fps, width, height, max_pixels=None) -> families.VideoEstimate:
    """Visual tokens of media transcoded to (fps, max_pixels, duration), as the server will see it.

    The transcode scales to ``transcode_size``; the server then resizes that with its own bounds (an
    identity unless the result fell below min_pixels).
    """
    if max_pixels is None:
        return video_estimate(config, duration_s, fps, width, height)
    th, tw = transcode_size(config, duration_s, fps, width, height, max_pixels)
    return video_estimate(config, duration_s, fps, tw, th)


def _fmt(x: float) -> str:
    return f"{x:g}"


def transcode_target(config: dict, fps, max_pixels, width, height, source_fps, duration_s=None):
    """Frame rate and (width, height) a transcode should produce for a plan.

    With ``duration_s`` (of the transcoded file), a clip so short that the planned rate would leave
    fewer than the family's ``min_file_frames`` frames gets a rate that gives at least that many (half a
    frame to spare: ffmpeg's fps filter rounds), even above the source's rate (frames repeat).
    """
    src = np.nan_to_num(np.asarray(source_fps, dtype=np.float64), nan=0.0)
    f = np.asarray(fps, dtype=np.float64)
    out_fps = np.where(src > 0, np.minimum(f, src), f)
    d = np.nan_to_num(np.asarray(duration_s if duration_s is not None else np.zeros(np.shape(out_fps)),
                                 dtype=np.float64), nan=0.0)
    if duration_s is not None:
        wanted = families.of_config(config).min_file_frames + 0.5
        with np.errstate(divide="ignore", invalid="ignore"):
            out_fps = np.where((d > 0) & (out_fps * d < wanted), wanted / d, out_fps)
    th, tw = transcode_size(config, d, out_fps, width, height, max_pixels)
    return out_fps, tw, th


def formats_from_table(table: pa.Table) -> decode.Formats:
    """The decoder-relevant inventory columns of ``table`` (None for a column it lacks)."""
    def column(name):
        if name not in table.column_names:
            return None
        return np.asarray(table.column(name).to_pylist(), dtype=object)

    return decode.Formats(codec=column("video_codec") if "video_codec" in table.column_names
                          else np.full(table.num_rows, None, dtype=object),
                          pix_fmt=column("pix_fmt"), width=column("width"), height=column("height"),
                          rotation=column("rotation"), container=column("container"),
                          header_frames=column("header_frames"), fps=column("fps"), base_fps=column("base_fps"),
                          duration_s=column("duration_s"))


def plan_posts(config: dict, duration_s, source_fps, width, height, text_tokens, video_codec=None,
               formats: decode.Formats | None = None) -> Plan:
    """Gate every post on the context and re-plan (or exclude) those that do not fit; plan a transcode
    for the posts whose original file the server cannot read (``server_media_problem``), or that the
    chosen decoder cannot (``formats``: the inventory's columns, ``formats_from_table``; without them
    only the codec is known, enough for the default decoder). Where the inventory has a file's header
    frame count, the estimate counts from it, as the server's loader does."""
    p = config["planning"]
    family, s = families.of_config(config), sampling(config)
    d = np.nan_to_num(np.asarray(duration_s, dtype=np.float64), nan=0.0)
    sf = np.nan_to_num(np.asarray(source_fps, dtype=np.float64), nan=0.0)
    w = np.asarray(width, dtype=np.float64)
    h = np.asarray(height, dtype=np.float64)
    text = np.asarray(text_tokens, dtype=np.int64)
    n = len(d)
    budget = visual_token_budget(config, text)

    header = None if formats is None or formats.header_frames is None else \
        np.nan_to_num(np.asarray(formats.header_frames, dtype=np.float64), nan=0.0)
    total = file_frames(d, sf) if header is None else np.where(header > 0, header, file_frames(d, sf))
    base = video_estimate(config, d, sf, w, h, total).tokens if n else np.zeros(0, np.int64)
    fits = base <= budget
    action = np.where(fits, "as-is", "too_long").astype(object)
    plan = np.where(fits, "as-is", "").astype(object)
    out_fps = np.where(sf > 0, np.minimum(s.fps, sf), s.fps)
    out_px = np.full(n, s.max_pixels, dtype=np.int64)
    out_d = d.copy()
    visual = base.astype(np.int64).copy()

    over = np.flatnonzero(~fits)
    if len(over) and p["over_limit"] == "replan":
        od, osf, ow, oh, ob = d[over], sf[over], w[over], h[over], budget[over]
        best = np.full(len(over), -1, dtype=np.int64)
        best_cfg = [None] * len(over)
        trims = [None]
        if p.get("max_duration_s"):
            trims.append(float(p["max_duration_s"]))
        pixels = []
        px = s.max_pixels
        for _ in range(PIXEL_LADDER_STEPS):
            if px <= s.min_pixels:
                break
            pixels.append(int(px))
            px //= 2
        pixels.append(int(s.min_pixels))
        for trim in trims:
            # Trimming drops content: a last resort for posts no fps/pixel plan fits.
            eligible = np.ones(len(over), bool) if trim is None else (best < 0) & (od > trim)
            cd = od if trim is None else np.minimum(od, trim)
            for k in range(FPS_LADDER_STEPS):
                f = s.fps / 2 ** k
                cf = np.where(osf > 0, np.minimum(f, osf), f)
                for px in pixels:
                    est = media_estimate(config, cd, cf, ow, oh, np.full(len(over), px))
                    # One frame group of margin: the transcoded file's frame count can round up by one.
                    margin = family.group_tokens(est.height, est.width)
                    ok = eligible & (est.tokens + margin <= ob) & (est.tokens > best)
                    for i in np.flatnonzero(ok):
                        best[i] = est.tokens[i]
                        best_cfg[i] = (float(cf[i]), px, float(cd[i]), trim)
        for j, i in enumerate(over):
            if best_cfg[j] is None:
                continue
            f, px, dur, trim = best_cfg[j]
            changes = []
            if f != out_fps[i]:
                changes.append(f"fps {_fmt(out_fps[i])}->{_fmt(f)}")
            if px != s.max_pixels:
                changes.append(f"max_pixels {s.max_pixels}->{px}")
            if trim is not None:
                changes.append(f"trim {_fmt(d[i])}s->{_fmt(dur)}s")
            action[i] = "replan"
            plan[i] = f"replan: {', '.join(changes)} (visual tokens {int(base[i])}->{int(best[j])})"
            out_fps[i], out_px[i], out_d[i], visual[i] = f, px, dur, best[j]
    problem = server_media_problem(family, video_codec if formats is None else formats.codec, d, sf)
    # The chosen decoder's own limits, on top of the default decoder's (planning.decode).
    if formats is None:
        formats = decode.Formats(codec=np.asarray(video_codec if video_codec is not None else [None] * n,
                                                  dtype=object))
    problem = np.where(problem == None, decode.unreadable(config, formats), problem)  # noqa: E711
    problem = np.where(problem == None, sampler_frames_problem(config, formats), problem)  # noqa: E711
    for i in np.flatnonzero(problem != None):  # noqa: E711 (elementwise)
        if action[i] == "as-is":
            action[i] = "replan"
            plan[i] = f"transcode to {TRANSCODE_CODEC}: {problem[i]}"
        elif action[i] == "replan":
            plan[i] = f"{plan[i]}; {TRANSCODE_CODEC} because {problem[i]}"
    for i in np.flatnonzero(action == "too_long"):
        plan[i] = (f"estimated {int(base[i])} visual + {int(text[i])} text tokens exceed the limits: "
                   f"{limits_text(config)}"
                   + ("" if p["over_limit"] == "exclude" else "; no lower fps/pixel bound/trim fits"))
    return Plan(action=action, plan=plan, fps=out_fps, max_pixels=out_px, duration_s=out_d,
                visual_tokens=visual, text_tokens=text)


# ------------------------------------------------------------------ shards

def balance_shards(costs, keys, n_shards: int) -> np.ndarray:
    """Longest-processing-time greedy: shard index per item, deterministic for a given input."""
    costs = np.asarray(costs, dtype=np.int64)
    keys = np.asarray(keys, dtype=object).astype(str)
    n = len(costs)
    shards = np.zeros(n, dtype=np.int64)
    if n == 0:
        return shards
    order = np.lexsort((keys, -costs))  # cost descending, then request_id ascending
    if n_shards == 1:
        return shards
    heap = [(0, s) for s in range(n_shards)]
    sorted_costs = costs[order].tolist()
    out = [0] * n
    replace = heapq.heapreplace
    for pos, cost in enumerate(sorted_costs):
        load, s = heap[0]
        out[pos] = s
        replace(heap, (load + cost, s))
    shards[order] = out
    return shards


def plan_table(config: dict, shard, prompt_tokens, n_shards: int) -> pa.Table:
    """Per-shard requests, estimated prompt tokens and seconds (every shard listed, even empty)."""
    shard = np.asarray(shard, dtype=np.int64)
    tokens = np.bincount(shard, weights=np.asarray(prompt_tokens, dtype=np.float64), minlength=n_shards)
    reqs = np.bincount(shard, minlength=n_shards)
    secs = est_seconds(config, tokens, reqs)
    return pa.table({"shard": np.arange(n_shards), "requests": reqs.astype(np.int64),
                     "est_prompt_tokens": tokens.astype(np.int64), "est_seconds": np.round(secs, 1)})


def write_plan_csv(table: pa.Table, path) -> None:
    lines = [",".join(table.column_names)]
    cols = [table.column(c).to_pylist() for c in table.column_names]
    lines += [",".join(str(v) for v in row) for row in zip(*cols)]
    write_text("\n".join(lines) + "\n", path)


def imbalance(loads) -> float:
    """max/mean of per-shard loads (1.0 = perfect)."""
    loads = np.asarray(loads, dtype=np.float64)
    return float(loads.max() / loads.mean()) if len(loads) and loads.mean() > 0 else math.nan
