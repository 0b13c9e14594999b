# Helpers and wildcard constraints shared by all rules.
import hashlib
import json
import shlex
import subprocess
import sys

import yaml
from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

from qerl import workflow_config as wc
from qerl.files import write_text_atomic
from qerl.inputs import benchmark_names

def _strict_configfiles():
    """Per config file, before the schema's own (long) report: a key given twice (snakemake's YAML reader keeps the
    last, silently) and a key the schema does not know, in one line naming the file, the key's path and the
    nearest valid key (qerl.workflow_config.read_config_file: the one reader every qerl command uses too)."""
    for f in getattr(workflow, "configfiles", None) or []:
        try:
            wc.read_config_file(f)
        except wc.UnreadableFileError:
            continue  # (snakemake reports unreadable files itself)
        except wc.ConfigFileError as e:
            raise WorkflowError(str(e).removeprefix("--configfile ")) from None
    # an overlay that switches a model's source drops the keys only the old source read (and `key: null` removes a
    # key) in snakemake's own merge too, saying so once (qerl.overlays.settle_models)
    from qerl.overlays import settle_models

    layers = []
    for f in getattr(workflow, "configfiles", None) or []:
        try:
            layers.append((str(f), wc.read_config_file(f)))
        except wc.ConfigFileError:
            pass
    for note in settle_models(config, layers):
        if workflow.is_main_process:
            print(f"qerl: {note}", file=sys.stderr)
    try:  # the merged config against the schema: the first problem in one line (file(s), key path, what is wrong)
        wc.read_workflow_config(getattr(workflow, "configfiles", None) or [])
    except wc.UnreadableFileError:
        pass  # (snakemake reports unreadable files itself)
    except wc.ConfigFileError as e:
        raise WorkflowError(str(e).removeprefix("--configfile ")) from None


_strict_configfiles()
validate(config, os.path.join(workflow.basedir, "workflow/schemas/config.schema.yaml"))
_plain_variants = set(config.get("variants") or {})
try:
    wc.expand_grids(config)  # a variant's `grid` -> one variant per combination (the effective config holds those)
    from qerl.variants import check_variants  # an arm that changes nothing is refused (a grid's: a note)

    for _note in check_variants(config, grid_arms=set(config.get("variants") or {}) - _plain_variants):
        if workflow.is_main_process:
            print(f"qerl: {_note}", file=sys.stderr)
except ValueError as e:
    raise WorkflowError(str(e)) from None
# `inputs_lock` (qerl fetch): hub models / training sets at the locked commits (in the config from here on), the
# benchmarks' commits passed to `qerl evaluate --revision`, and every job with the hub off
try:
    LOCKED = wc.apply_lock(config)
except ValueError as e:
    raise WorkflowError(str(e)) from None
_OFFLINE = "export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1; " if config.get("inputs_lock") else ""

# Rules call `qerl ...`; in every job `qerl` is a shell function running the CLI with the interpreter
# snakemake runs under (the one that just imported qerl), so jobs need no `qerl` on PATH (`.venv/bin/snakemake`
# works without activating the venv); with `--sdm conda` each rule's own environment provides `qerl`. The
# workflow config's hash (an MLflow tag of every job) travels the same way. Both are kept out of params, so
# that a venv moved elsewhere or an edit elsewhere in the config reruns nothing that does not depend on it.
_CONDA = "CONDA" in {m.name for m in workflow.deployment_settings.deployment_method}
_CONFIG_HASH = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]
# (braces doubled twice: the f-string, then snakemake's formatting of every shell command)
_QERL_FN = "" if _CONDA else f'qerl() {{{{ {shlex.quote(sys.executable)} -m qerl "$@"; }}}}; '
if not _CONDA and (_missing := wc.missing_dependencies()):
    raise WorkflowError(f"missing dependencies for the workflow's jobs: {', '.join(_missing)} not importable by "
                        f"{sys.executable} (install the project: `make install`, or `pip install -e .`)")

