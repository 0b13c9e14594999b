"""``qerl train`` configuration: nested dataclasses loaded strictly from YAML.

Unknown keys, wrong types and impossible values raise :class:`ConfigError` naming the field and
what is allowed, before any model loads. Defaults live here (and in the settings dataclasses of
the modules they configure); paper values are noted per field.
"""
from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from qerl.lora import LoraSettings
from qerl.methods import NAMES
from qerl.rewards.registry import RewardSettings, available_rewards
from qerl.rl.aqn import AQNSettings
from qerl.rl.algorithms import NAMES as ALGORITHMS
from qerl.rollout.sampling import SamplingSettings
from qerl.workflow_config import runs, train_config

METHOD_NAMES = NAMES  # (qerl.methods: the registry)
SHARDING = ("auto", "none", "optimizer", "fsdp")
OFFLOAD = ("auto", "none", "rollout")
TEMPLATES = ("raw", "chat", "paper")


class ConfigError(ValueError):
    """A configuration key or value is invalid."""


@dataclass(frozen=True)
class ModelConfig:
    """path: bf16 Hugging Face directory / hub id (an NVFP4 checkpoint also works for NVFP4
    methods). dtype: compute dtype (bfloat16 in the paper; float32 is handy for tiny CPU runs)."""

    path: str = ""
    dtype: str = "bfloat16"
    revision: str | None = None


@dataclass(frozen=True)
class DataConfig:
    """task: 'synthetic' (offline arithmetic), a hub task name (qerl.data.tasks.HUB_TASKS) or
    'local' with ``path`` to .jsonl/.parquet. template: 'raw' | 'chat' | 'paper'."""

    task: str = "synthetic"
    path: str | None = None
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    answer_format: str = "plain"
    revision: str | None = None
    template: str = "raw"
    synthetic_size: int = 2000
    synthetic_max_operand: int = 9


@dataclass(frozen=True)
class AlgorithmConfig:
    """name: a preset of :mod:`qerl.rl.algorithms` (grpo | dapo | dr_grpo | gspo), whose table gives every setting
    left null here: ``aggregation`` (sequence-mean | token-mean | constant), ``ratio_level`` (token | sequence),
    ``clip_low`` / ``clip_high`` (ε), ``adv_scale`` (std | none), ``dynamic_sampling``, ``overlong_mask``.
    group_size G (paper 8 GSM8K / 16 BigMath). updates_per_batch μ (paper 4 GSM8K / 1 BigMath). tis_cap: truncated
    importance sampling cap C for the rollout-vs-trainer mismatch (None = off). old_logprob_pass: with μ = 1 the old
    policy's log-probs are the update's own forward, detached (the ratio is 1 in value, its gradient that of
    log π; TRL does the same), so no separate no-grad pass runs; true runs that pass anyway (μ > 1 always does)."""

    name: str = "grpo"
    group_size: int = 8
    clip_low: float | None = None
    clip_high: float | None = None
    kl_coef: float = 0.0
    adv_scale: str | None = None
    aggregation: str | None = None
    ratio_level: str | None = None
    updates_per_batch: int = 1
    dynamic_sampling: bool | None = None
    max_refill_rounds: int = 3
    overlong_mask: bool | None = None
    overlong_penalty: bool = False
    overlong_cache: int = 0
    tis_cap: float | None = None
    old_logprob_pass: bool = False

    def resolved(self) -> "AlgorithmConfig":
        """Every null setting filled from the preset ``name`` (:data:`qerl.rl.algorithms.PRESETS`)."""
        from qerl.rl.algorithms import preset

        p = preset(self.name)
        return dataclasses.replace(self, **{k: getattr(p, k) for k in PRESET_KEYS if getattr(self, k) is None})


#: the settings of :class:`AlgorithmConfig` a preset gives when the config leaves them null
PRESET_KEYS = ("clip_low", "clip_high", "adv_scale", "aggregation", "ratio_level", "dynamic_sampling", "overlong_mask")


