# Snakemake adapter: rule transcribe (one chunk).
from vidlabel.core.logs import configure
from vidlabel.core.stage_settings import for_job
from vidlabel.prepare.transcribe import run_chunk

configure(snakemake.log[0])
config = for_job(snakemake.config, "transcribe")
run_chunk(config, snakemake.input[0], int(snakemake.wildcards.chunk), snakemake.output[0])
