# vidlabel: label large video datasets with a multimodal LLM served by vLLM.
# Thin by design: every stage is one call into the `vidlabel` package (src/vidlabel/).
from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


report: "workflow/report/workflow.rst"


# Jobs (scripts/, also inside `--sdm conda` envs and on cluster nodes) import the package of
# this very checkout, so the workflow and its code never disagree.
import os
import sys

sys.path.insert(0, f"{workflow.basedir}/src")
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [f"{workflow.basedir}/src", os.environ.get("PYTHONPATH")]))

# Fail before any job: a bad key or a bad posts table is reported with the key / rows at fault.
import vidlabel.core.config
import vidlabel.core.identity
import vidlabel.core.models
import vidlabel.core.stage_settings
import vidlabel.core.slurm
import vidlabel.prepare.posts
import vidlabel.prepare.planning

vidlabel.core.config.validate(config, f"{workflow.basedir}/workflow/schemas/config.schema.yaml")
# The media's state (path, size, modification time of every media file): the inventory rule's params, so
# that a video replaced at the same path reruns the inventory and, through it, whatever that post needs.
# Jobs (on cluster nodes too: the SLURM plugin submits with --export=ALL) get it from the main process
# through the environment: a job's own Snakemake compares the params of the rules upstream of it, and a
# different value there would make it try to rerun the inventory inside the job.
MEDIA_STATE_VARIABLE = "VIDLABEL_MEDIA_STATE"
MEDIA_STATE = None if workflow.is_main_process else os.environ.get(MEDIA_STATE_VARIABLE)
if MEDIA_STATE is None:
    posts = vidlabel.prepare.posts.load_posts(config["posts"], config["media_root"])
    MEDIA_STATE = vidlabel.core.identity.media_state(vidlabel.prepare.posts.media_paths(posts))
    os.environ[MEDIA_STATE_VARIABLE] = MEDIA_STATE
if workflow.is_main_process:
    if vidlabel.core.models.own_servers(config):
        vidlabel.prepare.planning.allowed_media_path(config)  # the one directory the server may read
    # The SLURM plugin would keep a job cancelled with scancel ("CANCELLED by <uid>") running for ever.
    vidlabel.core.slurm.read_failure_states_by_base_name()


include: "workflow/rules/common.smk"
include: "workflow/rules/inventory.smk"
include: "workflow/rules/transcribe.smk"
include: "workflow/rules/transcode.smk"
include: "workflow/rules/manifest.smk"
include: "workflow/rules/classify.smk"
include: "workflow/rules/merge.smk"
include: "workflow/rules/aggregate.smk"
include: "workflow/rules/estimate.smk"
include: "workflow/rules/label_sample.smk"


rule all:
    input:
        expand(rules.aggregate.output.summary, model=MODELS),
        # The models side by side, when there are several (docs/models.md).
        rules.compare.output if len(MODELS) > 1 else [],
