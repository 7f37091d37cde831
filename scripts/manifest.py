# Snakemake adapter: rule manifest.
from vidlabel.logs import configure
from vidlabel.manifest import build

configure(snakemake.log[0])
build(snakemake.config, snakemake.input.inventory, list(snakemake.input.transcripts),
      list(snakemake.input.transcoded), list(snakemake.output.shards), snakemake.output.excluded,
      snakemake.output.plan)
