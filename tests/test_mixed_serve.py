"""The classify stage with posts of several media items (issue 26, phase 2, serve side): the request
of a carousel, its identity item by item, the server sized for the data, the image calibration and
per-item errors, on the stand-in started through vLLM's own command line (the default server
command), with manifest shards in the manifest's contract made from real media files."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from standin import is_probe, read_request_log, vllm_shim
from standin.mixed import post_row, write_limits, write_shard
from standin.shards import QUESTIONS, YES_IF

from vidlabel.core import config as vconfig
from vidlabel.core import identity
from vidlabel.demo_mixed import camera_photo
from vidlabel.families.base import Family
from vidlabel.families.qwen2_5_vl import Qwen25VL
from vidlabel.prepare import post_plan
from vidlabel.serve import command
from vidlabel.serve.classify import ServerBelowPlan, attach_requests, read_shard, run_shard
from vidlabel.serve.items import MediaLimits, job_limits, named_item
from vidlabel.serve.provenance import JobIdentity
from vidlabel.serve.settings import ServeSettings

MODEL = "standin-model"


def make_clip(path: Path, seconds: float = 2.0, size: str = "320x240") -> Path:
    subprocess.run(["ffmpeg", "-v", "error", "-y", "-f", "lavfi", "-i", f"testsrc=size={size}:rate=10", "-t",
                    str(seconds), "-c:v", "libx264", "-preset", "ultrafast", "-pix_fmt", "yuv420p", str(path)],
                   check=True)
    return path


def make_audio(path: Path, seconds: float = 2.0) -> Path:
    subprocess.run(["ffmpeg", "-v", "error", "-y", "-f", "lavfi", "-i", f"sine=frequency=440:duration={seconds}",
                    "-c:a", "aac", str(path)], check=True)
    return path


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixed-media")
    files = {
        "portrait": camera_photo(root / "portrait.jpg", (1080, 1920), 1),
        "sideways": camera_photo(root / "sideways one.jpg", (1920, 1080), 2, orientation=6),
        "feed": camera_photo(root / "feed.webp", (1080, 1350), 3, fmt="WEBP"),
        "small": camera_photo(root / "small.jpg", (300, 200), 4),
        "clip": make_clip(root / "clip.mp4"),
        "song": make_audio(root / "song.m4a"),
    }
    return root, files


class Job:
    """A classify job over a manifest shard of mixed posts, with the stand-in as `vllm`."""

    def __init__(self, tmp: Path, media_root: Path, monkeypatch, *standin: str, **classify):
        self.tmp, self.media_root = tmp, media_root
        self.request_log = tmp / "requests.jsonl"
        shim = vllm_shim(tmp / "bin", *YES_IF, "--request-log", self.request_log, *standin)
        monkeypatch.setenv("PATH", f"{shim.parent}{os.pathsep}{os.environ['PATH']}")
        self.config = vconfig.validate({
            "posts": str(tmp / "posts.csv"), "media_root": str(media_root), "results": str(tmp / "results"),
            "planning": {"model_family": "qwen2_5_vl"}, "classify": {"model": MODEL, "questions": QUESTIONS, "concurrency": 4, "max_attempts": 2,
                         "backoff_initial_s": 0.01, "backoff_max_s": 0.05, "startup_timeout_s": 60,
                         "shutdown_grace_s": 2, "health_interval_s": 0.5, **classify}})
        self.shard = tmp / "manifest" / "shard-0.parquet"
        self.labels = tmp / "labels.parquet"

    def write(self, posts: list[tuple]) -> list[dict]:
        rows = [post_row(self.config, pid, [str(f) for f in files], caption, transcripts)
                for pid, files, caption, transcripts in posts]
        write_shard(self.shard, rows)
        return rows

    def run(self, config: dict | None = None) -> dict[str, dict]:
        run_shard(config or self.config, self.shard, self.labels, self.tmp / "journal.jsonl", self.tmp / "server.log", 0)
        return {r["post_id"]: r for r in pq.read_table(self.labels).to_pylist()}

    def events(self) -> list[dict]:
        return [e for e in read_request_log(self.request_log) if not is_probe(e.get("request_id"))]

    def server_argv(self) -> str:
        return (self.tmp / "server.log").read_text(errors="replace")


def standin_text_tokens(rows_by_post: dict) -> dict:
    """The stand-in's text count of each request (1 + characters / 4 of the text parts joined)."""
    out = {}
    for pid, row in rows_by_post.items():
        parts = [f"{i['label']}:" for i in row["items"] if i["media_path"]] + [row["prompt"]]
        out[pid] = 1 + int(len("\n".join(parts)) / 4)
    return out


