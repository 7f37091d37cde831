# Snakemake adapter: rule transcode (one chunk).
from vidlabel.logs import configure
from vidlabel.transcode import run_chunk

configure(snakemake.log[0])
run_chunk(snakemake.config, snakemake.input[0], int(snakemake.wildcards.chunk), snakemake.output[0],
          snakemake.params.media_dir)
