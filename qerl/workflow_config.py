"""The workflow's experiment matrix (no torch: imported by the Snakefile).

A workflow config (``config/*.yaml``, schema ``workflow/schemas/config.schema.yaml``) names models,
training datasets and experiment blocks (models × datasets × methods × algorithms × seeds). This
module expands the matrix and resolves the per-run ``qerl train`` config: ``train`` defaults, then
``algorithm_overrides[algo]``, then ``method_overrides[method]``, then the run's own fields.
"""
from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from dataclasses import dataclass

from qerl.methods import DEFAULT_UNTRAINED, NAMES as METHODS, NVFP4_METHODS, UNTRAINED as _UNTRAINED, base_of  # noqa: F401 (the registry)
from qerl.rl.algorithms import NAMES as ALGORITHMS  # noqa: F401 (the presets table)
UNTRAINED = tuple(_UNTRAINED)


def base_method(config: dict, method: str) -> str:
    """A matrix 'method' is a base method or a named variant (``variants: {name: {method, overrides}}``)."""
    variants = config.get("variants", {})
    if method in variants:
        return variants[method]["method"]
    if method not in METHODS:
        raise ValueError(f"method {method!r} is neither one of {METHODS} nor a variant ({sorted(variants)})")
    return method


def uses_nvfp4(config: dict, method: str) -> bool:
    return base_method(config, method) in NVFP4_METHODS


def aqn_on(config: dict, run: "Run") -> bool:
    """Whether ``run`` trains with AQN: its resolved ``aqn.enabled``, or (``auto``) its base method's choice."""
    from qerl.methods import aqn_on as _aqn_on

    return _aqn_on(base_method(config, run.method), (train_config(config, run).get("aqn") or {}).get("enabled", "auto"))


@dataclass(frozen=True)
class Run:
    model: str
    method: str
    algo: str
    dataset: str
    seed: int

    @property
    def path(self) -> str:
        """Output path under results/train (one wildcard per directory level)."""
        return f"{self.model}/{self.method}/{self.algo}/{self.dataset}/seed{self.seed}"


def _block_runs(block: dict) -> list[Run]:
    return [Run(m, meth, a, d, s) for m in block["models"] for d in block["datasets"] for meth in block["methods"]
            for a in block["algorithms"] for s in block.get("seeds", [0])]


