# Paths and input functions shared by the rules.

RESULTS = config["results"]
TRANSCRIBE_CHUNKS = range(config["transcribe"]["chunks"])
TRANSCODE_CHUNKS = range(config["planning"]["transcode"]["chunks"])
SHARDS = range(config["classify"]["shards"])


wildcard_constraints:
    chunk=r"\d+",
    shard=r"\d+",


def transcript_chunks(wildcards):
    return expand(f"{RESULTS}/transcripts/chunk-{{chunk}}.parquet", chunk=TRANSCRIBE_CHUNKS)


def transcode_chunks(wildcards):
    return expand(f"{RESULTS}/transcoded/chunk-{{chunk}}.parquet", chunk=TRANSCODE_CHUNKS)


def manifest_shards(wildcards):
    return expand(f"{RESULTS}/manifest/shard-{{shard}}.parquet", shard=SHARDS)


def label_shards(wildcards):
    return expand(f"{RESULTS}/labels/shard-{{shard}}.parquet", shard=SHARDS)


def human_labels(wildcards):
    return [config["human_labels"]] if config["human_labels"] else []
