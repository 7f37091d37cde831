# Snakemake adapter: rule label_sample.
from vidlabel.analyze.label_sample import run
from vidlabel.core.logs import configure
from vidlabel.core.stage_settings import for_job

configure(snakemake.log[0])
config = for_job(snakemake.config, "label_sample")
burn_in = snakemake.input.burn_in[0] if snakemake.input.burn_in else None
run(config, snakemake.input.labels, list(snakemake.input.manifest), burn_in, dict(snakemake.output.items()),
    inventory_path=snakemake.input.inventory, transcript_paths=list(snakemake.input.transcripts))