@dataclass(frozen=True)
class OptimConfig:
    """AdamW. lr: paper 1e-5 for NVFP4/NF4 LoRA, 5e-6 for bf16 LoRA. eight_bit: 'auto' uses
    bitsandbytes AdamW8bit on CUDA and torch AdamW on CPU."""

    lr: float = 1e-5
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0
    # updates whose gradient norm is not finite (inf / nan) that a run may skip: the optimizer step is not taken and
    # the gradients are dropped (what verl, the paper's reference trainer, does with every one), each counted in the
    # step's metrics (``skipped_updates``); one more stops the run. 0: the first stops it.
    skip_nonfinite: int = 0
    eight_bit: str | bool = "auto"  # YAML true / false are taken as 'true' / 'false'
    # the optimizer states in host memory while the rollout runs (qerl.train.offload): none | rollout | auto
    # (rollout when the memory planner says the run fits only so; e.g. 32B full over 8 GPUs)
    offload: str = "auto"


@dataclass(frozen=True)
class TrackingConfig:
    """backend: 'mlflow' (sqlite store under the output's parent by default) or 'none'."""

    backend: str = "mlflow"
    tracking_uri: str | None = None  # else $MLFLOW_TRACKING_URI, else sqlite:///<output's parent>/mlflow.db
    experiment: str | None = None  # else $MLFLOW_EXPERIMENT_NAME, else "qerl"
    run_name: str | None = None
    tags: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainConfig:
    method: str = "qerl"
    output_dir: str = "results/train/run"
    steps: int = 100
    prompts_per_step: int = 16
    micro_batch_size: int | str = 64  # or auto: the largest the planner fits, <= half a group (plan.auto_micro_batch)
    seed: int = 0
    gradient_checkpointing: bool | str = "auto"  # true | false | auto (qerl.train.plan: on when the update would not fit)
    # NVFP4 base: dequantize the frozen linears once per update phase and multiply the bf16 copy (+2 B/weight while
    # the update runs, 7B: +13 GB) instead of dequantizing in every forward / backward call; same products.
    # auto: on a GPU where the memory planner fits it (qerl.train.plan.resolve_dense_update)
    dense_update: bool | str = "auto"
    # the update's forward / backward (and no-grad log-prob passes) on each micro-batch's real tokens packed into one
    # row (qerl.ops.packed: position ids per sequence, causal attention within each): no padding. auto: micro-batches
    # whose padding would be >= PACK_RATIO (1.25) x their real tokens, where FlashAttention's varlen kernel runs (CUDA,
    # bf16 / fp16, a model with SDPA attention; qerl.train.update.packing_mode); true: every one; false: padded rows
    packed_sequences: bool | str = "auto"
    # micro-batches cut by tokens instead of rows: each holds at most this many tokens as its forward runs them (real
    # tokens when packed, rows x live columns when padded; a longer sequence runs alone), whatever the rollout's
    # lengths. auto: on a GPU with micro_batch_size auto and packing, the most the memory planner fits
    # (qerl.train.plan.resolve_micro_tokens); false: micro_batch_size rows
    micro_batch_tokens: int | bool | str = "auto"
    checkpoint_every: int = 10
    device: str = "auto"
    # under several processes (qerl.train.dist): none (DDP, every rank holds everything) | optimizer (DDP +
    # ZeroRedundancyOptimizer: each rank keeps the AdamW states of 1/W of the weights) | fsdp (full method: FSDP2
    # shards weights, gradients and states; qerl.train.fsdp) | auto (optimizer for the full method, else none)
    sharding: str = "auto"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout: SamplingSettings = field(default_factory=SamplingSettings)
    lora: LoraSettings = field(default_factory=LoraSettings)
    aqn: AQNSettings = field(default_factory=AQNSettings)
    reward: RewardSettings = field(default_factory=RewardSettings)
    optim: OptimConfig = field(default_factory=OptimConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)


#: what a person writes as a number that YAML 1.1 keeps a string: ``3e-4``, ``1E5``, ``+2e3`` (no dot, or a sign)
_YAML11_FLOAT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+$")


