"""Label Studio for real: the files `label_sample` writes, coded in a running Label Studio and read back.

Label Studio (LABEL_STUDIO_PIN, from PyPI) is installed into a virtualenv of its own in the test's
temporary folder and started on 127.0.0.1 with SQLite, serving the demo videos as local files. Through
its HTTP API the test creates a project from the generated labelling config, connects a local-files
storage on media_root, imports the generated tasks, writes two coders' annotations (one disagreement)
and an adjudication (an annotation set as ground truth), exports JSON, reads the export back with
`label_sample collect` and aggregates. Debian's Chromium, driven by Playwright, opens every task's
labelling page: the video element must report the inventory's size and duration, the frame counter the
inventory's frame rate, a carousel's photo (every other post is a carousel of its clip and a photo)
its own size, and a screenshot of the first task is kept (path printed; a copy under
logs/test-artifacts/labelstudio/).

Set VIDLABEL_LABEL_STUDIO_VENV to a folder to keep Label Studio's virtualenv between runs (it is made
there when missing); by default it lives in the test's temporary folder.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import httpx
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import REPO, default_model_dir, run_snakemake, write_overlay
from demo_media import get_demo_set
from test_label_sample import write_transcript_chunks

from vidlabel.analyze import aggregate, labelstudio
from vidlabel.analyze.label_sample import sample_questions
from vidlabel.analyze.sample_design import read_design
from vidlabel.core.config import load
from vidlabel.demo_mixed import camera_photo

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

LABEL_STUDIO_PIN = "label-studio==1.23.2"
CHROMIUM = Path("/usr/bin/chromium")
# Headless, and quiet: this machine has no outside network, and Chromium's background services would
# flood it with refused connections.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = REPO / "logs" / "test-artifacts" / "labelstudio"
ADJUDICATOR = "adjudicator@example.org"
CODERS = ("coder1@example.org", "coder2@example.org")
STARTUP_TIMEOUT_S = 900  # first start migrates the SQLite database: about 2 minutes on 2 busy cores


def _fail_without(what: str, fix: str) -> None:
    pytest.fail(f"{what} is missing: {fix}. The Label Studio round trip is part of `make test` and is not skipped.")


# --------------------------------------------------------------------------------------------
# The sample: real demo videos, their inventory, and the real label_sample rule

@pytest.fixture(scope="module")
def drawn(tmp_path_factory):
    """`snakemake label_sample` on the demo posts: labels.parquet with answer probabilities (one post
    failed), the manifest and the inventory of the real videos. Returns (workdir, config, demo)."""
    demo = get_demo_set(tmp_path_factory)
    workdir = tmp_path_factory.mktemp("labelstudio-workflow")
    results = workdir / "results"
    # Each demo post four times (the copies share its media): enough posts for an active draw that keeps its
    # coverage, whose probabilities vary, so that the round trip checks each label keeps its post's own.
    demo_rows = [r for r in pq.read_table(demo.inventory).to_pylist() if r["probe_error"] is None]
    probed = [{**r, "post_id": copy_id(r["post_id"], k)} for k in range(COPIES) for r in demo_rows]
    (results / "manifest" / "qwen2_5_vl").mkdir(parents=True)  # the default model's plan
    pq.write_table(pa.Table.from_pylist(probed, pq.read_schema(demo.inventory)), results / "inventory.parquet")
    write_transcript_chunks(results, {})
    for shard in range(2):  # write_overlay's classify.shards
        part = probed[shard::2]
        pq.write_table(pa.table({
            "request_id": [f"r-{r['post_id']}" for r in part], "post_id": [r["post_id"] for r in part],
            "items": pa.array([_items(demo, r) for r in part], ITEMS),
            "video_path": [r["video_path"] for r in part], "caption": [r["caption"] for r in part],
            "transcript": [demo.expected[demo_post(r["post_id"])]["text"] for r in part]}),
            results / "manifest" / "qwen2_5_vl" / f"shard-{shard}.parquet")
    config_overrides = {"label_sample": {"budget": 24, "seed": 3, "design": "active"}}
    overlay = write_overlay(workdir, demo.root, config_overrides)
    config = load(REPO / "config" / "config.yaml", yaml.safe_load(overlay.read_text()))
    ids = [q["id"] for q in config["classify"]["questions"]]
    rng = np.random.default_rng(5)
    rows = []
    for i, r in enumerate(probed):
        failed = i % 10 == 2  # the model's request failed: drawn more often, coded all the same
        p = rng.uniform(0.02, 0.98, len(ids))
        rows.append({"post_id": r["post_id"], "status": "error" if failed else "ok",
                     **{q: None if failed else ("yes" if pq_ > 0.5 else "no") for q, pq_ in zip(ids, p)},
                     "answer_probs": None if failed else json.dumps({q: {"yes": float(pq_), "no": float(1 - pq_)}
                                                                     for q, pq_ in zip(ids, p)}),
                     "shard": i % 2, "error_kind": "timeout" if failed else None, "error": None,
                     "prompt_tokens": None if failed else 1000, "completion_tokens": None if failed else 20,
                     "latency_s": 1.0, "started_at": float(i), "finished_at": i + 1.0})
    labels = default_model_dir(results) / "labels.parquet"
    labels.parent.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), labels)
    run_snakemake(workdir, "label_sample", "--allowed-rules", "label_sample", "--cores", "1", timeout=600)
    return workdir, config, demo


ITEMS = pa.list_(pa.struct([("index", pa.int64()), ("kind", pa.string()), ("path", pa.string()),
                            ("media_path", pa.string()), ("label", pa.string()), ("est_tokens", pa.int64()),
                            ("transcript_id", pa.string())]))
PHOTO_SIZE = (640, 800)  # (width, height), upright (no orientation tag)
COPIES = 4


def copy_id(post_id: str, k: int) -> str:
    return post_id if k == 0 else f"{post_id}-copy{k}"


def demo_post(post_id: str) -> str:
    """The demo post a copy was made of."""
    return post_id.split("-copy")[0]


def _items(demo, row) -> list[dict]:
    """The post's clip alone, or (every other post) a carousel of the clip and a photo beside it."""
    video = {"index": 0, "kind": "video", "path": row["video_path"], "media_path": row["video_path"],
             "label": None, "est_tokens": None, "transcript_id": None}
    if int(hashlib.sha256(demo_post(row["post_id"]).encode()).hexdigest(), 16) % 2:
        return [video]
    photo = camera_photo(Path(demo.media) / "labelstudio-photos" / f"{demo_post(row['post_id'])}.jpg", PHOTO_SIZE, 5)
    return [{**video, "label": "Video 1 of 1"}, {"index": 1, "kind": "image", "path": str(photo),
                                                 "media_path": str(photo), "label": "Photo 1 of 1", "est_tokens": None,
                                                 "transcript_id": None}]


