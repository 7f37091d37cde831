def _plot(name, title):
    return report(
        f"{MODEL_DIR}/summary/plots/{name}.png",
        caption=f"../report/{name}.rst",
        category="Results",
        labels={"model": "{model}", "figure": title},
    )


rule aggregate:
    input:
        labels=rules.merge.output[0],
        human_labels=human_labels,
        human_design=human_design,
    output:
        prevalence=report(
            f"{MODEL_DIR}/summary/prevalence.csv",
            caption="../report/prevalence_table.rst",
            category="Tables",
            labels={"model": "{model}", "table": "prevalence"},
        ),
        agreement=report(
            f"{MODEL_DIR}/summary/agreement.csv",
            caption="../report/agreement_table.rst",
            category="Tables",
            labels={"model": "{model}", "table": "agreement"},
        ),
        prevalence_by_type=report(
            f"{MODEL_DIR}/summary/prevalence_by_type.csv",
            caption="../report/prevalence_by_type_table.rst",
            category="Tables",
            labels={"model": "{model}", "table": "prevalence by post type"},
        ),
        post_types=report(
            f"{MODEL_DIR}/summary/post_types.csv",
            caption="../report/post_types_table.rst",
            category="Tables",
            labels={"model": "{model}", "table": "post types"},
        ),
        tokens=f"{MODEL_DIR}/summary/tokens.csv",
        throughput=f"{MODEL_DIR}/summary/throughput.csv",
        errors=f"{MODEL_DIR}/summary/errors.csv",
        summary=report(
            f"{MODEL_DIR}/summary/summary.md",
            caption="../report/summary.rst",
            category="Tables",
            labels={"model": "{model}", "table": "summary"},
        ),
        input_tokens=_plot("input_tokens", "input tokens per request"),
        input_tokens_by_kind=_plot("input_tokens_by_kind", "input tokens per request by kind"),
        output_tokens=_plot("output_tokens", "output tokens per request"),
        prevalence_plot=_plot("prevalence", "prevalence per question"),
        throughput_plot=_plot("throughput", "throughput over time"),
        errors_plot=_plot("errors", "errors by kind"),
    params:
        # Its result settings: editing one reruns this job (vidlabel.core.stage_settings).
        settings=model_settings("aggregate"),
        summary_dir=f"{MODEL_DIR}/summary",
    log:
        "logs/aggregate/{model}.log",
    conda:
        "../../envs/stats.yaml"
    script:
        "../../scripts/aggregate.py"


# The models side by side (docs/models.md): part of `all` when classify.models names two or more.
rule compare:
    input:
        labels=expand(rules.merge.output[0], model=MODELS),
        summaries=expand(rules.aggregate.output.summary, model=MODELS),
        inventory=rules.inventory.output[0],
        human_labels=human_labels,
        human_design=human_design,
    output:
        models=report(
            f"{RESULTS}/compare/models.csv",
            caption="../report/compare_models_table.rst",
            category="Models compared",
            labels={"table": "models"},
        ),
        agreement=report(
            f"{RESULTS}/compare/model_agreement.csv",
            caption="../report/compare_agreement_table.rst",
            category="Models compared",
            labels={"table": "agreement between models"},
        ),
        disagreements=report(
            f"{RESULTS}/compare/disagreements.csv",
            caption="../report/compare_disagreements_table.rst",
            category="Models compared",
            labels={"table": "disagreements"},
        ),
        summary=report(
            f"{RESULTS}/compare/compare.md",
            caption="../report/compare_summary.rst",
            category="Models compared",
            labels={"table": "summary"},
        ),
        prevalence_plot=report(
            f"{RESULTS}/compare/plots/prevalence_by_model.png",
            caption="../report/compare_prevalence_by_model.rst",
            category="Models compared",
            labels={"figure": "prevalence per model"},
        ),
    params:
        # Its result settings: editing one reruns this job (vidlabel.core.stage_settings).
        settings=vidlabel.core.stage_settings.fingerprint(config, "compare"),
        models=MODELS,
        compare_dir=f"{RESULTS}/compare",
    log:
        "logs/compare.log",
    conda:
        "../../envs/stats.yaml"
    script:
        "../../scripts/compare.py"
