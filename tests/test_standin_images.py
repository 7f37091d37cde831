"""The stand-in counts image tokens as vLLM does (tests/standin/qwen_image.py, written from vLLM's
source), and vidlabel's estimate (vidlabel.families / post_plan) agrees with it."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer
from PIL import Image

from vidlabel import families
from vidlabel.core import config as cfgmod
from vidlabel.demo import make_video
from vidlabel.prepare import images
from vidlabel.prepare import post_plan as pp
from vidlabel.prepare.item_probe import probe_item
from vidlabel.prepare.post_prompt import message_content

sys.path.insert(0, str(Path(__file__).parent / "standin"))
import qwen_image  # noqa: E402
import server as standin  # noqa: E402  (the stand-in's own module, beside its helpers)

PROMPT = "<caption>beach day</caption>\n- promotes_product: Does it? (answer: yes/no)"


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixed")
    rng = np.random.default_rng(1)

    def save(name, size, **kw):
        Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(root / name, **kw)
        return root / name

    exif = Image.Exif()
    exif[images.EXIF_ORIENTATION] = 6
    files = {"portrait": save("portrait.jpg", (1080, 1920), quality=85),
             "sideways": save("sideways.jpg", (1920, 1080), quality=85, exif=exif),
             "small": save("small.png", (300, 200)),
             "tiny": save("tiny.webp", (20, 20)),
             "huge": save("huge.jpg", (8000, 6000), quality=60)}
    make_video(root / "clip.mp4", duration=4.0, size=(640, 360), fps=15, audio=False)
    files["clip"] = root / "clip.mp4"
    return root, files


def items(*pairs: tuple[str, Path]) -> list[dict]:
    """Manifest items (unlabelled) of (kind, file) pairs."""
    return [{"kind": kind, "media_path": str(path), "label": None} for kind, path in pairs]


def ask(root: Path, flags: list[str], content: list[dict]) -> tuple[int, dict]:
    args = standin.parse_args(["--port", "0", "--allowed-local-media-path", str(root), "--video-tokens", "qwen",
                               "--served-model", "m", *flags])

    async def go():
        async with TestClient(TestServer(standin.make_app(args))) as client:
            resp = await client.post("/v1/chat/completions",
                                     json={"model": "m", "max_tokens": 16,
                                           "messages": [{"role": "user", "content": content}]})
            return resp.status, await resp.json()

    return asyncio.run(go())


def text_tokens(content: list[dict]) -> int:
    """The stand-in's text count (1 + characters / 4 of the text parts joined), to isolate media tokens."""
    return 1 + int(len("\n".join(p["text"] for p in content if p["type"] == "text")) / 4)


def estimate(cfg, paths) -> int:
    infos = [probe_item(p) for p in paths]
    tokens, _ = pp.item_tokens(cfg, [i["kind"] for i in infos], [i["width"] for i in infos],
                               [i["height"] for i in infos], [i["duration_s"] or 0 for i in infos],
                               [i["fps"] or 0 for i in infos])
    return int(tokens.sum())


@pytest.fixture
def cfg():
    return cfgmod.validate({"posts": "p.csv", "media_root": "/m"})


def test_image_tokens_match_at_the_preprocessor_bounds(media, cfg):
    root, files = media
    names = ["portrait", "sideways", "small", "tiny", "clip"]
    content = message_content(items(*(("video" if n == "clip" else "image", files[n]) for n in names)), PROMPT)
    status, body = ask(root, ["--mm-processor-kwargs", json.dumps({"videos_kwargs": {"max_pixels": 602112}}),
                              "--limit-mm-per-prompt", '{"image": 4, "video": 1}'], content)
    assert status == 200, body
    media_tokens = body["usage"]["prompt_tokens"] - text_tokens(content)
    assert media_tokens == estimate(cfg, [files[n] for n in names])
    # By hand: 2691 (1080x1920, either orientation) x 2, 7x11 cells for 300x200, 2x2 for 20x20; the
    # 4 s clip at 2 fps = 8 frames = 4 pairs of 13x23 cells; 2 markers per item.
    assert media_tokens == 2 * 2693 + (7 * 11 + 2) + (4 + 2) + (4 * 13 * 23 + 2)


def test_a_flat_pixel_bound_applies_to_images_too(media, cfg):
    """vidlabel's default server command passes one min/max_pixels pair: transformers applies it to
    the image processor as well, so photos are then bounded like video frames."""
    root, files = media
    content = message_content(items(("image", files["portrait"])), PROMPT)
    status, body = ask(root, ["--mm-processor-kwargs", '{"min_pixels": 100352, "max_pixels": 602112}'], content)
    assert status == 200, body
    media_tokens = body["usage"]["prompt_tokens"] - text_tokens(content)
    q25 = families.by_name("qwen2_5_vl")
    assert media_tokens == int(q25.image_tokens([1080], [1920], families.ImageBounds(100352, 602112))[0]) == 20 * 36 + 2
    assert media_tokens != estimate(cfg, [files["portrait"]])  # the default image bound would say 2693