# --------------------------------------------------------------------------------------------
# Label Studio: installed from PyPI, started on a free port of 127.0.0.1

@pytest.fixture(scope="module")
def label_studio_bin(tmp_path_factory):
    venv = Path(os.environ.get("VIDLABEL_LABEL_STUDIO_VENV") or tmp_path_factory.mktemp("label-studio") / "venv")
    exe = venv / "bin" / "label-studio"
    started = time.monotonic()
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
    proc = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                           LABEL_STUDIO_PIN], capture_output=True, text=True, check=False)
    if proc.returncode != 0 or not exe.exists():
        pytest.fail(f"pip install {LABEL_STUDIO_PIN} into {venv} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    print(f"\n{LABEL_STUDIO_PIN} installed into {venv} in {time.monotonic() - started:.0f} s")
    return exe


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LabelStudioAPI:
    """The HTTP API with the admin's legacy token; a status of 400 or more fails the test with the body."""

    def __init__(self, url: str, token: str):
        self.url = url
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Token {token}"}, timeout=120)

    def __call__(self, method: str, path: str, **kwargs):
        response = self.http.request(method, path, **kwargs)
        if response.status_code >= 400:
            raise AssertionError(f"Label Studio {method} {path}: HTTP {response.status_code}: {response.text[:3000]}")
        return response.json()


@pytest.fixture(scope="module")
def label_studio(label_studio_bin, drawn, tmp_path_factory):
    """A running Label Studio whose local files are the demo posts' folder. Yields (api, password)."""
    _, config, _ = drawn
    home = tmp_path_factory.mktemp("label-studio-home")
    port, token, password = _free_port(), secrets.token_hex(20), secrets.token_urlsafe(16)
    document_root = Path(config["media_root"]).resolve().parent  # the folder that holds media_root
    # A clean environment: Label Studio also reads unprefixed names (HOST, PORT, USERNAME, DEBUG...).
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1",
           "LABEL_STUDIO_BASE_DATA_DIR": str(home / "data"), "DJANGO_DB": "sqlite",
           "LABEL_STUDIO_LOCAL_FILES_SERVING_ENABLED": "true",
           "LABEL_STUDIO_LOCAL_FILES_DOCUMENT_ROOT": str(document_root),
           # no outside network: no version check, analytics or error reports
           "LATEST_VERSION_CHECK": "false", "COLLECT_ANALYTICS": "false", "SENTRY_DSN": "",
           "FRONTEND_SENTRY_DSN": ""}
    log_path = home / "label-studio.log"
    command = [str(label_studio_bin), "start", "--no-browser", "--internal-host", "127.0.0.1", "--port", str(port),
               "--username", ADJUDICATOR, "--password", password, "--user-token", token,
               "--enable-legacy-api-token"]
    started = time.monotonic()
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=home)
    try:
        url = f"http://127.0.0.1:{port}"
        while True:
            if server.poll() is not None:
                pytest.fail(f"Label Studio exited ({server.returncode}) before answering:\n"
                            f"{log_path.read_text()[-5000:]}")
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() - started > STARTUP_TIMEOUT_S:
                pytest.fail(f"Label Studio did not answer on {url} in {STARTUP_TIMEOUT_S} s:\n"
                            f"{log_path.read_text()[-5000:]}")
            time.sleep(1)
        print(f"Label Studio started on {url} in {time.monotonic() - started:.0f} s (log {log_path})")
        yield LabelStudioAPI(url, token), password
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


