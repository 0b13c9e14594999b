"""Anyone's model directory checked at entry (issue 80: T3, T4, S7, S17): weights that are not their config's, no
tokenizer, int8 or NaN weights: one line naming the file and the tensor, in the loader, `qerl evaluate` and
`qerl quantize` alike, before any work and with nothing written."""
import json
import shutil

import pytest
import torch

from qerl.checkpoint import CheckpointError


@pytest.fixture
def tiny(tmp_path):
    from qerl.models.tiny import TinySpec, save_tiny_model

    return save_tiny_model(tmp_path / "tiny", TinySpec(seed=0))


def _copy(src, dst, edit_config=None, edit_tensors=None, drop=()):
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for name in drop:
        (dst / name).unlink()
    if edit_config:
        cfg = json.loads((dst / "config.json").read_text())
        edit_config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if edit_tensors:
        t = load_file(dst / "model.safetensors")
        edit_tensors(t)
        save_file(t, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _q(t):
    return next(k for k in t if k.endswith("layers.0.self_attn.q_proj.weight"))


CASES = {
    "config of another model (T3)": (dict(edit_config=lambda c: c.update(hidden_size=c["hidden_size"] * 2,
                                                                         head_dim=c.get("head_dim")
                                                                         or c["hidden_size"] // c["num_attention_heads"])),
                                     "has shape .* the weights are not this config's"),
    "fewer layers than the config (T3)": (dict(edit_config=lambda c: c.update(num_hidden_layers=5)),
                                          "decoder layers 0..1 .2., .*num_hidden_layers 5"),
    "int8 weights (S7)": (dict(edit_tensors=lambda t: t.__setitem__(_q(t), t[_q(t)].to(torch.int8))),
                          "q_proj.weight is I8; a dense checkpoint's weights are floating point"),
    "NaN weights (S7)": (dict(edit_tensors=lambda t: t[_q(t)].__setitem__((0, 0), float("nan"))),
                         "q_proj.weight holds NaN or inf"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_model_directory_that_is_not_what_it_says_is_named_by_the_loader(tiny, tmp_path, case):
    from qerl.models import load_policy

    kw, want = CASES[case]
    bad = _copy(tiny, tmp_path / "bad", **kw)
    for base in ("bf16", "nvfp4"):
        with pytest.raises(CheckpointError, match=want):
            load_policy(bad, base=base)


def test_evaluate_and_quantize_name_a_model_without_tokenizer_files_before_any_work(tiny, tmp_path, capsys):
    from qerl.cli import main

    names = [p.name for p in tiny.iterdir() if p.name.startswith(("tokenizer", "vocab", "merges", "special"))]
    bad = _copy(tiny, tmp_path / "notok", drop=names)
    assert main(["evaluate", "--model", str(bad), "--base", "bf16", "--benchmark", "synthetic_test",
                 "--output", str(tmp_path / "e.json"), "--limit", "2", "--no-progress"]) != 0
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "no tokenizer files" in err and "notok" in err and not (tmp_path / "e.json").exists()
    assert main(["quantize", "--model", str(bad), "--output", str(tmp_path / "q"), "--no-progress"]) != 0
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "no tokenizer files" in err and not (tmp_path / "q").exists()
    (bad / "tokenizer.json").write_text("")
    with pytest.raises(CheckpointError, match="tokenizer.json: the tokenizer file is empty"):
        from qerl.models.check import check_tokenizer

        check_tokenizer(bad)


def test_quantize_refuses_weights_that_are_not_their_configs(tiny, tmp_path, capsys):
    from qerl.cli import main

    bad = _copy(tiny, tmp_path / "bad", **CASES["config of another model (T3)"][0])
    assert main(["quantize", "--model", str(bad), "--output", str(tmp_path / "q"), "--no-progress"]) != 0
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "has shape" in err and "Traceback" not in err and not (tmp_path / "q").exists()
