# Snakemake adapter: rule manifest.
from vidlabel.core.logs import configure
from vidlabel.core.stage_settings import for_job
from vidlabel.prepare.manifest import build

configure(snakemake.log[0])
config = for_job(snakemake.config, "manifest", plan=snakemake.wildcards.plan)
build(config, snakemake.input.inventory, list(snakemake.input.transcripts),
      list(snakemake.input.transcoded), list(snakemake.output.shards), snakemake.output.excluded,
      snakemake.output.plan)