# --------------------------------------------------------------------------------------------
# The browser

@pytest.fixture(scope="module")
def browser_page(label_studio, tmp_path_factory):
    """A logged-in page of Debian's Chromium (never a downloaded browser) with a fresh profile."""
    if not CHROMIUM.exists():
        _fail_without(f"Debian's Chromium ({CHROMIUM})", "apt-get install chromium (make setup installs it)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _fail_without("The playwright package", "pip install -e '.[test]' (make setup installs it)")
    api, password = label_studio
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=str(CHROMIUM), headless=True,
            args=CHROMIUM_ARGS, viewport={"width": 1400, "height": 1200})
        try:
            page = context.new_page()
            page.goto(api.url + "/user/login/")
            page.fill("input[name=email]", ADJUDICATOR)
            page.fill("input[name=password]", password)
            page.click("button[type=submit]")
            page.wait_for_url(lambda u: "/user/login" not in u, timeout=120_000)
            yield page
        finally:
            context.close()


# The first video element once it has a decoded frame: what the browser knows of the clip.
VIDEO_STATE_JS = """() => {
  const v = document.querySelector('video');
  if (!v) return null;
  if (v.error) return {error: v.error.code, src: v.currentSrc};
  if (v.readyState < 2) return null;
  return {width: v.videoWidth, height: v.videoHeight, duration: v.duration, src: v.currentSrc};
}"""


# The carousel's photo once loaded: the largest picture on the page as the browser decoded it (Label
# Studio may show it from a blob: URL, so the file's name need not be in its src).
PHOTO_STATE_JS = """() => {
  const shown = [...document.querySelectorAll('img')].filter(i => i.complete && i.naturalWidth >= 100);
  if (!shown.length) return null;
  const i = shown.reduce((a, b) => a.naturalWidth * a.naturalHeight >= b.naturalWidth * b.naturalHeight ? a : b);
  return {width: i.naturalWidth, height: i.naturalHeight, src: i.currentSrc};
}"""


def _labelling_page(page, api, project, task, photo: bool = False) -> dict:
    """Open a task's labelling page; returns the video's state, the frame counter's total and, for a
    carousel, its photo's."""
    page.goto(f"{api.url}/projects/{project}/data?task={task}")
    state = page.wait_for_function(VIDEO_STATE_JS, timeout=120_000).json_value()
    image = page.wait_for_function(PHOTO_STATE_JS, timeout=120_000).json_value() if photo else None
    page.wait_for_timeout(1000)  # let the player draw the frame before a screenshot
    # The frame counter ("1 of 49"); a carousel's labels ("Photo 1 of 1") count items, fewer than frames.
    counters = [int(n) for n in re.findall(r"\b1\s+of\s+(\d+)\b", page.inner_text("body"))]
    return {**state, "frames": max(counters) if counters else None, "photo": image}


# --------------------------------------------------------------------------------------------
# The round trip

def _choices(labels: dict[str, str]) -> list[dict]:
    return [{"from_name": q, "to_name": labelstudio.CHOICES_TARGET, "type": "choices", "value": {"choices": [label]}}
            for q, label in labels.items()]


