"""Visual/text token estimates against hand-computed cases."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from vidlabel.core import config as cfgmod
from vidlabel.prepare import tokens as tk

S = tk.Sampling()  # fps 2, 4..768 frames, 100,352..602,112 pixels


def one(est: tk.VisualEstimate):
    return int(est.frames[0]), int(est.height[0]), int(est.width[0]), int(est.tokens[0])


def test_reference_example_720x1280_32_frames():
    # 720x1280 -> nearest 28-multiples 728x1288 = 937,664 px > 602,112: beta = sqrt(921,600/602,112)
    # = 1.2372; 720/beta = 581.97 -> floor 560; 1280/beta = 1034.6 -> floor 1008; 20x36 cells;
    # 32 frames = 16 pairs -> 16 * 720 = 11,520.
    assert tuple(int(x[0]) for x in tk.smart_resize(720, 1280, S.min_pixels, S.max_pixels)) == (560, 1008)
    # 16 s at 2 fps = 32 frames
    assert one(tk.qwen2_5_vl(np.array([16.0]), np.array([30.0]), np.array([1280]), np.array([720]), S)) == \
        (32, 560, 1008, 11520)


def test_portrait_is_the_transpose_of_landscape():
    land = one(tk.qwen2_5_vl(np.array([16.0]), np.array([30.0]), np.array([1280]), np.array([720]), S))
    port = one(tk.qwen2_5_vl(np.array([16.0]), np.array([30.0]), np.array([720]), np.array([1280]), S))
    assert port == (32, 1008, 560, 11520)
    assert land[1:3] == port[2:0:-1]


def test_within_bounds_rounds_to_nearest_multiple():
    # 480x640: 17.14 -> 17*28 = 476, 22.86 -> 23*28 = 644; 476*644 = 306,544 within bounds.
    h, w = tk.smart_resize(480, 640, S.min_pixels, S.max_pixels)
    assert (int(h[0]), int(w[0])) == (476, 644)
    # 10 s at 2 fps = 20 frames = 10 pairs of 17*23 cells
    assert one(tk.qwen2_5_vl(np.array([10.0]), np.array([25.0]), np.array([640]), np.array([480]), S))[3] == 10 * 17 * 23


def test_below_min_pixels_scales_up_with_ceil():
    # 144x256 = 36,864 px < 100,352: beta = sqrt(100,352/36,864) = 1.64992;
    # 144*beta = 237.59 -> 8.49 cells -> ceil 9 = 252; 256*beta = 422.38 -> 15.08 cells -> ceil 16 = 448.
    h, w = tk.smart_resize(144, 256, S.min_pixels, S.max_pixels)
    assert (int(h[0]), int(w[0])) == (252, 448)
    assert int(h[0]) * int(w[0]) >= S.min_pixels


def test_lower_max_pixels_shrinks_frames():
    s = S.with_(max_pixels=200_704)  # 256 cells
    # 1080x1920: beta = sqrt(2,073,600/200,704) = 3.2143; 1080/beta = 336.0 -> 336; 1920/beta = 597.3 -> 588
    h, w = tk.smart_resize(1080, 1920, s.min_pixels, s.max_pixels)
    assert (int(h[0]), int(w[0])) == (336, 588)
    assert int(h[0]) * int(w[0]) <= s.max_pixels


def test_frames_clamped_to_min_max_and_even():
    d = np.array([0.5, 3.3, 7.4, 1000.0])
    frames = tk.qwen_frames(d, np.full(4, 30.0), S)
    # 1 frame -> min 4; 6.6 -> even 6; 14.8 -> 14; 2000 -> max 768
    assert frames.tolist() == [4, 6, 14, 768]
    s = S.with_(fps=1.0, max_frames=100)
    assert tk.qwen_frames(np.array([333.0]), np.array([30.0]), s).tolist() == [100]


def test_never_more_frames_than_the_file_has():
    # 60 s at 0.5 fps holds 30 frames; the server would ask for 120 at 2 fps.
    assert tk.qwen_frames(np.array([60.0]), np.array([0.5]), S).tolist() == [30]
    # 1 s at 2 fps: the file has 2 frames, fewer than min_frames.
    assert tk.qwen_frames(np.array([1.0]), np.array([2.0]), S).tolist() == [2]
    # A file of 3 frames: vLLM samples an even count, 2 of them, one pair.
    est = tk.qwen2_5_vl(np.array([10.0]), np.array([0.3]), np.array([640]), np.array([480]), S)
    assert int(est.frames[0]) == 2 and int(est.tokens[0]) == 1 * 17 * 23


def test_frames_floor_like_vllm_not_round():
    # 1223 frames at 30 fps (40.77 s) at 2 fps: 81.5 -> 80 frames (vLLM), not round(81.5) = 82.
    assert tk.qwen_frames(np.array([1223 / 30]), np.array([30.0]), S).tolist() == [80]
    assert tk.qwen_frames(np.array([534 / 30]), np.array([30.0]), S).tolist() == [34]


def test_unknown_source_fps_does_not_cap():
    assert tk.qwen_frames(np.array([10.0]), np.array([np.nan]), S).tolist() == [20]


def test_fixed_frames_family():
    est = tk.fixed_frames(np.array([60.0, 1.0]), np.array([30.0, 10.0]), np.array([1280, 1280]),
                          np.array([720, 720]), S)
    # 32 frames regardless of duration; a 10-frame file gives all its 10 frames = 5 pairs.
    assert est.frames.tolist() == [32, 10]
    assert est.tokens.tolist() == [16 * 720, 5 * 720]


def test_registry_and_config_dispatch():
    cfg = cfgmod.validate({"posts": "p.csv", "media_root": "/m"})
    a = tk.estimate_visual(cfg, [60.0], [30.0], [1280], [720])
    assert int(a.tokens[0]) == 60 * 720  # 120 frames = 60 pairs
    cfg["planning"]["model_family"] = "fixed_frames"
    assert int(tk.estimate_visual(cfg, [60.0], [30.0], [1280], [720]).tokens[0]) == 16 * 720

    @tk.register("one_token_per_frame")
    def _rule(d, f, w, h, s):
        frames = np.round(d).astype(np.int64)
        return tk.VisualEstimate(frames, h.astype(np.int64), w.astype(np.int64), frames)

    try:
        cfg["planning"]["model_family"] = "one_token_per_frame"
        assert int(tk.estimate_visual(cfg, [7.0], [30.0], [64], [64]).tokens[0]) == 7
        cfg["planning"]["model_family"] = "nope"
        with pytest.raises(ValueError, match="nope"):
            tk.estimate_visual(cfg, [7.0], [30.0], [64], [64])
    finally:
        tk.VISUAL_RULES.pop("one_token_per_frame", None)


def test_approx_text_tokens_counts_utf8_bytes():
    out = tk.approx_text_tokens(["a" * 400, "", None, "日本語" * 4])  # 36 bytes
    assert out.tolist() == [100 + tk.CHAT_OVERHEAD_TOKENS, tk.CHAT_OVERHEAD_TOKENS,
                            tk.CHAT_OVERHEAD_TOKENS, 9 + tk.CHAT_OVERHEAD_TOKENS]


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
    assert out.tolist() == [3 + tk.CHAT_OVERHEAD_TOKENS, 1 + tk.CHAT_OVERHEAD_TOKENS]


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


# ---------------------------------------------------------------- images

B = tk.ImageBounds()  # the Qwen2.5-VL preprocessor's 3,136 .. 12,845,056 pixels


def test_image_bounds_default_to_the_preprocessor_config():
    cfg = cfgmod.validate({"posts": "p.csv", "media_root": "/m"})
    assert tk.ImageBounds.from_config(cfg) == B == tk.ImageBounds(3136, 12845056)


def test_a_1080x1920_photo_is_2691_cells_plus_its_markers():
    # 1080/28 = 38.57 -> 39 cells, 1920/28 = 68.57 -> 69; 1092*1932 = 2,109,744 px within bounds.
    assert tk.image_cells([1080], [1920], B).tolist() == [39 * 69]
    assert tk.image_tokens([1080], [1920], B).tolist() == [2691 + 2]


def test_image_tokens_shrink_above_and_grow_below_the_bounds():
    # 8000x6000 = 48 Mpx > bound: beta = sqrt(48e6/12,845,056) = 1.9331; 6000/beta = 3103.8 -> floor
    # 110 cells; 8000/beta = 4138.4 -> 147 cells.
    assert tk.image_cells([8000], [6000], B).tolist() == [147 * 110]
    # 20x20 = 400 px < 3,136: beta = 2.8, 56x56 -> 2x2 cells.
    assert tk.image_cells([20], [20], B).tolist() == [4]
    # A lowered bound per post (the slideshow plan): 1080x1920 at 736,960 px -> 616x1120 = 22x40 cells.
    assert tk.image_cells([1080], [1920], B, max_pixels=736960).tolist() == [22 * 40]
