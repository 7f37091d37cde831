# Snakemake adapter: rule aggregate.
from vidlabel.analyze.aggregate import run
from vidlabel.core.logs import configure
from vidlabel.core.stage_settings import for_job

configure(snakemake.log[0])
config = for_job(snakemake.config, "aggregate", snakemake.wildcards.model)
human = snakemake.input.human_labels[0] if snakemake.input.human_labels else None
design = snakemake.input.human_design[0] if snakemake.input.human_design else None
run(config, snakemake.input.labels, human, snakemake.params.summary_dir, design)
