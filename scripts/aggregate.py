# Snakemake adapter: rule aggregate.
from vidlabel.aggregate import run
from vidlabel.logs import configure

configure(snakemake.log[0])
human = snakemake.input.human_labels[0] if snakemake.input.human_labels else None
run(snakemake.config, snakemake.input.labels, human, snakemake.params.summary_dir)
