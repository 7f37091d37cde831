"""Label Studio files: each video's frame rate, and the adjudication an export carries (ground truth).

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
    assert view.find("Video").get("frameRate") == "$fps"
    base = {"post_id": "p", "video": "/v.mp4", "caption": None, "transcript": "", "questions": "q", "pi": 0.5,
            "seed": 1, "design": "active"}
    fps = [t["data"]["fps"] for t in labelstudio.tasks({**base, "fps": f} for f in (29.97, 15, None, math.nan, 0.0))]
    assert fps == [29.97, 15.0, None, None, None]  # unknown: null, and Label Studio assumes 24
    assert labelstudio.reserved_question_ids(["fps"]) == ["fps"]


def test_tasks_carry_each_video_frame_rate_from_the_inventory(tmp_path):
    labels, manifest, truth = _results(tmp_path, n_ok=60, n_error=3, n_excluded=2)
    rates = {post_id: [25.0, 30.0, 29.97002997, None][i % 4] for i, post_id in enumerate(truth)}
    inventory = tmp_path / "inventory.parquet"
    pq.write_table(pa.table({"post_id": list(rates), "fps": pa.array(list(rates.values()), pa.float64())}), inventory)
    outputs = _outputs(tmp_path)
    run(_config(tmp_path, budget=30, seed=1), labels, manifest, None, outputs, inventory_path=inventory)
    tasks = json.loads(outputs["ls_tasks"].read_text())
    assert {t["data"]["post_id"]: t["data"]["fps"] for t in tasks} == {
        t["data"]["post_id"]: rates[t["data"]["post_id"]] for t in tasks}
    assert {t["data"]["fps"] for t in tasks} >= {None, 30.0}

    run(_config(tmp_path, budget=30, seed=1), labels, manifest, None, outputs)  # no inventory: no frame rate
    assert {t["data"]["fps"] for t in json.loads(outputs["ls_tasks"].read_text())} == {None}


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