def _check_type(value, hint, path: str):
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(hint):
            if arg is type(None) and value is None:
                return None
        for arg in typing.get_args(hint):
            if arg is not type(None):
                try:
                    return _check_type(value, arg, path)
                except ConfigError:
                    pass
        raise ConfigError(f"{path}: expected {hint}, got {value!r}")
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return {str(k): str(v) for k, v in value.items()}
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        return tuple(_check_type(v, typing.get_args(hint)[0], f"{path}[{i}]") for i, v in enumerate(value))
    if hint is float:
        if isinstance(value, str) and _YAML11_FLOAT.match(value.strip()):
            value = float(value)  # `3e-4`: YAML 1.1 (PyYAML) reads a float without a dot as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{path}: expected a finite number, got {value!r}")
        return float(value)
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if hint in (str, bool):
        if not isinstance(value, hint):
            raise ConfigError(f"{path}: expected {hint.__name__}, got {value!r}")
        return value
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, path)
    return value


def from_dict(cls, data, path: str = "config"):
    """Build dataclass ``cls`` from a mapping, strictly (unknown keys and bad types raise)."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {unknown}; allowed: {names}")
    kwargs = {k: _check_type(v, hints[k], f"{path}.{k}") for k, v in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{path}: {e}") from None


def validate(cfg: TrainConfig) -> TrainConfig:
    """Cross-field checks; returns the config with algorithm defaults resolved."""
    if cfg.method not in METHOD_NAMES:
        raise ConfigError(f"config.method: {cfg.method!r} is not one of {METHOD_NAMES}")
    a = cfg.algorithm
    if a.name not in ALGORITHMS:
        raise ConfigError(f"config.algorithm.name: {a.name!r} is not one of {ALGORITHMS}")
    if a.group_size < 2:
        raise ConfigError(f"config.algorithm.group_size: G = {a.group_size}; must be >= 2")
    if (a.clip_low is not None and a.clip_low < 0) or (a.clip_high is not None and a.clip_high < 0):
        raise ConfigError("config.algorithm.clip_low/clip_high: ε must be >= 0")
    from qerl.rl.algorithms import check_axes, preset

    p = preset(a.name)
    try:
        check_axes(a.aggregation or p.aggregation, a.ratio_level or p.ratio_level, a.adv_scale or p.adv_scale,
                   where="config.algorithm")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if a.updates_per_batch < 1:
        raise ConfigError("config.algorithm.updates_per_batch: μ must be >= 1")
    if a.kl_coef < 0:
        raise ConfigError("config.algorithm.kl_coef: must be >= 0")
    if a.kl_coef > 0 and cfg.method == "full":
        raise ConfigError("config.algorithm.kl_coef: KL needs a reference policy; with method 'full' that "
                          "would be a second model copy (use a LoRA method, whose reference is the base)")
    if a.tis_cap is not None and a.tis_cap <= 0:
        raise ConfigError("config.algorithm.tis_cap: must be > 0 (or null)")
    if a.overlong_penalty and not 0 < a.overlong_cache <= cfg.rollout.max_new_tokens:
        raise ConfigError("config.algorithm.overlong_cache: must be in (0, rollout.max_new_tokens] with overlong_penalty")
    if isinstance(cfg.micro_batch_size, str) and cfg.micro_batch_size != "auto":
        raise ConfigError(f"config.micro_batch_size: a positive integer or 'auto', got {cfg.micro_batch_size!r}")
    for name in ("steps", "prompts_per_step", "micro_batch_size", "checkpoint_every"):
        if getattr(cfg, name) != "auto" and getattr(cfg, name) < 1:
            raise ConfigError(f"config.{name}: must be >= 1, got {getattr(cfg, name)}")
    o = cfg.optim
    for name, ok, want in (("lr", o.lr > 0, "> 0"), ("weight_decay", o.weight_decay >= 0, ">= 0"),
                           ("beta1", 0 <= o.beta1 < 1, "in [0, 1)"), ("beta2", 0 <= o.beta2 < 1, "in [0, 1)"),
                           ("warmup_steps", o.warmup_steps >= 0, ">= 0"),
                           ("min_lr_ratio", 0 <= o.min_lr_ratio <= 1, "in [0, 1]"),
                           ("grad_clip", o.grad_clip > 0, "> 0"),
                           ("skip_nonfinite", o.skip_nonfinite >= 0, ">= 0")):
        if not ok:
            raise ConfigError(f"config.optim.{name}: must be {want}, got {getattr(o, name)}")
    if a.max_refill_rounds < 0:
        raise ConfigError(f"config.algorithm.max_refill_rounds: must be >= 0, got {a.max_refill_rounds}")
    if cfg.reward.correctness not in available_rewards():  # before any model loads (a name registered by a plugin
        raise ConfigError(f"config.reward.correctness: {cfg.reward.correctness!r} is not a registered reward "
                          f"({', '.join(available_rewards())}; qerl.rewards.register_reward adds one)")
    if cfg.reward.timeout <= 0 or cfg.reward.format_weight < 0:
        raise ConfigError(f"config.reward: timeout must be > 0 s and format_weight >= 0, got timeout "
                          f"{cfg.reward.timeout}, format_weight {cfg.reward.format_weight}")
    if not 1 <= cfg.data.synthetic_size <= 10_000_000 or cfg.data.synthetic_max_operand < 1:
        raise ConfigError(f"config.data: synthetic_size must be in [1, 1e7] and synthetic_max_operand >= 1, got "
                          f"{cfg.data.synthetic_size} and {cfg.data.synthetic_max_operand}")
    from qerl.data.tasks import ANSWER_FORMATS, HUB_TASKS

    tasks = ("synthetic", "local", *sorted(HUB_TASKS))
    for name, value, allowed in (("task", cfg.data.task, tasks), ("template", cfg.data.template, TEMPLATES),
                                 ("answer_format", cfg.data.answer_format, ANSWER_FORMATS)):
        if value not in allowed:
            raise ConfigError(f"config.data.{name}: {value!r} is not one of {list(allowed)}")
    if cfg.data.task == "local" and not cfg.data.path:
        raise ConfigError("config.data.path: required when data.task is 'local' (a .jsonl or .parquet file)")
    if cfg.seed < 0:
        raise ConfigError(f"config.seed: must be >= 0, got {cfg.seed}")
    if cfg.dense_update not in (True, False, "auto"):
        raise ConfigError(f"config.dense_update: true, false or auto, got {cfg.dense_update!r}")
    if cfg.packed_sequences not in (True, False, "auto"):
        raise ConfigError(f"config.packed_sequences: true, false or auto, got {cfg.packed_sequences!r}")
    mbt = cfg.micro_batch_tokens
    if not (mbt is False or mbt == "auto" or (isinstance(mbt, int) and not isinstance(mbt, bool) and mbt >= 1)):
        raise ConfigError(f"config.micro_batch_tokens: a positive integer, auto or false, got {mbt!r}")
    if cfg.gradient_checkpointing not in (True, False, "auto"):
        raise ConfigError(f"config.gradient_checkpointing: true, false or auto, got {cfg.gradient_checkpointing!r}")
    tri = {n: (str(v).lower() if isinstance(v, bool) else v) for n in ("eight_bit",)
           for v in [getattr(cfg.optim, n)]}
    for name, v in tri.items():
        if v not in ("auto", "true", "false"):
            raise ConfigError(f"config.optim.{name}: one of 'auto', 'true', 'false', got {v!r}")
    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, **tri))
    if cfg.optim.offload not in OFFLOAD:
        raise ConfigError(f"config.optim.offload: one of {OFFLOAD}, got {cfg.optim.offload!r}")
    if cfg.model.dtype not in ("bfloat16", "float16", "float32"):
        raise ConfigError(f"config.model.dtype: {cfg.model.dtype!r} is not bfloat16/float16/float32")
    if cfg.sharding not in SHARDING:
        raise ConfigError(f"config.sharding: one of {SHARDING}, got {cfg.sharding!r}")
    if cfg.sharding == "fsdp" and cfg.method != "full":
        raise ConfigError(f"config.sharding: fsdp shards the full method's weights; method {cfg.method!r} trains "
                          "adapters on a frozen base (use none or optimizer)")
    if cfg.tracking.backend not in ("mlflow", "none"):
        raise ConfigError("config.tracking.backend: 'mlflow' or 'none'")
    if not cfg.model.path:
        raise ConfigError("config.model.path: required (a model directory or hub id)")
    return dataclasses.replace(cfg, algorithm=a.resolved())


def resolve_sharding(cfg: TrainConfig, world: int) -> str:
    """``sharding`` for ``world`` processes: ``none`` on one; ``auto`` is ``optimizer`` for the full method."""
    if world <= 1:
        return "none"
    if cfg.sharding == "auto":
        return "optimizer" if cfg.method == "full" else "none"
    return cfg.sharding


def load_config(path: str | Path, overrides: dict | None = None) -> TrainConfig:
    """Read a YAML config file (plus optional overrides merged on top) and validate it."""
    import yaml

    from qerl.yamlio import DuplicateKeyError, load

    path = Path(path)
    try:
        data = load(path.read_text(), str(path)) or {}
    except DuplicateKeyError as e:
        raise ConfigError(str(e)) from None
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a YAML config file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file (expected a YAML config)") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of config keys, got a {type(data).__name__}")
    apply_overrides(data, overrides or {})
    return validate(from_dict(TrainConfig, data, path.name))


def apply_overrides(data: dict, overrides: dict) -> None:
    """Merge ``--set a.b.c=value`` items into ``data`` in place; a key that runs through a value (``steps.x``
    where ``steps`` is a number) is a :class:`ConfigError` naming it."""
    for key, value in overrides.items():
        node = data
        *parents, leaf = key.split(".")
        if not all(parents + [leaf]):
            raise ConfigError(f"--set {key}={value!r}: empty key part (expected KEY or SECTION.KEY)")
        for i, p in enumerate(parents):
            if node.get(p) is None:  # missing, or an empty YAML section
                node[p] = {}
            node = node[p]
            if not isinstance(node, dict):
                where = ".".join(parents[: i + 1])
                raise ConfigError(f"--set {key}=...: {where} is a value ({node!r}), not a section with keys")
        node[leaf] = value


def to_dict(cfg) -> dict:
    """A plain (YAML/JSON-able) dict of a config."""
    def conv(x):
        if dataclasses.is_dataclass(x):
            return {f.name: conv(getattr(x, f.name)) for f in dataclasses.fields(x)}
        if isinstance(x, tuple):
            return [conv(v) for v in x]
        return x
    return conv(cfg)


def check_train_configs(config: dict, source: str, tracking_uri: str = "sqlite:///mlflow.db") -> None:
    """Validate every run's resolved ``qerl train`` config with ``qerl train``'s own checks, so that a bad
    value under ``train`` / ``*_overrides`` / ``variants`` stops the workflow before any job runs (a job
    failing on it would rerun, and snakemake would drop, that run's earlier outputs). Raises
    :class:`ConfigError` naming ``source`` (the config files), the run and the field.
    Imports torch (the settings dataclasses live beside their modules): call it only where qerl's
    runtime is installed."""
    for run in runs(config):
        where_ = f"{source}: run {run.path} (train + overrides)"
        try:
            validate(from_dict(TrainConfig, train_config(config, run, tracking_uri), "config"))
        except ConfigError as e:
            raise ConfigError(f"{where_}: {e}") from None


def read_workflow_config_checked(paths, flag: str = "--configfile") -> dict:
    """:func:`qerl.workflow_config.read_workflow_config` (YAML, keys, the schema, names) plus every run's resolved
    ``qerl train`` config checked by ``qerl train``'s own rules (a typo under ``train`` / ``*_overrides`` /
    ``variants`` named): what every command that reads a workflow config calls (the Snakefile does the same in two
    steps)."""
    from qerl.workflow_config import ConfigFileError, read_workflow_config

    config = read_workflow_config(paths, flag)
    files = " ".join(map(str, [paths] if isinstance(paths, (str, Path)) else paths))
    try:
        check_train_configs(config, f"{flag} {files}")
    except ConfigError as e:
        raise ConfigFileError(str(e)) from None
    return config
