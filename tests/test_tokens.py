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




# The text-handling steps of Qwen3-VL-8B's (and Qwen2.5-VL's) tokenizer.json as shipped, verbatim: the reference
# that a folder with vocab.json + merges.txt alone (Qwen3-Omni's repo) must be tokenized like.
QWEN_TOKENIZER_STEPS = json.loads(r'''{
 "normalizer": {"type": "NFC"},
 "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
  {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
   "behavior": "Isolated", "invert": false},
  {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}]},
 "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}}''')

TRICKY_PIECES = ["Hello", " world", "I'm", "DON'T", "  ", "\n\n", "\r\n", "123456", "3.14", "naïve", "cafe\u0301",
                 "日本語のテキスト", "😀👍🏽", "#ad", "@brand", "https://x.co/abc?d=1", "\t", "  spaced   out  ",
                 "<|im_start|>", "<|video_pad|>", "—", "…", "Ｆｕｌｌ", "مرحبا", "Привет", " 's", "'sand", "'LLama", "\u00a0", "x\n \n"]


def _vocab_and_merges_folder(tmp_path, rng):
    """A small byte-level BPE trained with Qwen's steps: (reference tokenizer.json, a folder holding only
    its vocab.json, merges.txt and a Qwen2Tokenizer tokenizer_config.json with Qwen's special tokens)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    # Trained on whole texts (no split): its merges cross every boundary of Qwen's pre-tokenizer, so a step
    # done otherwise than Qwen's shows in the ids.
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    corpus = ["".join(rng.choice(TRICKY_PIECES) for _ in range(30)) for _ in range(300)]
    trained.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=3000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    spec = json.loads(trained.to_str())
    spec.update(QWEN_TOKENIZER_STEPS)
    reference = Tokenizer.from_str(json.dumps(spec))
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|video_pad|>"]
    reference.add_special_tokens(specials)
    folder = tmp_path / "model"
    folder.mkdir()
    reference.model.save(str(folder))  # vocab.json, merges.txt
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": {str(reference.token_to_id(t)): {
            "content": t, "special": True, "normalized": False, "lstrip": False, "rstrip": False,
            "single_word": False} for t in specials}}))
    return reference, folder


def test_a_folder_with_vocab_and_merges_alone_tokenizes_as_its_tokenizer_json_would(tmp_path):
    import random

    rng = random.Random(3)
    reference, folder = _vocab_and_merges_folder(tmp_path, rng)
    assert not (folder / "tokenizer.json").exists()
    kind, tok = tk.load_tokenizer(str(folder))
    assert kind == "tokenizers"
    texts = ["".join(rng.choice(TRICKY_PIECES) for _ in range(rng.randint(1, 40))) for _ in range(2000)]
    ours = [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
    theirs = [e.ids for e in reference.encode_batch(texts, add_special_tokens=False)]
    assert sum(a != b for a, b in zip(ours, theirs)) == 0
    assert tok.token_to_id("<|video_pad|>") == reference.token_to_id("<|video_pad|>")
    assert any(reference.token_to_id("<|im_start|>") in ids for ids in ours)  # a special token stays whole


def test_a_folder_whose_added_tokens_disagree_with_its_vocabulary_is_refused(tmp_path):
    import random

    _, folder = _vocab_and_merges_folder(tmp_path, random.Random(3))
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings["added_tokens_decoder"] = {str(int(k) + 5): v for k, v in settings["added_tokens_decoder"].items()}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    with pytest.raises(tk.TokenizerUnavailable, match="got id"):
        tk.load_tokenizer(str(folder))


def test_without_a_usable_tokenizer_the_error_says_why_transformers_failed(tmp_path, monkeypatch):
    folder = tmp_path / "unknown-class"
    folder.mkdir()
    for name in ("vocab.json", "merges.txt"):
        (folder / name).write_text("{}" if name.endswith("json") else "#version: 0.2\n")
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "SomeOtherTokenizer"}))
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(tk.TokenizerUnavailable, match="Qwen2Tokenizer.*transformers cannot be imported"):
        tk.load_tokenizer(str(folder))
