"""Label Studio files: every item of a post, each video's frame rate, and the adjudication an export
carries (ground truth).

The same files in a running Label Studio: tests/test_labelstudio_live.py.
"""

import json
import math
import xml.etree.ElementTree as ET

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
from test_label_sample import IDS, _annotation, _config, _export, _outputs, _read_csv, _results

from vidlabel.analyze import labelstudio
from vidlabel.analyze.aggregate import load_human_labels
from vidlabel.analyze.label_sample import collect, run


def test_the_video_plays_at_the_task_frame_rate():
    view = ET.fromstring(labelstudio.labelling_config([{"id": "q", "text": "Q?"}]))
    videos = view.find("Repeater[@on='$videos']")
    assert videos.find("Video").get("frameRate") == "$videos[{{idx}}].fps"
    assert videos.find("Video").get("value") == "$videos[{{idx}}].url"
    assert view.find("Repeater[@on='$images']/Image").get("value") == "$images[{{idx}}].url"
    assert view.find("Choices").get("toName") == "caption" == view.find("Text[@name='caption']").get("name")
    base = {"post_id": "p", "images": [], "caption": None, "transcript": "", "questions": "q", "pi": 0.5,
            "seed": 1, "design": "active"}
    fps = [t["data"]["videos"][0]["fps"] for t in labelstudio.tasks(
        {**base, "videos": [{"url": "/v.mp4", "label": "Video", "fps": f}]} for f in (29.97, 15, None, math.nan, 0.0))]
    assert fps == [29.97, 15.0, None, None, None]  # unknown: null, and Label Studio assumes 24
    assert labelstudio.reserved_question_ids(["videos", "video_0", "image_12", "video_clip"]) == [
        "image_12", "video_0", "videos"]


def test_a_task_shows_every_item_of_a_post_under_its_label(tmp_path):
    """A carousel's photos and clip, each under its label and its place in the post, the clip at its own
    frame rate (the inventory's item row), the transcripts each under its item's label."""
    labels, manifest, truth = _results(tmp_path, n_ok=40, n_error=0, n_excluded=0)
    media = tmp_path / "media"
    carousel = sorted(truth)[:40]
    items = pa.list_(pa.struct([("index", pa.int64()), ("kind", pa.string()), ("path", pa.string()),
                                ("media_path", pa.string()), ("label", pa.string()), ("est_tokens", pa.int64()),
                                ("transcript_id", pa.string())]))
    post_items = [[{"index": 0, "kind": "image", "path": str(media / f"{p}-1.jpg"), "media_path": None,
                    "label": "Photo 1 of 2", "est_tokens": 2693, "transcript_id": None},
                   {"index": 1, "kind": "video", "path": str(media / f"{p}.mp4"), "media_path": None,
                    "label": "Video 1 of 1", "est_tokens": 5000, "transcript_id": f"t-{p}"},
                   {"index": 2, "kind": "image", "path": str(media / f"{p}-2.webp"), "media_path": None,
                    "label": "Photo 2 of 2", "est_tokens": 722, "transcript_id": None},
                   {"index": 3, "kind": "audio", "path": str(media / f"{p}.m4a"), "media_path": None,
                    "label": "Soundtrack transcript", "est_tokens": 0, "transcript_id": f"s-{p}"}] for p in carousel]
    for path in manifest:
        path.unlink()
    pq.write_table(pa.table({"post_id": carousel, "items": pa.array(post_items, items), "caption": ["buy"] * 40}),
                   manifest[0])
    manifest = manifest[:1]
    inventory = tmp_path / "inventory.parquet"
    # One row per post, each item's frame rate in its items (the post's own is another: not the one shown).
    item_rates = pa.list_(pa.struct([("index", pa.int32()), ("fps", pa.float64())]))
    pq.write_table(pa.table({"post_id": carousel, "fps": pa.array([99.0] * 40, pa.float64()),
                             "items": pa.array([[{"index": i, "fps": 25.0 if i == 1 else None} for i in range(4)]] * 40,
                                               item_rates)}), inventory)
    transcripts = tmp_path / "transcripts.parquet"
    pq.write_table(pa.table({"transcript_id": [f"t-{p}" for p in carousel] + [f"s-{p}" for p in carousel],
                             "text": ["pizza"] * 40 + ["la la"] * 40, "status": ["ok"] * 80}), transcripts)
    outputs = _outputs(tmp_path)
    run(_config(tmp_path, budget=10, seed=1), labels, manifest, None, outputs, inventory_path=inventory,
        transcript_paths=[transcripts])
    tasks = json.loads(outputs["ls_tasks"].read_text())
    assert tasks
    for task in tasks:
        data = task["data"]
        assert [i["label"] for i in data["images"]] == ["Photo 1 of 2 (item 1 of 4)", "Photo 2 of 2 (item 3 of 4)"]
        assert [(v["label"], v["fps"]) for v in data["videos"]] == [("Video 1 of 1 (item 2 of 4)", 25.0)]
        assert data["images"][1]["url"].endswith(f"{data['post_id']}-2.webp")
        assert data["transcript"] == "Video 1 of 1: pizza\nSoundtrack transcript: la la"
    sample = _read_csv(outputs["sample"])
    assert json.loads(sample[0]["media"])[3].endswith(".m4a") and sample[0]["video_path"].endswith(".mp4")


