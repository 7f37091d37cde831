# Paths and input functions shared by the rules.
import re


RESULTS = config["results"]
TRANSCRIBE_CHUNKS = range(config["transcribe"]["chunks"])
TRANSCODE_CHUNKS = range(config["planning"]["transcode"]["chunks"])
SHARDS = range(config["classify"]["shards"])
# Every model labels the same manifest into its own folder (vidlabel.core.models, docs/models.md).
MODELS = vidlabel.core.models.names(config)
MODEL_DIR = f"{RESULTS}/models/{{model}}"


wildcard_constraints:
    chunk=r"\d+",
    shard=r"\d+",
    model="|".join(re.escape(name) for name in MODELS),


def transcript_chunks(wildcards):
    return expand(f"{RESULTS}/transcripts/chunk-{{chunk}}.parquet", chunk=TRANSCRIBE_CHUNKS)


def transcode_chunks(wildcards):
    return expand(f"{RESULTS}/transcoded/chunk-{{chunk}}.parquet", chunk=TRANSCODE_CHUNKS)


def manifest_shards(wildcards):
    return expand(f"{RESULTS}/manifest/shard-{{shard}}.parquet", shard=SHARDS)


def label_shards(wildcards):
    return expand(f"{RESULTS}/models/{wildcards.model}/labels/shard-{{shard}}.parquet", shard=SHARDS)


def model_settings(stage):
    """A per-model rule's params: the fingerprint of the stage's settings under that model's config."""
    return lambda wildcards: vidlabel.core.settings.fingerprint(config, stage, wildcards.model)


def model_files(wildcards):
    """A per-model classify rule's params: its model folder and the files its server command names, by
    content (vidlabel.core.identity.files_state), so that one overwritten in place reruns its jobs."""
    return vidlabel.core.identity.files_state(vidlabel.core.models.model_config(config, wildcards.model))


def human_labels(wildcards):
    return [config["human_labels"]] if config["human_labels"] else []


def human_design(wildcards):
    return [config["human_design"]] if config["human_design"] else []
