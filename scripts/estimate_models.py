# Snakemake adapter: rule estimate (the models' pilot projections side by side).
from vidlabel.core.logs import configure
from vidlabel.serve.pilot import compare_projections

configure(snakemake.log[0])
compare_projections(list(snakemake.input), snakemake.output[0])
