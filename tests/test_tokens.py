"""Text token estimates: the approximation, a tokenizer, and each family's chat template."""

from __future__ import annotations

import json
import sys

import pytest

from vidlabel.core import config as cfgmod
from vidlabel.prepare import tokens as tk


def test_approx_text_tokens_counts_utf8_bytes():
    out = tk.approx_text_tokens(["a" * 400, "", None, "日本語" * 4], 19)  # 36 bytes
    assert out.tolist() == [100 + 19, 19, 19, 9 + 19]


@pytest.mark.parametrize("model, overhead", [("Qwen/Qwen2.5-VL-7B-Instruct", 19), ("Qwen/Qwen3-VL-8B-Instruct", 8),
                                             ("Qwen/Qwen3-Omni-30B-A3B-Instruct", 8)])
def test_the_chat_template_overhead_is_the_family_s(model, overhead):
    # Rendered from each checkpoint's chat template and counted with its tokenizer: Qwen2.5-VL's adds a
    # default system turn, the Qwen3 families' do not.
    cfg = cfgmod.validate({"posts": "p.csv", "media_root": "/m", "classify": {"model": model}})
    assert tk.estimate_text(cfg, ["abcd"]).tolist() == [1 + overhead]


def test_tokenizer_path(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = cfgmod.validate({"posts": "p.csv", "media_root": "/m"})
    cfg["planning"]["tokenizer"] = str(tmp_path)
    out = tk.estimate_text(cfg, ["hello world hello", "x"])
    assert out.tolist() == [3 + 19, 1 + 19]  # Qwen2.5-VL's chat template around them


def test_missing_tokenizer_is_a_clear_error(tmp_path, monkeypatch):
    cfg = cfgmod.validate({"posts": "p.csv", "media_root": "/m"})
    cfg["planning"]["tokenizer"] = str(tmp_path / "absent")
    with pytest.raises(tk.TokenizerUnavailable, match="planning.tokenizer"):
        tk.estimate_text(cfg, ["hi"])
    # A directory without tokenizer.json needs transformers; without it, the error says so.
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps({}))
    cfg["planning"]["tokenizer"] = str(tmp_path / "empty")
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    with pytest.raises(tk.TokenizerUnavailable, match="transformers"):
        tk.estimate_text(cfg, ["hi"])


