# Always runs: with planning.transcode.enabled false it only re-encodes the videos that must be
# re-planned to fit the context (and converts the photos the server would misread or that must be
# smaller), so a chunk is usually small. It plans with the real transcripts, as the manifest does: a
# speech allowance in their place let the two plans disagree (a photo post planned to its last token).
rule transcode:
    input:
        inventory=rules.inventory.output[0],
        transcripts=transcript_chunks,
    output:
        f"{RESULTS}/transcoded/chunk-{{chunk}}.parquet",
    params:
        # Its result settings: editing one reruns this job (vidlabel.core.settings).
        settings=vidlabel.core.settings.fingerprint(config, "transcode"),
        media_dir=vidlabel.prepare.planning.transcoded_media_dir(config),
    log:
        "logs/transcode/chunk-{chunk}.log",
    conda:
        "../../envs/media.yaml"
    script:
        "../../scripts/transcode.py"
