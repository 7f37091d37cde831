"""Demo and test media: short speech videos made with espeak-ng + ffmpeg, plus the usual bad files.

``make_demo_set`` writes ``media/*.mp4`` and ``posts.csv`` and returns what each post should
become downstream (probe error or not, spoken text, whether it promotes a product), so tests can
check every stage against it. Command line: ``python -m vidlabel.demo OUTDIR [--n N]``.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import wave
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import ffmpeg

#: Spoken sentences of the good posts, alternating: product promotion (with "buy") / everyday talk.
SENTENCES: list[tuple[str, bool]] = [
    # Chosen so that Whisper tiny.en transcribes them back faithfully from espeak-ng's voice
    # (a sentence-initial "Buy" comes back as "By", "vitamin" as "victim in").
    ("I want you to buy the new phone case from my shop.", True),
    ("We cooked pasta with fresh tomatoes for dinner tonight.", False),
    ("Use my code to buy these running shoes at half price.", True),
    ("My cat likes to sleep in the sun all afternoon.", False),
    ("Go and buy this face cream from the link below.", True),
    ("The train was late again so I walked home.", False),
    ("Please buy my new cookbook, it is on sale now.", True),
    ("We went hiking in the mountains with my family.", False),
]

CAPTIONS = [
    "morning routine #health",
    "beach day 🌊",
    'my "favourite" shoes, again',
    None,  # posts without caption exist
    "new drop\nlink in bio",
    "sleepy cat",
    "skincare, honestly",
    "commute diaries",
]

AUTHORS = ["ana", "ben", "chloé", "dev"]

SMALL_PORTRAIT = (360, 640)
SMALL_LANDSCAPE = (640, 360)


class DemoError(RuntimeError):
    """A tool needed to make demo media (espeak-ng, ffmpeg) is missing or failed."""


def speak(text: str) -> bytes:
    """WAV bytes of ``text`` spoken by espeak-ng (written to stdout, no temp file)."""
    exe = shutil.which("espeak-ng") or shutil.which("espeak")
    if exe is None:
        raise DemoError("espeak-ng is not installed (Debian: apt-get install espeak-ng)")
    proc = subprocess.run([exe, "--stdout", text], capture_output=True, check=False)
    if proc.returncode != 0 or not proc.stdout:
        raise DemoError(f"espeak-ng failed: {proc.stderr.decode(errors='replace').strip()}")
    return proc.stdout


def wav_duration(data: bytes) -> float:
    """Duration of WAV bytes; espeak's stdout header may carry a placeholder length, so count bytes."""
    with wave.open(io.BytesIO(data)) as wav:
        frame_bytes = wav.getsampwidth() * wav.getnchannels()
        rate = wav.getframerate()
    header = data.find(b"data") + 8
    return max(0, len(data) - header) / frame_bytes / rate


def make_video(
    path: str | os.PathLike,
    text: str | None = None,
    duration: float | None = None,
    size: tuple[int, int] = (720, 1280),
    fps: int = 30,
    audio: bool = True,
    rotate: int = 0,
    faststart: bool = False,
) -> float:
    """Write an H.264/AAC MP4 of a test pattern, with ``text`` spoken by espeak-ng.

    ``size`` is (width, height) of the coded frames. ``audio=False`` writes no audio stream;
    ``text=None`` with audio gives a silent audio track. ``duration`` defaults to the speech plus
    half a second (at least 3 s). ``rotate`` stores a display rotation (as phones do) without
    changing the coded frames. ``faststart`` puts the index (moov) before the media data.
    Returns the duration in seconds.
    """
    speech = speak(text) if (text and audio) else None
    if duration is None:
        duration = max(3.0, wav_duration(speech) + 0.5) if speech else 3.0
    width, height = size
    video = ffmpeg.input(f"testsrc2=size={width}x{height}:rate={fps}", f="lavfi", t=duration)
    streams = [video]
    if audio:
        if speech is not None:
            sound = ffmpeg.input("pipe:", f="wav").filter("apad")
        else:
            sound = ffmpeg.input("anullsrc=r=16000:cl=mono", f="lavfi")
        streams.append(sound)
    out_args: dict[str, Any] = {
        "vcodec": "libx264",
        "preset": "veryfast",
        "crf": 30,
        "pix_fmt": "yuv420p",
        "t": duration,
    }
    if audio:
        out_args.update(acodec="aac", ac=1)
    if faststart:
        out_args["movflags"] = "+faststart"
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # ffmpeg 5.1 writes a "rotate" display matrix only when copying streams: encode, then remux.
    encoded = path.with_name(f".{path.name}.unrotated.mp4") if rotate else path
    try:
        _run(ffmpeg.output(*streams, os.fspath(encoded), **out_args), speech)
        if rotate:
            remux = {"c": "copy", "metadata:s:v:0": f"rotate={rotate}"}
            if faststart:
                remux["movflags"] = "+faststart"
            _run(ffmpeg.input(os.fspath(encoded)).output(os.fspath(path), **remux), None)
    except ffmpeg.Error as exc:
        raise DemoError(f"ffmpeg failed for {path}: {exc.stderr.decode(errors='replace').strip()}") from None
    except FileNotFoundError:
        raise DemoError("ffmpeg is not installed (Debian: apt-get install ffmpeg)") from None
    finally:
        if rotate:
            encoded.unlink(missing_ok=True)
    return float(duration)


