"""``fixed_frames``: a Qwen2.5-VL-shaped model served through vLLM's generic video loader, chosen by hand
(``planning.model_family: fixed_frames``; never from a config.json).

vLLM's generic ``VideoBackend`` (``vllm/multimodal/video.py``, what ``VLLM_VIDEO_LOADER_BACKEND`` or a model
without its own loader gets) samples ``FIXED_FRAMES`` frames uniformly, or every frame of a shorter file;
``planning.fps`` does not apply. Cells, pairs, images and the rest as Qwen2.5-VL.
"""

from __future__ import annotations

import numpy as np

from vidlabel.families.base import Sampling, arr
from vidlabel.families.qwen2_5_vl import Qwen25VL

FIXED_FRAMES = 32


class FixedFrames(Qwen25VL):
    name = "fixed_frames"
    rule_version = 1
    model_types = ()
    known_names = ()

    def sampled_frames(self, total_frames, source_fps, sampling: Sampling, duration_s=None) -> np.ndarray:
        return np.minimum(np.int64(FIXED_FRAMES), arr(total_frames).astype(np.int64))


FAMILY = FixedFrames()
