"""The classify stage on a real GPU with a real vLLM, exactly as the workflow runs it, measured.

Runs on any machine with a GPU and ``vllm`` on PATH (``--standin`` puts the test stand-in there
instead, to try the script without a GPU). Steps:

``media``    makes a set in WORKDIR (media/, posts.csv, transcripts.parquet, media.json):
             ``--kind camera`` (default): ``--sources`` distinct videos like phone uploads: portrait-heavy
             720p/1080p with some landscape and 4K, log-uniform 5-45 s, 30 fps, H.264 High profile with
             B-frames and CABAC at 1-4 Mb/s (VBV-capped), sensor-like temporal noise over moving content,
             AAC speech by espeak-ng (pink noise where espeak-ng is missing). ``--kind testsrc2``: the
             former set (ffmpeg's testsrc2 pattern, x264 ultrafast crf 30, 5-60 s, no audio), cheap to
             decode. ``--kind none``: no such set (with ``--formats`` only). ``--formats`` adds one post
             per format users download (HEVC 8/10 bit, VP9 WebM, AV1, .mov, .mkv, 60 fps, variable
             frame rate, a rotation flag, odd and panoramic sizes, yuv444, 10-bit H.264, 4K portrait,
             0.5 s / 0.25 s / one-frame clips, no audio, MPEG-4 Part 2 in AVI, an edit-list cut, a
             359-frame 1080x1920 clip that vLLM's float32 indices sample one frame more; a format file already in
             media/ is kept, so a set made elsewhere can be copied in first). ``--posts`` posts use
             the sources (several posts may share a file: the default server flags turn vLLM's prefix
             and multimodal caches off, so every request is decoded, processed and prefilled in full),
             with captions, synthetic transcripts (~2.5 words per second of video) and a few broken
             files (empty, text, cut before and after the MP4 index, missing). Prints, per set, the CPU
             seconds a vLLM-style OpenCV decode spends per second of video next to the visual tokens.
             ``--photo-posts N --carousels M`` add mixed posts (benchmarks/mixed_posts.py): photo posts
             of 1 to 35 camera-like JPEG and WebP photos at phone sizes (some stored sideways with an
             EXIF orientation tag; half with a soundtrack: slideshows) and carousels of 2 to 10 images
             and clips of the set, in posts.csv's ``media`` column (a JSON array) and mixed.json.
``prepare``  per media mode (``--modes raw,transcoded``): inventory, transcode (its CPU seconds
             measured) and manifest with vidlabel's stage functions and the default config, and the
             decode cost of the media the server will read; no GPU needed. Mixed posts go through the
             same stages (the per-post gate, the photos converted or written smaller by the transcode
             stage). The shard's rows are grouped by post type, so that each type runs a phase of its
             own (gpu_steady.py reports each type's steady state).
``run``      per variant, ``vidlabel.serve.classify.run_shard`` with the configured server command, which
             starts, uses and stops its own server (``prepare`` runs first where needed). Variants are
             dash-joined words: ``default``, ``transcoded``, ``apiN`` (API servers), ``concN`` (client
             concurrency per copy), ``seqsN`` (classify.max_num_seqs: the engine's running cap), ``adapt`` / ``adaptN`` (classify.adaptive_concurrency on, as by default; ceiling N), ``fixed`` (off: the KV-fitted count alone),
             ``tpN`` / ``dpN`` (tensor or data parallel instead of ``auto``),
             ``dpvllm`` (copies served by vLLM's --data-parallel-size), ``eager`` (--enforce-eager),
             ``kvfp8`` (--kv-cache-dtype fp8: FP8 attention and twice the KV cache),
             ``mbtN`` (--max-num-batched-tokens N), ``lpN`` (classify.top_logprobs N; lp0: none), ``decgpu`` /
             ``dectorchcodec`` / ``deccpu`` (planning.decode), ``fp8`` (classify.quantization); ``@anything`` at the end only names the run
             (``default-@72b-4gpu``). A rerun of the same workdir resumes unfinished variants from
             their journals and skips finished ones.
``estimate`` ``vidlabel.serve.pilot.run`` (the pilot and projection of ``snakemake estimate``) on the
             prepared manifest of ``--mode``, printed next to the measured job of ``--compare``.

``prepare``, ``run`` and ``estimate`` take ``--posts`` (a posts CSV/Parquet table or a directory of
videos) and ``--media-root`` to measure on your own data instead of the generated set (with
``--transcripts`` optionally, else every transcript is empty).

Printed per variant: requests by status and error kind; estimated / served prompt tokens (min,
median, max of the ratio); prompt and output tok/s, req/s and p50 latency over the request phase
(first start to last finish); server start time (launch to ready); the most requests the engine
ran at once (from vLLM's log); GPU busy (mean nvidia-smi utilisation, and the share of 1 s samples
under 5 %); the media's decode CPU seconds per second of video; the transcode's CPU seconds.

Example (one H200, 16 cores, Qwen2.5-VL-7B; extra server flags such as --load-format dummy come
from ``--server-args`` or the ``vllm`` on PATH, never from this script):
    python benchmarks/gpu_classify.py media --workdir /tmp/bench --sources 80 --posts 240 --formats
    python benchmarks/gpu_classify.py prepare --workdir /tmp/bench
    python benchmarks/gpu_classify.py run --workdir /tmp/bench --variants default,transcoded
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import faulthandler
import json
import logging
import math
import multiprocessing
import os
import random
import re
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import mixed_posts  # noqa: E402

TESTSRC2_SIZES = [(720, 1280), (1280, 720), (1080, 1920), (1920, 1080)]
# (width, height), share of the camera-like set: portrait-heavy, as phones upload.
CAMERA_SIZES = [((720, 1280), 0.40), ((1080, 1920), 0.40), ((1280, 720), 0.07), ((1920, 1080), 0.08),
                ((2160, 3840), 0.05)]
CAMERA_SECONDS = (5.0, 45.0)
CAMERA_KBPS = (1000, 4000)
WORDS = ("today I want to show you this new product it is really good and you can buy it with my code "
         "we went to the beach and had pizza with friends the weather was great check the link in my bio "
         "this recipe takes ten minutes follow for more tips and tricks honestly I did not expect that").split()
CAPTIONS = ["New drop is live! Link in bio #ad", "Sunday vibes", "", "Recette facile: gâteau au chocolat 🍫",
            "Use code SAVE20 at checkout", "What do you think? Comment below 👇", "Not sponsored, just love it",
            "Day 12 of my fitness journey #gym #motivation"]


# ----------------------------------------------------------------------------------------- media

def ffmpeg_run(args: list, what: str) -> None:
    proc = subprocess.run(["ffmpeg", "-nostdin", "-v", "error", "-y", *map(str, args)], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"ffmpeg failed making {what}: {proc.stderr.strip()[-800:]}")


# A folder of speech recordings (benchmarks/speech_pool.py), for a machine without espeak-ng: the GPU machine.
SPEECH_POOL = "VIDLABEL_SPEECH_POOL"


def speech_input(work: Path, key: str, seconds: float, rng: random.Random) -> list:
    """ffmpeg input arguments for ~``seconds`` of speech: espeak-ng reading random words (looped to
    length), else a recording of the speech pool (``SPEECH_POOL``), else pink noise."""
    exe = shutil.which("espeak-ng") or shutil.which("espeak")
    pool = sorted(Path(os.environ[SPEECH_POOL]).glob("*")) if os.environ.get(SPEECH_POOL) else []
    if not exe and pool:
        return ["-stream_loop", "-1", "-i", rng.choice(pool)]
    if not exe:
        return ["-f", "lavfi", "-i", f"anoisesrc=color=pink:amplitude=0.1:sample_rate=16000:duration={seconds:.2f}"]
    wav = work / "speech" / f"{key}.wav"
    if not wav.exists():
        wav.parent.mkdir(parents=True, exist_ok=True)
        words = " ".join(rng.choice(WORDS) for _ in range(max(3, int(seconds * 2.5))))
        subprocess.run([exe, "-s", "165", "-w", str(wav), words], check=True, capture_output=True)
    return ["-stream_loop", "-1", "-i", wav]


def camera_video_input(width: int, height: int, seconds: float, rate: int, seed: int) -> tuple[list, str]:
    """Moving content with sensor-like temporal noise (a new noise pattern every frame)."""
    return (["-f", "lavfi", "-i", f"testsrc2=size={width}x{height}:rate={rate}", "-t", f"{seconds:.3f}"],
            f"noise=alls=14:allf=t+u:all_seed={seed % 100000},format=yuv420p")


def h264_camera_args(kbps: int, threads: int) -> list:
    """What a phone's encoder writes: High profile, CABAC, 3 B-frames, 2 s GOP, VBV-capped bitrate."""
    return ["-c:v", "libx264", "-profile:v", "high", "-preset", "superfast", "-bf", "3", "-g", "60",
            "-b:v", f"{kbps}k", "-maxrate", f"{int(kbps * 1.5)}k", "-bufsize", f"{kbps * 2}k", "-threads", threads]


