# Always runs: with planning.transcode.enabled false it only re-encodes the videos that must be
# re-planned to fit the context (and converts the photos the server would misread or that must be
# smaller), so a chunk is usually small. It plans with the real transcripts, as the manifest does: a
# speech allowance in their place let the two plans disagree (a photo post planned to its last token).
# Per plan: the family decides the sizes, and a model that hears the audio gets its WAVs here. Files two
# plans need alike are written once (their name is their transcode key) in the one media directory.
rule transcode:
    input:
        inventory=rules.inventory.output[0],
        transcripts=plan_transcripts,
    output:
        f"{RESULTS}/transcoded/{{plan}}/chunk-{{chunk}}.parquet",
    params:
        # Its result settings under the plan's config: editing one reruns this job (vidlabel.core.stage_settings).
        settings=plan_settings("transcode"),
        media_dir=vidlabel.prepare.planning.transcoded_media_dir(config),
    log:
        "logs/transcode/{plan}/chunk-{chunk}.log",
    conda:
        "../../envs/media.yaml"
    script:
        "../../scripts/transcode.py"
