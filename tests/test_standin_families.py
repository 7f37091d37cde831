"""Each family's estimate of real files equals what the stand-in counts of them (tests/standin/served.py: vLLM
0.26's loaders and processors written apart from vidlabel.families, per item in plain Python), so that the
end-to-end tests of every family check the plan against an independent server."""

from __future__ import annotations

import subprocess
import sys
import wave
from pathlib import Path

import numpy as np
import pytest

from vidlabel import families
from vidlabel.prepare.media import probe

sys.path.insert(0, str(Path(__file__).parent / "standin"))
import qwen_video  # noqa: E402
import served  # noqa: E402

# (seconds, width, height, fps): the 359-frame clip of the float step, short and long, portrait and odd sizes.
CLIPS = [(359 / 30, 1080, 1920, 30), (12.0, 1280, 720, 30), (1.0, 640, 360, 30), (31.5, 720, 1280, 25),
         (3.3, 718, 1278, 60), (20.0, 480, 480, 24)]
FAMILIES = {"qwen2_5_vl": "qwen2_5_vl", "qwen3_vl": "qwen3_vl", "qwen3_omni": "qwen3_omni_moe"}


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    root = tmp_path_factory.mktemp("clips")
    out = []
    for i, (seconds, width, height, fps) in enumerate(CLIPS):
        path = root / f"clip-{i}.mp4"
        frames = int(round(seconds * fps))
        subprocess.run(["ffmpeg", "-v", "error", "-y", "-f", "lavfi", "-i", f"testsrc2=size={width}x{height}:rate={fps}",
                        "-frames:v", str(frames), "-c:v", "libx264", "-preset", "ultrafast", "-pix_fmt", "yuv420p",
                        str(path)], check=True)
        out.append(path)
    return out


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_video_estimates_equal_the_stand_in_s_counts(clips, name):
    family = families.by_name(name)
    server = served.Served(FAMILIES[name], {}, 2.0)
    for path in clips:
        info = probe(str(path))
        est = family.video_tokens([info["duration_s"]], [info["fps"]], [info["width"]], [info["height"]],
                                  family.default_sampling, total_frames=[info["header_frames"]])
        tokens, embeds = server.video_tokens(qwen_video.probe(str(path)))
        assert (int(est.tokens[0]), int(est.embeds[0])) == (tokens, embeds), (name, path.name, info)


def test_audio_estimates_equal_the_stand_in_s_counts(tmp_path):
    omni = families.by_name("qwen3_omni")
    server = served.Served("qwen3_omni_moe", {}, 2.0)
    for samples in (16000, 16000 * 12, 16000 * 7 + 123, 159, 16000 * 61 + 1):
        path = tmp_path / f"a-{samples}.wav"
        with wave.open(str(path), "wb") as wav:
            wav.setnchannels(1)
            wav.setsampwidth(2)
            wav.setframerate(16000)
            wav.writeframes(np.zeros(samples, "<i2").tobytes())
        assert (int(omni.audio_tokens([samples])[0]), int(omni.audio_embeds([samples])[0])) == \
            server.audio_tokens(str(path)), samples


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_image_estimates_equal_the_stand_in_s_counts(tmp_path, name):
    from vidlabel.demo_mixed import camera_photo

    family = families.by_name(name)
    server = served.Served(FAMILIES[name], {}, 2.0)
    for i, size in enumerate([(1080, 1920), (4000, 3000), (300, 200), (1080, 1350)]):
        path = camera_photo(tmp_path / f"p{i}.jpg", size, seed=i)
        expected = int(family.image_tokens([size[0]], [size[1]], family.default_image_bounds)[0])
        assert server.image_tokens(str(path))[0] == expected, (name, size)