def _run(stream, stdin: bytes | None) -> None:
    (
        stream.global_args("-nostdin", "-hide_banner", "-loglevel", "error")
        .overwrite_output()
        .run(input=stdin, capture_stdout=True, capture_stderr=True)
    )


def _truncate(path: Path, fraction: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * fraction)])


def make_demo_set(outdir: str | os.PathLike, n: int = 8) -> dict[str, dict[str, Any]]:
    """Write ``outdir/media/*.mp4`` and ``outdir/posts.csv``; return the expectations per post_id.

    ``n`` good speech posts (3-6 s, portrait, landscape and a rotated phone clip; about half
    say "buy" and promote a product), one of them with spaces, quotes and unicode in its file
    name, plus the bad cases: silent audio, no audio stream, empty file, truncated before and
    after the MP4 index, a text file named .mp4 and a missing file.

    Each expectation: ``kind``, ``video_path`` (as written in the CSV), ``text`` (spoken or
    None), ``promotes_product`` (bool or None), ``probe_ok`` (bool), ``has_audio``,
    ``width``/``height`` (display size, good posts), ``caption``, ``author``.
    """
    outdir = Path(outdir)
    media = outdir / "media"
    media.mkdir(parents=True, exist_ok=True)
    posts: dict[str, dict[str, Any]] = {}
    jobs: list[tuple[Path, dict[str, Any]]] = []

    def add(post_id: str, filename: str, kind: str, *, text=None, promotes=None, probe_ok=True,
            has_audio=True, display=None, make=None) -> None:
        i = len(posts)
        posts[post_id] = {
            "kind": kind,
            "video_path": f"media/{filename}",
            "text": text,
            "promotes_product": promotes,
            "probe_ok": probe_ok,
            "has_audio": has_audio if probe_ok else None,
            "width": display[0] if display else None,
            "height": display[1] if display else None,
            "caption": CAPTIONS[i % len(CAPTIONS)],
            "author": AUTHORS[i % len(AUTHORS)],
        }
        if make is not None:
            jobs.append((media / filename, make))

    for i in range(n):
        text, promotes = SENTENCES[i % len(SENTENCES)]
        post_id = f"good-{i + 1:02d}"
        filename = f"{post_id}.mp4"
        if i == 1:
            filename = "clip with spaces 'quoted' café – ünïcode.mp4"
        shape = i % 3
        if shape == 0:
            make, display = dict(size=SMALL_PORTRAIT), SMALL_PORTRAIT
        elif shape == 1:
            make, display = dict(size=SMALL_LANDSCAPE), SMALL_LANDSCAPE
        else:  # a phone clip: landscape frames with a 90 degree display rotation shows portrait
            make, display = dict(size=SMALL_LANDSCAPE, rotate=90), SMALL_PORTRAIT
        add(post_id, filename, "speech", text=text, promotes=promotes, display=display,
            make=dict(make, text=text, fps=15, faststart=i % 2 == 0))

    add("silent-audio", "silent-audio.mp4", "silent", promotes=False, display=SMALL_PORTRAIT,
        make=dict(size=SMALL_PORTRAIT, fps=15, duration=4.0, text=None))
    add("no-audio", "no-audio.mp4", "no_audio", promotes=False, has_audio=False,
        display=SMALL_LANDSCAPE, make=dict(size=SMALL_LANDSCAPE, fps=15, duration=3.0, audio=False))
    add("empty", "empty.mp4", "empty", probe_ok=False)
    add("truncated-before-index", "truncated-before-index.mp4", "truncated_before_index",
        text=SENTENCES[0][0], probe_ok=False,
        make=dict(size=SMALL_PORTRAIT, fps=15, text=SENTENCES[0][0], _cut=0.5))
    add("truncated-after-index", "truncated-after-index.mp4", "truncated_after_index",
        text=SENTENCES[2][0], probe_ok=False,
        make=dict(size=SMALL_PORTRAIT, fps=15, text=SENTENCES[2][0], faststart=True, _cut=0.6))
    add("text-as-mp4", "not-a-video.mp4", "not_video", probe_ok=False)
    add("missing-file", "deleted-video.mp4", "missing", probe_ok=False)

    (media / "empty.mp4").write_bytes(b"")
    (media / "not-a-video.mp4").write_text("This is a text file, not a video.\n")

    def run(job: tuple[Path, dict[str, Any]]) -> None:
        path, kwargs = job
        kwargs = dict(kwargs)
        cut = kwargs.pop("_cut", None)
        make_video(path, **kwargs)
        if cut is not None:
            _truncate(path, cut)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        list(pool.map(run, jobs))

    with open(outdir / "posts.csv", "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(["post_id", "video_path", "caption", "author"])
        for post_id, post in posts.items():
            writer.writerow([post_id, post["video_path"], post["caption"] or "", post["author"]])
    return posts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vidlabel.demo", description=__doc__.splitlines()[0])
    parser.add_argument("outdir", help="directory for media/ and posts.csv")
    parser.add_argument("--n", type=int, default=8, help="number of good speech posts (default 8)")
    args = parser.parse_args(argv)
    posts = make_demo_set(args.outdir, n=args.n)
    with open(Path(args.outdir) / "expected.json", "w", encoding="utf-8") as fh:
        json.dump(posts, fh, indent=1, ensure_ascii=False)
    print(f"wrote {len(posts)} posts to {Path(args.outdir) / 'posts.csv'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
