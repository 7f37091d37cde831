# Snakemake adapter: rule estimate (the models' pilot projections side by side).
from vidlabel.estimate import compare_projections
from vidlabel.logs import configure

configure(snakemake.log[0])
compare_projections(list(snakemake.input), snakemake.output[0])
