"""Stage 2: real Whisper (tiny.en, offline) through run_chunk, both backends; crash and resume."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from demo_media import get_demo_set, whisper_tiny_en

from vidlabel.core.journal import iter_records, journal_beside
from vidlabel.prepare.sharding import stable_chunk
from vidlabel.prepare.transcribe import chunk_items, run_chunk

os.environ["HF_HUB_OFFLINE"] = "1"  # the model is loaded by path; nothing may be downloaded

N_GOOD = 4  # a handful of short clips: Whisper on 2 CPU cores


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return get_demo_set(tmp_path_factory, n=N_GOOD)


@pytest.fixture(scope="session")
def openai_checkpoint(tmp_path_factory) -> Path:
    """tiny.en converted from CTranslate2 to an openai-whisper checkpoint, once per test session."""
    from whisper_convert import convert

    return convert(whisper_tiny_en(), tmp_path_factory.mktemp("whisper") / "tiny.en.pt")


def whisper_config(demo, **overrides):
    transcribe = {
        "chunks": 1,
        "backend": "faster-whisper",
        "model": str(whisper_tiny_en()),
        "device": "cpu",
        "compute_type": "int8",
        "beam_size": 5,
        "vad": True,
        "threads": 2,
    }
    transcribe.update(overrides)
    return demo.config(transcribe=transcribe)


def words(text: str) -> list[str]:
    return re.findall(r"[a-z']+", text.lower())


def assert_transcribed(expected: dict, rows: dict) -> None:
    """Every spoken sentence comes back (tiny.en on synthetic speech: allow a word or two to differ)."""
    for post_id, row in rows.items():
        exp = expected[post_id]
        if exp["kind"] != "speech":
            continue
        assert row["status"] == "ok" and row["error"] is None, row
        spoken, heard = words(exp["text"]), set(words(row["text"]))
        found = [w for w in spoken if w in heard]
        assert len(found) >= 0.75 * len(spoken), (exp["text"], row["text"])
        assert ("buy" in heard) == exp["promotes_product"], (exp["text"], row["text"])
        assert row["language"] == "en"
        segments = json.loads(row["segments"])
        assert segments and all(s["end"] > s["start"] >= 0 for s in segments)
        assert row["audio_s"] == pytest.approx(3.0, abs=1.2)


def valid_posts(demo) -> set[str]:
    return {p for p, e in demo.expected.items() if e["probe_ok"]}


def read_chunk(path) -> dict:
    rows = pq.read_table(path).to_pylist()
    assert len(rows) == len({r["post_id"] for r in rows}), "a post appears twice"
    return {r["post_id"]: r for r in rows}


def test_faster_whisper_transcribes_the_spoken_words(demo, tmp_path, caplog):
    out = tmp_path / "chunk-0.parquet"
    with caplog.at_level(logging.INFO, logger="vidlabel.prepare.transcribe"):
        run_chunk(whisper_config(demo), demo.inventory, 0, out)
    rows = read_chunk(out)
    assert set(rows) == valid_posts(demo)  # probe errors are not transcribed
    assert_transcribed(demo.expected, rows)
    # VAD on: silence stays silent instead of becoming "You".
    assert rows["silent-audio"]["status"] == "ok"
    assert rows["silent-audio"]["text"] == ""
    assert rows["no-audio"]["status"] == "no_audio" and rows["no-audio"]["text"] is None
    assert re.search(r"items/s, [\d.]+ audio-s/s \(RTF [\d.]+\)", caplog.text)


def test_chunks_partition_the_valid_posts_by_stable_hash(demo):
    chunks = [chunk_items(demo.inventory, i, 3) for i in range(3)]
    ids = [p["post_id"] for chunk in chunks for p in chunk]
    assert sorted(ids) == sorted(valid_posts(demo))
    for i, chunk in enumerate(chunks):
        assert all(stable_chunk(p["post_id"], 3) == i for p in chunk)


def test_no_audio_chunk_and_journaled_chunk_never_load_the_model(demo, tmp_path):
    table = pq.read_table(demo.inventory)
    only_no_audio = table.filter([pid == "no-audio" for pid in table.column("post_id").to_pylist()])
    inventory = tmp_path / "inventory.parquet"
    pq.write_table(only_no_audio, inventory)
    config = whisper_config(demo, model=str(tmp_path / "no-such-model"))  # loading it would fail
    out = tmp_path / "chunk-0.parquet"
    run_chunk(config, inventory, 0, out)
    assert read_chunk(out)["no-audio"]["status"] == "no_audio"
    # Everything journaled: the output is rebuilt from the journal alone.
    out.unlink()
    run_chunk(config, inventory, 0, out)
    assert list(read_chunk(out)) == ["no-audio"]


def test_unreadable_audio_is_an_error_record(demo, tmp_path):
    broken = demo.media / "became-unreadable.mp4"
    broken.write_text("overwritten after the inventory ran")
    table = pq.read_table(demo.inventory).slice(0, 1).to_pylist()
    table[0].update(post_id="gone-bad", video_path=str(broken))
    table[0]["items"][0]["path"] = str(broken)
    inventory = tmp_path / "inventory.parquet"
    pq.write_table(pa.Table.from_pylist(table), inventory)
    out = tmp_path / "chunk-0.parquet"
    run_chunk(whisper_config(demo, model=str(tmp_path / "no-such-model")), inventory, 0, out)
    row = read_chunk(out)["gone-bad"]
    assert row["status"] == "error"
    assert "audio decode failed" in row["error"] and ("moov atom not found" in row["error"] or "Invalid data" in row["error"])


def test_crash_mid_chunk_then_resume_transcribes_only_the_rest(demo, tmp_path):
    out = tmp_path / "chunk-0.parquet"
    journal = journal_beside(out)
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(whisper_config(demo)))
    script = textwrap.dedent(
        f"""
        import json, logging, sys
        logging.basicConfig(level=logging.INFO, stream=sys.stderr)
        from vidlabel.prepare.transcribe import run_chunk
        run_chunk(json.load(open({str(config_file)!r})), {str(demo.inventory)!r}, 0, {str(out)!r})
        """
    )
    total = len(valid_posts(demo))
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, env=os.environ.copy())
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if len(list(iter_records(journal))) >= 1:
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.01)
    finally:
        if proc.poll() is None:
            proc.kill()
        stderr = proc.communicate()[1].decode()
    assert proc.returncode == -signal.SIGKILL, f"the job ended on its own before the kill:\n{stderr}"
    before = [r["post_id"] for r in iter_records(journal)]
    assert 1 <= len(before) < total
    assert not out.exists()  # no partial output

    run_chunk(whisper_config(demo), demo.inventory, 0, out)

    lines = [json.loads(line) for line in journal.read_bytes().splitlines()]
    ids = [r["post_id"] for r in lines]
    # Every post was transcribed exactly once over both runs: the rerun appended only the missing ones.
    assert sorted(ids) == sorted(valid_posts(demo))
    assert ids[: len(before)] == before
    rows = read_chunk(out)
    assert set(rows) == valid_posts(demo)
    assert_transcribed(demo.expected, rows)


def test_openai_whisper_vocabulary_matches_the_converted_model(openai_checkpoint):
    """tiny.en is English-only: openai-whisper must pick its GPT-2 tokenizer (n_vocab 51864), whose
    tokens must be the very ones the CTranslate2 model was trained with (vocabulary.txt)."""
    import torch
    from whisper.tokenizer import get_tokenizer

    dims = torch.load(openai_checkpoint, map_location="cpu")["dims"]
    assert dims["n_vocab"] == 51864 and dims["n_audio_layer"] == 4 and dims["n_text_head"] == 6
    vocabulary = (whisper_tiny_en() / "vocabulary.txt").read_text(encoding="utf-8").splitlines()
    assert len(vocabulary) == dims["n_vocab"]
    tokenizer = get_tokenizer(multilingual=dims["n_vocab"] >= 51865)
    byte_chars = _gpt2_byte_chars()
    for token_id in range(tokenizer.eot):  # ordinary tokens: byte for byte
        raw = tokenizer.encoding.decode_single_token_bytes(token_id)
        assert "".join(byte_chars[b] for b in raw) == vocabulary[token_id], (token_id, raw)
    # The special tokens the decoder relies on sit at the same ids. (Some are spelled differently
    # between releases: <|nospeech|> was <|nocaptions|>, <|he|> was <|iw|>.)
    special = {
        "eot": {"<|endoftext|>"},
        "sot": {"<|startoftranscript|>"},
        "transcribe": {"<|transcribe|>"},
        "translate": {"<|translate|>"},
        "sot_prev": {"<|startofprev|>"},
        "sot_lm": {"<|startoflm|>"},
        "no_speech": {"<|nospeech|>", "<|nocaptions|>"},
        "no_timestamps": {"<|notimestamps|>"},
        "timestamp_begin": {"<|0.00|>"},
    }
    for attribute, names in special.items():
        assert vocabulary[getattr(tokenizer, attribute)] in names, attribute
    assert vocabulary[tokenizer.encoding.encode_single_token("<|en|>")] == "<|en|>"


def _gpt2_byte_chars() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (how vocabulary.txt spells tokens)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def test_openai_whisper_backend_transcribes_the_spoken_words(demo, openai_checkpoint, tmp_path):
    table = pq.read_table(demo.inventory)
    keep = {"good-01", "good-02", "silent-audio"}  # openai-whisper is slower: two clips and silence
    subset = table.filter([pid in keep for pid in table.column("post_id").to_pylist()])
    inventory = tmp_path / "inventory.parquet"
    pq.write_table(subset, inventory)
    out = tmp_path / "chunk-0.parquet"
    # One thread: PyTorch with 2 OpenMP threads slows down badly when the 2 cores are shared.
    config = whisper_config(demo, backend="openai-whisper", model=str(openai_checkpoint), threads=1)
    run_chunk(config, inventory, 0, out)
    rows = read_chunk(out)
    assert set(rows) == keep
    assert_transcribed(demo.expected, rows)
    assert rows["silent-audio"]["status"] == "ok" and rows["silent-audio"]["text"] == ""


def test_changed_settings_make_journal_records_stale(demo, tmp_path):
    table = pq.read_table(demo.inventory)
    only_no_audio = table.filter([pid == "no-audio" for pid in table.column("post_id").to_pylist()])
    inventory = tmp_path / "inventory.parquet"
    pq.write_table(only_no_audio, inventory)
    out = tmp_path / "chunk-0.parquet"
    journal = tmp_path / "chunk-0.jsonl"
    config = whisper_config(demo, model=str(tmp_path / "no-such-model"))
    run_chunk(config, inventory, 0, out)
    run_chunk(config, inventory, 0, out)  # same settings: served from the journal
    assert len(journal.read_text().splitlines()) == 1
    config["transcribe"]["beam_size"] = 2
    run_chunk(config, inventory, 0, out)  # new settings: done again
    records = [json.loads(line) for line in journal.read_text().splitlines()]
    assert len(records) == 2 and records[0]["settings"] != records[1]["settings"]


# ---- transcripts keyed by what they were made from (vidlabel.core.identity) ---------------------------

def one_post_inventory(demo, tmp_path, source: str = "good-01") -> tuple[Path, Path]:
    """An inventory of one speech post whose video is a private copy (so that a test may replace it)."""
    row = next(r for r in pq.read_table(demo.inventory).to_pylist() if r["post_id"] == source)
    video = tmp_path / "media" / "post.mp4"
    video.parent.mkdir(exist_ok=True)
    video.write_bytes(Path(row["video_path"]).read_bytes())
    row.update(post_id="post", video_path=str(video))
    row["items"][0]["path"] = str(video)
    inventory = tmp_path / "inventory.parquet"
    pq.write_table(pa.Table.from_pylist([row]), inventory)
    return inventory, video


def test_the_transcription_settings_are_the_stage_declaration(demo, tmp_path):
    """transcribe.device is one of the stage's result settings (vidlabel.core.stage_settings.STAGES): a
    transcript made on another device is made again, like one of another model or beam size."""
    inventory, _ = one_post_inventory(demo, tmp_path)
    out = tmp_path / "chunk-0.parquet"
    run_chunk(whisper_config(demo, device="auto"), inventory, 0, out)
    run_chunk(whisper_config(demo, device="auto"), inventory, 0, out)
    assert len(list(iter_records(journal_beside(out)))) == 1
    run_chunk(whisper_config(demo, device="cpu"), inventory, 0, out)
    assert len(list(iter_records(journal_beside(out)))) == 2


def test_a_video_replaced_at_the_same_path_is_transcribed_again(demo, tmp_path):
    inventory, video = one_post_inventory(demo, tmp_path, "good-01")
    out = tmp_path / "chunk-0.parquet"
    run_chunk(whisper_config(demo), inventory, 0, out)
    first = read_chunk(out)["post"]
    assert "buy" in words(first["text"])
    # Downloaded again: another clip at the same path (the inventory still describes the old one).
    other = next(r["video_path"] for r in pq.read_table(demo.inventory).to_pylist() if r["post_id"] == "good-02")
    video.write_bytes(Path(other).read_bytes())
    run_chunk(whisper_config(demo), inventory, 0, out)
    second = read_chunk(out)["post"]
    assert "buy" not in words(second["text"]) and "pasta" in words(second["text"])
    assert second["transcript_id"] != first["transcript_id"]


class FlakyBackend:
    """The real Whisper model, failing its first ``fails`` calls as a GPU node's out-of-memory does."""

    def __init__(self, cfg: dict, fails: int):
        from vidlabel.prepare.transcribe import LazyBackend

        self.real, self.fails, self.calls = LazyBackend(cfg), fails, 0
        self.name = "faster-whisper"

    def transcribe(self, audio):
        self.calls += 1
        if self.calls <= self.fails:
            raise RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB")
        return self.real.transcribe(audio)


