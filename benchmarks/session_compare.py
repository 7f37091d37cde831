"""The runs of one GPU session side by side: each run's label shard merged and aggregated as the
workflow's merge and aggregate rules do, then ``compare`` over them (tokens, GPU-hours, cost, answers).

    python benchmarks/session_compare.py SESSION_DIR OUT \\
        heard=data-raw-Qwen3-Omni-30B-A3B-Instruct-native read=data-raw-Qwen3-Omni-30B-A3B-Instruct

Each NAME=DATA names a run of ``gpu_session.sh`` (RUNS' NAME; its files ``default-@mixed@NAME-labels.parquet``)
and the data folder of its plan (``DATA-inventory.parquet``, ``-excluded.parquet``, ``-shard-0.parquet``), as
the session's finish copies them. With random weights the answers mean nothing; the tokens, time and cost do.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    from vidlabel.analyze import aggregate, compare, merge
    from vidlabel.core import config as vconfig

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("session", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("runs", nargs="+", help="NAME=DATA per run")
    ap.add_argument("--variant", default="default-@mixed", help="the session's VARIANT")
    args = ap.parse_args(argv)
    config = vconfig.load(REPO / "config" / "config.yaml", {"posts": str(args.session), "media_root": "/"})
    compared = []
    for run in args.runs:
        name, _, data = run.partition("=")
        files = {kind: args.session / f"{data}-{kind}.parquet" for kind in ("inventory", "excluded", "shard-0")}
        shard_labels = args.session / f"{args.variant}@{name}-labels.parquet"
        missing = [str(p) for p in (*files.values(), shard_labels) if not p.exists()]
        if missing:
            print(f"{name}: missing {missing}", file=sys.stderr)
            return 1
        labels = args.out / name / "labels.parquet"
        labels.parent.mkdir(parents=True, exist_ok=True)
        merge.merge(config, files["inventory"], files["excluded"], [shard_labels], labels, [files["shard-0"]])
        aggregate.run(config, labels, None, args.out / name / "summary")
        compared.append((name, str(labels), str(args.out / name / "summary")))
    first_inventory = args.session / f"{args.runs[0].partition('=')[2]}-inventory.parquet"
    compare.run(config, compared, str(first_inventory), None, str(args.out / "compare"))
    print((args.out / "compare" / "compare.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
