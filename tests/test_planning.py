"""Context gate, re-planning, token-balanced shards, plan.csv and the server's media path."""

from __future__ import annotations

import csv

import numpy as np
import pytest

from vidlabel import families
from vidlabel.core import config as cfgmod
from vidlabel.prepare import planning as pl

Q25 = families.by_name("qwen2_5_vl")


def make_config(**planning) -> dict:
    cfg = cfgmod.validate({"posts": "p.csv", "media_root": "/m"})
    cfg["planning"].update(planning)
    return cfg


def test_fitting_posts_are_as_is():
    cfg = make_config()
    p = pl.plan_posts(cfg, [16.0, 60.0], [30.0, 30.0], [1280, 640], [720, 480], [500, 500])
    assert p.action.tolist() == ["as-is", "as-is"]
    # each video's tokens with its <|vision_start|>/<|vision_end|> pair
    assert p.visual_tokens.tolist() == [11520 + 2, 60 * 17 * 23 + 2]
    assert p.prompt_tokens.tolist() == [12022, 60 * 17 * 23 + 502]


def test_over_limit_exclude_gives_too_long():
    cfg = make_config(over_limit="exclude")
    # 60 s 720x1280: 60 pairs * 720 cells = 43,200 > 32,768 - max_tokens - 300.
    p = pl.plan_posts(cfg, [60.0, 10.0], [30.0, 30.0], [1280, 1280], [720, 720], [300, 300])
    assert p.action.tolist() == ["too_long", "as-is"]
    assert "estimated 43202 visual + 300 text tokens exceed the limits: max_model_len 32768" in p.plan[0]


def test_max_tokens_defaults_to_the_answer_schema_and_the_encoder_cache_to_the_context():
    cfg = make_config()
    # One yes/no question: {"promotes_product":"yes"} is 26 bytes, plus 8.
    assert cfg["classify"]["max_tokens"] == 34
    assert cfg["classify"]["max_num_batched_tokens"] == cfg["classify"]["max_model_len"] == 32768


def test_encoder_cache_is_a_limit_like_the_context():
    """vLLM refuses a video item with more visual tokens than its encoder cache (sized by
    --max-num-batched-tokens), after decoding it: the gate must catch it first."""
    cfg = make_config(over_limit="exclude")
    cfg["classify"]["max_num_batched_tokens"] = 8192
    # 16 s 720x1280 at 2 fps: 16 pairs * 720 = 11,520 visual tokens: fits the context, not the cache.
    p = pl.plan_posts(cfg, [16.0, 8.0], [30.0, 30.0], [1280, 1280], [720, 720], [300, 300])
    assert p.action.tolist() == ["too_long", "as-is"]
    assert "encoder cache 8192 (max_num_batched_tokens)" in p.plan[0]
    cfg["planning"]["over_limit"] = "replan"
    p = pl.plan_posts(cfg, [16.0], [30.0], [1280], [720], [300])
    assert p.action.tolist() == ["replan"]
    assert 0 < int(p.visual_tokens[0]) <= 8192