CONFIGURATION = config["configuration"]
RUNS = wc.runs(config)
MODELS = list(config["models"])
RESULTS = "results"
REPORT = f"results/reports/{CONFIGURATION}/index.md"
MLFLOW_URI = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{os.path.abspath('results/mlflow.db')}"
MLFLOW_MARKER = f"results/mlflow/{CONFIGURATION}.json"  # (written by the onstart handler, workflow/rules/tracking.smk)
# Where jobs log (the store, the experiment named by the configuration) travels in MLflow's own environment
# variables, like the config hash: never in params, a resolved train.yaml or a rule's inputs, so that an ablation
# overlay (another configuration name, another experiment) reruns none of the finished jobs it shares.
shell.prefix(f"set -euo pipefail; export QERL_CONFIG_HASH={_CONFIG_HASH} "
             f"MLFLOW_TRACKING_URI={shlex.quote(MLFLOW_URI)} MLFLOW_EXPERIMENT_NAME={shlex.quote(CONFIGURATION)}; "
             f"{_OFFLINE}{_QERL_FN}")
EVAL = config["evaluation"]


try:
    wc.check_benchmarks(config)  # (every name defined: wc.check_names; local benchmark files present)
except ValueError as e:
    raise WorkflowError(str(e)) from None
if not _CONDA:  # every run's qerl-train config checked now (the field named), not inside its job
    try:
        from qerl.train.config import check_train_configs  # (torch: only where qerl's runtime is installed)

        check_train_configs(config, " + ".join(map(str, workflow.configfiles)) or "config")
    except ValueError as e:
        raise WorkflowError(str(e)) from None
    if workflow.is_main_process:  # a training job that cannot fit its GPUs is named now (a dry run too), with its fix
        from qerl.fit_check import describe, misfits

        if _misfit := misfits(config):
            raise WorkflowError(describe(_misfit))


TRAIN_METHODS = list(wc.METHODS) + list(config.get("variants", {}))


wildcard_constraints:
    model="|".join(re.escape(m) for m in MODELS),
    dataset="|".join(re.escape(d) for d in config["datasets"]) + "|none",
    seed=r"\d+",
    benchmark="|".join(re.escape(b) for b in benchmark_names(config)),


def resources(kind, key, default):
    return config.get("resources", {}).get(kind, {}).get(key, default)


def train_launch():
    """`--nproc N` for `qerl train` when the config gives training N > 1 GPUs (one data-parallel process per
    GPU, through torchrun; qerl.train.launch), else nothing."""
    gpus = int(resources("train", "gpu", 0))
    return f" --nproc {gpus}" if gpus > 1 else ""


def model_source(model):
    return config["models"][model]["source"]


def model_marker(model):
    """The bf16 model directory's config.json (local models are used in place)."""
    if model_source(model) == "local":
        return os.path.join(config["models"][model]["path"], "config.json")
    return f"results/models/{model}/config.json"


def model_path(model):
    return os.path.dirname(model_marker(model))


def run_of(w):
    return wc.Run(w.model, w.method, w.algo, w.dataset, int(w.seed))


def train_config_text(w):
    return yaml.safe_dump(wc.train_config(config, run_of(w)), sort_keys=False)  # (tracking: the environment)


def input_revisions(tags):
    """The hub revisions a job reads (the locked commits with ``inputs_lock``), as MLflow tags."""
    out = {}
    m = config["models"].get(str(tags.get("model", "")))
    if m and m.get("source") == "hub":
        out["model_revision"] = m["revision"]
    d = config["datasets"].get(str(tags.get("dataset", "")))
    if d and d.get("revision"):
        out["dataset_revision"] = d["revision"]
    b = LOCKED.get(("dataset", str(tags.get("benchmark", ""))))
    if b:
        out["benchmark_revision"] = b
    return out


