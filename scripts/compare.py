# Snakemake adapter: rule compare.
from pathlib import Path

from vidlabel.analyze.compare import run
from vidlabel.core.logs import configure
from vidlabel.core.stage_settings import for_job

configure(snakemake.log[0])
config = for_job(snakemake.config, "compare")
human = snakemake.input.human_labels[0] if snakemake.input.human_labels else None
design = snakemake.input.human_design[0] if snakemake.input.human_design else None
summary_dirs = [str(Path(p).parent) for p in snakemake.input.summaries]
run(config, list(zip(snakemake.params.models, snakemake.input.labels, summary_dirs)), snakemake.input.inventory,
    human, snakemake.params.compare_dir, design)
