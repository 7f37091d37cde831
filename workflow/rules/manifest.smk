# One manifest per plan (a model family and how its models take the audio: vidlabel.core.models.plans).
rule manifest:
    input:
        inventory=rules.inventory.output[0],
        transcripts=plan_transcripts,
        transcoded=transcode_chunks,
    output:
        shards=expand(f"{MANIFEST_DIR}/shard-{{shard}}.parquet", shard=SHARDS, allow_missing=True),
        excluded=f"{MANIFEST_DIR}/excluded.parquet",
        plan=f"{MANIFEST_DIR}/plan.csv",
        # Written beside plan.csv (vidlabel.prepare.manifest): each re-planned post's reason, and what the
        # data need of the server (the classify jobs size their servers from it).
        post_plans=f"{MANIFEST_DIR}/post_plans.csv",
        media_limits=f"{MANIFEST_DIR}/media_limits.json",
    params:
        # Its result settings under the plan's config: editing one reruns this job (vidlabel.core.stage_settings).
        settings=plan_settings("manifest"),
    log:
        "logs/manifest/{plan}.log",
    conda:
        "../../envs/classify.yaml"
    script:
        "../../scripts/manifest.py"
