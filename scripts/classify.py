# Snakemake adapter: rule classify (one shard).
from vidlabel.classify import run_shard
from vidlabel.logs import configure

configure(snakemake.log[0])
run_shard(snakemake.config, snakemake.input[0], snakemake.output[0], snakemake.params.journal,
          snakemake.params.server_log, int(snakemake.wildcards.shard))