def test_replan_picks_the_richest_plan_that_fits():
    cfg = make_config()
    max_tokens = cfg["classify"]["max_tokens"]
    budget = int((32768 - max_tokens - 300) / (1 + pl.ESTIMATE_MARGIN))  # 2 % spare for estimate error
    p = pl.plan_posts(cfg, [60.0], [30.0], [1280], [720], [300])
    assert p.action.tolist() == ["replan"]
    # Candidates: fps 1 at full size = 30 pairs * 720 = 21,600; fps 2 at max_pixels/2 (301,056):
    # computed by the rule below; the chosen plan is the larger that fits (with one pair of margin).
    half = Q25.frame_size(720, 1280, 120, Q25.default_sampling.with_(max_pixels=301056))
    half_tokens = 60 * (int(half[0][0]) // 28) * (int(half[1][0]) // 28) + 2
    expected = max(t for t in (21600 + 2, half_tokens) if t + 720 <= budget)
    assert int(p.visual_tokens[0]) == expected
    assert int(p.visual_tokens[0]) + 300 + max_tokens <= 32768
    assert p.plan[0].startswith("replan: ") and "43202->" in p.plan[0]
    # The plan is what a transcode at (fps, max_pixels) would give, re-estimated independently.
    est = pl.media_estimate(cfg, p.duration_s, p.fps, [1280], [720], p.max_pixels)
    assert int(est.tokens[0]) == int(p.visual_tokens[0])


def test_replan_lowers_fps_for_long_videos_and_trims_only_as_last_resort():
    cfg = make_config(max_duration_s=300)
    d = [600.0, 100000.0]
    p = pl.plan_posts(cfg, d, [30.0, 30.0], [1920, 720], [1080, 1280], [300, 300])
    assert p.action.tolist() == ["replan", "replan"]
    assert "fps 2->" in p.plan[0] and "trim" not in p.plan[0]
    assert p.duration_s[0] == 600.0 and p.fps[0] < 2
    # 100,000 s: even fps/128 at min_pixels is too much; the trim to 300 s makes it fit.
    assert "trim 100000s->300s" in p.plan[1] and p.duration_s[1] == 300.0
    assert (p.prompt_tokens + cfg["classify"]["max_tokens"] <= 32768).all()


def test_nothing_fits_is_too_long_even_when_replanning():
    cfg = make_config()
    p = pl.plan_posts(cfg, [100000.0], [30.0], [1280], [720], [300])
    assert p.action.tolist() == ["too_long"]
    assert "no lower fps/pixel bound/trim fits" in p.plan[0]
    # A huge transcript alone can exceed the context: no video plan helps.
    p = pl.plan_posts(cfg, [5.0], [30.0], [640], [480], [40000])
    assert p.action.tolist() == ["too_long"]


def test_balance_is_deterministic_and_order_independent():
    rng = np.random.default_rng(1)
    costs = rng.lognormal(9, 1, 5000).astype(np.int64)
    keys = np.array([f"r{i:05d}" for i in range(5000)])
    a = pl.balance_shards(costs, keys, 16)
    perm = rng.permutation(5000)
    b = pl.balance_shards(costs[perm], keys[perm], 16)
    assert np.array_equal(a[perm], b)
    assert np.array_equal(a, pl.balance_shards(costs, keys, 16))


def test_balance_beats_count_based_sharding():
    rng = np.random.default_rng(7)
    costs = (rng.lognormal(9, 1.2, 3000)).astype(np.int64)
    keys = [f"r{i}" for i in range(3000)]
    shard = pl.balance_shards(costs, keys, 32)
    loads = np.bincount(shard, weights=costs, minlength=32)
    by_count = np.bincount(np.arange(3000) % 32, weights=costs, minlength=32)
    assert pl.imbalance(loads) <= 1.05
    assert pl.imbalance(loads) < pl.imbalance(by_count)
    # LPT bound: no shard exceeds the mean by more than the largest single item.
    assert loads.max() <= loads.mean() + costs.max()


def test_balance_ties_broken_by_request_id():
    shard = pl.balance_shards([5, 5, 5, 5], ["d", "b", "a", "c"], 2)
    # Sorted by id: a->0, b->1, c->0 (load tie -> lowest index), d->1
    assert shard.tolist() == [1, 1, 0, 0]


def test_plan_csv(tmp_path):
    cfg = make_config()
    t = pl.plan_table(cfg, [0, 0, 2], [1000, 3000, 5080], 3)
    path = tmp_path / "plan.csv"
    pl.write_plan_csv(t, path)
    rows = list(csv.DictReader(open(path)))
    assert [r["shard"] for r in rows] == ["0", "1", "2"]
    assert [int(r["requests"]) for r in rows] == [2, 0, 1]
    assert [int(r["est_prompt_tokens"]) for r in rows] == [4000, 0, 5080]
    completion = pl.expected_completion_tokens(cfg)  # 16 + 8 * 1 question
    assert completion == 24
    assert float(rows[2]["est_seconds"]) == pytest.approx((5080 + completion) / 5080, abs=0.05)
    assert float(rows[1]["est_seconds"]) == 0


def test_allowed_media_path(tmp_path):
    media = tmp_path / "data" / "media"
    media.mkdir(parents=True)
    cfg = make_config()
    cfg["media_root"] = str(media)
    cfg["results"] = str(tmp_path / "data" / "results")
    # Transcoding possible (replan is the default): the common parent of media and results.
    assert pl.allowed_media_path(cfg) == str(tmp_path / "data")
    cfg["results"] = str(media / "results")
    assert pl.allowed_media_path(cfg) == str(media)
    cfg["planning"]["over_limit"] = "exclude"
    cfg["results"] = "/elsewhere/results"
    assert pl.allowed_media_path(cfg) == str(media)  # no transcoded file is ever sent
    cfg["planning"]["transcode"]["enabled"] = True
    with pytest.raises(pl.MediaPathError, match="filesystem root"):
        pl.allowed_media_path(cfg)


# ------------------------------------------------------------------ media the server cannot read

def test_codec_names_are_canonical():
    assert pl.canonical_codec("libdav1d") == "av1"
    assert pl.canonical_codec("LIBVPX-VP9") == "vp9"
    assert pl.canonical_codec("h264") == "h264"
    assert pl.canonical_codec(None) is None


def test_server_media_problem_follows_the_measured_codec_table():
    codecs = ["h264", "hevc", "vp9", "av1", "libdav1d", "mpeg4", None, "h264"]
    problem = pl.server_media_problem(Q25, codecs, [10.0] * 7 + [1.0], [30.0] * 7 + [1.0])
    assert problem[:3].tolist() == [None, None, None]
    assert problem[3].startswith("the server cannot decode av1: OpenCV has no software AV1 decoder")
    assert problem[4] == problem[3]  # the decoder's name means the same codec
    assert problem[5] == "codec mpeg4 is not among those measured to decode on the server (h264, hevc, vp9)"
    assert problem[6] is None  # an unknown codec is not judged
    # A one-frame file (1 s at 1 fps): the server's sampler needs a frame pair.
    assert problem[7] == f"1 frame(s) in the file; the server's sampler needs at least {Q25.min_file_frames}"
    # Unknown fps or duration: the frame count is unknown, nothing to judge.
    assert pl.server_media_problem(Q25, None, [0.0, 1.0], [30.0, float("nan")]).tolist() == [None, None]


def test_media_the_server_cannot_read_is_planned_for_a_transcode_whatever_the_config():
    cfg = make_config()
    assert cfg["planning"]["transcode"]["enabled"] is False
    p = pl.plan_posts(cfg, [10.0, 10.0, 60.0, 10.0, 0.5], [30.0] * 5, [1280] * 5, [720] * 5, [300] * 5,
                      video_codec=["av1", "h264", "av1", "vp9", "h264"])
    assert p.action.tolist() == ["replan", "as-is", "replan", "as-is", "as-is"]
    assert p.plan[0].startswith("transcode to h264: the server cannot decode av1")
    # Tokens: the transcode keeps the model's own sampling, so the estimate is the as-is one.
    as_is = pl.plan_posts(cfg, [10.0], [30.0], [1280], [720], [300])
    assert p.visual_tokens[0] == as_is.visual_tokens[0] and p.fps[0] == 2.0
    # Over the context and undecodable: the re-plan says both.
    assert p.plan[2].startswith("replan: ") and "; h264 because the server cannot decode av1" in p.plan[2]
    # Too long whatever is done: stays excluded, with the limits as its reason.
    cfg["planning"]["over_limit"] = "exclude"
    p = pl.plan_posts(cfg, [60.0], [30.0], [1280], [720], [300], video_codec=["av1"])
    assert p.action.tolist() == ["too_long"] and "exceed the limits" in p.plan[0]


def test_short_clips_get_enough_frames_from_the_transcode():
    cfg = make_config()
    # 0.5 s and 0.2 s at 2 fps would be 1 and 0 frames; 60 s keeps its 2 fps; 0.034 s (one frame at
    # 30 fps) needs a rate far above the source's.
    d = np.array([0.5, 0.2, 60.0, 0.034])
    fps, w, h = pl.transcode_target(cfg, [2.0] * 4, [602112] * 4, [640.0] * 4, [360.0] * 4, [30.0] * 4, d)
    frames = fps * d
    assert (frames >= Q25.min_file_frames + 0.5 - 1e-9).all()
    assert fps[2] == 2.0 and fps[0] == pytest.approx(5.0)
    assert fps[3] > 30.0
    # Without a duration the rate is the plan's (capped at the source's).
    fps, _, _ = pl.transcode_target(cfg, [2.0], [602112], [640.0], [360.0], [1.0])
    assert fps.tolist() == [1.0]
