"""Stage 2, transcribe: Whisper transcripts of every probed post, one chunk job at a time.

Two backends behind one interface (``transcribe.backend``): faster-whisper (CTranslate2, the
default, about 3x faster on CPU) and openai-whisper (PyTorch). Audio is piped from ffmpeg into a
16 kHz float32 array, never through a temp file. Every finished post is appended to the chunk's
journal, so a rerun after a crash transcribes only what is missing; the chunk's Parquet file is
written (atomically) once every post of the chunk is done.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from vidlabel.core.io import write_parquet
from vidlabel.core.journal import Journal, journal_beside
from vidlabel.prepare.media import SAMPLE_RATE, AudioError, NoAudioStream, load_audio
from vidlabel.prepare.sharding import stable_chunk

log = logging.getLogger(__name__)

PROGRESS_INTERVAL_S = 10.0

OUTPUT_SCHEMA = pa.schema(
    [
        ("post_id", pa.string()),
        ("text", pa.string()),
        ("language", pa.string()),
        ("segments", pa.string()),
        ("status", pa.string()),
        ("error", pa.string()),
        ("audio_s", pa.float64()),
    ]
)

# openai-whisper's own default: retry at higher temperatures when a greedy/beam decode looks
# degenerate (compression ratio, log-probability). Temperature 0 alone truncated transcripts.
OPENAI_WHISPER_TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)


@dataclass
class Transcript:
    text: str
    language: str | None
    segments: list[dict[str, Any]] = field(default_factory=list)


class Backend(Protocol):
    name: str

    def transcribe(self, audio: np.ndarray) -> Transcript: ...


def _has_speech(audio: np.ndarray) -> bool:
    """Silero VAD (shipped with faster-whisper): does the clip contain any speech at all?"""
    from faster_whisper.vad import get_speech_timestamps

    return bool(get_speech_timestamps(audio, sampling_rate=SAMPLE_RATE))


class FasterWhisperBackend:
    """faster-whisper: ``model`` is a name (downloaded) or a local CTranslate2 directory."""

    name = "faster-whisper"

    def __init__(self, cfg: dict[str, Any]):
        from faster_whisper import WhisperModel

        self.cfg = cfg
        self.model = WhisperModel(
            cfg["model"],
            device=cfg["device"],
            compute_type=cfg["compute_type"],
            cpu_threads=cfg["threads"],
        )

    def transcribe(self, audio: np.ndarray) -> Transcript:
        segments, info = self.model.transcribe(
            audio,
            beam_size=self.cfg["beam_size"],
            vad_filter=self.cfg["vad"],  # silence would otherwise come out as "You"
            language=self.cfg["language"],
        )
        segs = [{"start": round(s.start, 3), "end": round(s.end, 3), "text": s.text.strip()} for s in segments]
        return Transcript(" ".join(s["text"] for s in segs if s["text"]), info.language, segs)


class OpenAIWhisperBackend:
    """openai-whisper: ``model`` is a name (downloaded) or a path to a .pt checkpoint (offline)."""

    name = "openai-whisper"

    def __init__(self, cfg: dict[str, Any]):
        import torch
        import whisper

        self.cfg = cfg
        device = cfg["device"]
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = device
        if device == "cpu":
            torch.set_num_threads(cfg["threads"])
        self.model = whisper.load_model(cfg["model"], device=device)

    def transcribe(self, audio: np.ndarray) -> Transcript:
        # openai-whisper has no VAD of its own; a clip without any speech is not decoded at all.
        if self.cfg["vad"] and not _has_speech(audio):
            return Transcript("", "en" if not self.model.is_multilingual else None, [])
        result = self.model.transcribe(
            audio,
            temperature=OPENAI_WHISPER_TEMPERATURES,
            beam_size=self.cfg["beam_size"],
            best_of=self.cfg["beam_size"],
            fp16=self.device == "cuda",  # fp16 is unsupported on CPU (it warns and falls back)
            language=self.cfg["language"],
            verbose=None,
        )
        segs = [
            {"start": round(float(s["start"]), 3), "end": round(float(s["end"]), 3), "text": s["text"].strip()}
            for s in result["segments"]
        ]
        return Transcript(" ".join(s["text"] for s in segs if s["text"]), result.get("language"), segs)


BACKENDS = {"faster-whisper": FasterWhisperBackend, "openai-whisper": OpenAIWhisperBackend}


def make_backend(cfg: dict[str, Any]) -> Backend:
    """Load the configured model (``cfg`` is ``config['transcribe']``, defaults filled)."""
    try:
        cls = BACKENDS[cfg["backend"]]
    except KeyError:
        raise ValueError(f"transcribe.backend must be one of {sorted(BACKENDS)}, not {cfg['backend']!r}") from None
    started = time.monotonic()
    backend = cls(cfg)
    log.info("loaded %s model %s in %.1f s", cfg["backend"], cfg["model"], time.monotonic() - started)
    return backend


class LazyBackend:
    """Loads the model on first use: a chunk with nothing to transcribe never loads it."""

    def __init__(self, cfg: dict[str, Any]):
        self.cfg = cfg
        self._backend: Backend | None = None

    @property
    def loaded(self) -> bool:
        return self._backend is not None

    def load(self) -> Backend:
        if self._backend is None:
            self._backend = make_backend(self.cfg)
        return self._backend

    def transcribe(self, audio: np.ndarray) -> Transcript:
        return self.load().transcribe(audio)


def transcribe_post(backend: LazyBackend | Backend, post: dict[str, Any]) -> dict[str, Any]:
    """One journal record for one inventory row (never raises for bad audio)."""
    record: dict[str, Any] = {
        "post_id": post["post_id"],
        "text": None,
        "language": None,
        "segments": None,
        "status": "ok",
        "error": None,
        "audio_s": 0.0,
    }
    if post.get("has_audio") is False:
        record["status"] = "no_audio"
        return record
    try:
        audio, warning = load_audio(post["video_path"], SAMPLE_RATE, expected_s=post.get("duration_s"))
    except NoAudioStream:
        record["status"] = "no_audio"
        return record
    except AudioError as exc:
        record.update(status="error", error=f"audio decode failed: {exc}")
        return record
    record["audio_s"] = round(len(audio) / SAMPLE_RATE, 3)
    if len(audio) == 0:  # an audio stream without a single sample
        record.update(status="no_audio", error=f"warning: {warning}" if warning else None)
        return record
    if isinstance(backend, LazyBackend):
        backend.load()  # a model that cannot load fails the job; it is not a per-post error
    try:
        result = backend.transcribe(audio)
    except MemoryError:
        raise
    except Exception as exc:  # one undecodable clip must not stop the chunk
        log.warning("post %s: transcription failed: %s: %s", post["post_id"], type(exc).__name__, exc)
        record.update(status="error", error=f"transcription failed: {type(exc).__name__}: {exc}")
        return record
    record.update(
        text=result.text,
        # Without any speech a detected language is noise (English-only models always say "en").
        language=result.language if result.segments else None,
        segments=json.dumps(result.segments, ensure_ascii=False),
        # The post is transcribed, but from damaged audio: keep ffmpeg's reason next to it.
        error=f"warning: {warning}" if warning else None,
    )
    return record


# Keys whose change makes earlier transcripts stale (threads, device and chunking do not).
SETTINGS_KEYS = ("backend", "model", "language", "vad", "beam_size", "compute_type")


def settings_fingerprint(cfg: dict[str, Any]) -> str:
    """Identity of the transcription settings, stored in every journal record."""
    payload = json.dumps({k: cfg.get(k) for k in SETTINGS_KEYS}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def chunk_posts(inventory_path: str | os.PathLike, chunk: int, n_chunks: int) -> list[dict[str, Any]]:
    """Inventory rows of ``chunk`` that probed without error, in inventory order."""
    table = pq.read_table(inventory_path, columns=["post_id", "video_path", "has_audio", "duration_s", "probe_error"])
    return [
        row
        for row in table.to_pylist()
        if row["probe_error"] is None and stable_chunk(row["post_id"], n_chunks) == chunk
    ]


def run_chunk(
    config: dict[str, Any],
    inventory_path: str | os.PathLike,
    chunk: int,
    output_path: str | os.PathLike,
    backend: Backend | None = None,
) -> None:
    """Transcribe the posts of ``chunk``; resume from the journal; write the chunk Parquet at the end.

    ``backend`` replaces the configured one (for callers that hold a loaded model).
    """
    cfg = config["transcribe"]
    n_chunks = cfg["chunks"]
    if not 0 <= chunk < n_chunks:
        raise ValueError(f"chunk {chunk} is outside 0..{n_chunks - 1} (transcribe.chunks = {n_chunks})")
    posts = chunk_posts(inventory_path, chunk, n_chunks)
    model = backend if backend is not None else LazyBackend(cfg)
    settings = settings_fingerprint(cfg)
    with Journal(journal_beside(output_path), key="post_id") as journal:
        # Records made with other settings (another model, say) are stale: transcribe those posts again.
        done = {k: r for k, r in journal.read().items() if r.get("settings") == settings}
        todo = [p for p in posts if p["post_id"] not in done]
        log.info(
            "chunk %d/%d: %d posts, %d already in the journal, %d to transcribe with %s",
            chunk, n_chunks, len(posts), len(posts) - len(todo), len(todo), cfg["backend"],
        )
        started = last = time.monotonic()
        audio_total = 0.0
        for n, post in enumerate(todo, 1):
            record = transcribe_post(model, post)
            record["settings"] = settings
            journal.append(record)
            done[record["post_id"]] = record
            audio_total += record["audio_s"] or 0.0
            now = time.monotonic()
            if now - last >= PROGRESS_INTERVAL_S or n == len(todo):
                last = now
                elapsed = max(now - started, 1e-9)
                log.info(
                    "chunk %d: %d/%d transcribed, %.2f items/s, %.1f audio-s/s (RTF %.3f)",
                    chunk, n, len(todo), n / elapsed, audio_total / elapsed,
                    elapsed / audio_total if audio_total else float("nan"),
                )
    rows = [done[p["post_id"]] for p in posts]
    table = pa.Table.from_pylist([{k: r.get(k) for k in OUTPUT_SCHEMA.names} for r in rows], schema=OUTPUT_SCHEMA)
    write_parquet(table, output_path)
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    log.info("chunk %d written to %s: %s", chunk, output_path, counts)
