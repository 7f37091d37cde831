# `snakemake label_sample`: the posts people code, drawn where the model is unsure, and the Label Studio
# files to code them (docs/human_labels.md). Not part of `all`: it draws once, before any coding.
def label_sample_burn_in(wildcards):
    return [config["label_sample"]["burn_in"]] if config["label_sample"]["burn_in"] else []


# The model whose answer probabilities steer the draw; the sample serves every model.
LABEL_SAMPLE_MODEL = config["label_sample"]["model"] or MODELS[0]


rule label_sample:
    input:
        labels=f"{RESULTS}/models/{LABEL_SAMPLE_MODEL}/labels.parquet",
        manifest=expand(f"{RESULTS}/manifest/{MODEL_PLAN[LABEL_SAMPLE_MODEL]}/shard-{{shard}}.parquet", shard=SHARDS),
        # each video's frame rate and each item's transcript, for the Label Studio tasks
        inventory=f"{RESULTS}/inventory.parquet",
        transcripts=lambda wildcards: transcript_chunks(wildcards) if vidlabel.core.models.uses_transcripts(
            config, MODEL_PLAN[LABEL_SAMPLE_MODEL]) else [],
        burn_in=label_sample_burn_in,
    output:
        sample=f"{RESULTS}/label_sample/sample.csv",
        design=f"{RESULTS}/label_sample/design.parquet",
        burn_in=f"{RESULTS}/label_sample/burn_in_labels.csv",
        ls_config=f"{RESULTS}/label_sample/labelstudio_config.xml",
        ls_tasks=f"{RESULTS}/label_sample/labelstudio_tasks.json",
    params:
        # Its result settings: editing one reruns this job (vidlabel.core.stage_settings).
        settings=vidlabel.core.stage_settings.fingerprint(config, "label_sample"),
    log:
        "logs/label_sample.log",
    conda:
        "../../envs/stats.yaml"
    script:
        "../../scripts/label_sample.py"
