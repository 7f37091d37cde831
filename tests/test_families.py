"""Model families: the protocol, how a model's family is told, and the Qwen2.5-VL and Qwen3-VL rules against
hand-computed cases and the counts measured on vLLM 0.26 (docs/models.md)."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from vidlabel import families
from vidlabel.core import config as cfgmod
from vidlabel.core import models

Q25 = families.by_name("qwen2_5_vl")
Q3 = families.by_name("qwen3_vl")
SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "vidlabel"


def one(est: families.VideoEstimate):
    return int(est.frames[0]), int(est.height[0]), int(est.width[0]), int(est.tokens[0])


# ------------------------------------------------------------------ the protocol


def test_every_family_module_is_found_and_complete():
    assert {"qwen2_5_vl", "qwen3_vl", "fixed_frames"} <= set(families.FAMILIES)
    for name, family in families.FAMILIES.items():
        assert family.name == name and family.rule_version >= 1
        assert family.cell > 0 and family.chat_overhead_tokens > 0
        est = family.video_tokens([10.0], [30.0], [1280], [720], family.default_sampling)
        assert int(est.tokens[0]) == int(est.embeds[0]) + family.item_markers > 0
        assert int(family.image_tokens([640], [480], family.default_image_bounds)[0]) > family.item_markers


def test_no_cell_size_or_qwen2_constant_outside_the_family_modules():
    # Everything a family means lives in its module: the rest of the package asks a Family.
    import re

    own = {SRC / "families" / f for f in ("qwen2_5_vl.py", "fixed_frames.py")}
    pattern = re.compile(r"\b28\b|\bFACTOR\b|IMAGE_MARKER_TOKENS|_MAX_FRAMES_PER_VIDEO|qwen_frames")
    found = [f"{path.relative_to(SRC)}:{n}: {line.strip()}" for path in SRC.rglob("*.py") if path not in own
             for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == []


def _folder(tmp_path, model_type: str, name: str = "m") -> str:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    return str(folder)


@pytest.mark.parametrize("model_type, family", [("qwen2_5_vl", "qwen2_5_vl"), ("qwen2_vl", "qwen2_5_vl"),
                                                ("qwen3_vl", "qwen3_vl"), ("qwen3_vl_moe", "qwen3_vl")])
def test_auto_reads_the_model_type_of_the_model_folder(tmp_path, model_type, family):
    folder = _folder(tmp_path, model_type)
    cfg = cfgmod.validate({"posts": "p.csv", "media_root": "/m", "classify": {"model": folder}})
    assert models.family(cfg, models.names(cfg)[0]).name == family
    assert cfg["planning"]["model_family"] == family  # one family: the run's planning is resolved for it


def test_an_unknown_model_type_is_refused_naming_the_known_families(tmp_path):
    folder = _folder(tmp_path, "llava")
    with pytest.raises(cfgmod.ConfigError) as err:
        cfgmod.validate({"posts": "p.csv", "media_root": "/m", "classify": {"model": folder}})
    text = str(err.value)
    assert "'classify.model'" in text and "llava" in text and "qwen3_vl" in text and "planning.model_family" in text


def test_a_name_alone_tells_a_known_family_and_an_unknown_name_is_refused():
    cfg = cfgmod.validate({"posts": "p.csv", "media_root": "/m", "classify": {"model": "Qwen/Qwen3-VL-8B-Instruct"}})
    assert cfg["planning"]["model_family"] == "qwen3_vl"
    with pytest.raises(cfgmod.ConfigError, match="classify.models.1.*cannot be told"):
        cfgmod.validate({"posts": "p.csv", "media_root": "/m",
                         "classify": {"models": ["Qwen/Qwen2.5-VL-7B-Instruct", "someone/a-video-model"]}})
    # ... unless the entry says which family it is served as
    cfg = cfgmod.validate({"posts": "p.csv", "media_root": "/m", "classify": {"models": [
        "Qwen/Qwen2.5-VL-7B-Instruct", {"model": "someone/a-video-model", "model_family": "qwen2_5_vl"}]}})
    assert list(models.plans(cfg)) == ["qwen2_5_vl"]


def test_fixed_frames_only_by_hand_and_a_forced_family_wins(tmp_path):
    folder = _folder(tmp_path, "qwen3_vl")
    cfg = cfgmod.validate({"posts": "p.csv", "media_root": "/m", "classify": {"model": folder},
                           "planning": {"model_family": "qwen2_5_vl"}})
    assert models.family(cfg, models.names(cfg)[0]).name == "qwen2_5_vl"
    assert families.of_model_type("fixed_frames") is None and families.of_name("fixed-frames") is None
    with pytest.raises(cfgmod.ConfigError, match="no model family 'qwen9'"):
        cfgmod.validate({"posts": "p.csv", "media_root": "/m", "planning": {"model_family": "qwen9"}})


def test_two_families_plan_apart_with_their_own_defaults_and_rule_version(tmp_path):
    cfg = cfgmod.validate({"posts": "p.csv", "media_root": "/m", "classify": {"models": [
        "Qwen/Qwen2.5-VL-7B-Instruct", _folder(tmp_path, "qwen3_vl_moe", "Qwen3-VL-30B-A3B-Instruct"),
        "Qwen/Qwen3-VL-8B-Instruct"]}})
    assert models.plans(cfg) == {"qwen2_5_vl": ["Qwen2.5-VL-7B-Instruct"],
                                 "qwen3_vl": ["Qwen3-VL-30B-A3B-Instruct", "Qwen3-VL-8B-Instruct"]}
    assert cfg["planning"]["model_family"] == "auto"  # several families: only a model's or a plan's config plans
    with pytest.raises(families.FamilyError, match="several model families"):
        families.of_config(cfg)
    q25, q3 = models.plan_config(cfg, "qwen2_5_vl")["planning"], models.plan_config(cfg, "qwen3_vl")["planning"]
    assert (q25["max_pixels"], q25["image_max_pixels"], q25["rule_version"]) == (602112, 12845056, Q25.rule_version)
    assert (q3["max_pixels"], q3["image_max_pixels"], q3["rule_version"]) == (25165824, 16777216, Q3.rule_version)
    # What the plan depends on is in the stages' fingerprints: the two plans' manifests differ.
    from vidlabel.core.stage_settings import fingerprint
    assert fingerprint(cfg, "manifest", plan="qwen2_5_vl") != fingerprint(cfg, "manifest", plan="qwen3_vl")
    assert fingerprint(cfg, "classify", "Qwen3-VL-8B-Instruct") != fingerprint(cfg, "classify", "Qwen2.5-VL-7B-Instruct")


def test_a_family_that_does_not_hear_refuses_native_audio():
    with pytest.raises(cfgmod.ConfigError, match="classify.audio.*does not hear audio"):
        cfgmod.validate({"posts": "p.csv", "media_root": "/m", "classify": {"audio": "native"}})


# ------------------------------------------------------------------ Qwen2.5-VL

S = Q25.default_sampling  # fps 2, 4..768 frames, 100,352..602,112 pixels per frame
B = Q25.default_image_bounds  # 3,136 .. 12,845,056 pixels


def test_q25_reference_example_720x1280_32_frames():
    # 720x1280 -> 728x1288 = 937,664 px > 602,112: beta 1.2372; 581.97 -> 560, 1034.6 -> 1008; 20x36 cells;
    # 32 frames = 16 pairs -> 11,520, plus <|vision_start|> and <|vision_end|>.
    assert one(Q25.video_tokens([16.0], [30.0], [1280], [720], S)) == (32, 560, 1008, 11520 + 2)
    assert one(Q25.video_tokens([16.0], [30.0], [720], [1280], S)) == (32, 1008, 560, 11520 + 2)


def test_q25_frames_clamped_floored_even_and_never_more_than_the_file():
    frames = Q25.sampled_frames([15, 99, 222, 30000], [30.0] * 4, S)
    assert frames.tolist() == [4, 6, 14, 768]  # 1 -> min 4; 6.6 -> 6; 14.8 -> 14; 2000 -> 768
    assert Q25.sampled_frames([1223], [30.0], S).tolist() == [80]  # 81.5 floors to 80, not 82
    assert Q25.sampled_frames([30], [0.5], S).tolist() == [30]  # 60 s at 0.5 fps holds 30 frames
    assert Q25.sampled_frames([2], [2.0], S).tolist() == [2]
    # an unknown source rate: the duration at the sampling rate
    assert Q25.sampled_frames([2 ** 62], [np.nan], S, [10.0]).tolist() == [20]


def test_q25_counts_the_indices_vllm_s_float_step_makes():
    # vLLM 0.26 samples torch.arange(0, 359, 359 / 22): 23 indices (359 / (359 / 22) = 22.000000000000004),
    # which the processor pads to 24 frames: 12 pairs, measured 709 tokens over a 22-frame estimate.
    assert Q25.sampled_frames([359], [30.0], S).tolist() == [23]
    assert Q25.sampled_frames([360], [30.0], S).tolist() == [24]
    est = Q25.video_tokens([359 / 30], [30.0], [1920], [1080], S, total_frames=[359])
    cells = (est.height[0] // 28) * (est.width[0] // 28)
    assert int(est.embeds[0]) == 12 * cells


def test_q25_images_a_1080x1920_photo_and_the_bounds():
    assert Q25.image_tokens([1080], [1920], B).tolist() == [39 * 69 + 2]
    assert Q25.image_embeds([8000], [6000], B).tolist() == [147 * 110]
    assert Q25.image_embeds([20], [20], B).tolist() == [4]
    assert Q25.image_embeds([1080], [1920], B, max_pixels=736960).tolist() == [22 * 40]


def test_fixed_frames_samples_32_uniformly():
    ff = families.by_name("fixed_frames")
    est = ff.video_tokens([60.0, 1.0], [30.0, 10.0], [1280, 1280], [720, 720], ff.default_sampling)
    assert est.frames.tolist() == [32, 10]
    assert est.embeds.tolist() == [16 * 720, 5 * 720]


# ------------------------------------------------------------------ Qwen3-VL

S3 = Q3.default_sampling  # fps 2, 4..768 frames, 4,096..25,165,824 pixels for the whole video


def test_q3_the_kit_s_measured_examples():
    # 720x1280 12 s at 30 fps: 24 frames, one resize 704x1280 (24 x 704 x 1280 within the budget),
    # 12 groups of 22 x 40 = 880: 10,560 + 26 markers + 74 timestamp tokens = 10,660 (vLLM 0.26).
    assert one(Q3.video_tokens([12.0], [30.0], [1280], [720], S3)) == (24, 704, 1280, 10660)
    # 90 s 720p: 180 frames share the budget: 256x480 frames, 90 x 120 = 10,800 + 182 + 620 = 11,602.
    assert one(Q3.video_tokens([90.0], [30.0], [1280], [720], S3)) == (180, 256, 480, 11602)
    # 1 s of 360x640: 4 frames, 2 groups of 11 x 20: 440 + 6 + 12.
    assert one(Q3.video_tokens([1.0], [30.0], [640], [360], S3)) == (4, 352, 640, 458)


def test_q3_frames_truncate_and_are_not_paired_by_the_loader():
    # int(359 / 30 * 2) = 23: 23 frames (the processor pads the last group), unlike Qwen2-VL's even count.
    assert Q3.sampled_frames([359], [30.0], S3).tolist() == [23]
    assert Q3.sampled_frames([3], [30.0], S3).tolist() == [3]
    est = Q3.video_tokens([359 / 30], [30.0], [1920], [1080], S3, total_frames=[359])
    assert int(est.frames[0]) == 23


def test_q3_timestamp_tokens_follow_the_formatted_times():
    from vidlabel.families.qwen3_vl import timestamp_tokens

    def by_format(total, fps, n):
        idx = np.linspace(0, total - 1, n).round().astype(int).tolist()
        if len(idx) % 2:
            idx.append(idx[-1])
        times = [i / fps for i in idx]
        return sum(sum(ch.isdigit() for ch in f"{(times[g] + times[g + 1]) / 2:.1f}") + 4
                   for g in range(0, len(times), 2))

    cases = [(360, 30.0, 24), (2700, 30.0, 180), (29970, 29.97, 768), (301, 30.0, 20), (17999, 59.94, 600),
             (600, 60.0, 20), (6001, 1.0, 768), (59, 3.0, 39)]
    for total, fps, n in cases:
        groups = -(-n // 2)
        assert int(timestamp_tokens([total], [fps], [n], [groups])[0]) == by_format(total, fps, n), (total, fps, n)


def test_q3_images_32_pixel_cells_within_its_bounds():
    assert Q3.image_tokens([1920, 4000], [1080, 3000], Q3.default_image_bounds).tolist() == [34 * 60 + 2, 94 * 125 + 2]
    # a tiny image grows to the 65,536-pixel lower bound: 8 x 8 cells
    assert Q3.image_embeds([32], [32], Q3.default_image_bounds).tolist() == [64]


def test_q3_lowering_the_video_budget_lowers_the_tokens():
    lower = S3.with_(max_pixels=S3.max_pixels // 4)
    full = Q3.video_tokens([12.0], [30.0], [1280], [720], S3)
    quarter = Q3.video_tokens([12.0], [30.0], [1280], [720], lower)
    assert int(quarter.embeds[0]) < int(full.embeds[0]) / 2


KIT = pathlib.Path(__file__).resolve().parent / "data"


@pytest.mark.parametrize("folder, params, kv_kib", [("qwen3_vl_8b", 8.767e9, 144), ("qwen3_vl_30b_a3b", 31.071e9, 96)])
def test_q3_model_shape_matches_the_published_sizes(folder, params, kv_kib):
    shape = Q3.model_shape(json.loads((KIT / folder / "config.json").read_text()))
    assert abs(shape.parameters / params - 1) < 0.002
    assert shape.kv_bytes_per_token == kv_kib * 1024
    if "a3b" in folder:  # 8 of 128 experts per token: about 3B active
        assert 3.0e9 < shape.active_parameters < 4.5e9
