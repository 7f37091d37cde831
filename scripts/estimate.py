# Snakemake adapter: rule pilot (one model's pilot run and projection).
from vidlabel.estimate import run
from vidlabel.logs import configure
from vidlabel.settings import for_job

configure(snakemake.log[0])
config = for_job(snakemake.config, "estimate", snakemake.wildcards.model)
run(config, list(snakemake.input.shards), snakemake.output.json, snakemake.output.summary,
    snakemake.params.workdir, snakemake.params.server_log)
