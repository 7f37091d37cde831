rule inventory:
    input:
        config["posts"],
    output:
        f"{RESULTS}/inventory.parquet",
    params:
        # Its result settings: editing one reruns this job (vidlabel.core.stage_settings).
        settings=vidlabel.core.stage_settings.fingerprint(config, "inventory"),
        # A video replaced at its path reruns it too; its journal (inventory.jsonl) re-probes that one.
        media=MEDIA_STATE,
    log:
        "logs/inventory.log",
    conda:
        "../../envs/media.yaml"
    threads: config["inventory"]["threads"]
    script:
        "../../scripts/inventory.py"