def track(stage, **tags):
    """CLI options that log a job as an MLflow run named by qerl.tracking.run_name (the arm and seed first), tagged
    with each part (``config_hash`` is added from ``$QERL_CONFIG_HASH``; the store and the experiment from
    ``$MLFLOW_TRACKING_URI`` / ``$MLFLOW_EXPERIMENT_NAME``, see above)."""
    from qerl.tracking import run_name

    name = run_name(stage, configuration=CONFIGURATION if stage == "report" else "", **tags)
    tags = {"stage": stage, **tags, **input_revisions(tags)}
    t = " ".join(f"--mlflow-tag {shlex.quote(f'{k}={v}')}" for k, v in tags.items())
    return f"--mlflow-run-name {shlex.quote(name)} {t}"


def train_inputs(w):
    base = f"results/quantize/{w.model}/config.json" if wc.uses_nvfp4(config, w.method) else model_marker(w.model)
    return {"cfg": f"results/train/{w.model}/{w.method}/{w.algo}/{w.dataset}/seed{w.seed}/train.yaml",
            "model": base}


def eval_opts():
    e = EVAL
    opts = [f"--samples {e.get('samples', 4)}", f"--temperature {e.get('temperature', 0.6)}",
            f"--top-p {e.get('top_p', 0.95)}", f"--max-new-tokens {e.get('max_new_tokens', 4096)}",
            f"--batch-size {e.get('batch_size', 32)}", f"--dtype {e.get('dtype', 'bfloat16')}",
            f"--template {e.get('template', 'paper')}"]
    if e.get("limit"):
        opts.append(f"--limit {e['limit']}")
    if e.get("nf4_weights", "eager") != "eager":
        opts.append(f"--nf4-weights {e['nf4_weights']}")
    return " ".join(opts)


def trained_policy(w):
    """(--model, --base, --adapter) of a trained run, exactly as it was trained."""
    final = f"results/train/{w.model}/{w.method}/{w.algo}/{w.dataset}/seed{w.seed}/final"
    method = wc.base_method(config, w.method)
    if method == "full":
        return f"--model {final} --base bf16"
    base = f"results/quantize/{w.model}" if method in wc.NVFP4_METHODS else model_path(w.model)
    return f"--model {base} --base {wc.base_of(method)} --adapter {final}"


def quant_setting(model, key, default):
    """A model's quantization setting: its own (models.<name>.<key>), else quantize.<key>, else the default."""
    return config["models"][model].get(key, config.get("quantize", {}).get(key, default))


def calibration_inputs(model):
    """The calibration file of a model quantized with AWQ (an input of its quantize job), else nothing."""
    data = config.get("quantize", {}).get("calibration_data")
    return [data] if data and quant_setting(model, "calibration", "none") == "awq" else []


def quant_gpus(model):
    """GPUs a quantize job claims: resources.quantize.gpu, and at least one for an AWQ model (its search runs the
    fp32 model over every calibration token; several side by side on a GPU no job counted ran it out of memory)."""
    n = int(resources("quantize", "gpu", 0))
    return max(n, 1) if quant_setting(model, "calibration", "none") == "awq" else n


def calibration_args(model):
    q = config.get("quantize", {})
    if quant_setting(model, "calibration", "none") != "awq":
        return "--calibration none"
    if not q.get("calibration_data"):
        raise WorkflowError(f"models.{model}: calibration awq needs quantize.calibration_data (a JSONL of training "
                            "prompts or a text file)")
    return (f"--calibration awq --calibration-data {q['calibration_data']} "
            f"--calibration-field {q.get('calibration_field', 'question')} "
            + (f"--calibration-solution-field {q['calibration_solution_field']} "
               if q.get("calibration_solution_field") else "")
            + f"--calibration-template {q.get('calibration_template', 'raw')} "
            f"--calibration-samples {q.get('calibration_samples', 128)} "
            f"--calibration-seq-len {q.get('calibration_seq_len', 512)}")