def make_camera_source(work: Path, path: Path, width: int, height: int, seconds: float, kbps: int, seed: int,
                       threads: int) -> None:
    if path.exists():
        return
    rng = random.Random(seed)
    video, vf = camera_video_input(width, height, seconds, 30, seed)
    tmp = path.with_suffix(".part" + path.suffix)
    ffmpeg_run([*video, *speech_input(work, path.stem, seconds, rng), "-map", "0:v", "-map", "1:a", "-vf", vf,
                *h264_camera_args(kbps, threads), "-c:a", "aac", "-b:a", "96k", "-ac", "1", "-t", f"{seconds:.3f}",
                "-movflags", "+faststart", "-f", "mp4", tmp], path.name)
    tmp.rename(path)


def make_testsrc2_source(work: Path, path: Path, width: int, height: int, seconds: float, kbps: int, seed: int,
                         threads: int) -> None:
    """The former benchmark set: cheap to decode (flat pattern, no B-frames, no CABAC, no audio)."""
    if path.exists():
        return
    tmp = path.with_suffix(".part" + path.suffix)
    ffmpeg_run(["-f", "lavfi", "-i", f"testsrc2=size={width}x{height}:rate=30", "-t", f"{seconds:.2f}",
                "-c:v", "libx264", "-preset", "ultrafast", "-crf", "30", "-pix_fmt", "yuv420p", "-threads", threads,
                "-movflags", "+faststart", "-f", "mp4", tmp], path.name)
    tmp.rename(path)


def av1_encoder() -> list | None:
    """Arguments for the fastest AV1 encoder this ffmpeg has, or None."""
    listed = subprocess.run(["ffmpeg", "-hide_banner", "-encoders"], capture_output=True, text=True).stdout
    for name, args in (("libsvtav1", ["-preset", "12"]), ("libaom-av1", ["-cpu-used", "8", "-row-mt", "1"]),
                       ("librav1e", ["-speed", "10"])):
        if f" {name} " in listed:
            return ["-c:v", name, *args, "-b:v", "1500k"]
    return None


def format_specs() -> dict[str, dict]:
    """One post per format users download: name -> file extension, size, seconds, fps, codec args."""
    h264 = ["-c:v", "libx264", "-profile:v", "high", "-preset", "superfast", "-bf", "3", "-b:v", "2000k"]
    aac = ["-c:a", "aac", "-b:a", "96k", "-ac", "1"]
    specs = {
        "hevc-8bit": dict(ext="mp4", args=["-c:v", "libx265", "-preset", "superfast", "-b:v", "1500k", "-tag:v", "hvc1",
                                           "-x265-params", "log-level=error", *aac]),
        "hevc-10bit": dict(ext="mp4", pix="yuv420p10le", args=["-c:v", "libx265", "-preset", "superfast", "-b:v",
                                                               "1500k", "-tag:v", "hvc1", "-x265-params",
                                                               "log-level=error", *aac]),
        "vp9": dict(ext="webm", args=["-c:v", "libvpx-vp9", "-deadline", "realtime", "-cpu-used", "8", "-b:v", "1500k",
                                      "-c:a", "libopus", "-b:a", "64k"]),
        "quicktime": dict(ext="mov", args=[*h264, *aac]),
        "matroska": dict(ext="mkv", args=[*h264, *aac]),
        "60fps": dict(ext="mp4", fps=60, args=[*h264, *aac]),
        "vfr": dict(ext="mp4", vf="select='not(mod(n\\,3))+gt(random(0)\\,0.5)'",
                    args=[*h264, "-fps_mode", "vfr", *aac]),
        "rotated": dict(ext="mp4", size=(1280, 720), rotate=90, args=[*h264, *aac]),
        "odd-718x1278": dict(ext="mp4", size=(718, 1278), args=[*h264, *aac]),
        "panorama-2560x480": dict(ext="mp4", size=(2560, 480), args=[*h264, *aac]),
        "h264-yuv444": dict(ext="mp4", pix="yuv444p", args=["-c:v", "libx264", "-profile:v", "high444", "-preset",
                                                            "superfast", "-b:v", "2000k", *aac]),
        "h264-10bit": dict(ext="mp4", pix="yuv420p10le", args=["-c:v", "libx264", "-profile:v", "high10", "-preset",
                                                               "superfast", "-b:v", "2000k", *aac]),
        "4k-portrait": dict(ext="mp4", size=(2160, 3840), args=[*h264[:-1], "4000k", *aac]),
        "short-0.5s": dict(ext="mp4", seconds=0.5, args=[*h264, *aac]),
        "short-0.25s": dict(ext="mp4", seconds=0.25, args=[*h264, *aac]),
        "one-frame": dict(ext="mp4", frames=1, args=[*h264]),
        "no-audio": dict(ext="mp4", args=[*h264]),
        "mpeg4-avi": dict(ext="avi", args=["-c:v", "mpeg4", "-b:v", "2000k", "-c:a", "aac", "-b:a", "96k"]),
        # A clip cut without re-encoding, as phone editors and platforms trim: an MP4 edit list whose
        # header still counts the frames before the cut, which the decoder drops.
        "edit-list": dict(ext="mp4", cut_copy=1.3, args=[*h264]),
        # 359 frames at 30 fps, 1080x1920: Qwen2-VL's loader computes its indices in float32 and samples
        # 23 frames (12 pairs) where exact arithmetic gives 22; the estimate must count what is served.
        "float-edge-359": dict(ext="mp4", size=(1080, 1920), seconds=359 / 30, frames=359, args=[*h264, *aac]),
    }
    av1 = av1_encoder()
    if av1:
        specs["av1"] = dict(ext="mp4", args=[*av1, *aac])
    return specs