def _read_csv(path):
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def test_label_studio_round_trip(drawn, label_studio, browser_page, tmp_path):
    workdir, config, demo = drawn
    api, _ = label_studio
    sample_dir = workdir / "results" / "label_sample"
    questions = sample_questions(config)
    ids = [q["id"] for q in questions]
    sample = _read_csv(sample_dir / "sample.csv")
    assert len(sample) >= 2, "the draw must give a disagreement and an agreement to code"
    design_table, metadata = read_design(sample_dir / "design.parquet")
    design = {r["post_id"]: r for r in design_table.to_pylist()}
    assert metadata["design"] == "active" and "requested_design" not in metadata
    assert len({round(design[r["post_id"]]["pi"], 9) for r in sample}) > 1, "expected varying pi (active design)"
    inventory = {r["post_id"]: r for r in pq.read_table(workdir / "results" / "inventory.parquet").to_pylist()}

    # Project from the generated config, local-files storage on media_root, the generated tasks.
    label_config = (sample_dir / "labelstudio_config.xml").read_text()
    assert label_config == labelstudio.labelling_config(questions)
    project = api("POST", "/api/projects", json={"title": "vidlabel human sample", "label_config": label_config})["id"]
    api("POST", "/api/storages/localfiles", json={"project": project, "title": "media_root",
                                                  "path": str(Path(config["media_root"]).resolve()),
                                                  "use_blob_urls": False})
    task_file = json.loads((sample_dir / "labelstudio_tasks.json").read_text())
    imported = api("POST", f"/api/projects/{project}/import", json=task_file)
    assert imported["task_count"] == len(sample)
    listed = api("GET", "/api/tasks", params={"project": project, "page_size": 1000})["tasks"]
    task_of = {t["data"]["post_id"]: t["id"] for t in listed}
    assert [t["data"] for t in sorted(listed, key=lambda t: t["id"])] == [t["data"] for t in task_file]
    for task in task_file:  # the inventory's frame rate, for the Video tag's frameRate
        (video,) = task["data"]["videos"]
        assert video["fps"] == pytest.approx(inventory[task["data"]["post_id"]]["fps"])
    carousels = {t["data"]["post_id"] for t in task_file if t["data"]["images"]}
    assert carousels and len(carousels) < len(task_file), "the draw must hold carousels and one-video posts"

    # Every labelling page plays its clip at the inventory's size, duration and frame rate, and shows a
    # carousel's photo at its own size.
    page = browser_page
    for row in {demo_post(r["post_id"]): r for r in reversed(sample)}.values():  # each clip once
        probe = inventory[row["post_id"]]
        state = _labelling_page(page, api, project, task_of[row["post_id"]], photo=row["post_id"] in carousels)
        if row["post_id"] in carousels:
            assert (state["photo"]["width"], state["photo"]["height"]) == PHOTO_SIZE, (row["post_id"], state)
        assert "error" not in state, f"{row['post_id']}: the browser could not play {state['src']}: error {state}"
        assert (state["width"], state["height"]) == (probe["width"], probe["height"]), row["post_id"]
        assert state["duration"] == pytest.approx(probe["duration_s"], abs=1 / probe["fps"]), row["post_id"]  # a frame
        # Label Studio counts frames at the task's frameRate (24 without it)
        assert state["frames"] == round(state["duration"] * probe["fps"]), (row["post_id"], state)
        print(f"{row['post_id']}: browser {state['width']}x{state['height']} {state['duration']:.3f} s "
              f"{state['frames']} frames; inventory {probe['width']}x{probe['height']} {probe['duration_s']:.3f} s "
              f"{probe['fps']:g} fps {probe['video_codec']}")
    first = sample[0]["post_id"]
    _labelling_page(page, api, project, task_of[first])
    body = page.inner_text("body")
    assert all(q["text"] in body for q in questions), body
    # every question's choices, in order, with their hotkeys
    assert re.findall(r"\b(yes|no)\[(\d+)\]", body) == [
        (choice, str(i + 1)) for i, choice in enumerate(["yes", "no"] * len(questions))], body
    screenshot = tmp_path / "labelling-page.png"
    page.screenshot(path=str(screenshot))
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shutil.copy(screenshot, ARTIFACTS / screenshot.name)
    print(f"screenshot of the labelling page of post {first}: {screenshot} (copy: {ARTIFACTS / screenshot.name})")

    # Two coders code every task; they disagree once, on the first post's first question, and the
    # adjudicator's annotation of that post, set as ground truth, decides it.
    coder_ids = [api("POST", "/api/users/", json={"email": email, "username": email.split("@")[0]})["id"]
                 for email in CODERS]
    truth = {r["post_id"]: {q: "yes" if demo.expected[demo_post(r["post_id"])]["promotes_product"] and q == ids[0]
                            else "no"
                            for q in ids} for r in sample}
    coded = {post: [dict(labels), dict(labels)] for post, labels in truth.items()}
    disputed = ids[0]
    coded[first][1][disputed] = "no" if coded[first][0][disputed] == "yes" else "yes"
    for post, by_coder_labels in coded.items():
        for coder, labels in zip(coder_ids, by_coder_labels):
            api("POST", f"/api/tasks/{task_of[post]}/annotations/",
                json={"result": _choices(labels), "completed_by": coder, "lead_time": 20.0})
    decision = {**coded[first][0], disputed: coded[first][1][disputed]}  # the second coder was right
    adjudication = api("POST", f"/api/tasks/{task_of[first]}/annotations/", json={"result": _choices(decision)})
    api("PATCH", f"/api/annotations/{adjudication['id']}/", json={"ground_truth": True})

    # Export (JSON), read it back with `label_sample collect`, aggregate.
    response = api.http.get(f"/api/projects/{project}/export", params={"exportType": "JSON"})
    assert response.status_code == 200, response.text[:2000]
    export = tmp_path / "project-export.json"
    export.write_bytes(response.content)
    human = tmp_path / "human_labels.csv"
    proc = subprocess.run([sys.executable, "-m", "vidlabel.analyze.label_sample", "collect", str(export),
                           "--sample-dir", str(sample_dir), "-o", str(human)], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    rows = _read_csv(human)
    assert len(rows) == 2 * len(ids) * len(sample) + len(ids)
    for r in rows:
        assert float(r["sampling_probability"]) == pytest.approx(design[r["post_id"]]["pi"], abs=1e-12)
    adjudicated = [r for r in rows if r["adjudication"]]
    assert sorted((r["post_id"], r["question"], r["adjudication"]) for r in adjudicated) == sorted(
        (first, q, decision[q]) for q in ids)
    by_coder = {}
    for r in rows:
        if not r["adjudication"]:
            by_coder.setdefault((r["post_id"], r["question"]), []).append(r["label"])
    assert by_coder == {(post, q): [a[q] for a in by_coder_labels] for post, by_coder_labels in coded.items()
                        for q in ids}

    con = duckdb.connect()
    con.read_parquet(str(default_model_dir(workdir / "results") / "labels.parquet")).create_view("labels")
    con.register("q", pa.table({"question": ids, "position": list(range(len(ids)))}))
    con.execute("CREATE TABLE questions AS SELECT * FROM q")
    described = aggregate.load_human_labels(con, human)
    assert described["weighted"]
    resolved = {(p, q): (y, res) for p, q, y, res in
                con.execute("SELECT post_id, question, y, resolution FROM human_resolved").fetchall()}
    assert resolved[(first, disputed)] == (1.0 if decision[disputed] == "yes" else 0.0, "adjudicated")

    summary = tmp_path / "summary"
    aggregate.run(config, default_model_dir(workdir / "results") / "labels.parquet", human, summary)
    prevalence = {r["question"]: r for r in _read_csv(summary / "prevalence.csv")}
    for q in ids:
        y = np.array([1.0 if (decision if post == first else truth[post])[q] == "yes" else 0.0 for post in truth])
        pi = np.array([design[post]["pi"] for post in truth])
        row = prevalence[q]
        assert row["design"] == "weighted" and int(row["human_n"]) == len(sample)
        assert float(row["human_yes"]) == y.sum()
        assert float(row["human_share"]) == pytest.approx((y / pi).sum() / (1 / pi).sum())


def test_personal_access_token_as_the_docs_describe(label_studio):
    """Label Studio 1.23's default token kind (docs/human_labels.md, step 3): a personal access token,
    traded for a short-lived access token, authenticates with `Authorization: Bearer`."""
    api, _ = label_studio
    personal = api("POST", "/api/token/")["token"]
    refreshed = httpx.post(f"{api.url}/api/token/refresh/", json={"refresh": personal}, timeout=60)
    assert refreshed.status_code == 200, refreshed.text[:2000]
    whoami = httpx.get(f"{api.url}/api/current-user/whoami", timeout=60,
                       headers={"Authorization": f"Bearer {refreshed.json()['access']}"})
    assert whoami.status_code == 200 and whoami.json()["email"] == ADJUDICATOR, whoami.text[:2000]
    rejected = httpx.get(f"{api.url}/api/current-user/whoami", timeout=60, headers={"Authorization": "Bearer nonsense"})
    assert rejected.status_code == 401
