# Paths and input functions shared by the rules.
import functools
import re


RESULTS = config["results"]
TRANSCRIBE_CHUNKS = range(config["transcribe"]["chunks"])
TRANSCODE_CHUNKS = range(config["planning"]["transcode"]["chunks"])
SHARDS = range(config["classify"]["shards"])
# Every model labels the same posts into its own folder; the models of one family that take the audio
# alike share a plan, its manifest in manifest/<plan>/ (vidlabel.core.models, docs/models.md).
MODELS = vidlabel.core.models.names(config)
MODEL_DIR = f"{RESULTS}/models/{{model}}"
PLANS = vidlabel.core.models.plans(config)
MODEL_PLAN = {model: plan for plan, models in PLANS.items() for model in models}
MANIFEST_DIR = f"{RESULTS}/manifest/{{plan}}"


wildcard_constraints:
    chunk=r"\d+",
    shard=r"\d+",
    model="|".join(re.escape(name) for name in MODELS),
    plan="|".join(re.escape(plan) for plan in PLANS),


def transcript_chunks(wildcards):
    return expand(f"{RESULTS}/transcripts/chunk-{{chunk}}.parquet", chunk=TRANSCRIBE_CHUNKS)


def plan_of(wildcards):
    """The plan of a per-plan rule, or of a per-model rule's model."""
    return wildcards.plan if "plan" in wildcards.keys() else MODEL_PLAN[wildcards.model]


def plan_transcripts(wildcards):
    """The transcript chunks, where the plan's prompts carry transcripts (a model that hears the audio
    itself neither waits for nor depends on the transcribe stage)."""
    return transcript_chunks(wildcards) if vidlabel.core.models.uses_transcripts(config, plan_of(wildcards)) else []


def transcode_chunks(wildcards):
    return expand(f"{RESULTS}/transcoded/{plan_of(wildcards)}/chunk-{{chunk}}.parquet", chunk=TRANSCODE_CHUNKS)


def manifest_shards(wildcards):
    return expand(f"{RESULTS}/manifest/{plan_of(wildcards)}/shard-{{shard}}.parquet", shard=SHARDS)


def manifest_file(name):
    """A file of the manifest of the plan (of a per-model rule's model)."""
    return lambda wildcards: f"{RESULTS}/manifest/{plan_of(wildcards)}/{name}"


# The params below are computed once per stage and model or plan, not once per job: the config is fixed
# for the whole run, and with 512 shards per model their per-job evaluation was a third of the dry run.
@functools.cache
def _fingerprint(stage, model=None, plan=None):
    return vidlabel.core.stage_settings.fingerprint(config, stage, model, plan=plan)


@functools.cache
def _files_state(model):
    return vidlabel.core.identity.files_state(vidlabel.core.models.model_config(config, model))


def plan_settings(stage):
    """A per-plan rule's params: the fingerprint of the stage's settings under that plan's config."""
    return lambda wildcards: _fingerprint(stage, plan=wildcards.plan)


def label_shards(wildcards):
    return expand(f"{RESULTS}/models/{wildcards.model}/labels/shard-{{shard}}.parquet", shard=SHARDS)


def model_settings(stage):
    """A per-model rule's params: the fingerprint of the stage's settings under that model's config."""
    return lambda wildcards: _fingerprint(stage, wildcards.model)


def model_files(wildcards):
    """A per-model classify rule's params: its model folder and the files its server command names, by
    content (vidlabel.core.identity.files_state), so that one overwritten in place reruns its jobs."""
    return _files_state(wildcards.model)


def human_labels(wildcards):
    return [config["human_labels"]] if config["human_labels"] else []


def human_design(wildcards):
    return [config["human_design"]] if config["human_design"] else []
