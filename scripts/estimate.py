# Snakemake adapter: rule pilot (one model's pilot run and projection).
from vidlabel.core.logs import configure
from vidlabel.core.stage_settings import for_job
from vidlabel.serve.pilot import run

configure(snakemake.log[0])
config = for_job(snakemake.config, "estimate", snakemake.wildcards.model)
run(config, list(snakemake.input.shards), snakemake.output.json, snakemake.output.summary,
    snakemake.params.workdir, snakemake.params.server_log)