def make_format(work: Path, media: Path, name: str, spec: dict, seed: int) -> Path:
    width, height = spec.get("size", (720, 1280))
    seconds = spec.get("seconds", 6.0)
    path = media / f"fmt-{name}.{spec['ext']}"
    if path.exists():
        return path
    video, vf = camera_video_input(width, height, seconds, spec.get("fps", 30), seed)
    vf = vf.replace("format=yuv420p", f"format={spec.get('pix', 'yuv420p')}")
    if spec.get("vf"):
        vf = f"{spec['vf']},{vf}"
    has_audio = "-c:a" in spec["args"]
    audio = speech_input(work, f"fmt-{name}", seconds, random.Random(seed)) if has_audio else []
    maps = ["-map", "0:v"] + (["-map", "1:a"] if has_audio else [])
    frames = ["-frames:v", spec["frames"]] if spec.get("frames") else []
    tmp = path.with_name(f"{path.stem}.part.{spec['ext']}")
    ffmpeg_run([*video, *audio, *maps, "-vf", vf, *spec["args"], *frames, "-t", f"{seconds:.3f}", tmp], path.name)
    if spec.get("rotate"):
        rotated = path.with_name(f"{path.stem}.rot.{spec['ext']}")
        ffmpeg_run(["-i", tmp, "-c", "copy", "-metadata:s:v:0", f"rotate={spec['rotate']}", rotated], path.name)
        tmp.unlink()
        tmp = rotated
    if spec.get("cut_copy"):
        cut = path.with_name(f"{path.stem}.cut.{spec['ext']}")
        ffmpeg_run(["-ss", spec["cut_copy"], "-i", tmp, "-c", "copy", cut], path.name)
        tmp.unlink()
        tmp = cut
    tmp.rename(path)
    return path


def vllm_decode_cpu(path: str) -> tuple[float, float]:
    """(CPU seconds, video seconds) of decoding a file as vLLM's OpenCV backend does: every frame up to
    the last sampled one grabbed, the sampled ones (2 per second) retrieved to BGR."""
    import cv2

    cv2.setNumThreads(1)  # the processor's own threads are not the decoder's
    before = time.process_time()
    cap = cv2.VideoCapture(path)
    try:
        total = int(cap.get(cv2.CAP_PROP_FRAME_COUNT))
        fps = cap.get(cv2.CAP_PROP_FPS) or 30.0
        if not 0 < total <= MAX_DECODE_FRAMES:  # a header without a frame count can read as ~2^63
            return time.process_time() - before, 0.0
        seconds = total / fps if total else 0.0
        wanted = {int(i) for i in _linspace(total, max(2, int(seconds * 2)))}
        last = max(wanted) if wanted else -1
        for index in range(last + 1):
            if not cap.grab():
                break
            if index in wanted:
                cap.retrieve()
    finally:
        cap.release()
    return time.process_time() - before, seconds


# The decode-cost figure's bounds: frames a file may claim (an hour at 60 fps) and the wall time of the pool.
MAX_DECODE_FRAMES = 3600 * 60
DECODE_COST_BUDGET_S = 180


def _linspace(total: int, n: int) -> list[int]:
    if total <= 0:
        return []
    n = min(n, total)
    return [round(i * (total - 1) / max(1, n - 1)) for i in range(n)]


def decode_cost(paths: list[str], jobs: int) -> dict | None:
    """Decode CPU seconds per second of video over distinct files (hard links counted once)."""
    try:
        import cv2  # noqa: F401
    except ImportError:
        print("decode cost: OpenCV (cv2) is not installed here; not measured", flush=True)
        return None
    unique = {}
    for p in paths:
        try:
            unique.setdefault(os.stat(p).st_ino, p)
        except OSError:
            continue
    # spawn, not fork: a forked child of a process with threads (a test session, the steady-state
    # samplers) can hang on a lock one of those threads held. A figure that is only reported must not
    # hold up a session: past its budget the workers are stopped and the figure is left out.
    pool = multiprocessing.get_context("spawn").Pool(processes=jobs)
    try:
        results = pool.map_async(vllm_decode_cpu, list(unique.values())).get(timeout=DECODE_COST_BUDGET_S)
    except multiprocessing.TimeoutError:
        print(f"decode cost: not measured (past {DECODE_COST_BUDGET_S} s over {len(unique)} files)", flush=True)
        return None
    finally:
        pool.terminate()
    cpu = sum(r[0] for r in results)
    video = sum(r[1] for r in results)
    per_file = sorted(r[0] / r[1] for r in results if r[1] > 0)
    return {"files": len(results), "video_s": video, "decode_cpu_s": cpu,
            "decode_cpu_s_per_video_s": cpu / video if video else None,
            "per_file_median": statistics.median(per_file) if per_file else None,
            "per_file_max": per_file[-1] if per_file else None}


