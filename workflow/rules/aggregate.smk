def _plot(name, title):
    return report(
        f"{RESULTS}/summary/plots/{name}.png",
        caption=f"../report/{name}.rst",
        category="Results",
        labels={"figure": title},
    )


rule aggregate:
    input:
        labels=rules.merge.output[0],
        human_labels=human_labels,
    output:
        prevalence=report(
            f"{RESULTS}/summary/prevalence.csv",
            caption="../report/prevalence_table.rst",
            category="Tables",
            labels={"table": "prevalence"},
        ),
        agreement=report(
            f"{RESULTS}/summary/agreement.csv",
            caption="../report/agreement_table.rst",
            category="Tables",
            labels={"table": "agreement"},
        ),
        tokens=f"{RESULTS}/summary/tokens.csv",
        throughput=f"{RESULTS}/summary/throughput.csv",
        errors=f"{RESULTS}/summary/errors.csv",
        summary=report(
            f"{RESULTS}/summary/summary.md",
            caption="../report/summary.rst",
            category="Tables",
            labels={"table": "summary"},
        ),
        input_tokens=_plot("input_tokens", "input tokens per request"),
        output_tokens=_plot("output_tokens", "output tokens per request"),
        prevalence_plot=_plot("prevalence", "prevalence per question"),
        throughput_plot=_plot("throughput", "throughput over time"),
        errors_plot=_plot("errors", "errors by kind"),
    params:
        # Its result settings: editing one reruns this job (vidlabel.settings).
        settings=vidlabel.settings.fingerprint(config, "aggregate"),
        summary_dir=f"{RESULTS}/summary",
    log:
        "logs/aggregate.log",
    conda:
        "../../envs/stats.yaml"
    script:
        "../../scripts/aggregate.py"
