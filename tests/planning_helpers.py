"""Test media and inventory tables for the planning, transcode and manifest tests."""

from __future__ import annotations

from pathlib import Path

import ffmpeg
import pyarrow as pa

from vidlabel.core.io import write_parquet

INVENTORY_SCHEMA = pa.schema([
    ("post_id", pa.string()), ("source_path", pa.string()), ("video_path", pa.string()),
    ("caption", pa.string()), ("size_bytes", pa.int64()), ("duration_s", pa.float64()),
    ("fps", pa.float64()), ("width", pa.int64()), ("height", pa.int64()), ("video_codec", pa.string()),
    ("has_audio", pa.bool_()), ("probe_error", pa.string()),
])


def make_clip(path: Path, width: int, height: int, seconds: float, rate: int = 30) -> Path:
    """A silent H.264 test-pattern clip (lavfi testsrc2)."""
    src = ffmpeg.input(f"testsrc2=size={width}x{height}:rate={rate}", f="lavfi", t=seconds)
    (ffmpeg.output(src, str(path), vcodec="libx264", preset="ultrafast", crf=35, pix_fmt="yuv420p")
     .overwrite_output().global_args("-nostdin", "-v", "error").run(capture_stdout=True, capture_stderr=True))
    return path


def inventory_row(post_id: str, path: Path | str, *, duration_s=None, fps=None, width=None, height=None,
                  caption=None, probe_error=None) -> dict:
    return {"post_id": post_id, "source_path": str(path), "video_path": str(path), "caption": caption,
            "size_bytes": Path(path).stat().st_size if Path(path).exists() else None,
            "duration_s": duration_s, "fps": fps, "width": width, "height": height,
            "video_codec": "h264" if probe_error is None else None, "has_audio": False,
            "probe_error": probe_error}


def write_inventory(rows: list[dict], path: Path) -> Path:
    write_parquet(pa.Table.from_pylist(rows, schema=INVENTORY_SCHEMA), path)
    return path


def write_transcripts(rows: list[dict], path: Path) -> Path:
    schema = pa.schema([("post_id", pa.string()), ("text", pa.string()), ("language", pa.string()),
                        ("segments", pa.string()), ("status", pa.string()), ("error", pa.string()),
                        ("audio_s", pa.float64())])
    full = [{"language": "en", "segments": "[]", "error": None, "audio_s": 1.0, **r} for r in rows]
    write_parquet(pa.Table.from_pylist(full, schema=schema), path)
    return path
