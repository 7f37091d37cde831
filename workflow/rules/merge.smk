rule merge:
    input:
        inventory=rules.inventory.output[0],
        excluded=manifest_file("excluded.parquet"),
        labels=label_shards,
        # The token estimates per kind of each classified post (docs/outputs.md, labels.parquet).
        manifest=manifest_shards,
    output:
        f"{MODEL_DIR}/labels.parquet",
    params:
        # Its result settings: editing one reruns this job (vidlabel.core.stage_settings).
        settings=model_settings("merge"),
    log:
        "logs/merge/{model}.log",
    conda:
        "../../envs/stats.yaml"
    script:
        "../../scripts/merge.py"
