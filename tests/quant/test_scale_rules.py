"""The scale-rule registry (qerl.quant.scale_rules): a rule registered by a test alone -- no other file touched --
quantizes (the library call and `qerl quantize`), loads (our loader and the Hugging Face config) and reports (its
error beside max6's), and the registry refuses bad entries by name."""
import json

import pytest
import torch

from qerl.quant import nvfp4, scale_rules


def quantize_max4(w, gs, own_scale=True):
    """A throw-away rule: each block's largest value on 4 (never 6); under a cap of 256 its scales fit E4M3."""
    n, k = w.shape
    x = w.float().reshape(n, k // 16, 16)
    s = (gs * x.abs().amax(-1) / 4).clamp(max=nvfp4.FP8_MAX).to(torch.float8_e4m3fn)
    s = torch.where(s.float() == 0, torch.tensor(nvfp4.ZERO_SCALE_REPLACEMENT).to(s.dtype), s)
    codes = nvfp4.rne_e2m1_codes(torch.clamp(x / (s.float() / gs).unsqueeze(-1), -6, 6)).reshape(n, k)
    return nvfp4.pack_fp4(codes), s, gs.clone()


@pytest.fixture
def max4():
    rule = scale_rules.register(scale_rules.ScaleRule("max4", 256.0, quantize_max4, "each block's largest value on 4"))
    yield rule
    scale_rules.unregister("max4")


def test_a_registered_rule_quantizes_loads_and_reports(max4, tiny_dirs, tmp_path):
    from qerl.cli import main
    from qerl.models import load_policy
    from qerl.stages.quantize import quantize_checkpoint

    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    p, s, gs = nvfp4.quantize(w, scale_rule="max4")
    assert float(gs) == pytest.approx(256.0 * 6 / float(w.abs().max()), rel=1e-6)
    magnitude = nvfp4.unpack_fp4(p) & 7  # e2m1: 6 is the value 4, 7 the value 6
    assert int(magnitude.max()) == 6  # every block's largest value on 4, none on 6
    back = nvfp4.dequantize(p, s, gs, dtype=torch.float32)
    assert float((back - w).norm() / w.norm()) < 0.2
    summary = quantize_checkpoint(tiny_dirs["qwen2"], tmp_path / "q4", progress=False, scale_rule="max4")
    assert summary["scale_rule"] == "max4"
    report = json.loads((tmp_path / "q4" / "quantization_report.json").read_text())
    layer = next(iter(report["layers"].values()))
    assert {"rel_fro_error", "max6_rel_fro_error"} <= set(layer)  # beside the paper's rule, as four-over-six is
    assert "max6_sqnr_db_mean" in report["summary"]
    policy = load_policy(tmp_path / "q4", base="nvfp4", dtype=torch.float32)
    assert policy is not None
    assert main(["quantize", "--model", str(tiny_dirs["qwen2"]), "--output", str(tmp_path / "cli"),
                 "--scale-rule", "max4", "--no-progress"]) == 0
    assert json.loads((tmp_path / "cli" / "quantization_report.json").read_text())["summary"]["scale_rule"] == "max4"
    from qerl.hf import QerlNVFP4Config

    assert QerlNVFP4Config(scale_rule="max4").scale_rule == "max4"


def test_the_registry_refuses_bad_rules_by_name():
    with pytest.raises(ValueError, match="scale rule 'max6' is registered already"):
        scale_rules.register(scale_rules.ScaleRule("max6", 448.0, quantize_max4))
    with pytest.raises(ValueError, match=r"scale_cap 500.0 must be in \(0, 448\]"):
        scale_rules.register(scale_rules.ScaleRule("big", 500.0, quantize_max4))
    with pytest.raises(nvfp4.NVFP4Error, match="scale rule 'max5' is not one of max6, four-over-six"):
        nvfp4.quantize(torch.ones(16, 16), scale_rule="max5")
    with pytest.raises(ValueError, match="cannot be removed"):
        scale_rules.unregister("max6")
    assert list(scale_rules.RULES)[:2] == ["max6", "four-over-six"]


def test_the_schema_lists_the_built_in_rules():
    """The workflow schema (data) lists the registry's built-in rules, in its order."""
    from pathlib import Path

    import yaml

    text = json.dumps(yaml.safe_load((Path(__file__).resolve().parents[2] / "workflow/schemas/config.schema.yaml")
                                     .read_text()))
    assert text.count(json.dumps(list(scale_rules.RULES))) == 2
