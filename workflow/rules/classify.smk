# One job per model and shard: starts its own server (or uses classify.endpoints) and journals every
# answer. The journal is undeclared so that a failed or killed job keeps it; the rerun resumes from it.
rule classify:
    input:
        shard=lambda wildcards: f"{RESULTS}/manifest/{MODEL_PLAN[wildcards.model]}/shard-{wildcards.shard}.parquet",
        # What the whole data set needs of the server (items per prompt, the largest item): read beside the shard.
        media_limits=manifest_file("media_limits.json"),
    output:
        f"{MODEL_DIR}/labels/shard-{{shard}}.parquet",
    params:
        # Its result settings under this model's config: editing one reruns this model's jobs only.
        settings=model_settings("classify"),
        # Its model folder and the files its server command names, by content (an in-place edit).
        files=model_files,
        journal=f"{MODEL_DIR}/journal/shard-{{shard}}.jsonl",
        server_log="logs/classify/{model}/server-{shard}.log",
    log:
        "logs/classify/{model}/shard-{shard}.log",
    conda:
        "../../envs/classify.yaml"
    script:
        "../../scripts/classify.py"
