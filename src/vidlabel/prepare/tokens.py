"""Text tokens of the prompts, before any GPU time is spent.

Media tokens (videos, images, audio) are the model family's (vidlabel.families); this module counts the
text: from a tokenizer when ``planning.tokenizer`` names a local one, else a documented approximation
(``approx_text_tokens``), plus the tokens the family's chat template puts around one user turn
(``Family.chat_overhead_tokens``; each media item counts its own markers).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from vidlabel import families

# Text approximation: about 4 bytes of UTF-8 per token for English BPE vocabularies (Qwen's
# included); counting bytes rather than characters keeps CJK text (3 bytes, ~1 token per
# character) from being undercounted by 4x.
BYTES_PER_TOKEN = 4.0


# ---------------------------------------------------------------- text tokens

def approx_text_tokens(texts: Sequence[str | None] | np.ndarray, overhead: int) -> np.ndarray:
    """ceil(UTF-8 bytes / 4) + the chat template's ``overhead``, per text (see module constants)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    arr = texts if isinstance(texts, (pa.Array, pa.ChunkedArray)) else pa.array(list(texts), type=pa.string())
    nbytes = pc.fill_null(pc.binary_length(arr), 0).to_numpy(zero_copy_only=False).astype(np.float64)
    return (np.ceil(nbytes / BYTES_PER_TOKEN) + overhead).astype(np.int64)


class TokenizerUnavailable(RuntimeError):
    """planning.tokenizer is set but cannot be loaded."""


_TOKENIZERS: dict[str, object] = {}

# Byte-level BPE tokenizers that a model folder may ship as vocab.json + merges.txt alone (Qwen3-Omni's
# repo has no tokenizer.json): the pre-tokenizer regex of each tokenizer class, as the class's fast
# tokenizer in transformers builds it (the same text as the "Split" step of Qwen2.5-VL's and Qwen3-VL's
# tokenizer.json). NFC normalisation and byte-level mapping are common to them.
BYTE_LEVEL_BPE_PATTERNS = {
    "Qwen2Tokenizer": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                       r"|\s*[\r\n]+|\s+(?!\S)|\s+"),
}


def byte_level_bpe(folder: Path):
    """The fast tokenizer of ``folder``'s vocab.json, merges.txt and tokenizer_config.json (its class's
    pre-tokenizer and its added tokens), or None when the folder lacks one of them or names a class
    not in BYTE_LEVEL_BPE_PATTERNS."""
    import json

    files = [folder / name for name in ("vocab.json", "merges.txt", "tokenizer_config.json")]
    if not all(f.is_file() for f in files):
        return None
    settings = json.loads(files[2].read_text())
    pattern = BYTE_LEVEL_BPE_PATTERNS.get(settings.get("tokenizer_class"))
    if pattern is None:
        return None
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    tok = Tokenizer(models.BPE.from_file(str(files[0]), str(files[1])))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    added = sorted(settings.get("added_tokens_decoder", {}).items(), key=lambda kv: int(kv[0]))
    for token_id, spec in added:
        token = AddedToken(spec["content"], single_word=spec.get("single_word", False),
                           lstrip=spec.get("lstrip", False), rstrip=spec.get("rstrip", False),
                           normalized=spec.get("normalized", False), special=spec.get("special", False))
        if token.special:
            tok.add_special_tokens([token])
        else:
            tok.add_tokens([token])
        if tok.token_to_id(spec["content"]) != int(token_id):
            raise TokenizerUnavailable(f"planning.tokenizer: {str(folder)!r}: added token {spec['content']!r} "
                                       f"got id {tok.token_to_id(spec['content'])}, its config says {token_id}")
    return tok


def load_tokenizer(path: str):
    """A tokenizer from a local ``tokenizer.json`` (or a directory holding one), else from a directory's
    vocab.json + merges.txt (``byte_level_bpe``), both with the ``tokenizers`` library; else
    ``transformers.AutoTokenizer`` where it is installed."""
    if path in _TOKENIZERS:
        return _TOKENIZERS[path]
    p = Path(path).expanduser()
    if not p.exists():
        raise TokenizerUnavailable(f"planning.tokenizer: {path!r} does not exist (give a local path to a "
                                   "tokenizer.json or a model directory, or null for the approximation)")
    file = p / "tokenizer.json" if p.is_dir() else p
    if file.is_file():
        from tokenizers import Tokenizer

        tok = ("tokenizers", Tokenizer.from_file(str(file)))
    elif p.is_dir() and (bpe := byte_level_bpe(p)) is not None:
        tok = ("tokenizers", bpe)
    else:
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:  # missing, or broken by another package's version: say which
            raise TokenizerUnavailable(
                f"planning.tokenizer: cannot load {path!r}: it has no tokenizer.json, nor a vocab.json, "
                f"merges.txt and tokenizer_config.json of a known class ({', '.join(BYTE_LEVEL_BPE_PATTERNS)}), "
                f"and transformers cannot be imported ({exc}); give a folder or file with a tokenizer.json, "
                "or set planning.tokenizer to null to use the approximation") from None
        tok = ("transformers", AutoTokenizer.from_pretrained(str(p), local_files_only=True))
    _TOKENIZERS[path] = tok
    return tok


def tokenizer_text_tokens(path: str, texts: Sequence[str | None], overhead: int) -> np.ndarray:
    """Exact token counts of the texts + the chat template's ``overhead``."""
    kind, tok = load_tokenizer(path)
    texts = [t or "" for t in texts]
    if kind == "tokenizers":
        counts = [len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False)]
    else:
        counts = [len(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]]
    return np.asarray(counts, dtype=np.int64) + overhead


def estimate_text(config: dict, texts) -> np.ndarray:
    """Text tokens per prompt with the family's chat template: tokenizer when ``planning.tokenizer`` is set,
    else the approximation."""
    path = config["planning"].get("tokenizer")
    overhead = families.of_config(config).chat_overhead_tokens
    if path:
        if not isinstance(texts, list):
            texts = texts.to_pylist() if hasattr(texts, "to_pylist") else list(texts)
        return tokenizer_text_tokens(path, texts, overhead)
    return approx_text_tokens(texts, overhead)