def test_a_passing_failure_is_retried_then_fails_the_chunk_and_the_rerun_finishes_it(demo, tmp_path):
    inventory, _ = one_post_inventory(demo, tmp_path)
    out = tmp_path / "chunk-0.parquet"
    config = whisper_config(demo)
    flaky = FlakyBackend(config["transcribe"], fails=100)
    with pytest.raises(Exception, match=r"1 item\(s\).*post item 0.*CUDA out of memory"):
        run_chunk(config, inventory, 0, out, backend=flaky)
    assert flaky.calls >= 2  # tried again within the job
    assert not out.exists()  # no chunk with a missing transcript in it
    records = list(iter_records(journal_beside(out)))
    assert records and all(r["status"] == "error" and r["retryable"] for r in records)
    # The passing cause is gone: the same command transcribes it.
    run_chunk(config, inventory, 0, out, backend=FlakyBackend(config["transcribe"], fails=0))
    row = read_chunk(out)["post"]
    assert row["status"] == "ok" and "buy" in words(row["text"])


def test_a_failure_that_never_passes_becomes_terminal_after_a_bound_of_runs(demo, tmp_path):
    inventory, _ = one_post_inventory(demo, tmp_path)
    out = tmp_path / "chunk-0.parquet"
    config = whisper_config(demo)
    for run in range(10):
        try:
            run_chunk(config, inventory, 0, out, backend=FlakyBackend(config["transcribe"], fails=10**6))
            break
        except Exception as exc:
            assert "CUDA out of memory" in str(exc)
    assert 1 <= run <= 5  # a few runs, not for ever
    row = read_chunk(out)["post"]
    assert row["status"] == "error" and "CUDA out of memory" in row["error"] and row["text"] is None