def test_tasks_carry_each_video_frame_rate_from_the_inventory(tmp_path):
    labels, manifest, truth = _results(tmp_path, n_ok=60, n_error=3, n_excluded=2)
    rates = {post_id: [25.0, 30.0, 29.97002997, None][i % 4] for i, post_id in enumerate(truth)}
    inventory = tmp_path / "inventory.parquet"
    pq.write_table(pa.table({"post_id": list(rates), "fps": pa.array(list(rates.values()), pa.float64())}), inventory)
    outputs = _outputs(tmp_path)
    run(_config(tmp_path, budget=30, seed=1), labels, manifest, None, outputs, inventory_path=inventory)
    tasks = json.loads(outputs["ls_tasks"].read_text())
    assert {t["data"]["post_id"]: t["data"]["videos"][0]["fps"] for t in tasks} == {
        t["data"]["post_id"]: rates[t["data"]["post_id"]] for t in tasks}
    assert {t["data"]["videos"][0]["fps"] for t in tasks} >= {None, 30.0}
    assert {(len(t["data"]["videos"]), len(t["data"]["images"]), t["data"]["videos"][0]["label"]) for t in tasks} == {
        (1, 0, "Video")}  # a one-video post: as before, one video and no image

    run(_config(tmp_path, budget=30, seed=1), labels, manifest, None, outputs)  # no inventory: no frame rate
    assert {t["data"]["videos"][0]["fps"] for t in json.loads(outputs["ls_tasks"].read_text())} == {None}


def test_the_annotation_set_as_ground_truth_is_the_adjudication(tmp_path):
    labels, manifest, _ = _results(tmp_path)
    outputs = _outputs(tmp_path)
    run(_config(tmp_path, budget=30, seed=2), labels, manifest, None, outputs)
    sample = _read_csv(outputs["sample"])
    disputed, agreed = sample[0]["post_id"], sample[1]["post_id"]
    decision = {"promotes_product": "no", "sales_interaction": "yes"}
    adjudication = _annotation(3, {"id": 9, "email": "lead@example.org"}, decision)
    adjudication["ground_truth"] = True
    annotations = {
        disputed: [_annotation(1, 1, {"promotes_product": "yes", "sales_interaction": "yes"}),
                   _annotation(2, 2, {"promotes_product": "no", "sales_interaction": "yes"}), adjudication],
        agreed: [_annotation(4, 1, {"promotes_product": "yes", "sales_interaction": "no"}),
                 _annotation(5, 2, {"promotes_product": "yes", "sales_interaction": "no"})],
    }
    export = tmp_path / "export.json"
    export.write_text(json.dumps(_export(outputs["ls_tasks"], annotations)))
    rows = labelstudio.read_export(export).to_pylist()
    adjudicated = sorted((r["post_id"], r["question"], r["annotator"], r["adjudication"]) for r in rows
                         if r["adjudication"])
    assert adjudicated == [(disputed, q, "lead@example.org", decision[q]) for q in IDS]
    assert sum(r["adjudication"] is None for r in rows) == 8  # the coders' labels

    human = tmp_path / "human_labels.csv"
    collect(outputs["design"].parent, export, human)
    assert [r["adjudication"] for r in _read_csv(human)] == [r["adjudication"] or "" for r in rows]
    con = duckdb.connect()
    con.read_parquet(str(labels)).create_view("labels")
    con.register("q", pa.table({"question": IDS, "position": [0, 1]}))
    con.execute("CREATE TABLE questions AS SELECT * FROM q")
    load_human_labels(con, human)
    resolved = {(p, q): (y, res) for p, q, y, res in
                con.execute("SELECT post_id, question, y, resolution FROM human_resolved").fetchall()}
    # two coders who disagree would be a tie (0.5): the adjudication decides
    assert resolved[(disputed, "promotes_product")] == (0.0, "adjudicated")
    assert resolved[(disputed, "sales_interaction")] == (1.0, "adjudicated")
    assert resolved[(agreed, "promotes_product")] == (1.0, "agreeing copies")