def runs(config: dict) -> list[Run]:
    """Every training run of the matrix, in config order, without duplicates."""
    out: dict[Run, None] = {}
    for block in config.get("experiments", []):
        for r in _block_runs(block):
            out[r] = None
    return list(out)


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in (over or {}).items():
        out[k] = _merge(out.get(k, {}), v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def model_dir(model: str) -> str:
    return f"results/models/{model}"


def quantized_dir(model: str) -> str:
    return f"results/quantize/{model}"


def train_config(config: dict, run: Run, tracking_uri: str | None = None) -> dict:
    """The resolved ``qerl train`` config (a plain dict) of one run. Where it is tracked is not part of what it is:
    without ``tracking_uri`` (the workflow) the store and the experiment are left to ``MLFLOW_TRACKING_URI`` /
    ``MLFLOW_EXPERIMENT_NAME``, so an overlay that renames the configuration does not change a finished run's
    config (and does not rerun it)."""
    cfg = _merge(config.get("train", {}), config.get("algorithm_overrides", {}).get(run.algo, {}))
    method = base_method(config, run.method)
    cfg = _merge(cfg, config.get("method_overrides", {}).get(method, {}))
    cfg = _merge(cfg, config.get("variants", {}).get(run.method, {}).get("overrides", {}))
    data = _merge(cfg.get("data", {}), config["datasets"][run.dataset])
    local = config["models"][run.model].get("path") if config["models"][run.model]["source"] == "local" else None
    path = quantized_dir(run.model) if method in NVFP4_METHODS else (local or model_dir(run.model))
    from qerl.tracking import run_name

    name = run_name("train", model=run.model, method=run.method, algo=run.algo, dataset=run.dataset, seed=run.seed)
    cfg = _merge(cfg, {
        "method": method, "seed": run.seed, "output_dir": f"results/train/{run.path}", "data": data,
        "model": {"path": path},
        "algorithm": {"name": run.algo},
        "tracking": {"backend": "mlflow", "run_name": name,
                     "tags": {"model": run.model, "method": run.method, "algo": run.algo,
                              "dataset": run.dataset, "seed": str(run.seed), "stage": "train"}},
    })
    if tracking_uri is not None:
        cfg["tracking"].update(tracking_uri=tracking_uri, experiment=config.get("configuration", "default"))
    return cfg


def apply_lock(config: dict) -> dict[tuple[str, str], str]:
    """With ``inputs_lock`` set: every hub model's and hub training set's ``revision`` in ``config`` replaced by its
    locked commit (in place); returns ``{(kind, name): commit}`` (benchmarks' commits go to ``qerl evaluate
    --revision``). Without: ``{}``. A lock that lacks an input or disagrees with the config is an error naming
    it (:func:`qerl.inputs.locked_commits`)."""
    from qerl.inputs import locked_commits, read_lock

    if not config.get("inputs_lock"):
        return {}
    commits = locked_commits(config, read_lock(config["inputs_lock"]), f"inputs_lock {config['inputs_lock']}")
    for (kind, name), commit in commits.items():
        if kind == "model":
            config["models"][name]["revision"] = commit
        else:
            for d in config.get("datasets", {}).values():
                if d.get("task") == name:
                    d["revision"] = commit
    return commits


def check_names(config: dict) -> None:
    """Every name the matrix uses is defined: a block's models and datasets, its methods (registered or a variant),
    ``evaluation.base_models``' models, and each benchmark (registered or under ``evaluation.local_benchmarks``). A
    ValueError names the culprit and what is defined."""
    from qerl.data.tasks import BENCHMARKS
    from qerl.inputs import benchmark_names

    for i, block in enumerate(config.get("experiments") or []):
        for key in ("models", "datasets"):
            known = config.get(key) or {}
            if bad := [x for x in block.get(key, []) if x not in known]:
                raise ValueError(f"config experiments[{i}].{key}: {bad} not defined under '{key}' (known: "
                                 f"{list(known)})")
        known = list(METHODS) + list(config.get("variants", {}))
        if bad := [x for x in block.get("methods", []) if x not in known]:
            raise ValueError(f"config experiments[{i}].methods: {bad} unknown (methods: {list(METHODS)}; variants: "
                             f"{list(config.get('variants', {}))})")
    ev = config.get("evaluation") or {}
    if bad := [m for m in ev.get("base_models") or {} if m not in (config.get("models") or {})]:
        raise ValueError(f"config evaluation.base_models: {bad} not defined under 'models'")
    local = ev.get("local_benchmarks") or {}
    for name in benchmark_names(config):
        if name not in BENCHMARKS and name not in local:
            raise ValueError(f"config evaluation: benchmark {name!r} is neither registered ({', '.join(BENCHMARKS)}) "
                             f"nor defined under evaluation.local_benchmarks (defined: {sorted(local)})")


def check_benchmarks(config: dict, root: str = ".") -> None:
    """Each benchmark named is registered or defined under ``evaluation.local_benchmarks`` with an existing file
    (relative paths from ``root``, the workflow's directory); a ValueError names the culprit."""
    check_names(config)
    local = config.get("evaluation", {}).get("local_benchmarks", {}) or {}
    for name, spec in local.items():
        path = os.path.join(root, spec["path"])
        if not os.path.isfile(path):
            raise ValueError(f"config evaluation.local_benchmarks.{name}.path: {spec['path']} not found")


def benchmark_args(config: dict, name: str, commits: dict | None = None) -> str:
    """``qerl evaluate``'s benchmark arguments for ``name``: the registered name (with ``--revision`` of its locked
    commit, from :func:`apply_lock`), or a local file with its fields, answer format and name (shell-quoted)."""
    import shlex

    spec = config.get("evaluation", {}).get("local_benchmarks", {}).get(name)
    if spec is None:
        commit = (commits or {}).get(("dataset", name))
        return shlex.quote(name) + (f" --revision {shlex.quote(commit)}" if commit else "")
    args = [spec["path"], "--name", name]
    for key in ("prompt_field", "answer_field", "answer_format", "verifier"):
        if key in spec:
            args += [f"--{key.replace('_', '-')}", str(spec[key])]
    return " ".join(map(shlex.quote, args))


def benchmark_files(config: dict, name: str) -> list[str]:
    """The local file a benchmark reads (an input of its evaluation jobs), or nothing."""
    spec = config.get("evaluation", {}).get("local_benchmarks", {}).get(name)
    return [spec["path"]] if spec else []


def untrained_bases(config: dict) -> dict[str, list[str]]:
    """Model -> its untrained bases (``bf16`` / ``nvfp4`` / ``nf4``) that are evaluated, in config order: each
    experiment block's ``untrained`` (default ``evaluation.untrained``, default bf16 and nvfp4) for its models, then
    ``evaluation.base_models``. The one place that decides which untrained evaluations exist."""
    ev = config.get("evaluation", {})
    out: dict[str, list[str]] = {}
    for block in config.get("experiments", []):
        for model in block["models"]:
            for base in block.get("untrained", ev.get("untrained", DEFAULT_UNTRAINED)):
                out.setdefault(model, [])
                if base not in out[model]:
                    out[model].append(base)
    for model, bases in ev.get("base_models", {}).items():
        for base in bases:
            out.setdefault(model, [])
            if base not in out[model]:
                out[model].append(base)
    return out


def eval_targets(config: dict) -> list[str]:
    """``results/eval/...json`` paths: every trained run on its block's benchmarks (default:
    ``evaluation.benchmarks``) plus the untrained bases of each model (:func:`untrained_bases`) on the benchmarks its
    runs use (``evaluation.base_models``: on ``evaluation.benchmarks``)."""
    ev = config.get("evaluation", {})
    out: dict[str, None] = {}
    benches: dict[str, list[str]] = {m: list(ev.get("benchmarks", [])) for m in ev.get("base_models", {})}
    for block in config.get("experiments", []):
        for r in _block_runs(block):
            for b in block.get("benchmarks", ev.get("benchmarks", [])):
                out[f"results/eval/{r.path}/{b}.json"] = None
                if b not in benches.setdefault(r.model, []):
                    benches[r.model].append(b)
    for model, bases in untrained_bases(config).items():
        for b in benches.get(model, []):
            for base in bases:
                out[f"results/eval/{model}/{base}/untrained/none/seed0/{b}.json"] = None
    return list(out)


# Runtime packages every workflow job needs, by import name (checked before any job runs: a missing one
# would otherwise fail inside the first job, after the DAG was built).
JOB_DEPENDENCIES = ("torch", "transformers", "peft", "safetensors", "mlflow", "matplotlib", "yaml", "tqdm")


def missing_dependencies(names: tuple[str, ...] = JOB_DEPENDENCIES) -> list[str]:
    """Import names in ``names`` that this interpreter cannot find (``importlib.util.find_spec``: nothing is
    imported, so ``snakemake -n`` stays fast)."""
    import importlib.util

    return [n for n in names if importlib.util.find_spec(n) is None]


def visible_gpus() -> int:
    """GPUs this machine's jobs can see: ``CUDA_VISIBLE_DEVICES`` when set (its entries up to the first invalid
    one, as CUDA reads it), else the NVIDIA device nodes ``/dev/nvidia<N>`` (a container has only its own); 0
    without them. Read without importing torch (the workflow's parse stays fast)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        n = 0
        for item in env.split(","):
            item = item.strip()
            if not item or item.startswith("-"):
                break
            n += 1
        return n
    return sum(1 for d in Path("/dev").glob("nvidia*") if d.name[6:].isdigit())


def local_gpus(global_resources, config: dict) -> int | None:
    """The GPUs of a *local* run whose config gives jobs GPUs (``resources.<kind>.gpu`` > 0): the visible GPUs; None
    for a cluster executor (``nodes`` set: SLURM assigns GPUs per job), a config without GPU jobs or no GPU. The
    Snakefile then limits ``gpu`` to them unless ``--resources gpu=N`` was given (snakemake starts jobs whose
    ``gpu`` has no limit side by side: two training jobs on one GPU) and gives each job its own
    (:mod:`qerl.gpu_claim`)."""
    wants = any(int((v or {}).get("gpu", 0) or 0) > 0 for v in (config.get("resources") or {}).values()
                if isinstance(v, dict) or v is None)
    nodes = global_resources.get("_nodes") if "_nodes" in global_resources else None
    if not wants or getattr(nodes, "value", nodes) is not None:
        return None
    return visible_gpus() or None


def jobs_per_gpu(config: dict) -> int:
    """``resources.jobs_per_gpu`` (default 1): how many GPU jobs of a local run may share one GPU."""
    return int((config.get("resources") or {}).get("jobs_per_gpu", 1) or 1)


def use_gpu_locks(directory: str, jobs_per_gpu: int = 1) -> None:
    """Export ``QERL_GPU_LOCKS`` (absolute) and ``QERL_JOBS_PER_GPU`` for the jobs this snakemake starts locally:
    each GPU job's ``qerl`` locks a slot of GPUs of its own there (:mod:`qerl.gpu_claim`)."""
    os.environ["QERL_GPU_LOCKS"] = os.path.abspath(directory)
    os.environ["QERL_JOBS_PER_GPU"] = str(jobs_per_gpu)


def where(configuration: str, results: str = "results", mlflow_uri: str | None = None) -> str:
    """What a finished run produced and where (printed at the end of ``make run`` / ``snakemake``)."""
    import os
    import sys

    exe = os.path.join(os.path.dirname(sys.executable), "mlflow")
    mlflow = exe if os.path.exists(exe) else "mlflow"
    uri = mlflow_uri or f"sqlite:///{os.path.abspath(os.path.join(results, 'mlflow.db'))}"
    rep = os.path.join(results, "reports", configuration)
    return "\n".join([
        f"qerl workflow '{configuration}' is complete:",
        f"  report   {os.path.join(rep, 'index.md')}  (tables: table1.md, runs.md; figures: {rep}/*.png)",
        f"  training {os.path.join(results, 'train')}/<model>/<method>/<algo>/<dataset>/seed<seed>/ (metrics.jsonl, final/)",
        f"  MLflow   {uri}  (experiment '{configuration}')",
        f"  browse:  MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false {mlflow} ui --workers 1 --backend-store-uri {uri}",
    ])


def main(argv: list[str] | None = None) -> int:
    """``python -m qerl.workflow_config where [CONFIGFILE ...]``: print :func:`where` for the configuration
    named by the last config file that sets one (default ``config/config.yaml``)."""
    import argparse
    import os

    p = argparse.ArgumentParser(prog="python -m qerl.workflow_config", description=main.__doc__)
    p.add_argument("verb", choices=["where"], help="what to print")
    p.add_argument("configfiles", nargs="*", default=["config/config.yaml"], help="the workflow's config files")
    p.add_argument("--results", default="results", help="the results directory")
    a = p.parse_args(argv)
    try:
        name = read_workflow_config(a.configfiles).get("configuration")
    except ConfigFileError as e:
        raise SystemExit(str(e)) from None
    if name is None:
        raise SystemExit(f"none of {a.configfiles} sets 'configuration'")
    print(where(name, a.results, os.environ.get("MLFLOW_TRACKING_URI")))
    return 0



def unknown_keys(data, schema: dict, root: dict | None = None, path: str = "") -> list[tuple[str, str | None]]:
    """``(key path, nearest allowed key or None)`` for every key of ``data`` that ``schema`` (JSON schema: objects
    with ``properties`` and ``additionalProperties: false``, ``$ref`` into ``$defs``) does not allow."""
    import difflib

    root = schema if root is None else root
    if "$ref" in schema:
        schema = root["$defs"][schema["$ref"].rsplit("/", 1)[1]]
    if not isinstance(data, dict) or schema.get("type", "object") != "object":
        return []
    props = schema.get("properties") or {}
    out = []
    for key, value in data.items():
        where = f"{path}.{key}" if path else str(key)
        if key in props:
            out += unknown_keys(value, props[key], root, where)
        elif schema.get("additionalProperties") is False:
            near = difflib.get_close_matches(str(key), list(props), n=1, cutoff=0.6)
            out.append((where, near[0] if near else None))
        elif isinstance(schema.get("additionalProperties"), dict):
            out += unknown_keys(value, schema["additionalProperties"], root, where)
    return out


SCHEMA = Path(__file__).resolve().parents[1] / "workflow" / "schemas" / "config.schema.yaml"


class ConfigFileError(ValueError):
    """A workflow config file that cannot be read as one: one line naming the file and the key."""


class UnreadableFileError(ConfigFileError):
    """A config file that is not UTF-8 YAML at all."""


class UnreadKeyError(ConfigFileError):
    """A model entry sets a key its ``source`` does not read (it would be silently ignored)."""


def read_config_file(path: str | Path, flag: str = "--configfile") -> dict:
    """One workflow config file, strictly: UTF-8 YAML whose top level is a mapping, no key given twice, no key the
    schema does not know (the nearest valid key named). Raises :class:`ConfigFileError`."""
    import yaml

    from qerl.yamlio import DuplicateKeyError, load

    path = Path(path)
    if not path.is_file():
        raise ConfigFileError(f"{flag} {path}: " + ("is a directory, not a YAML file" if path.is_dir()
                                                    else "file not found"))
    try:
        data = load(path.read_text(), str(path))
    except DuplicateKeyError as e:
        raise ConfigFileError(f"{flag} {e}") from None
    except UnicodeDecodeError:
        raise UnreadableFileError(f"{flag} {path}: not a text file (UTF-8 YAML expected)") from None
    except yaml.YAMLError as e:
        raise UnreadableFileError(f"{flag} {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"{flag} {path}: the top level must be a mapping, got a {type(data).__name__}")
    bad = unknown_keys(data, schema())
    if bad:
        key, near = bad[0]
        raise ConfigFileError(f"{flag} {path}: unknown key '{key}'" + (f" (did you mean '{near}'?)" if near else "")
                              + (f"; {len(bad) - 1} more" if len(bad) > 1 else ""))
    return data


def read_workflow_config(paths: list[str | Path] | str | Path, flag: str = "--configfile",
                         notes: list[str] | None = None) -> dict:
    """The workflow config of ``paths`` (each read by :func:`read_config_file`, later files merged over earlier
    ones as snakemake merges ``--configfile A B``, then :func:`qerl.overlays.settle_models`: a model an overlay
    switches to another ``source`` keeps no key only the old source reads, ``key: null`` removes a key; its notes
    are appended to ``notes``), checked against the workflow's JSON schema: the one reader of workflow configs for
    every command (``report``, ``claims``, ``bench cost``, ``fetch``) and the Snakefile."""
    from qerl.overlays import settle_models

    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    config: dict = {}
    layers = []
    for p in paths:
        layers.append((str(p), read_config_file(p, flag)))
        config = _merge(config, layers[-1][1])
    said = settle_models(config, layers)
    if notes is not None:
        notes.extend(said)
    import jsonschema

    err = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema()).iter_errors(config))
    if err is not None:
        where = ".".join(str(x) for x in err.absolute_path) or "the top level"
        what = err.message
        if err.validator == "not" and isinstance(err.instance, dict) and "anyOf" in err.validator_value:
            keys = [r["required"][0] for r in err.validator_value["anyOf"] if r["required"][0] in err.instance]
            what = (f"{', '.join(keys)} {'is' if len(keys) == 1 else 'are'} not read for source "
                    f"{err.instance.get('source')!r} (it would be silently ignored): remove {'it' if len(keys) == 1 else 'them'}")
        if err.validator == "required" and isinstance(err.instance, dict) and "source" in err.instance:
            what = f"{what} for source {err.instance['source']!r}"
        unread = err.validator == "not" and isinstance(err.instance, dict) and "anyOf" in err.validator_value
        raise (UnreadKeyError if unread else ConfigFileError)(f"{flag} {' '.join(map(str, paths))}: {where}: {what}")
    try:
        expand_grids(config)
        check_names(config)
    except ValueError as e:
        raise ConfigFileError(f"{flag} {' '.join(map(str, paths))}: {str(e).removeprefix('config ')}") from None
    return config


