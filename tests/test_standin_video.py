"""The stand-in counts a video's frames as vLLM's default (OpenCV) reader does, also for containers whose
video stream carries no frame count or duration of its own (Matroska, WebM): a stand-in that counted none
there served a fraction of the estimated prompt tokens, a gap the real server does not have."""
from __future__ import annotations

import ffmpeg
from planning_helpers import make_clip
from standin import qwen_video


def test_a_matroska_remux_has_the_frames_of_its_mp4(tmp_path):
    mp4 = make_clip(tmp_path / "clip.mp4", 320, 240, 3.0)
    mkv = tmp_path / "clip.mkv"
    (ffmpeg.input(str(mp4)).output(str(mkv), c="copy").overwrite_output()
     .global_args("-nostdin", "-v", "error").run(capture_stdout=True, capture_stderr=True))

    from_mp4, from_mkv = qwen_video.probe(str(mp4)), qwen_video.probe(str(mkv))

    assert from_mp4.total_frames == 90
    assert abs(from_mkv.total_frames - from_mp4.total_frames) <= 1
    assert qwen_video.sampled_frames(from_mkv, 2.0) == qwen_video.sampled_frames(from_mp4, 2.0) == 6
