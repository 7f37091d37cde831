# Snakemake adapter: rule inventory.
from vidlabel.inventory import build_inventory
from vidlabel.logs import configure
from vidlabel.settings import for_job

configure(snakemake.log[0])
config = for_job(snakemake.config, "inventory")
build_inventory(config, snakemake.output[0], threads=snakemake.threads)
