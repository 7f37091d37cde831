"""Model families end to end: `snakemake` with Qwen2.5-VL, Qwen3-VL and Qwen3-Omni side by side in one run,
the Omni model both hearing the audio (classify.audio: native) and reading its transcript, on videos with
speech, photos, a slideshow with its soundtrack and an audio post; only the GPU server is stood in (it counts
each family's tokens as vLLM 0.26 does: tests/standin/served.py). And a server of another family than the
plan's is refused by the job's calibration, naming both."""

from __future__ import annotations

import csv
import json
import shutil
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import REPO, run_snakemake, write_overlay
from standin import read_request_log, standin_command
from test_fault_matrix import make_shard, media  # noqa: F401 (fixtures)

from vidlabel.demo_mixed import make_mixed_set, soundtrack
from vidlabel.prepare.manifest import describe
from vidlabel.serve.probe import CalibrationUnlikePlan

DATA = REPO / "tests" / "data"
RULES = {"promotes_product": "buy", "sales_interaction": "link"}
# name -> (model, audio): two families by their folders' config.json, one by its hub name.
MODELS = {"q3vl": (DATA / "qwen3_vl_8b", None), "q25": ("Qwen/Qwen2.5-VL-7B-Instruct", None),
          "heard": (DATA / "qwen3_omni_30b_a3b", "native"), "read": (DATA / "qwen3_omni_30b_a3b", None)}
PLANS = {"q3vl": "qwen3_vl", "q25": "qwen2_5_vl", "heard": "qwen3_omni-native", "read": "qwen3_omni"}