def expand_grids(config: dict) -> dict:
    """A variant with a ``grid`` (``{method: qerl, grid: {aqn.sigma_start: [0.01, 0.05]}}``, dotted keys into the
    train config, beside any ``overrides``) becomes one variant per combination, named after the values
    (``qerl_sigma-0.01``, ``qerl_sigma-0.05``), and an experiment block naming the grid variant gets all of them.
    In place (the Snakefile's ``config``; the effective config then holds plain variants); returns ``config``."""
    import itertools

    variants, made = config.get("variants") or {}, {}
    if not any("grid" in v for v in variants.values()):
        return config
    out = {}
    for name, v in variants.items():
        if "grid" not in v:
            out[name] = v
            continue
        keys = list(v["grid"])
        made[name] = []
        for values in itertools.product(*(v["grid"][k] for k in keys)):
            over = copy.deepcopy(v.get("overrides") or {})
            for key, value in zip(keys, values):
                *parents, leaf = key.split(".")
                node = over
                for part in parents:
                    node = node.setdefault(part, {})
                node[leaf] = value
            arm = name + "".join(f"-{value}" for value in values)
            if not _NAME.fullmatch(arm):
                raise ValueError(f"config variants.{name}.grid: the arm name {arm!r} (from its values) is not a name "
                                 "(letters, digits, '.', '_', '-'); use plain values or separate variants")
            if arm in variants or arm in out:
                raise ValueError(f"config variants.{name}.grid: the arm {arm!r} is also defined elsewhere")
            out[arm] = {"method": v["method"], "overrides": over}
            made[name].append(arm)
    config["variants"] = out
    for block in config.get("experiments", []):
        block["methods"] = list(dict.fromkeys(a for m in block.get("methods", []) for a in made.get(m, [m])))
    return config


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


_SCHEMA: dict = {}


def schema() -> dict:
    """The workflow's JSON schema (``workflow/schemas/config.schema.yaml``, read once)."""
    if not _SCHEMA:
        import yaml

        if not SCHEMA.is_file():
            raise ConfigFileError(f"{SCHEMA}: the workflow schema is missing (qerl runs from its repository: "
                                  "pip install -e .)")
        _SCHEMA.update(yaml.safe_load(SCHEMA.read_text()))
    return _SCHEMA


if __name__ == "__main__":
    raise SystemExit(main())
