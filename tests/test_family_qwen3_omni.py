"""Qwen3-Omni (vidlabel.families.qwen3_omni): its rules against the counts measured on vLLM 0.26
(docs/models.md) and hand-computed cases, its shape, and how a config of it plans."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from vidlabel import families
from vidlabel.core import config as cfgmod
from vidlabel.core import models

OMNI = families.by_name("qwen3_omni")
S = OMNI.default_sampling  # fps 2, 4..768 frames, 131,072..786,432 pixels per frame


def test_it_is_found_from_its_model_type_and_name():
    assert families.of_model_type("qwen3_omni_moe") is OMNI
    assert families.of_name("Qwen/Qwen3-Omni-30B-A3B-Instruct") is OMNI
    assert OMNI.hears_audio and OMNI.audio_rate == 16000


@pytest.mark.parametrize("seconds, width, height, video_tokens", [
    (12, 1280, 720, 8640), (40, 1280, 720, 28800), (45, 1920, 1080, 32400), (90, 1280, 720, 64800)])
def test_video_tokens_have_no_cap_on_the_total(seconds, width, height, video_tokens):
    # Each pair of frames at most 768 tokens (640x1152 at 32-pixel cells: 20 x 36 = 720), 2 frames a second:
    # measured on vLLM 0.26 (12 s 720p: 8,640 + 2; 45 s 1080p: 32,400 + 2).
    est = OMNI.video_tokens([float(seconds)], [30.0], [width], [height], S)
    assert int(est.tokens[0]) == video_tokens + 2


def test_its_video_loader_is_qwen2_vl_s_float_step_included():
    assert OMNI.sampled_frames([359], [30.0], S).tolist() == [23]  # padded to 12 pairs by the processor
    assert OMNI.sampled_frames([1223], [30.0], S).tolist() == [80]


def test_audio_is_13_tokens_a_second_and_the_remainder_s():
    # 12 s at 16 kHz: 1,200 feature frames = 12 chunks of 100 -> 156 tokens, + 2 markers.
    assert OMNI.audio_tokens([12 * 16000]).tolist() == [158]
    # A partial chunk: 3 stride-2 convolutions of its frames (1 frame -> 1 token, 100 -> 13).
    assert OMNI.audio_embeds([160, 320, 99 * 160, 100 * 160, 101 * 160]).tolist() == [1, 1, 13, 13, 14]
    # Samples are padded to whole 10 ms hops: one sample more is one feature frame more.
    assert OMNI.audio_embeds([100 * 160 + 1]).tolist() == [14]
    assert OMNI.audio_embeds([0]).tolist() == [0]


def test_audio_tokens_match_the_processor_formula_everywhere():
    def by_formula(samples: int) -> int:  # vLLM's _get_feat_extract_output_lengths on the padded length
        frames = -(-samples // 160)
        leave = frames % 100
        feat = (leave - 1) // 2 + 1
        return ((feat - 1) // 2 + 1 - 1) // 2 + 1 + (frames // 100) * 13

    samples = np.arange(1, 16000 * 3, 37)
    assert OMNI.audio_embeds(samples).tolist() == [by_formula(int(n)) for n in samples]


def test_images_at_32_pixel_cells_within_the_preprocessor_bounds():
    b = OMNI.default_image_bounds
    assert (b.min_pixels, b.max_pixels) == (3136, 12845056)
    assert OMNI.image_tokens([1920], [1080], b).tolist() == [34 * 60 + 2]


def test_model_shape_is_the_thinker_s():
    cfg = json.loads((pathlib.Path(__file__).parent / "data" / "qwen3_omni_30b_a3b" / "config.json").read_text())
    shape = OMNI.model_shape(cfg)
    # The thinker: 31.72B (audio 0.648B, vision 0.539B, text 30.221B, lm_head 0.311B); talker and code2wav are
    # not loaded by vLLM.
    assert abs(shape.parameters / 31.72e9 - 1) < 0.002
    assert shape.kv_bytes_per_token == 96 * 1024 and shape.attention_heads == 32


def test_a_config_with_only_the_model_plans_it_and_native_audio_is_a_plan_of_its_own():
    cfg = cfgmod.validate({"posts": "p.csv", "media_root": "/m",
                           "classify": {"model": "Qwen/Qwen3-Omni-30B-A3B-Instruct"}})
    assert list(models.plans(cfg)) == ["qwen3_omni"]
    assert (cfg["planning"]["min_pixels"], cfg["planning"]["max_pixels"]) == (131072, 786432)
    both = cfgmod.validate({"posts": "p.csv", "media_root": "/m", "classify": {"models": [
        {"model": "Qwen/Qwen3-Omni-30B-A3B-Instruct", "name": "heard", "audio": "native"},
        {"model": "Qwen/Qwen3-Omni-30B-A3B-Instruct", "name": "read"}]}})
    assert models.plans(both) == {"qwen3_omni-native": ["heard"], "qwen3_omni": ["read"]}
    assert not models.uses_transcripts(both, "qwen3_omni-native") and models.uses_transcripts(both, "qwen3_omni")