def visual_tokens(paths: list[str]) -> tuple[int, float]:
    """Visual tokens at the default config (vidlabel's estimate) and seconds of video of the files."""
    from vidlabel.core import config as vconfig
    from vidlabel.prepare import planning
    from vidlabel.prepare.media import probe

    config = vconfig.load(REPO / "config" / "config.yaml", {"posts": "p", "media_root": "/"})
    infos = [probe(p) for p in paths]
    infos = [i for i in infos if not i["probe_error"]]
    est = planning.video_estimate(config, [i["duration_s"] for i in infos], [i["fps"] or 0 for i in infos],
                                  [i["width"] for i in infos], [i["height"] for i in infos])
    return int(est.tokens.sum()), float(sum(i["duration_s"] for i in infos))


# CPU seconds per megapixel-second of video, relative to x264 superfast (measured with ffmpeg 7.0.2, the
# imageio-ffmpeg build the GPU machine gets): only the order of the media step's pool depends on them.
CODEC_COST = {"h264": 1.0, "hevc": 3.0, "vp9": 1.5, "av1": 25.0, "mpeg4": 0.5}


def codec_of(spec: dict) -> str:
    args = " ".join(spec["args"])
    for word, codec in (("libx265", "hevc"), ("vp9", "vp9"), ("av1", "av1"), ("mpeg4", "mpeg4")):
        if word in args:
            return codec
    return "h264"


def encode_cost(width: int, height: int, seconds: float, codec: str) -> float:
    """A file's encoding cost in arbitrary units (megapixel-seconds times the codec's factor)."""
    return width * height * seconds / 1e6 * CODEC_COST[codec]


