"""Every decoder samples the same frames as the default one, on the format zoo.

vLLM's decode backends read a file's frame count and rate each in their own way, and the Qwen2-VL
sampler picks its frame indices from them (``tests/vllm_video.py``, re-implemented from vLLM 0.26.0's
``vllm/multimodal/video.py``): a backend that reads other numbers samples other frames, and other
tokens. OpenCV (the default) and PyAV run for real here; torchcodec's metadata is its exact-mode scan
redone with PyAV's demuxer (its PyPI wheels need a CUDA torch); NVDEC needs a GPU
(``benchmarks/decode_indices.py`` compares vLLM's own loaders there).

What is checked: for each decoder choice, every zoo file the planner sends as it is gets the default's
indices, and every file where the indices would differ is planned for the transcode, whose output
every backend samples alike.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import vllm_video as vv
from format_zoo import make_zoo
from vidlabel import families
from vidlabel.core import config as vconfig
from vidlabel.prepare import planning
from vidlabel.prepare import transcode as tc
from vidlabel.prepare.media import probe
from vidlabel.core import decode


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    work = tmp_path_factory.mktemp("zoo")
    files = make_zoo(work)
    infos = {name: probe(path) for name, path in files.items()}
    return work, files, infos


def config_for(choice: str) -> dict:
    return vconfig.validate({"posts": "p.csv", "media_root": "/m", "planning": {"decode": choice}})


def formats_of(infos: list[dict]) -> decode.Formats:
    col = {k: np.asarray([i[k] for i in infos], dtype=object) for k in infos[0]}
    return decode.Formats(codec=col["video_codec"], pix_fmt=col["pix_fmt"], width=col["width"],
                          height=col["height"], rotation=col["rotation"], container=col["container"],
                          header_frames=col["header_frames"], fps=col["fps"], base_fps=col["base_fps"],
                          duration_s=col["duration_s"])


def routed(choice: str, infos: dict[str, dict]) -> dict[str, str | None]:
    """name -> why the planner transcodes the file for this choice (None: sent as it is)."""
    names = sorted(infos)
    cfg = config_for(choice)
    own = decode.unreadable(cfg, formats_of([infos[n] for n in names]))
    default = planning.server_media_problem(families.of_config(cfg), [infos[n]["video_codec"] for n in names],
                                            [infos[n]["duration_s"] for n in names], [infos[n]["fps"] for n in names])
    return {n: (d if d is not None else o) for n, d, o in zip(names, default, own)}


def transcoded(work, name, path, info) -> str:
    """The file as vidlabel's transcode writes it for the default plan (2 fps, the pixel bound)."""
    cfg = config_for("cpu")
    fps, w, h = planning.transcode_target(cfg, [2.0], [cfg["planning"]["max_pixels"]], [info["width"]],
                                          [info["height"]], [info["fps"] or 0.0], [info["duration_s"]])
    out = work / "transcoded" / f"{name}.mp4"
    if not out.exists():
        out.parent.mkdir(exist_ok=True)
        tc.transcode_file(str(path), out, float(fps[0]), int(w[0]), int(h[0]))
    return str(out)


def test_scanning_decoders_sample_the_default_frames_or_are_transcoded(zoo):
    work, files, infos = zoo
    plan = routed("torchcodec", infos)
    differing = []
    for name, path in sorted(files.items()):
        default = vv.load(path, "opencv", decode=False)
        other = vv.load(path, "torchcodec", decode=False)
        same = default.error is None and other.error is None and default.indices == other.indices
        if not same:
            differing.append(name)
            assert plan[name] is not None, (
                f"{name}: torchcodec would read {other.source} ({other.error or other.indices}) where OpenCV reads "
                f"{default.source} ({default.error or default.indices}), yet the planner sends it as it is")
        if plan[name] is None:
            assert same, name
            continue
        # Transcoded, every backend reads the same frames.
        if infos[name]["probe_error"] is None and name != "av1":
            out = transcoded(work, name, path, infos[name])
            a, b = vv.load(out, "opencv", decode=False), vv.load(out, "torchcodec", decode=False)
            assert a.error is None and a.indices == b.indices, (name, a, b)
    # Not vacuous: the zoo holds files whose frame counts the two read differently.
    assert {"vfr", "edit-list"} <= set(differing), differing
    # And the camera-like H.264 (B-frames, CABAC, MP4) that most uploads are goes as it is.
    assert plan["no-audio"] is None and plan["60fps"] is None and plan["4k-portrait"] is None


def test_the_default_decoder_turns_rotated_video_and_reads_what_it_samples(zoo):
    _, files, infos = zoo
    rotated = vv.load(files["rotated"], "opencv")
    assert rotated.error is None and rotated.shape[1:3] == (infos["rotated"]["height"], infos["rotated"]["width"])
    assert infos["rotated"]["height"] > infos["rotated"]["width"]  # portrait on the screen
    plain = vv.load(files["no-audio"], "opencv")
    assert plain.valid == plain.indices and len(plain.indices) == 6  # 3 s at 2 fps


