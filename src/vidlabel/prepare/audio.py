"""Audio the model hears (``classify.audio: native`` or ``both``): each audio item, and each video's sound,
as a 16 kHz mono 16-bit WAV.

Why a WAV of its own for everything heard: the model's audio tokens follow the number of samples its
processor reads (13 per second for Qwen3-Omni, vidlabel.families), and a compressed track decodes to a
length that depends on the decoder (AAC priming: PyAV 18 added about 23 ms); a PCM WAV at the processor's
own rate is read the same by every decoder and needs no resampling, so the estimate counts exactly the
samples the server reads. And vLLM 0.26 cannot take a video's sound inside the video (audio-in-video
stops its engine: docs/models.md), so the sound goes as an item after its video.
"""

from __future__ import annotations

import os
import wave
from pathlib import Path

import ffmpeg

from vidlabel.core.io import atomic_path

_STDERR_TAIL = 2000


def to_wav(src: str | os.PathLike, dst: str | os.PathLike, rate: int) -> dict[str, float | int]:
    """Write the first audio stream of ``src`` (an audio file or a video) at ``dst`` as mono 16-bit PCM at
    ``rate`` Hz, atomically; return its ``samples`` and ``duration_s``. Raises RuntimeError with ffmpeg's
    message (no audio stream, a corrupt file), or when the sound is empty."""
    with atomic_path(Path(dst)) as tmp:
        out = ffmpeg.input(str(src)).output(str(tmp), format="wav", vn=None, ac=1, ar=int(rate), acodec="pcm_s16le")
        try:
            out.overwrite_output().global_args("-nostdin", "-v", "error").run(capture_stdout=True,
                                                                               capture_stderr=True)
        except ffmpeg.Error as exc:  # str(exc) says only "see stderr"
            msg = (exc.stderr or b"").decode("utf-8", "replace").strip()[-_STDERR_TAIL:]
            raise RuntimeError(f"ffmpeg failed: {msg or 'no message'}") from None
        with wave.open(str(tmp), "rb") as wav:
            samples = wav.getnframes()
        if samples == 0:
            raise RuntimeError("the sound has no samples (an empty audio stream)")
    return {"samples": int(samples), "duration_s": samples / float(rate)}
