"""Stage 2, transcribe: Whisper transcripts of every media item with sound, one chunk job at a time.

Two backends behind one interface (``transcribe.backend``): faster-whisper (CTranslate2, the
default, about 3x faster on CPU) and openai-whisper (PyTorch). Audio is piped from ffmpeg into a
16 kHz float32 array, never through a temp file. The items transcribed are every usable video item
(its speech) and every audio item (a slideshow's soundtrack) of the chunk's posts, each under its own
identity (``transcript_id``: the audio file and the transcription settings), so a file two posts share
is transcribed once. Every finished transcript is appended to the chunk's journal (key
``transcript_id``), so a rerun after a crash transcribes only what is missing, and only under the same
audio (a video replaced at the same path is transcribed again) and settings; the chunk's Parquet file
(one row per item: post_id, item_index) is written (atomically) once every item of the chunk has a
transcript or a terminal error. A failure that
is not the audio's (an I/O error, CUDA out of memory) is tried again, in the job and by the reruns,
before it becomes a terminal error (``TRIES_PER_RUN``, ``RERUN_ATTEMPT_FACTOR``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from vidlabel.core import identity
from vidlabel.core.io import write_parquet
from vidlabel.core.journal import Journal, journal_beside
from vidlabel.prepare.inventory_schema import SOUND_KINDS, items_table
from vidlabel.prepare.media import SAMPLE_RATE, AudioError, NoAudioStream, load_audio
from vidlabel.prepare.sharding import stable_chunk

log = logging.getLogger(__name__)

PROGRESS_INTERVAL_S = 10.0

OUTPUT_SCHEMA = pa.schema(
    [
        ("post_id", pa.string()),
        ("item_index", pa.int32()),  # the item's place in its post (0 for a one-video post)
        ("text", pa.string()),
        ("language", pa.string()),
        ("segments", pa.string()),
        ("status", pa.string()),
        ("error", pa.string()),
        ("audio_s", pa.float64()),
        # What it was made from: the audio item and the transcription settings (vidlabel.core.identity).
        ("transcript_id", pa.string()),
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


class PassingFailure(Exception):
    """A transcription that failed for a reason that is not the audio's (an I/O error, out of memory):
    tried again (``TRIES_PER_RUN`` times in the job, then by the rerun)."""


class TranscriptsIncomplete(RuntimeError):
    """Some items of the chunk still have no transcript after passing failures; a rerun retries them."""


# ffmpeg's words for a read that failed because of the file system, not because of the audio.
_PASSING_AUDIO_ERROR = re.compile(
    r"Input/output error|Stale file handle|Resource temporarily unavailable|Transport endpoint is not connected|"
    r"Connection timed out|Permission denied|No such file or directory", re.IGNORECASE)


def transcribe_item(backend: LazyBackend | Backend, item: dict[str, Any]) -> dict[str, Any]:
    """One journal record for one media item (``chunk_items``). Bad audio is a record (status
    ``error``); a failure that is not the audio's raises PassingFailure."""
    record: dict[str, Any] = {
        "post_id": item["post_id"],
        "text": None,
        "language": None,
        "segments": None,
        "status": "ok",
        "error": None,
        "audio_s": 0.0,
    }
    if item.get("has_audio") is False:
        record["status"] = "no_audio"
        return record
    try:
        audio, warning = load_audio(item["path"], SAMPLE_RATE, expected_s=item.get("duration_s"))
    except NoAudioStream:
        record["status"] = "no_audio"
        return record
    except AudioError as exc:
        if _PASSING_AUDIO_ERROR.search(str(exc)):
            raise PassingFailure(f"audio read failed: {exc}") from None
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
    except Exception as exc:  # CUDA out of memory, a worker lost: not a property of the audio
        raise PassingFailure(f"transcription failed: {type(exc).__name__}: {exc}") from None
    record.update(
        text=result.text,
        # Without any speech a detected language is noise (English-only models always say "en").
        language=result.language if result.segments else None,
        segments=json.dumps(result.segments, ensure_ascii=False),
        # The post is transcribed, but from damaged audio: keep ffmpeg's reason next to it.
        error=f"warning: {warning}" if warning else None,
    )
    return record


# A passing failure is tried this often per job, with this pause (times the attempt) in between;
# once its attempts over all runs reach RERUN_ATTEMPT_FACTOR x TRIES_PER_RUN its record is terminal.
TRIES_PER_RUN = 3
RETRY_PAUSE_S = 0.5
RERUN_ATTEMPT_FACTOR = 2


