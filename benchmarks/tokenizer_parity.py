"""A model folder's vocab.json + merges.txt + tokenizer_config.json (read as vidlabel reads a folder without
tokenizer.json) against a tokenizer.json of the same vocabulary: how many texts get other ids.

    python benchmarks/tokenizer_parity.py ../shared/gpu-kit/qwen3vl-8b/tokenizer.json \\
        ../shared/gpu-kit/qwen3vl-8b ../shared/gpu-kit/qwen3-omni-30b-a3b/tokenizer_config.json --texts 5000

Texts: random runs of pieces that stress each step (scripts, emoji, contractions, line breaks, spaces, NFC,
special tokens both tokenizers know).
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
from pathlib import Path

PIECES = ["Hello", " world", "I'm", "DON'T", "'sand", "  ", "\n\n", "\r\n", "123456", "3.14", "naïve", "cafe\u0301",
          "日本語のテキスト", "😀👍🏽", "#ad", "@brand", "https://x.co/abc?d=1", "\t", "  spaced   out  ", "<|im_start|>",
          "<|video_pad|>", "—", "…", "Ｆｕｌｌ", "مرحبا", "Привет", " THE", " 's", "'ll", "\u00a0", "\u200b", "x\n \n"]


def main(argv=None) -> int:
    from tokenizers import Tokenizer

    from vidlabel.prepare import tokens

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reference", help="a tokenizer.json")
    ap.add_argument("vocab_folder", help="a folder with vocab.json and merges.txt")
    ap.add_argument("tokenizer_config", help="the tokenizer_config.json to read them with")
    ap.add_argument("--texts", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    reference = Tokenizer.from_file(args.reference)
    folder = Path(tempfile.mkdtemp())
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(Path(args.vocab_folder) / name, folder / name)
    shutil.copy(args.tokenizer_config, folder / "tokenizer_config.json")
    kind, ours = tokens.load_tokenizer(str(folder))
    rng = random.Random(args.seed)
    texts = ["".join(rng.choice(PIECES) for _ in range(rng.randint(1, 40))) for _ in range(args.texts)]
    theirs = [e.ids for e in reference.encode_batch(texts, add_special_tokens=False)]
    mine = [e.ids for e in ours.encode_batch(texts, add_special_tokens=False)]
    different = [t for t, a, b in zip(texts, theirs, mine) if a != b]
    print(f"{kind}: {len(texts)} texts, {sum(map(len, theirs))} tokens; {len(different)} with other ids"
          + (f", e.g. {different[0][:60]!r}" if different else ""))
    shutil.rmtree(folder)
    return 1 if different else 0


if __name__ == "__main__":
    sys.exit(main())
