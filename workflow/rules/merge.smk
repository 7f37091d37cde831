rule merge:
    input:
        inventory=rules.inventory.output[0],
        excluded=rules.manifest.output.excluded,
        labels=label_shards,
    output:
        f"{RESULTS}/labels.parquet",
    params:
        # Its result settings: editing one reruns this job (vidlabel.settings).
        settings=vidlabel.settings.fingerprint(config, "merge"),
    log:
        "logs/merge.log",
    conda:
        "../../envs/stats.yaml"
    script:
        "../../scripts/merge.py"
