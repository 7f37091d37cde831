# Snakemake adapter: rule merge.
from vidlabel.analyze.merge import merge
from vidlabel.core.logs import configure
from vidlabel.core.stage_settings import for_job

configure(snakemake.log[0])
config = for_job(snakemake.config, "merge", snakemake.wildcards.model)
merge(config, snakemake.input.inventory, snakemake.input.excluded, list(snakemake.input.labels),
      snakemake.output[0], manifest_paths=list(snakemake.input.manifest))