def transcribe_with_retries(backend: LazyBackend | Backend, item: dict[str, Any], attempts_before: int) -> dict:
    """``transcribe_item`` with passing failures tried again; their record is ``retryable`` until the
    attempts over all runs reach the bound."""
    for attempt in range(1, TRIES_PER_RUN + 1):
        try:
            record = transcribe_item(backend, item)
        except PassingFailure as exc:
            failure = str(exc)
            log.warning("post %s, item %s (%s): %s (attempt %d of %d in this job)", item["post_id"], item["index"],
                        item["path"], failure, attempt, TRIES_PER_RUN)
            if attempt < TRIES_PER_RUN:
                time.sleep(RETRY_PAUSE_S * attempt)
            continue
        return {**record, "attempts": attempts_before + attempt, "retryable": False}
    attempts = attempts_before + TRIES_PER_RUN
    retryable = attempts < RERUN_ATTEMPT_FACTOR * TRIES_PER_RUN
    if not retryable:
        failure += f"; {attempts} attempts over several runs, giving up"
    return {"post_id": item["post_id"], "text": None, "language": None, "segments": None, "status": "error",
            "error": failure, "audio_s": 0.0, "attempts": attempts, "retryable": retryable}


def chunk_items(inventory_path: str | os.PathLike, chunk: int, n_chunks: int) -> list[dict[str, Any]]:
    """The usable video and audio items of the posts of ``chunk`` (by post_id), in inventory order:
    post_id, index, path, kind, has_audio, duration_s."""
    table = items_table(pq.read_table(inventory_path))
    keep = ["post_id", "index", "path", "kind", "has_audio", "duration_s", "probe_error"]
    return [
        row
        for row in table.select(keep).to_pylist()
        if row["probe_error"] is None and row["kind"] in SOUND_KINDS and stable_chunk(row["post_id"], n_chunks) == chunk
    ]


def run_chunk(
    config: dict[str, Any],
    inventory_path: str | os.PathLike,
    chunk: int,
    output_path: str | os.PathLike,
    backend: Backend | None = None,
) -> None:
    """Transcribe the items of ``chunk``; resume from the journal; write the chunk Parquet at the end.

    A journaled transcript is reused only for the same audio item (path, size, modification time, or
    content: ``classify.media_identity``) and the same transcription settings
    (vidlabel.core.identity.transcription_settings). Raises TranscriptsIncomplete, after journaling
    the rest, when a passing failure left an item without transcript. ``backend`` replaces the
    configured one (for callers that hold a loaded model).
    """
    cfg = config["transcribe"]
    n_chunks = cfg["chunks"]
    if not 0 <= chunk < n_chunks:
        raise ValueError(f"chunk {chunk} is outside 0..{n_chunks - 1} (transcribe.chunks = {n_chunks})")
    items = chunk_items(inventory_path, chunk, n_chunks)
    model = backend if backend is not None else LazyBackend(cfg)
    settings = identity.transcription_fingerprint(config)
    audio = identity.media_items([i["path"] for i in items], config["classify"]["media_identity"],
                                 threads=cfg["threads"] * 4)
    ids = [identity.transcript_id(audio[i["path"]], settings) for i in items]
    with Journal(journal_beside(output_path), key="transcript_id") as journal:
        journaled = journal.read()
        done: dict[str, dict] = {}
        todo: dict[str, tuple[dict, int]] = {}  # one transcription per audio file and settings
        for item, tid in zip(items, ids):
            prev = journaled.get(tid)
            if prev is not None and not prev.get("retryable"):
                done[tid] = prev
            elif tid not in todo:
                todo[tid] = (item, int(prev.get("attempts") or 0) if prev else 0)
        log.info(
            "chunk %d/%d: %d items with sound (%d distinct files under these settings), %d in the journal under the "
            "same audio and settings, %d to transcribe with %s",
            chunk, n_chunks, len(items), len(set(ids)), len(done), len(todo), cfg["backend"],
        )
        started = last = time.monotonic()
        audio_total = 0.0
        for n, (tid, (item, attempts_before)) in enumerate(todo.items(), 1):
            record = transcribe_with_retries(model, item, attempts_before)
            record.update(settings=settings, audio=audio[item["path"]], transcript_id=tid)
            journal.append(record)
            done[tid] = record
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
    rows = [{**done[tid], "post_id": item["post_id"], "item_index": item["index"]} for item, tid in zip(items, ids)]
    waiting = [r for r in rows if r.get("retryable")]
    if waiting:
        raise TranscriptsIncomplete(
            f"chunk {chunk}: {len(waiting)} item(s) still have no transcript after passing failures ("
            + "; ".join(f"{r['post_id']} item {r['item_index']}: {r['error']}" for r in waiting[:5])
            + (", ..." if len(waiting) > 5 else "")
            + f"); rerun the job to retry them (the finished ones are kept in {journal_beside(output_path)})")
    table = pa.Table.from_pylist([{k: r.get(k) for k in OUTPUT_SCHEMA.names} for r in rows], schema=OUTPUT_SCHEMA)
    write_parquet(table, output_path)
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    log.info("chunk %d written to %s: %s", chunk, output_path, counts)
