# The chunk's resume journal (transcripts/chunk-{chunk}.jsonl) is deliberately undeclared:
# Snakemake deletes the declared outputs of a failed job, and the journal must survive it.
rule transcribe:
    input:
        rules.inventory.output,
    output:
        f"{RESULTS}/transcripts/chunk-{{chunk}}.parquet",
    params:
        # Its result settings: editing one reruns this job (vidlabel.core.stage_settings).
        settings=vidlabel.core.stage_settings.fingerprint(config, "transcribe"),
    log:
        "logs/transcribe/chunk-{chunk}.log",
    conda:
        "../../envs/whisper.yaml"
    threads: config["transcribe"]["threads"]
    script:
        "../../scripts/transcribe.py"
