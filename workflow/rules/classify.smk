# One job per shard: starts its own server (or uses classify.endpoints) and journals every answer.
# The journal is undeclared so that a failed or killed job keeps it; the rerun resumes from it.
rule classify:
    input:
        f"{RESULTS}/manifest/shard-{{shard}}.parquet",
    output:
        f"{RESULTS}/labels/shard-{{shard}}.parquet",
    params:
        # Its result settings: editing one reruns this job (vidlabel.settings).
        settings=vidlabel.settings.fingerprint(config, "classify"),
        journal=f"{RESULTS}/journal/shard-{{shard}}.jsonl",
        server_log="logs/classify/server-{shard}.log",
    log:
        "logs/classify/shard-{shard}.log",
    conda:
        "../../envs/classify.yaml"
    script:
        "../../scripts/classify.py"
