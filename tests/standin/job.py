"""Run one classify shard job in its own process (as the Snakemake rule does), for kill tests.

Usage: python job.py CONFIG.json SHARD.parquet OUTPUT.parquet JOURNAL.jsonl SERVER.log SHARD_INDEX
"""

import json
import logging
import sys

from vidlabel.serve.classify import run_shard


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config_path, shard_path, output, journal, server_log, shard = argv
    with open(config_path) as fh:
        config = json.load(fh)
    try:
        run_shard(config, shard_path, output, journal, server_log, int(shard))
    except Exception as exc:  # the job's outcome is its exit status and this line
        logging.error("classify job failed: %s: %s", type(exc).__name__, exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
