# Snakemake adapter: rule estimate (pilot run and projection).
from vidlabel.estimate import run
from vidlabel.logs import configure

configure(snakemake.log[0])
run(snakemake.config, list(snakemake.input.shards), snakemake.output.json, snakemake.output.summary,
    snakemake.params.workdir)