def make_media(args) -> None:
    work = Path(args.workdir)
    media = work / "media"
    media.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    threads = 2
    sources = []
    if args.kind == "camera":
        sizes, weights = zip(*CAMERA_SIZES)
        for i in range(args.sources):
            width, height = rng.choices(sizes, weights)[0]
            seconds = round(math.exp(rng.uniform(*map(math.log, CAMERA_SECONDS))), 2)
            kbps = int(math.exp(rng.uniform(*map(math.log, CAMERA_KBPS))))
            sources.append((media / f"cam{i:03d}-{width}x{height}-{seconds:g}s-{kbps}k.mp4", width, height, seconds,
                            kbps, args.seed * 1000 + i))
        maker = make_camera_source
    elif args.kind == "testsrc2":
        for i in range(args.sources):
            width, height = TESTSRC2_SIZES[i % len(TESTSRC2_SIZES)]
            seconds = round(math.exp(rng.uniform(math.log(5), math.log(60))), 2)
            sources.append((media / f"src{i:03d}-{width}x{height}-{seconds:g}s.mp4", width, height, seconds, 0, i))
        maker = make_testsrc2_source
    specs = format_specs() if args.formats else {}
    if args.formats and "av1" not in specs:
        print("media: this ffmpeg has no AV1 encoder (libsvtav1, libaom-av1, librav1e): no AV1 file", flush=True)

    def attempt(item):
        try:
            return make_format(work, media, item[0], item[1], args.seed + len(item[0]))
        except RuntimeError as exc:  # e.g. an encoder this ffmpeg lacks: the others still count
            print(f"media: format {item[0]} not made: {exc}", flush=True)
            return None

    # Sources and formats in one pool, the dearest first (longest-processing-time order): a 4K source or
    # the AV1 file started last would otherwise run alone at the end. Each file's content depends on its
    # own seed only, not on the order.
    tasks = [(encode_cost(s[1], s[2], s[3], "h264"), "source", s) for s in sources]
    tasks += [(encode_cost(*spec.get("size", (720, 1280)), spec.get("seconds", 6.0) * spec.get("fps", 30) / 30,
                           codec_of(spec)), "format", (name, spec)) for name, spec in specs.items()]
    tasks.sort(key=lambda t: -t[0])
    t0 = time.monotonic()
    done_at = {"source": 0.0, "format": 0.0}
    made: dict[str, Path | None] = {}
    lock = threading.Lock()

    def one(task):
        _, kind, item = task
        if kind == "source":
            maker(work, item[0], *item[1:], threads)
        else:
            made[item[0]] = attempt(item)
        with lock:
            done_at[kind] = max(done_at[kind], time.monotonic() - t0)

    # x264 at 2 threads keeps about 1.5 cores busy: one worker per core (--jobs) fills the machine.
    with cf.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        list(pool.map(one, tasks))
    print(f"media: {len(sources)} {args.kind} sources in {done_at['source']:.1f} s", flush=True)
    formats = {name: made[name] for name in specs if made.get(name) is not None}
    if args.formats:
        print(f"media: {len(formats)} format files in {done_at['format']:.1f} s (one pool with the sources)", flush=True)
    # Broken files: empty, text, an MP4 cut before its index, one cut after it, and a missing file.
    bad = []
    if sources:
        (media / "bad-empty.mp4").write_bytes(b"")
        (media / "bad-text.mp4").write_text("This is a text file, not a video.\n")
        whole = sources[0][0].read_bytes()
        (media / "bad-cut-after-index.mp4").write_bytes(whole[: int(len(whole) * 0.6)])
        ffmpeg_run(["-i", sources[min(1, len(sources) - 1)][0], "-c", "copy", media / "nofaststart.mp4"], "a copy")
        plain = (media / "nofaststart.mp4").read_bytes()
        (media / "bad-cut-before-index.mp4").write_bytes(plain[: len(plain) // 2])
        (media / "nofaststart.mp4").unlink()
        bad = ["bad-empty.mp4", "bad-text.mp4", "bad-cut-after-index.mp4", "bad-cut-before-index.mp4",
               "bad-missing.mp4"]
    # Posts: each source used by posts/sources posts (hard links: one file per post, as in a dataset).
    lines = ["post_id,video_path,media,caption"]
    transcripts = []
    for p in range(args.posts if sources else 0):
        src, seconds = sources[p % len(sources)][0], sources[p % len(sources)][3]
        name = f"post{p:04d}.mp4"
        if not (media / name).exists():
            os.link(src, media / name)
        lines.append(f"post{p:04d},media/{name},,{CAPTIONS[p % len(CAPTIONS)].replace(',', ' ')}")
        words = int(seconds * 2.5 * rng.uniform(0, 1.2))
        transcripts.append((f"post{p:04d}", " ".join(rng.choice(WORDS) for _ in range(words)), "ok"))
    # Every video post has a transcript row with the transcribe stage's statuses (ok, also for silence;
    # no_audio without an audio stream): the manifest excludes a post that has none, or another status, as
    # transcript_error, which took the format zoo out of the run (and any post with an empty transcript).
    said = random.Random(args.seed + 1)  # apart from `rng`: the video posts' transcripts stay as they were
    for name, path in formats.items():
        lines.append(f"fmt-{name},media/{path.name},,format {name}")
        spec = specs[name]
        speech = "-c:a" in spec["args"] and not spec.get("frames")
        words = int(spec.get("seconds", 6.0) * 2.5 * said.uniform(0.3, 1.2)) if speech else 0
        transcripts.append((f"fmt-{name}", " ".join(said.choice(WORDS) for _ in range(words)),
                            "ok" if "-c:a" in spec["args"] else "no_audio"))
    for j, name in enumerate(bad):
        lines.append(f"bad{j},media/{name},,broken file")
        transcripts.append((f"bad{j}", "", "no_audio"))
    mixed = []
    if args.photo_posts or args.carousels or args.audio_posts:
        t0 = time.monotonic()
        clips = [(s[0], s[3]) for s in sources]
        mixed_lines, mixed = mixed_posts.make(work, media, args.photo_posts, args.carousels, clips, args.seed,
                                              args.jobs, WORDS, CAPTIONS, args.audio_posts)
        lines += mixed_lines
        # One transcript row per item with sound (a slideshow's track, a carousel's clips), as the
        # transcribe stage writes them: (post_id, item_index).
        transcripts += [(post["post_id"], text, "ok", int(index)) for post in mixed
                        for index, text in post["transcripts"].items()]
        print(f"media: {len(mixed)} mixed posts ({args.photo_posts} photo posts, {args.carousels} carousels, "
              f"{args.audio_posts} audio posts) in "
              f"{time.monotonic() - t0:.1f} s", flush=True)
    (work / "posts.csv").write_text("\n".join(lines) + "\n")
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({
        "post_id": [t[0] for t in transcripts], "item_index": [t[3] if len(t) > 3 else 0 for t in transcripts],
        "text": [t[1] for t in transcripts],
        "language": ["en"] * len(transcripts), "segments": ["[]"] * len(transcripts),
        "status": [t[2] for t in transcripts], "error": [None] * len(transcripts),
        "audio_s": [None] * len(transcripts)}, schema=pa.schema([
            ("post_id", pa.string()), ("item_index", pa.int32()), ("text", pa.string()), ("language", pa.string()), ("segments", pa.string()),
            ("status", pa.string()), ("error", pa.string()), ("audio_s", pa.float64())])),
        work / "transcripts.parquet")
    posts = args.posts if sources else 0
    print(f"media: {posts} posts + {len(formats)} formats + {len(bad)} broken in {work / 'posts.csv'}",
          flush=True)
    summary = {"kind": args.kind, "sources": len(sources), "posts": posts, "format_names": sorted(formats),
               "mixed_posts": len(mixed)}
    for label, paths in ((args.kind, [str(s[0]) for s in sources]), ("formats", [str(p) for p in formats.values()])):
        if not paths:
            continue
        tokens, seconds = visual_tokens(paths)
        cost = decode_cost(paths, args.jobs)
        summary[label] = {"files": len(paths), "video_s": seconds, "visual_tokens": tokens,
                          "bytes": sum(os.path.getsize(p) for p in paths), "decode": cost}
        print(f"media {label}: {len(paths)} files, {seconds:,.0f} s of video, {tokens:,} visual tokens "
              f"({tokens / max(seconds, 1e-9):,.0f} per s of video), "
              f"{summary[label]['bytes'] / 2**20:,.1f} MiB; decode CPU "
              + (f"{cost['decode_cpu_s_per_video_s']:.3f} s per s of video (per file median "
                 f"{cost['per_file_median']:.3f}, max {cost['per_file_max']:.3f}), "
                 f"{cost['decode_cpu_s'] / max(tokens, 1) * 1000:.3f} s per 1,000 visual tokens" if cost else "-"),
              flush=True)
    (work / "media.json").write_text(json.dumps(summary, indent=1))


# ------------------------------------------------------------------------------------ the stages

def posts_source(args) -> tuple[str, str, list[Path]]:
    """(posts table or directory, media root, transcript files): the user's, else the generated set."""
    work = Path(args.workdir)
    if args.posts:
        root = args.media_root or (args.posts if Path(args.posts).is_dir() else str(Path(args.posts).parent))
        return str(Path(args.posts).resolve()), str(Path(root).resolve()), [Path(t) for t in args.transcripts]
    return str(work / "posts.csv"), str(work / "media"), [work / "transcripts.parquet"]


def model_suffix(args) -> str:
    """The data folder's suffix of a model other than the default one (its plan differs), and its audio mode."""
    from vidlabel.core.models import default_name

    audio = getattr(args, "audio", "transcript")
    if args.model == DEFAULT_MODEL and audio == "transcript":
        return ""
    return f"-{default_name(args.model)}" + ("" if audio == "transcript" else f"-{audio}")


def base_config(args, mode: str) -> dict:
    from vidlabel.core import config as vconfig

    work = Path(args.workdir)
    posts, media_root, _ = posts_source(args)
    overrides = {
        "posts": posts, "media_root": media_root,
        "results": str(work / f"data-{mode}{model_suffix(args)}"),
        "classify": {"model": args.model, "shards": 1, "server_args": args.server_args,
                     "startup_timeout_s": args.startup_timeout, "audio": getattr(args, "audio", "transcript")},
        "planning": {"transcode": {"enabled": mode.startswith("transcoded"), "chunks": args.jobs,
                                   "media_dir": str(work / f"transcoded-media-{mode}")},
                     "tokenizer": args.tokenizer,
                     # raw-decgpu: raw media for a GPU-decoding server (planning.decode)
                     "decode": mode.split("-dec", 1)[1] if "-dec" in mode else "auto"},
    }
    return vconfig.load(REPO / "config" / "config.yaml", overrides)


def prepare(args, mode: str) -> Path:
    """Inventory, transcode chunks (in parallel, as SLURM would run them) and the manifest; the
    transcode's CPU seconds and the decode cost of the media the server will read go to
    ``{results}/prepare.json``."""
    import pyarrow.parquet as pq

    from vidlabel.prepare import manifest, transcode
    from vidlabel.prepare.inventory import build_inventory

    config = base_config(args, mode)
    results = Path(config["results"])
    shard = results / "manifest" / "shard-0.parquet"
    if shard.exists():
        return shard
    _, _, transcripts = posts_source(args)
    if config["classify"]["audio"] == "native":  # the model hears the audio: no transcript
        transcripts = []
    inventory = results / "inventory.parquet"
    t0 = time.monotonic()
    build_inventory(config, inventory, threads=args.jobs)
    t1 = time.monotonic()
    chunks = [results / "transcoded" / f"chunk-{i}.parquet" for i in range(args.jobs)]
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    with cf.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        list(pool.map(lambda i: transcode.run_chunk(config, inventory, i, chunks[i],
                                                    config["planning"]["transcode"]["media_dir"],
                                                    transcript_paths=[t for t in transcripts if t.exists()]),
                      range(args.jobs)))
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    transcode_cpu = (after.ru_utime - children.ru_utime) + (after.ru_stime - children.ru_stime)
    t2 = time.monotonic()
    manifest.build(config, inventory, [t for t in transcripts if t.exists()], chunks, [shard],
                   results / "manifest" / "excluded.parquet", results / "manifest" / "plan.csv")
    group_by_post_type(shard)
    rows = pq.read_table(shard).to_pylist()
    print(f"{mode}: the manifest by post type:\n{manifest.describe(shard.parent)}", flush=True)
    t3 = time.monotonic()
    transcoded = sum(r["status"] == "ok" for c in chunks for r in pq.read_table(c, columns=["status"]).to_pylist())
    sent = [i["media_path"] for r in rows for i in (r.get("items") or [{"kind": "video", **r}])
            if i["kind"] == "video" and i.get("media_path")]
    info = {"mode": mode, "inventory_s": t1 - t0, "transcode_s": t2 - t1, "transcode_cpu_s": transcode_cpu,
            "transcoded_posts": transcoded, "manifest_s": t3 - t2, "requests": len(sent),
            "decode": decode_cost(sent, args.jobs)}
    (results / "prepare.json").write_text(json.dumps(info, indent=1))
    decode = info["decode"]
    print(f"{mode}: inventory {t1 - t0:.1f} s, transcode {t2 - t1:.1f} s ({transcoded} posts, {transcode_cpu:.1f} "
          f"CPU-s), manifest {t3 - t2:.1f} s; the server's media: "
          + (f"{decode['decode_cpu_s_per_video_s']:.3f} decode CPU-s per s of video" if decode else "-"), flush=True)
    return shard


# The order the shard sends its post types in: each type a phase of its own (gpu_steady.py).
POST_TYPE_ORDER = ("video", "photo", "slideshow", "carousel", "audio")


def group_by_post_type(shard: Path) -> None:
    """Rewrite the shard with its rows grouped by post type (stable within a type, the manifest's order)."""
    import numpy as np
    import pyarrow.parquet as pq

    from vidlabel.core.io import write_parquet

    table = pq.read_table(shard)
    order = {t: i for i, t in enumerate(POST_TYPE_ORDER)}
    rank = np.asarray([order.get(t or "video", len(order)) for t in table.column("post_type").to_pylist()])
    write_parquet(table.take(np.argsort(rank, kind="stable")), shard)


def variant_config(args, name: str) -> tuple[str, dict]:
    """(media mode, config) of a variant name such as ``api1-transcoded``."""
    words = name.split("@", 1)[0].split("-")  # what follows @ only names the run
    mode = "transcoded" if "transcoded" in words else "raw"
    decoder = next((w for w in words if re.fullmatch(r"dec(cpu|gpu|torchcodec)", w)), None)
    if decoder:
        mode = f"{mode}-{decoder}"
    config = base_config(args, mode)
    c = config["classify"]
    for word in words:
        if m := re.fullmatch(r"api(\d+)", word):
            c["api_server_count"] = int(m.group(1))
        elif m := re.fullmatch(r"conc(\d+)", word):
            c["concurrency"] = int(m.group(1))
        elif m := re.fullmatch(r"seqs(\d+)", word):
            c["max_num_seqs"] = int(m.group(1))
        elif m := re.fullmatch(r"adapt(\d*)", word):
            c["adaptive_concurrency"] = {**c.get("adaptive_concurrency", {}), "enabled": True,
                                         **({"ceiling": int(m.group(1))} if m.group(1) else {})}
        elif word == "fixed":
            c["adaptive_concurrency"] = {**c.get("adaptive_concurrency", {}), "enabled": False}
        elif m := re.fullmatch(r"lp(\d+)", word):
            c["top_logprobs"] = int(m.group(1))
        elif m := re.fullmatch(r"mbt(\d+)", word):
            c["max_num_batched_tokens"] = int(m.group(1))
        elif m := re.fullmatch(r"tp(\d+)", word):
            c["parallelism"] = {"tensor": int(m.group(1)), "data": 1}
        elif m := re.fullmatch(r"dp(\d+)", word):
            c["parallelism"] = {"tensor": 1, "data": int(m.group(1))}
        elif word == "dpvllm":
            c["data_parallel_backend"] = "vllm"
        elif word == "eager":
            c["server_args"] = f"{c['server_args']} --enforce-eager".strip()
        elif word == "kvfp8":
            c["server_args"] = f"{c['server_args']} --kv-cache-dtype fp8".strip()
        elif re.fullmatch(r"dec(cpu|gpu|torchcodec)", word):
            pass  # in the media mode: the decoder decides which posts the manifest transcodes
        elif word == "fp8":
            c["quantization"] = "fp8"
        elif word not in ("default", "transcoded", "raw", ""):
            raise SystemExit(f"unknown variant word {word!r} in {name!r}")
    return mode, config


class _JobLog(logging.Handler):
    """Collects 'server N ready ... X s after its start' and the parallelism decision of the job."""

    def __init__(self):
        super().__init__()
        self.seconds: list[float] = []
        self.layout: str | None = None

    def emit(self, record):
        if "ready on port" in record.msg:
            self.seconds.append(float(record.args[-1]))
        elif "parallelism" in record.msg:
            self.layout = record.getMessage().split("parallelism ", 1)[-1][:120]


class _GpuSampler(threading.Thread):
    def __init__(self):
        super().__init__(daemon=True)
        self.samples: list[tuple[float, float]] = []
        self.stop = threading.Event()

    def run(self):
        exe = shutil.which("nvidia-smi")
        # nvidia-smi counts physical GPUs; this job's are those CUDA_VISIBLE_DEVICES names.
        ids = [f"--id={os.environ['CUDA_VISIBLE_DEVICES']}"] if os.environ.get("CUDA_VISIBLE_DEVICES") else []
        while exe and not self.stop.wait(1.0):
            try:
                out = subprocess.run([exe, *ids, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=5).stdout
                values = [float(v) for v in out.split()]
                self.samples.append((time.time(), sum(values) / len(values)))
            except (OSError, ValueError, subprocess.SubprocessError):
                continue


def run_variant(args, name: str) -> dict:
    return run_job(args, name)[0]


def run_job(args, name: str, samplers=()) -> tuple[dict, list[dict], dict, list]:
    """Run a variant's shard job; (summary row, its records, its config, its GPU samples). ``samplers`` (objects with
    ``start()`` and ``stop()``, e.g. benchmarks/gpu_steady.py's) run alongside the job."""
    import pyarrow.parquet as pq

    from vidlabel.serve.classify import run_shard

    mode, config = variant_config(args, name)
    shard = prepare(args, mode)
    out = Path(args.workdir) / "runs" / name
    out.mkdir(parents=True, exist_ok=True)
    labels_path = out / "labels.parquet"
    ready = _JobLog()
    for name_ in ("vidlabel.serve.server", "vidlabel.serve.classify"):
        logging.getLogger(name_).addHandler(ready)
    gpu = _GpuSampler()
    gpu.start()
    for sampler in samplers:
        sampler.start()
    t0 = time.monotonic()
    error = None
    try:
        if not labels_path.exists():
            run_shard(config, shard, labels_path, out / "journal.jsonl", out / "server.log", 0)
    except (Exception, KeyboardInterrupt) as exc:  # reported, and the journal keeps what finished
        error = f"{type(exc).__name__}: {exc}"[:500]
    finally:
        wall = time.monotonic() - t0
        gpu.stop.set()
        for sampler in samplers:
            sampler.stop()
        for name_ in ("vidlabel.serve.server", "vidlabel.serve.classify"):
            logging.getLogger(name_).removeHandler(ready)
    records = (pq.read_table(labels_path).to_pylist() if labels_path.exists()
               else [json.loads(x) for x in (out / "journal.jsonl").read_text().splitlines() if x.strip()])
    excluded = pq.read_table(Path(config["results"]) / "manifest" / "excluded.parquet").to_pylist()
    row = summarise(name, config, records, excluded, wall, ready.seconds, gpu.samples,
                    sorted(out.glob("server*.log")), error)
    row["layout"] = ready.layout
    return row, records, config, gpu.samples


def summarise(name, config, records, excluded, wall, ready_s, gpu_samples, server_logs: list[Path], error) -> dict:
    ok = [r for r in records if r["status"] == "ok"]
    kinds: dict[str, int] = {}
    for r in records:
        key = "ok" if r["status"] == "ok" else r.get("error_kind") or "error"
        kinds[key] = kinds.get(key, 0) + 1
    ratios = sorted(r["est_prompt_tokens"] / r["prompt_tokens"] for r in ok if r.get("prompt_tokens"))
    started = [r["started_at"] for r in records if r.get("started_at")]
    finished = [r["finished_at"] for r in records if r.get("finished_at")]
    window = (max(finished) - min(started)) if started and finished else float("nan")
    prompt = sum(r["prompt_tokens"] or 0 for r in ok)
    output = sum(r["completion_tokens"] or 0 for r in ok)
    # vLLM logs the requests it runs every few seconds, per copy.
    running = [int(x) for log in server_logs for x in re.findall(r"Running: (\d+) reqs", log.read_text(errors="replace"))]
    in_window = [u for t, u in gpu_samples if started and min(started) <= t <= max(finished)]
    prepared = Path(config["results"]) / "prepare.json"
    prep = json.loads(prepared.read_text()) if prepared.exists() else {}
    c = config["classify"]
    return {
        "variant": name, "requests": len(records), "excluded": len(excluded),
        "excluded_reasons": sorted({e["reason"] for e in excluded}), "by_kind": kinds,
        "est_over_served": {"min": ratios[0], "median": statistics.median(ratios), "max": ratios[-1]}
        if ratios else None,
        "within_2pct": sum(abs(x - 1) <= 0.02 for x in ratios),
        "prompt_tokens": {"min": min(r["prompt_tokens"] for r in ok), "median": statistics.median(
            r["prompt_tokens"] for r in ok), "max": max(r["prompt_tokens"] for r in ok)} if ok else None,
        "window_s": window, "prompt_tok_s": prompt / window if ok else 0.0,
        "output_tok_s": output / window if ok else 0.0, "req_s": len(ok) / window if ok else 0.0,
        "p50_latency_s": statistics.median(r["latency_s"] for r in ok) if ok else None,
        "server_start_s": max(ready_s) if ready_s else None, "wall_s": wall,
        "engine_running_max": max(running) if running else None,
        "engine_running_median": statistics.median(running) if running else None,
        "gpu_util_mean": statistics.mean(in_window) if in_window else None,
        "gpu_idle_share": sum(u < 5 for u in in_window) / len(in_window) if in_window else None,
        "decode_cpu_s_per_video_s": (prep.get("decode") or {}).get("decode_cpu_s_per_video_s"),
        "transcode_cpu_s": prep.get("transcode_cpu_s"), "transcoded_posts": prep.get("transcoded_posts"),
        "model": c["model"], "gpus": os.environ.get("CUDA_VISIBLE_DEVICES", "all"), "cpus": len(os.sched_getaffinity(0)),
        "concurrency": c["concurrency"], "api_server_count": c["api_server_count"],
        "max_num_batched_tokens": c["max_num_batched_tokens"], "max_tokens": c["max_tokens"],
        "server_args": c["server_args"], "error": error,
    }


def table(rows: list[dict]) -> str:
    head = ("| variant | requests: status | est/served tokens (min / median / max) | served prompt tokens "
            "(min / median / max) | prompt tok/s | output tok/s | req/s | p50 latency | server start | "
            "engine running (max / median) | GPU busy (idle samples) | decode CPU-s per s of video | "
            "transcode CPU-s (posts) | layout |\n" + "|---" * 14 + "|")
    lines = [head]
    for r in rows:
        ratio = r["est_over_served"]
        pt = r["prompt_tokens"]
        decode = r.get("decode_cpu_s_per_video_s")
        lines.append(
            f"| {r['variant']} | {r['requests']}: {r['by_kind']} (+{r['excluded']} excluded) | "
            + (f"{ratio['min']:.3f} / {ratio['median']:.3f} / {ratio['max']:.3f} ({r['within_2pct']} within ±2 %)"
               if ratio else "-")
            + " | " + (f"{pt['min']:,} / {pt['median']:,.0f} / {pt['max']:,}" if pt else "-")
            + f" | {r['prompt_tok_s']:,.0f} | {r['output_tok_s']:,.0f} | {r['req_s']:.2f} | "
            + (f"{r['p50_latency_s']:.1f} s" if r["p50_latency_s"] is not None else "-") + " | "
            + (f"{r['server_start_s']:.0f} s" if r["server_start_s"] is not None else "-") + " | "
            + (f"{r['engine_running_max']} / {r['engine_running_median']:g}" if r["engine_running_max"] else "-")
            + " | " + (f"{r['gpu_util_mean']:.0f} % ({r['gpu_idle_share']:.0%})" if r["gpu_util_mean"] is not None
                       else "-")
            + " | " + (f"{decode:.3f}" if decode is not None else "-")
            + " | " + (f"{r['transcode_cpu_s']:,.0f} ({r['transcoded_posts']})" if r.get("transcode_cpu_s") is not None
                       else "-")
            + f" | {r.get('layout') or '-'} |")
    return "\n".join(lines)


def use_standin(args) -> None:
    if args.standin:
        sys.path.insert(0, str(REPO / "tests"))
        from standin import vllm_shim

        extra = getattr(args, "standin_args", "").split()  # later flags override the defaults
        shim = vllm_shim(Path(args.workdir) / "standin-bin", "--random-weights", "--slots", "16",
                         "--prefill-tokens-per-s", "200000", "--latency", "0.05", *extra)
        os.environ["PATH"] = f"{shim.parent}{os.pathsep}{os.environ['PATH']}"


def run(args) -> int:
    use_standin(args)
    rows = []
    results = Path(args.out) if args.out else Path(args.workdir) / "gpu_classify.json"
    previous = json.loads(results.read_text()) if results.exists() else []
    for name in args.variants.split(","):
        row = run_variant(args, name)
        rows.append(row)
        print(json.dumps(row), flush=True)
        previous = [r for r in previous if r["variant"] != name] + [row]
        results.write_text(json.dumps(previous, indent=1))
    print(table(previous))
    return 0 if all(r["error"] is None for r in rows) else 1


def estimate(args) -> int:
    """The estimate target's pilot and projection on the prepared manifest, next to a measured job."""
    from vidlabel.serve import pilot as es

    use_standin(args)
    mode, config = variant_config(args, args.variant)
    config["planning"]["pilot_size"] = args.pilot_size
    shard = prepare(args, mode)
    out = Path(args.workdir) / "estimate" / args.variant
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    result = es.run(config, [shard], out / "estimate.json", out / "estimate.md", out, out / "server.log")
    wall = time.monotonic() - t0
    projected = result["projection"]["shard_hours"]["max"] * 3600
    pilot = result["pilot"]
    print((out / "estimate.md").read_text())
    line = (f"estimate ({args.variant}): pilot of {pilot['requests']} requests in {wall:.0f} s (steady "
            f"{pilot['steady']}, window {pilot['steady_window_s']:.0f} s, {pilot['prompt_tokens_per_s']:,.0f} prompt "
            f"tok/s, model: {pilot['model']}); projected shard job {projected:.0f} s (start-up "
            f"{pilot['startup_s']:.0f} s + ramp-up and drain {pilot['ramp_drain_s']:.0f} s + requests)")
    results = Path(args.out) if args.out else Path(args.workdir) / "gpu_classify.json"
    measured = [r for r in (json.loads(results.read_text()) if results.exists() else [])
                if r["variant"] == (args.compare or args.variant)]
    whole = result["projection"]["requests"]
    if measured and (measured[0].get("stopped_by_time_limit") or measured[0]["requests"] < whole):
        line += (f"; measured job ({measured[0]['variant']}) did not answer the whole shard "
                 f"({measured[0]['requests']} of {result['projection']['requests']} requests): no comparison")
    elif measured:
        job = measured[0]["wall_s"]
        line += (f"; measured job ({measured[0]['variant']}, {measured[0]['requests']} requests) {job:.0f} s: "
                 f"projected / measured {projected / job:.3f}")
    print(line, flush=True)
    return 0


def main(argv=None) -> int:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="step", required=True)
    m = sub.add_parser("media")
    pr = sub.add_parser("prepare")
    r = sub.add_parser("run")
    e = sub.add_parser("estimate")
    for p in (m, pr, r, e):
        p.add_argument("--workdir", default="/tmp/vidlabel-gpu")
        p.add_argument("--jobs", type=int, default=os.cpu_count() or 4)
    m.add_argument("--kind", choices=("camera", "testsrc2", "none"), default="camera")
    m.add_argument("--sources", type=int, default=80)
    m.add_argument("--posts", type=int, default=240)
    m.add_argument("--formats", action="store_true", help="add one post per platform format")
    m.add_argument("--photo-posts", type=int, default=0, help="photo posts of 1 to 35 photos (half slideshows)")
    m.add_argument("--carousels", type=int, default=0, help="carousels of 2 to 10 images and clips")
    m.add_argument("--audio-posts", type=int, default=0, help="audio posts: a clip's speech as an .m4a alone")
    m.add_argument("--seed", type=int, default=0)
    for p in (pr, r, e):
        p.add_argument("--posts", default=None, help="your posts table (CSV/Parquet) or directory of videos")
        p.add_argument("--media-root", default=None, help="media_root for --posts (default: its directory)")
        p.add_argument("--transcripts", nargs="*", default=[], help="transcript parquet files for --posts")
        p.add_argument("--model", default=DEFAULT_MODEL)
        p.add_argument("--audio", default="transcript", choices=("transcript", "native", "both"),
                       help="classify.audio: how the model takes the posts' audio")
        p.add_argument("--tokenizer", default=None,
                       help="planning.tokenizer (a tokenizer.json or model directory): exact text tokens, which "
                            "short clips need to be estimated within 2 %%; give it to prepare, run and estimate alike")
        p.add_argument("--server-args", default="", help="classify.server_args for every variant")
        p.add_argument("--startup-timeout", type=float, default=900)
        p.add_argument("--out", default=None, help="JSON results (default WORKDIR/gpu_classify.json)")
        p.add_argument("--standin", action="store_true", help="the test stand-in as `vllm` (no GPU needed)")
    pr.add_argument("--modes", default="raw,transcoded")
    r.add_argument("--variants", default="default,transcoded")
    e.add_argument("--variant", default="default", help="the server and media of this variant")
    e.add_argument("--pilot-size", type=int, default=128)
    e.add_argument("--compare", default=None, help="the measured variant to compare with (default: --variant)")
    args = ap.parse_args(argv)
    if args.step == "media":
        make_media(args)
        return 0
    if args.step == "prepare":
        # A prepare that takes minutes on a machine where it took seconds elsewhere says where it waits.
        faulthandler.dump_traceback_later(120, repeat=True)
        for mode in args.modes.split(","):
            prepare(args, mode)
        return 0
    if args.step == "estimate":
        return estimate(args)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
