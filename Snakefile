# QeRL workflow: get model -> NVFP4 quantization -> RL training (experiment matrix) -> evaluation
# -> report. The rules are a table of contents; every job calls the `qerl` CLI and logs an MLflow run.
from snakemake.utils import min_version

min_version("9.0")


# The embedded default, unless config files are given on the command line (then only those,
# deep-merged in order: an ablation is `--configfile config/config.yaml config/ablations/X.yaml`).
if not workflow.overwrite_configfiles:

    configfile: os.path.join(workflow.basedir, "config/config.yaml")



include: "workflow/rules/common.smk"
include: "workflow/rules/tracking.smk"
include: "workflow/rules/model.smk"
include: "workflow/rules/quantize.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/report.smk"


# A local run limits the jobs that ask for GPUs to the GPUs it sees (snakemake would otherwise start them side by
# side on the same GPU; `--resources gpu=N` sets another limit) and gives each job its own (qerl.gpu_claim: the
# job's `qerl` locks that many GPUs and narrows CUDA_VISIBLE_DEVICES to them). Cluster executors are left alone.
# `resources.jobs_per_gpu: N` lets N jobs share each GPU (small models leave most of a GPU idle).
_gpus = wc.local_gpus(workflow.global_resources, config)
if _gpus:
    _share = wc.jobs_per_gpu(config)
    if "gpu" not in workflow.global_resources:
        workflow.global_resources["gpu"] = _gpus * _share
    wc.use_gpu_locks(os.path.join(".snakemake", "qerl-gpu-locks"), _share)
    if workflow.is_main_process:  # (not again where a job re-reads the Snakefile)
        print(f"qerl: local run on {_gpus} visible GPU(s): GPU jobs use at most "
              f"{workflow.global_resources['gpu'].value} at a time, "
              f"{'each its own' if _share == 1 else f'up to {_share} to a GPU'}", file=sys.stderr)


# Writing a resolved config or the effective config is no cluster job: on SLURM these run where snakemake runs.
localrules: all, resolve_train_config, effective_config


rule all:
    input:
        REPORT,
    default_target: True


onsuccess:
    end_invocation_run("FINISHED")  # (workflow/rules/tracking.smk)
    if not os.environ.get("QERL_MAKE"):  # `make run` prints this itself, also when nothing was to be done
        print(wc.where(CONFIGURATION, RESULTS, os.environ.get("MLFLOW_TRACKING_URI")))
