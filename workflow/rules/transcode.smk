# Always runs: with planning.transcode.enabled false it only re-encodes the videos that must be
# re-planned to fit the context, so a chunk is usually empty and takes a second.
rule transcode:
    input:
        rules.inventory.output,
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
