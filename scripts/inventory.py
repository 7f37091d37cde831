# Snakemake adapter: rule inventory.
from vidlabel.core.logs import configure
from vidlabel.core.stage_settings import for_job
from vidlabel.prepare.inventory import build_inventory

configure(snakemake.log[0])
config = for_job(snakemake.config, "inventory")
build_inventory(config, snakemake.output[0], threads=snakemake.threads)
