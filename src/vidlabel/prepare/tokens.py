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


def load_tokenizer(path: str):
    """A tokenizer from a local ``tokenizer.json`` (or a directory holding one).

    Uses the ``tokenizers`` library (installed with faster-whisper); falls back to
    ``transformers.AutoTokenizer`` for directories without tokenizer.json.
    """
    if path in _TOKENIZERS:
        return _TOKENIZERS[path]
    p = Path(path).expanduser()
    if not p.exists():
        raise TokenizerUnavailable(f"planning.tokenizer: {path!r} does not exist (give a local path to a "
                                   "tokenizer.json or a model directory, or null for the approximation)")
    file = p / "tokenizer.json" if p.is_dir() else p
    tok = None
    if file.is_file():
        try:
            from tokenizers import Tokenizer
        except ImportError:
            Tokenizer = None
        if Tokenizer is not None:
            tok = ("tokenizers", Tokenizer.from_file(str(file)))
    if tok is None:
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise TokenizerUnavailable(
                f"planning.tokenizer: cannot load {path!r}: neither the 'tokenizers' package (for a "
                "tokenizer.json) nor 'transformers' is installed; install one (pip install tokenizers) "
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