@pytest.fixture(scope="module")
def families_run(tmp_path_factory, demo_set):
    workdir = tmp_path_factory.mktemp("families")
    demo_root, info = demo_set
    # The demo's videos (speech, silence, no audio, broken files), its mixed posts, and an audio post.
    root = workdir / "data"
    shutil.copytree(demo_root, root)
    mixed = make_mixed_set(root)
    soundtrack(root / "media" / "voice-note.m4a", "Buy the blue one through the link in my bio.")
    with open(root / "posts.csv", newline="") as fh:
        videos = list(csv.DictReader(fh))
    with open(root / "posts-all.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["post_id", "media", "caption"])
        for row in videos:
            writer.writerow([row["post_id"], json.dumps([row["video_path"]]), row["caption"]])
        for post_id, post in mixed.items():
            writer.writerow([post_id, json.dumps(post["media"]), post["caption"]])
        writer.writerow(["voice-note", json.dumps(["media/voice-note.m4a"]), "a voice note"])
    yes_if = [arg for qid, word in RULES.items() for arg in ("--yes-if", f"{qid}={word}")]
    entries = []
    for name, (model, audio) in MODELS.items():
        command = standin_command(sys.executable, workdir / f"requests-{name}.jsonl", *yes_if, "--latency", "0.02",
                                  faults_name=name)
        entries.append({"model": str(model), "name": name, "server_command": command,
                        **({"audio": audio} if audio else {})})
    write_overlay(workdir, demo_root, {"posts": str(root / "posts-all.csv"), "media_root": str(root / "media"),
                                       "classify": {"models": entries, "shards": 1},
                                       "planning": {"model_family": "auto"}})
    # Before any run: the model that hears the audio needs no transcript.
    dry = run_snakemake(workdir, "results/models/heard/labels.parquet", "-n", "--quiet", "rules").stdout
    run_snakemake(workdir)
    return workdir, dry, info


def _labels(workdir: Path, name: str) -> dict[str, dict]:
    return {r["post_id"]: r for r in pq.read_table(workdir / "results" / "models" / name / "labels.parquet").to_pylist()}


def _manifest(workdir: Path, plan: str) -> dict[str, dict]:
    return {r["post_id"]: r for r in pq.read_table(workdir / "results" / "manifest" / plan / "shard-0.parquet").to_pylist()}


@pytest.mark.slow
def test_a_model_that_hears_the_audio_waits_for_no_transcript(families_run):
    _, dry, _ = families_run
    assert "manifest" in dry and "classify" in dry and "transcribe" not in dry


@pytest.mark.slow
def test_each_family_gets_its_own_plan_and_every_estimate_is_the_server_s(families_run):
    workdir, _, _ = families_run
    assert sorted(p.name for p in (workdir / "results" / "manifest").iterdir()) == sorted(PLANS.values())
    for name, plan in PLANS.items():
        labels = _labels(workdir, name)
        ok = [r for r in labels.values() if r["status"] == "ok"]
        assert len(ok) >= 12, (name, {p: (r["status"], r["error_kind"], r["error"]) for p, r in labels.items()})
        assert all(r["error_kind"] in (None, "probe_error") or r["status"] == "excluded" for r in labels.values()
                   if r["status"] != "ok"), name
        manifest = _manifest(workdir, plan)
        for r in ok:  # the media tokens are exact; the text is approximated here (by a tokenizer on a real run)
            off = (r["est_prompt_tokens"], r["prompt_tokens"], manifest[r["post_id"]]["est_visual_tokens"])
            # within 2 %, or (a post of little media: a voice note) the chat template's few tokens apart
            assert abs(r["est_prompt_tokens"] - r["prompt_tokens"]) <= max(0.02 * r["prompt_tokens"], 24), \
                (name, r["post_id"], off)
        assert {r["model"] for r in ok} == {str(MODELS[name][0])}
    # The same video costs each family its own tokens: Qwen3-VL's one budget with its timestamps, Omni's 32-px
    # cells per frame, Qwen2.5-VL's 28-px cells.
    post = next(p for p, r in _manifest(workdir, "qwen2_5_vl").items() if r["post_type"] == "video")
    tokens = {plan: _manifest(workdir, plan)[post]["est_video_tokens"] for plan in ("qwen2_5_vl", "qwen3_vl",
                                                                                   "qwen3_omni")}
    assert len(set(tokens.values())) == 3, tokens


@pytest.mark.slow
def test_the_model_that_hears_gets_every_sound_as_audio_and_no_transcript(families_run):
    workdir, _, info = families_run
    heard, read = _manifest(workdir, "qwen3_omni-native"), _manifest(workdir, "qwen3_omni")
    talking = next(p for p, e in info.items() if e["probe_ok"] and e["has_audio"] and e["text"])
    row = heard[talking]
    assert [(i["kind"], i["part"]) for i in row["items"]] == [("video", None), ("audio", "sound")]
    assert row["items"][1]["media_path"].endswith(".wav") and row["items"][1]["label"] == "Sound of video 1 of 1"
    assert row["transcript_status"] == "heard" and "listen to the post's audio" in row["prompt"]
    assert row["est_audio_tokens"] > 0 and row["est_prompt_tokens"] > read[talking]["est_prompt_tokens"]
    assert read[talking]["transcript"] and [i["kind"] for i in read[talking]["items"]] == ["video"]
    silent = next(p for p, e in info.items() if e["probe_ok"] and not e["has_audio"])
    assert [i["kind"] for i in heard[silent]["items"]] == ["video"]  # no sound: nothing to hear
    # The slideshow's soundtrack and the voice note are heard; the reading model gets their transcripts.
    assert [i["kind"] for i in heard["slideshow-01"]["items"]][-1] == "audio"
    assert heard["slideshow-01"]["items"][-1]["media_path"].endswith(".wav")
    assert read["slideshow-01"]["items"][-1]["media_path"] is None and "Soundtrack transcript" in read["slideshow-01"]["prompt"]
    assert heard["voice-note"]["post_type"] == "audio" and heard["voice-note"]["est_audio_tokens"] > 0
    # The heard tokens are counted apart wherever tokens are shown by kind: the manifest's table by post type
    # and the summary's post_types.csv.
    header, *lines = describe(workdir / "results" / "manifest" / "qwen3_omni-native").splitlines()
    audio_line = next(x for x in lines if x.split()[0] == "audio")
    assert "audio tok" in header and int(audio_line.split()[-2]) == sum(
        r["est_audio_tokens"] for r in heard.values() if r["post_type"] == "audio")
    by_type = {name: {r["post_type"]: r for r in csv.DictReader(
        open(workdir / "results" / "models" / name / "summary" / "post_types.csv"))} for name in ("heard", "read")}
    assert float(by_type["heard"]["audio"]["est_audio_tokens_mean"]) > 0
    assert float(by_type["read"]["audio"]["est_audio_tokens_mean"]) == 0
    # What each server was sent: WAVs to the hearing model only.
    sent = {name: [e["path"] for e in read_request_log(workdir / f"requests-{name}.jsonl") if e["event"] == "media"]
            for name in MODELS}
    assert any(p.endswith(".wav") for p in sent["heard"])
    assert not any(p.endswith(".wav") for name in ("q3vl", "q25", "read") for p in sent[name])


@pytest.mark.slow
def test_the_four_models_compare_in_one_report_with_their_tokens(families_run):
    workdir, _, _ = families_run
    models = {r["model"]: r for r in csv.DictReader(open(workdir / "results" / "compare" / "models.csv"))}
    assert set(models) == set(MODELS)
    tokens = {name: {r["direction"]: r for r in csv.DictReader(
        open(workdir / "results" / "models" / name / "summary" / "tokens.csv"))} for name in MODELS}
    assert int(tokens["heard"]["input_audio"]["requests"]) > 0
    assert int(tokens["read"]["input_audio"]["requests"]) == 0
    compare = (workdir / "results" / "compare" / "compare.md").read_text()
    assert all(name in compare for name in MODELS)


def test_a_server_of_another_family_is_refused_before_any_post(make_shard, tmp_path):  # noqa: F811
    """The plan says Qwen2.5-VL (forced), the server is a Qwen3-VL model: its calibration video counts as
    Qwen3-VL counts, and the job stops naming both families, having sent no post."""
    shard = make_shard(3)
    cfg = shard.config(model=str(DATA / "qwen3_vl_8b"))  # planning.model_family: qwen2_5_vl (the shard's)
    with pytest.raises(CalibrationUnlikePlan) as err:
        shard.run(cfg)
    text = str(err.value)
    assert "as the qwen3_vl family does" in text and "not as the plan's qwen2_5_vl" in text
    assert "planning.model_family" in text
    assert [e for e in shard.events() if e["event"] == "received"] == []
