# Snakemake adapter: rule transcode (one chunk).
from vidlabel.core.logs import configure
from vidlabel.core.stage_settings import for_job
from vidlabel.prepare.transcode import run_chunk

configure(snakemake.log[0])
config = for_job(snakemake.config, "transcode", plan=snakemake.wildcards.plan)
run_chunk(config, snakemake.input.inventory, int(snakemake.wildcards.chunk), snakemake.output[0],
          snakemake.params.media_dir, transcript_paths=list(snakemake.input.transcripts))
