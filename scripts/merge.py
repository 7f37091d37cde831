# Snakemake adapter: rule merge.
from vidlabel.logs import configure
from vidlabel.merge import merge

configure(snakemake.log[0])
merge(snakemake.config, snakemake.input.inventory, snakemake.input.excluded, list(snakemake.input.labels),
      snakemake.output[0])