POSTS = [
    ("carousel", ["portrait", "clip", "sideways", "feed"], "New drop, buy now #ad", {1: "pizza for everyone"}),
    ("slideshow", ["small", "feed", "song"], "Sunday vibes", {2: "la la la"}),
    ("photo", ["portrait"], "just a photo", {}),
    ("video", ["clip"], "a clip", {0: "hello"}),
]


def _posts(files):
    return [(pid, [files[n] for n in names], caption, transcripts) for pid, names, caption, transcripts in POSTS]


# ---- the request and the server it goes to ----------------------------------------------------------

def test_mixed_posts_are_sent_item_by_item_to_a_server_sized_for_them(media, tmp_path, monkeypatch):
    """Each post's items reach the server in order, images as image_url and videos as video_url; the
    server is started with --limit-mm-per-prompt from the data's largest counts, the image bounds of
    their own, and every image and video counted by vLLM's rule equals the item's estimate."""
    root, files = media
    job = Job(tmp_path, root, monkeypatch)
    rows = {r["post_id"]: r for r in job.write(_posts(files))}
    labels = job.run()
    assert {pid: r["status"] for pid, r in labels.items()} == dict.fromkeys(rows, "ok")
    assert labels["carousel"]["answers"] == json.dumps({"mentions_food": "yes", "promotes_product": "yes"})
    argv = job.server_argv()
    assert "--limit-mm-per-prompt '{\"image\":3,\"video\":1}'" in argv or '{"image":3,"video":1}' in argv
    assert '"images_kwargs":{"min_pixels":3136,"max_pixels":12845056}' in argv
    # The files the server opened, per request, in the post's order (audio is not sent).
    opened: dict[str, list[str]] = {}
    by_request = {r["request_id"]: pid for pid, r in rows.items()}
    for e in job.events():
        if e["event"] == "media" and e["request_id"] in by_request:
            opened.setdefault(by_request[e["request_id"]], []).append(e["path"])
    for pid, row in rows.items():
        assert opened[pid] == [os.path.realpath(i["media_path"]) for i in row["items"] if i["kind"] != "audio"]
    # Visual tokens as the server counts them = the items' estimates (the text is counted apart).
    text = standin_text_tokens(rows)
    for pid, row in rows.items():
        assert labels[pid]["prompt_tokens"] - text[pid] == sum(i["est_tokens"] for i in row["items"]), pid


