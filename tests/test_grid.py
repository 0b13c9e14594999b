"""A sweep in grid form: a variant's ``grid`` of dotted train-config keys becomes one arm per combination, named
after its values, each resolving to its own train config, and an experiment naming the grid gets every arm; a typo
in a grid key or a value that makes no name is one line naming it."""
import pytest

from qerl.train.config import read_workflow_config_checked
from qerl.variants import arm_changes
from qerl.workflow_config import ConfigFileError, runs, train_config

BASE = """configuration: sweep
models: {m: {source: tiny}}
datasets: {d: {task: synthetic}}
train: {}
variants:
  qerl_s: {method: qerl, overrides: {lora: {r: 8}}, grid: GRID}
experiments: [{models: [m], datasets: [d], methods: [lora, qerl_s], algorithms: [grpo]}]
evaluation: {benchmarks: [synthetic_test]}
"""


def _read(tmp_path, grid):
    f = tmp_path / "c.yaml"
    f.write_text(BASE.replace("GRID", grid))
    return read_workflow_config_checked([f])


def test_a_grid_expands_to_one_arm_per_combination(tmp_path):
    config = _read(tmp_path, "{aqn.sigma_start: [0.01, 0.05], optim.lr: [1.0e-4]}")
    assert [r.method for r in runs(config)] == ["lora", "qerl_s-0.01-0.0001", "qerl_s-0.05-0.0001"]
    cfg = train_config(config, next(r for r in runs(config) if r.method == "qerl_s-0.05-0.0001"))
    assert cfg["aqn"]["sigma_start"] == 0.05 and cfg["optim"]["lr"] == 1e-4 and cfg["lora"]["r"] == 8
    assert cfg["method"] == "qerl"
    assert arm_changes(config, "qerl_s-0.01-0.0001") == "lora.r 8; aqn.sigma_start 0.01; optim.lr 0.0001"


def test_a_bad_grid_is_named(tmp_path):
    with pytest.raises(ConfigFileError, match="sigma_strat"):
        _read(tmp_path, "{aqn.sigma_strat: [0.01]}")
    with pytest.raises(ConfigFileError, match="is not a name"):
        _read(tmp_path, "{aqn.schedule: ['a b']}")
    with pytest.raises(ConfigFileError, match="grid"):
        _read(tmp_path, "{aqn.sigma_start: []}")
