# `snakemake estimate`: per model, classify a stratified pilot sample and project wall time, GPU-hours
# and cost; then the models side by side. Not part of `all`: it spends GPU time on purpose.
rule pilot:
    input:
        shards=manifest_shards,
    output:
        json=f"{MODEL_DIR}/estimate.json",
        summary=f"{MODEL_DIR}/estimate.md",
    params:
        # Its result settings under this model's config: editing one reruns this model's pilot only.
        settings=model_settings("estimate"),
        # Its model folder and the files its server command names, by content (an in-place edit).
        files=model_files,
        workdir=f"{MODEL_DIR}/estimate",
        server_log="logs/estimate/{model}-server.log",
    log:
        "logs/estimate/{model}.log",
    conda:
        "../../envs/classify.yaml"
    script:
        "../../scripts/estimate.py"


rule estimate:
    input:
        expand(rules.pilot.output.json, model=MODELS),
    output:
        f"{RESULTS}/estimate.md",
    log:
        "logs/estimate/models.log",
    conda:
        "../../envs/classify.yaml"
    script:
        "../../scripts/estimate_models.py"
