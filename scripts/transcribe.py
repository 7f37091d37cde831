# Snakemake adapter: rule transcribe (one chunk).
from vidlabel.logs import configure
from vidlabel.transcribe import run_chunk

configure(snakemake.log[0])
run_chunk(snakemake.config, snakemake.input[0], int(snakemake.wildcards.chunk), snakemake.output[0])