def test_too_many_items_of_a_kind_are_refused_as_vllm_does(media):
    root, files = media
    content = message_content(items(*[("image", files["small"])] * 3), PROMPT)
    status, body = ask(root, ["--limit-mm-per-prompt", '{"image": 2, "video": 1}'], content)
    assert status == 400 and body["message"] == "At most 2 image(s) may be provided in one prompt."
    status, body = ask(root, ["--limit-mm-per-prompt", '{"image": 0, "video": 1}'], content[:2] + content[-1:])
    assert status == 400 and body["message"] == "At most 0 image(s) may be provided in one prompt."


def test_the_encoder_cache_holds_the_largest_image_the_bound_allows(media, cfg):
    root, files = media
    flags = ["--max-num-batched-tokens", "8192", "--limit-mm-per-prompt", '{"image": 1, "video": 0}']
    content = message_content(items(("image", files["huge"])), PROMPT)
    status, body = ask(root, flags, content)  # 16,170 cells: over 8192, within the profiled 16,384
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] - text_tokens(content) == estimate(cfg, [files["huge"]]) == 147 * 110 + 2
    args = standin.parse_args(["--port", "0", "--allowed-local-media-path", str(root), "--video-tokens", "qwen",
                               *flags])
    assert standin.StandIn(args).encoder_cache == 128 * 128  # the profiler's image at 12,845,056 px
    # Per-modality bounds do not reach vLLM's profiler (it reads the image processor's own size): the
    # cache stays 16,384 while the photo is resized within its own, smaller bound.
    small = ["--mm-processor-kwargs", json.dumps({"images_kwargs": {"max_pixels": 4096 * 784}}),
             "--max-num-batched-tokens", "2048", "--limit-mm-per-prompt", '{"image": 1, "video": 0}']
    status, body = ask(root, small, content)
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] - text_tokens(content) <= 4096 + 2


def test_the_profilers_video_is_sized_by_the_image_bound(media):
    """vLLM 0.26's profiler (models/qwen2_vl.py) sizes its video's frames by the image processor's bound and
    takes as many as the context holds, at most 14: with the checkpoint's 12,845,056 px, 2 pairs of
    128x128 cells in a 32,768-token context; with a flat 602,112 px (24x32 cells), 7 pairs."""
    root, _ = media

    def cache(*flags: str) -> int:
        args = standin.parse_args(["--port", "0", "--allowed-local-media-path", str(root), "--video-tokens", "qwen",
                                   "--max-num-batched-tokens", "2048", "--limit-mm-per-prompt",
                                   '{"image": 0, "video": 1}', *flags])
        return standin.StandIn(args).encoder_cache

    assert cache() == 2 * 128 * 128
    assert cache("--mm-processor-kwargs", json.dumps({"videos_kwargs": {"max_pixels": 602112}})) == 2 * 128 * 128
    assert cache("--mm-processor-kwargs", json.dumps({"min_pixels": 100352, "max_pixels": 602112})) == 7 * 24 * 32
    assert cache("--max-model-len", "8192") == 128 * 128  # one frame at least, padded to a pair, even over the context


def test_each_form_of_the_bounds_reaches_its_modality():
    """The split forms give images and video frames their own bounds; the flat form one pair for both
    (transformers' _merge_kwargs)."""
    split = {"images_kwargs": {"min_pixels": 3136, "max_pixels": 12845056},
             "videos_kwargs": {"min_pixels": 100352, "max_pixels": 602112}}
    size = {"images_kwargs": {"size": {"shortest_edge": 3136, "longest_edge": 12845056}},
            "videos_kwargs": {"size": {"shortest_edge": 100352, "longest_edge": 602112}}}
    flat = {"min_pixels": 100352, "max_pixels": 602112}
    for kwargs in (split, size):
        assert qwen_image.bounds(kwargs, "image") == (3136, 12845056)
        assert qwen_image.bounds(kwargs, "video") == (100352, 602112)
    assert qwen_image.bounds(flat, "image") == qwen_image.bounds(flat, "video") == (100352, 602112)


def test_an_unreadable_image_is_a_400(media, tmp_path):
    root, _ = media
    bad = root / "notes.jpg"
    bad.write_text("not a picture")
    content = message_content(items(("image", bad)), PROMPT)
    status, body = ask(root, [], content)
    assert status == 400 and body["message"].startswith("Failed to load image: ")
