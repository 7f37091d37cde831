rule manifest:
    input:
        inventory=rules.inventory.output[0],
        transcripts=transcript_chunks,
        transcoded=transcode_chunks,
    output:
        shards=expand(f"{RESULTS}/manifest/shard-{{shard}}.parquet", shard=SHARDS),
        excluded=f"{RESULTS}/manifest/excluded.parquet",
        plan=f"{RESULTS}/manifest/plan.csv",
        # Written beside plan.csv (vidlabel.prepare.manifest): each re-planned post's reason, and what the
        # data need of the server (the classify jobs size their servers from it).
        post_plans=f"{RESULTS}/manifest/post_plans.csv",
        media_limits=f"{RESULTS}/manifest/media_limits.json",
    params:
        # Its result settings: editing one reruns this job (vidlabel.core.settings).
        settings=vidlabel.core.settings.fingerprint(config, "manifest"),
    log:
        "logs/manifest.log",
    conda:
        "../../envs/classify.yaml"
    script:
        "../../scripts/manifest.py"
