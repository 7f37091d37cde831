rule inventory:
    input:
        config["posts"],
    output:
        f"{RESULTS}/inventory.parquet",
    log:
        "logs/inventory.log",
    conda:
        "../../envs/media.yaml"
    threads: config["inventory"]["threads"]
    script:
        "../../scripts/inventory.py"
