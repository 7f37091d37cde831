# Snakemake adapter: rule merge.
from vidlabel.logs import configure
from vidlabel.settings import for_job
from vidlabel.merge import merge

configure(snakemake.log[0])
config = for_job(snakemake.config, "merge", snakemake.wildcards.model)
merge(config, snakemake.input.inventory, snakemake.input.excluded, list(snakemake.input.labels),
      snakemake.output[0])
