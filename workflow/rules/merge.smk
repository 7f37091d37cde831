rule merge:
    input:
        inventory=rules.inventory.output[0],
        excluded=rules.manifest.output.excluded,
        labels=label_shards,
    output:
        f"{RESULTS}/labels.parquet",
    log:
        "logs/merge.log",
    conda:
        "../../envs/stats.yaml"
    script:
        "../../scripts/merge.py"
