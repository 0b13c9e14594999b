# QeRL workflow: get model -> NVFP4 quantization (later: train -> evaluate -> report).
# The rules are a table of contents; every job calls the `qerl` CLI.
from snakemake.utils import min_version

min_version("9.0")


configfile: os.path.join(workflow.basedir, "config/config.yaml")


include: "workflow/rules/common.smk"
include: "workflow/rules/model.smk"
include: "workflow/rules/quantize.smk"


rule all:
    input:
        expand("results/quantize/{model}/config.json", model=MODELS),
    default_target: True
