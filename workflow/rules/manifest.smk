rule manifest:
    input:
        inventory=rules.inventory.output[0],
        transcripts=transcript_chunks,
        transcoded=transcode_chunks,
    output:
        shards=expand(f"{RESULTS}/manifest/shard-{{shard}}.parquet", shard=SHARDS),
        excluded=f"{RESULTS}/manifest/excluded.parquet",
        plan=f"{RESULTS}/manifest/plan.csv",
    log:
        "logs/manifest.log",
    conda:
        "../../envs/classify.yaml"
    script:
        "../../scripts/manifest.py"
