rule inventory:
    input:
        config["posts"],
    output:
        f"{RESULTS}/inventory.parquet",
    params:
        # Its result settings: editing one reruns this job (vidlabel.core.settings).
        settings=vidlabel.core.settings.fingerprint(config, "inventory"),
    log:
        "logs/inventory.log",
    conda:
        "../../envs/media.yaml"
    threads: config["inventory"]["threads"]
    script:
        "../../scripts/inventory.py"