def test_a_one_video_manifest_is_sent_as_before(media, tmp_path):
    """A manifest of one-video posts (media_path, no items) reads as one unlabelled video item: its body
    is the video and the prompt, as it always was."""
    import pyarrow as pa

    from vidlabel.serve.client import ClassifyClient

    root, files = media
    path = tmp_path / "shard.parquet"
    pq.write_table(pa.table({"request_id": ["r1"], "post_id": ["p1"], "media_path": [str(files["clip"])],
                             "prompt": ["PROMPT"], "est_prompt_tokens": [100]}), path)
    (row,) = read_shard(path)
    assert row["items"] == [{"index": 0, "kind": "video", "path": str(files["clip"]), "media_path": str(files["clip"]),
                             "label": None, "est_tokens": None, "est_embeds": None, "transcript_id": None}]
    cfg = vconfig.validate({"posts": "p.csv", "media_root": str(root), "results": str(tmp_path / "results"),
                            "planning": {"model_family": "qwen2_5_vl"},
                            "classify": {"model": MODEL, "questions": QUESTIONS, "endpoints": ["http://x/v1"]}})
    client = ClassifyClient([("http://127.0.0.1:9", "k")], ServeSettings.from_config(cfg).client)
    attach_requests(ServeSettings.from_config(cfg), [row])
    body = json.loads(client._body(row, 8))
    assert body["messages"] == [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": files["clip"].as_uri()}}, {"type": "text", "text": "PROMPT"}]}]


def test_the_answer_depends_on_every_item(media, tmp_path):
    """Reordering a carousel, relabelling an item, another transcript or a photo replaced at its path make a
    new request fingerprint; the same post again keeps it."""
    root, files = media
    cfg = vconfig.validate({"posts": "p.csv", "media_root": str(root), "results": str(tmp_path / "results"),
                            "planning": {"model_family": "qwen2_5_vl"}, "classify": {"model": MODEL, "questions": QUESTIONS, "endpoints": ["http://x/v1"]}})
    job = JobIdentity.resolve(ServeSettings.from_config(cfg))
    photo = camera_photo(tmp_path / "replaced.jpg", (640, 480), 7)
    row = post_row(cfg, "c", [str(files["portrait"]), str(photo), str(files["clip"])], "cap", {2: "hi"})

    def fingerprint(r) -> str:
        paths = [i["media_path"] for i in r["items"] if i["media_path"]]
        return job.request(r, identity.media_items(paths)).fingerprint()

    first = fingerprint(row)
    assert fingerprint(json.loads(json.dumps(row))) == first
    swapped = dict(row, items=[row["items"][1], row["items"][0], row["items"][2]])
    relabelled = dict(row, items=[dict(row["items"][0], label="Photo 9 of 9"), *row["items"][1:]])
    retranscribed = dict(row, items=[*row["items"][:2], dict(row["items"][2], transcript_id="other")])
    assert len({first, fingerprint(swapped), fingerprint(relabelled), fingerprint(retranscribed)}) == 4
    camera_photo(photo, (640, 480), 8)  # another photo at the same path
    os.utime(photo, ns=(1, 1))
    assert fingerprint(row) != first


def test_the_server_limits_come_from_the_whole_data_set(media, tmp_path, monkeypatch):
    """The manifest's figures for the data set (server_media_limits) size the server, and never below what
    the job's own rows send; --max-num-batched-tokens is raised to the largest item."""
    root, files = media
    cfg = vconfig.validate({"posts": "p.csv", "media_root": str(root), "results": str(tmp_path / "results"),
                            "planning": {"model_family": "qwen2_5_vl"}, "classify": {"model": MODEL, "questions": QUESTIONS}})
    rows = [post_row(cfg, "a", [str(files["portrait"]), str(files["small"])])]
    assert job_limits(rows, tmp_path) == MediaLimits(image=2, video=1, largest_item_tokens=2693)
    other = [post_row(cfg, "b", [str(files["small"])] * 12 + [str(files["clip"])] * 2)]
    write_limits(tmp_path, other)
    monkeypatch.setattr(post_plan, "server_media_limits",
                        lambda d: json.loads((Path(d) / "media_limits.json").read_text()), raising=False)
    limits = job_limits(rows, tmp_path)
    assert limits == MediaLimits(image=12, video=2, largest_item_tokens=2693)
    settings = ServeSettings.from_config(cfg).with_media_limits(MediaLimits(12, 2, 40000))
    argv = command.build_command(settings.server, 8000, command.single_copy(settings, tmp_path / "s.log"))
    assert argv[argv.index("--limit-mm-per-prompt") + 1] == '{"image":12,"video":2}'
    assert argv[argv.index("--max-num-batched-tokens") + 1] == "40000"
    # Neither decides an answer: the command a record is tied to leaves them as placeholders.
    held = command.placeholder_command(settings.server)
    assert held[held.index("--limit-mm-per-prompt") + 1] == "<limit_mm_per_prompt>"
    assert held[held.index("--max-num-batched-tokens") + 1] == "<max_num_batched_tokens>"
    # Data without images: no image allowed, as before; never fewer than one video.
    assert MediaLimits.of_rows([]).flag == '{"image":0,"video":1}'
    monkeypatch.setattr(post_plan, "server_media_limits", lambda d: {"images": 3}, raising=False)
    with pytest.raises(ValueError, match="lacks"):
        job_limits(rows, tmp_path)


def test_the_image_bounds_are_part_of_the_answers_settings(tmp_path):
    cfg = vconfig.validate({"posts": "p.csv", "media_root": str(tmp_path), "results": str(tmp_path / "results")})
    from vidlabel.core import stage_settings

    before = stage_settings.fingerprint(cfg, "classify")
    cfg["planning"]["image_max_pixels"] = 1003520
    assert stage_settings.fingerprint(cfg, "classify") != before
    assert ServeSettings.from_config(cfg).plan.identity()["image_max_pixels"] == 1003520


# ---- the image calibration and errors item by item --------------------------------------------------

def test_a_server_bounding_photos_like_video_frames_stops_the_job_before_any_post(media, tmp_path, monkeypatch):
    """The flat --mm-processor-kwargs makes transformers bound images like video frames: the calibration
    image shows it (the plan's figure and the server's), and the job stops with the fix before sending
    any post, since every image estimate would be wrong. The split form then labels every post."""
    root, files = media
    job = Job(tmp_path, root, monkeypatch)
    job.write(_posts(files))
    flat = lambda self, video, image: {"min_pixels": video.min_pixels, "max_pixels": video.max_pixels}  # noqa: E731
    monkeypatch.setattr(Qwen25VL, "mm_processor_kwargs", flat)
    with pytest.raises(ServerBelowPlan) as info:
        job.run()
    message = str(info.value)
    # 6760x3804 shrunk within 602,112 px: 20x36 cells; within the plan's 12,845,056: 96x170 (+2 markers).
    assert "took 722 visual tokens where the plan expects 16322" in message
    assert "mm_processor_kwargs" in message and "Nothing was sent" in message
    assert [e for e in job.events() if e["event"] == "received"] == []
    # the other spelling of the split form (the Qwen3 families'): size with shortest/longest_edge
    monkeypatch.setattr(Qwen25VL, "mm_processor_kwargs", Family.mm_processor_kwargs)
    assert all(r["status"] == "ok" for r in job.run().values())


def test_a_server_that_takes_no_images_stops_the_job_naming_the_limit(media, tmp_path, monkeypatch):
    root, files = media
    job = Job(tmp_path, root, monkeypatch)
    job.write(_posts(files))
    old = job.config["classify"]["server_command"].replace("{limit_mm_per_prompt}", "'{{\"image\":0,\"video\":1}}'")
    with pytest.raises(ServerBelowPlan) as info:
        job.run(vconfig.validate({**job.config, "classify": {**job.config["classify"], "server_command": old}}))
    assert "takes no images" in str(info.value) and "--limit-mm-per-prompt" in str(info.value)
    assert [e for e in job.events() if e["event"] == "received"] == []


def test_an_item_missing_here_is_its_posts_own_error_naming_the_item(media, tmp_path, monkeypatch):
    """One photo of a carousel deleted after the manifest was made: that post ends bad_media naming the
    item (error_item), the others are labelled; nothing stops the job."""
    root, files = media
    job = Job(tmp_path, root, monkeypatch)
    gone = camera_photo(root / "gone.jpg", (640, 480), 9)
    job.write([("broken", [files["portrait"], gone], "cap", {}), *_posts(files)[2:]])
    gone.unlink()
    labels = job.run()
    assert labels["broken"]["status"] == "error" and labels["broken"]["error_kind"] == "bad_media"
    assert labels["broken"]["error_item"] == 1
    assert labels["photo"]["status"] == "ok" and labels["photo"]["error_item"] is None


def test_the_item_an_error_names():
    items = [{"index": 0, "kind": "image", "media_path": "/m/a b.jpg", "est_tokens": 2693, "est_embeds": 2691},
             {"index": 1, "kind": "video", "media_path": "/m/c.mp4", "est_tokens": 5000, "est_embeds": 4998},
             {"index": 2, "kind": "image", "media_path": "/m/d.jpg", "est_tokens": 722, "est_embeds": 720},
             {"index": 3, "kind": "audio", "media_path": None, "est_tokens": 0, "est_embeds": 0}]
    assert named_item("[Errno 2] No such file or directory: '/m/d.jpg'", items)["index"] == 2
    assert named_item("The file path /m/a b.jpg must be a subpath of `--allowed-local-media-path /x`.",
                      items)["index"] == 0
    assert named_item("The decoder prompt contains a(n) image item with 720 embedding tokens, which exceeds the "
                      "pre-allocated encoder cache size 512.", items)["index"] == 2
    assert named_item("Failed to load video: broken", items)["index"] == 1  # the one video
    assert named_item("Failed to load image: cannot identify image file", items) is None  # two images
    from vidlabel.serve.error_kinds import classify_error

    assert classify_error(500, "[Errno 2] No such file or directory: '/m/d.jpg'", ["/m/a b.jpg", "/m/d.jpg"]) == \
        ("bad_media", True)  # the client's media check decides: missing here too, or the server's
    assert classify_error(500, "[Errno 2] No such file or directory: '/dev/shm/x'", ["/m/d.jpg"])[0] == "server_error"
    assert classify_error(400, "At most 2 image(s) may be provided in one prompt.") == ("too_many_items", False)


def test_a_server_below_the_datas_items_per_prompt_trips_the_breaker():
    from vidlabel.serve import breaker as br

    trips = []
    b = br.Breaker(br.PlannedLimits(context=32768, encoder_cache=32768, images=35, videos=2), trips.append)
    b.attempt("a", "too_many_items", 400, "At most 35 image(s) may be provided in one prompt.")
    assert trips == []  # at the plan's figure: that post's own
    b.attempt("b", "too_many_items", 400, "At most 4 image(s) may be provided in one prompt.")
    (trip,) = trips
    assert trip.kind == "limits" and "at most 4 image(s)" in trip.message and "35" in trip.message
    assert "--limit-mm-per-prompt" in trip.message
