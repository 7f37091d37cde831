# Snakemake adapter: rule inventory.
from vidlabel.inventory import build_inventory
from vidlabel.logs import configure

configure(snakemake.log[0])
build_inventory(snakemake.config, snakemake.output[0], threads=snakemake.threads)
