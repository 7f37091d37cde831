# `snakemake estimate`: classify a stratified pilot sample and project wall time, GPU-hours and cost.
# Not part of `all`: it spends GPU time on purpose.
rule estimate:
    input:
        shards=manifest_shards,
    output:
        json=f"{RESULTS}/estimate.json",
        summary=f"{RESULTS}/estimate.md",
    params:
        # Its result settings: editing one reruns this job (vidlabel.settings).
        settings=vidlabel.settings.fingerprint(config, "estimate"),
        workdir=f"{RESULTS}/estimate",
    log:
        "logs/estimate.log",
    conda:
        "../../envs/classify.yaml"
    script:
        "../../scripts/estimate.py"