def test_pyav_backend_is_not_offered(zoo):
    """vLLM's pyav backend reads no frame count from a WebM or Matroska header (it has none): the sampler
    divides by zero; and it hands the model rotated videos on their side."""
    _, files, _ = zoo
    for name in ("vp9", "matroska"):
        assert "division by zero" in (vv.load(files[name], "pyav", decode=False).error or ""), name
    turned = vv.load(files["rotated"], "pyav")
    assert turned.error is None and turned.shape[1] < turned.shape[2]  # landscape frames of a portrait video


def test_nvdec_is_given_only_what_it_is_documented_and_measured_to_decode(zoo):
    _, _, infos = zoo
    plan = routed("gpu", infos)
    for name in ("h264-yuv444", "h264-10bit", "rotated", "vfr", "edit-list", "vp9", "matroska", "av1", "one-frame"):
        if name in plan:
            assert plan[name] is not None, name
    for name in ("no-audio", "60fps", "hevc-8bit", "hevc-10bit", "quicktime", "4k-portrait", "odd-718x1278",
                 "panorama-2560x480", "short-0.5s"):
        assert plan[name] is None, (name, plan[name])
    assert "4:4:4" in plan["h264-yuv444"] or "yuv444p" in plan["h264-yuv444"]
    assert "yuv420p10le" in plan["h264-10bit"]


def test_decode_indices_script_compares_each_backend_with_the_default(zoo, tmp_path):
    """benchmarks/decode_indices.py's own parts (files, comparison, table, JSON), with the re-implemented
    loaders standing in for vLLM's (which it calls on the GPU machine)."""
    import json
    import shutil
    import sys

    sys.path.insert(0, str(__import__("format_zoo").BENCHMARKS))
    import decode_indices as di

    _, files, _ = zoo
    media = tmp_path / "media"
    media.mkdir()
    for name in ("no-audio", "vfr", "vp9", "rotated"):
        shutil.copy(files[name], media / files[name].name)
    assert di.main(["--media", str(media), "--workdir", str(tmp_path), "--reference",
                    "--backends", "pyav,torchcodec,opencv"]) == 0
    rows = {(Path(r["file"]).stem.removeprefix("fmt-"), r["backend"]): r
            for r in json.loads((tmp_path / "decode_indices.json").read_text())}
    assert {b for _, b in rows} == {"opencv", "pyav", "torchcodec"}
    assert rows["no-audio", "pyav"]["same_indices"] is True and rows["no-audio", "pyav"]["frame_diff"] == 0.0
    assert rows["no-audio", "opencv"]["indices"] == [0, 15, 30, 45, 60, 75]
    assert rows["vfr", "torchcodec"]["same_indices"] is False
    assert "division by zero" in rows["vp9", "pyav"]["error"] and rows["vp9", "pyav"]["same_indices"] is False
    assert rows["rotated", "opencv"]["shape"][1:3] == [1280, 720] and rows["rotated", "pyav"]["shape"][1:3] == [720, 1280]
    table = di.table([di.Result(**r) for r in json.loads((tmp_path / "decode_indices.json").read_text())])
    assert "| fmt-vfr.mp4 | torchcodec |" in table and "**no**" in table


def test_the_default_decoder_reads_the_frames_the_estimate_counts_or_the_file_is_transcoded(zoo):
    """The visual tokens of a video are its decoded frame pairs: a file the planner sends as it is must
    decode, with vLLM's OpenCV path, as many frames as the estimate counts (the served prompt tokens then
    match the plan). A file whose header's frame count over its rate is not the duration it shows (an MP4
    edit list, a variable frame rate) is sampled over the header's count: transcoded (measured on vLLM 0.26:
    an edit-list file's estimate / served 0.813 before this)."""
    _, files, infos = zoo
    cfg = config_for("cpu")
    family, sampling = families.of_config(cfg), planning.sampling(cfg)
    sent_as_is = []
    for name, path in sorted(files.items()):
        info = infos[name]
        if info["probe_error"] is not None:
            continue
        plan = planning.plan_posts(cfg, [info["duration_s"]], [info["fps"] or 0.0], [info["width"]],
                                   [info["height"]], [200], formats=formats_of([info]))
        if plan.action[0] != "as-is":
            continue
        sent_as_is.append(name)
        total = info.get("header_frames") or round(info["duration_s"] * (info["fps"] or 0.0))
        expected = int(family.sampled_frames([total], [info["fps"] or 0.0], sampling, [info["duration_s"]])[0])
        read = vv.load(path, "opencv")
        assert read.error is None, (name, read.error)
        assert len(read.valid) == expected, (name, len(read.valid), expected, info)
    # The edit-list file shows 1.7 s of the header's 90 frames: sampled over the header, transcoded. The
    # variable-rate one is sent as it is where the loader's count over its average rate is the estimate's
    # (the loop above decoded exactly that many frames of it).
    assert "edit-list" not in sent_as_is
    assert {"no-audio", "60fps", "4k-portrait", "hevc-8bit", "quicktime"} <= set(sent_as_is)
    problems = planning.sampler_frames_problem(cfg, formats_of([infos[n] for n in ("edit-list", "vfr", "no-audio")]))
    assert "edit list" in problems[0] and "would sample 6 frames where the estimate counts 4" in problems[0]
    assert problems[1] is None and problems[2] is None  # the same count from the header as from the duration
