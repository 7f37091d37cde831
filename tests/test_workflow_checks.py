"""The workflow refuses bad input before any job runs, naming what is wrong."""

import csv

from conftest import run_snakemake, write_overlay


def _posts(path, rows):
    with open(path, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["post_id", "video_path", "caption"])
        writer.writerows(rows)


def test_bad_config_key_is_named(tmp_path, demo_set):
    demo_root, _ = demo_set
    write_overlay(tmp_path, demo_root, {"classify": {"concurrency": -3}})
    proc = run_snakemake(tmp_path, "-n", check=False)
    assert proc.returncode != 0
    assert "classify.concurrency" in proc.stdout + proc.stderr
    assert not (tmp_path / "results").exists()


def test_duplicate_post_ids_stop_before_any_job(tmp_path, demo_set):
    demo_root, _ = demo_set
    posts = tmp_path / "posts.csv"
    media = demo_root / "media"
    _posts(posts, [["a", str(media / "good-01.mp4"), ""], ["b", str(media / "good-03.mp4"), ""],
                   ["a", str(media / "good-04.mp4"), ""]])
    write_overlay(tmp_path, demo_root, {"posts": str(posts)})
    proc = run_snakemake(tmp_path, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "duplicate post_id" in out and "'a' (rows 1, 3)" in out
    assert not (tmp_path / "results").exists()


def test_path_outside_media_root_stops_before_any_job(tmp_path, demo_set):
    demo_root, _ = demo_set
    outside = tmp_path / "elsewhere.mp4"
    outside.write_bytes(b"x")
    posts = tmp_path / "posts.csv"
    _posts(posts, [["ok", str(demo_root / "media" / "good-01.mp4"), ""], ["sneaky", str(outside), ""],
                   ["dots", str(demo_root / "media" / ".." / ".." / "elsewhere.mp4"), ""]])
    write_overlay(tmp_path, demo_root, {"posts": str(posts)})
    proc = run_snakemake(tmp_path, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "sneaky" in out and "dots" in out and "media_root" in out
    assert not (tmp_path / "results").exists()
