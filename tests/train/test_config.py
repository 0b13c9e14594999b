"""Config loading: strict keys, types and impossible values, all before any model loads."""
import pytest

from qerl.train.config import ConfigError, load_config


def _write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  path: some/model\n" + text)
    return p


@pytest.mark.parametrize("text, match", [
    ("stepz: 3\n", r"unknown key\(s\) \['stepz'\].*allowed"),
    ("algorithm:\n  name: ppo\n", "algorithm.name.*'ppo'"),
    ("algorithm:\n  group_size: 1\n", "group_size.*>= 2"),
    ("algorithm:\n  clip_low: -0.1\n", "clip_low"),
    ("lora:\n  r: 0\n", "lora.r"),
    ("aqn:\n  sigma_start: 0.001\n  sigma_end: 0.01\n", "sigma_end"),
    ("aqn:\n  stages: 0\n", "K"),
    ("steps: ten\n", "steps: expected an integer"),
    ("sharding: zero3\n", "config.sharding: one of .*'fsdp'.*got 'zero3'"),
    ("sharding: fsdp\n", "fsdp shards the full method's weights; method 'qerl'"),
    ("optim:\n  eight_bit: maybe\n", "optim.eight_bit: one of"),
    ("optim:\n  lr: 0\n", "optim.lr"),
    ("method: qlora8\n", "method.*qlora8"),
    ("rollout:\n  temperature: -1\n", "temperature"),
    ("method: full\nalgorithm:\n  kl_coef: 0.1\n", "second model copy"),
    ("optim:\n  betas: [0.9]\n", "unknown key"),
])
def test_bad_configs(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        load_config(_write(tmp_path, text))


def test_defaults_resolve_per_algorithm(tmp_path):
    dapo = load_config(_write(tmp_path, "algorithm:\n  name: dapo\n")).algorithm
    assert (dapo.clip_high, dapo.dynamic_sampling, dapo.overlong_mask) == (0.28, True, True)
    grpo = load_config(_write(tmp_path, "")).algorithm
    assert (grpo.clip_high, grpo.dynamic_sampling, grpo.adv_scale) == (0.2, False, "std")
    dr = load_config(_write(tmp_path, "algorithm:\n  name: dr_grpo\n")).algorithm
    assert dr.adv_scale == "none"
    cfg = load_config(_write(tmp_path, ""), {"steps": 7, "aqn.stages": 4})
    assert cfg.steps == 7 and cfg.aqn.stages == 4


def test_gspo_preset_and_axes_set_one_by_one(tmp_path):
    """Each preset's settings come from the one table (qerl.rl.algorithms.PRESETS); a config may set an axis
    itself; a value outside an axis's choices is a ConfigError naming it."""
    from qerl.rl.algorithms import PRESETS

    for name, p in PRESETS.items():
        a = load_config(_write(tmp_path, f"algorithm:\n  name: {name}\n")).algorithm
        assert (a.aggregation, a.ratio_level, a.clip_low, a.clip_high, a.adv_scale, a.dynamic_sampling,
                a.overlong_mask) == (p.aggregation, p.ratio_level, p.clip_low, p.clip_high, p.adv_scale,
                                     p.dynamic_sampling, p.overlong_mask), name
    a = load_config(_write(tmp_path, "algorithm:\n  name: grpo\n  ratio_level: sequence\n  clip_low: 0.1\n")).algorithm
    assert (a.aggregation, a.ratio_level, a.clip_low, a.clip_high) == ("sequence-mean", "sequence", 0.1, 0.2)
    with pytest.raises(ConfigError, match=r"config.algorithm.aggregation: 'mean' is not one of"):
        load_config(_write(tmp_path, "algorithm:\n  aggregation: mean\n"))
    with pytest.raises(ConfigError, match=r"config.algorithm.name: 'ppo' is not one of \('grpo', 'dapo', 'dr_grpo', "
                                          r"'gspo'\)"):
        load_config(_write(tmp_path, "algorithm:\n  name: ppo\n"))


def test_the_shipped_config_loads():
    from pathlib import Path

    cfg = load_config(Path(__file__).resolve().parents[2] / "config/train/tiny.yaml")
    assert cfg.method == "qerl"


def test_tri_state_optim_switch_takes_yaml_booleans(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model: {path: m}\noptim: {eight_bit: false}\n")
    assert load_config(p).optim.eight_bit == "false"



def test_numbers_yaml_1_1_reads_as_strings_are_taken_as_numbers(tmp_path):
    """`lr: 3e-4` is a string to PyYAML (YAML 1.1 wants a dot); every reader sees a number, so it is one."""
    from qerl.train.config import ConfigError, load_config

    f = tmp_path / "c.yaml"
    f.write_text("model: {path: m}\noptim: {lr: 3e-4, weight_decay: 1E-2}\naqn: {sigma_start: 5e-2}\n")
    cfg = load_config(f)
    assert cfg.optim.lr == 3e-4 and cfg.optim.weight_decay == 0.01 and cfg.aqn.sigma_start == 0.05
    f.write_text("model: {path: m}\noptim: {lr: fast}\n")
    with pytest.raises(ConfigError, match="optim.lr: expected a number, got 'fast'"):
        load_config(f)
