# Snakemake adapter: rule aggregate.
from vidlabel.aggregate import run
from vidlabel.logs import configure
from vidlabel.settings import for_job

configure(snakemake.log[0])
config = for_job(snakemake.config, "aggregate", snakemake.wildcards.model)
human = snakemake.input.human_labels[0] if snakemake.input.human_labels else None
run(config, snakemake.input.labels, human, snakemake.params.summary_dir)
