# Snakemake adapter: rule classify (one shard).
from vidlabel.core.logs import configure
from vidlabel.core.stage_settings import for_job
from vidlabel.serve.classify import run_shard

configure(snakemake.log[0])
config = for_job(snakemake.config, "classify", snakemake.wildcards.model)
run_shard(config, snakemake.input.shard, snakemake.output[0], snakemake.params.journal,
          snakemake.params.server_log, int(snakemake.wildcards.shard))
