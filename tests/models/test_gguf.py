"""A local GGUF file as a model source (qerl.models.gguf, `qerl from-gguf`): tiny GGUF files written by the gguf
package's writer (tests/conftest.py) are turned into model directories equal to the model they came from."""
import json
import subprocess
import sys

import pytest
import torch


def _logits(model_dir, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model(torch.tensor([ids])).logits


def test_float_gguf_round_trips_bit_exact_with_tokenizer_and_template(tiny_dirs, tiny_gguf, tmp_path):
    from transformers import AutoTokenizer

    from qerl.models.gguf import MARKER, convert, source_tags

    out = tmp_path / "m"
    rec = convert(tiny_gguf["F32"], out, dtype="float32")
    assert rec["architecture"] == "qwen2" and rec["tensor_types"] == {"F32": 27} and not rec["dequantized"]
    assert not rec["cached"] and json.loads((out / MARKER).read_text())["sha256"] == rec["sha256"]
    src_tok, tok = AutoTokenizer.from_pretrained(tiny_dirs["qwen2"]), AutoTokenizer.from_pretrained(out)
    text = "12+7= hello <|im_end|>"
    assert tok(text).input_ids == src_tok(text).input_ids
    assert tok.eos_token == src_tok.eos_token and tok.chat_template == src_tok.chat_template
    ids = src_tok(text).input_ids
    assert torch.equal(_logits(out, ids), _logits(tiny_dirs["qwen2"], ids))  # F32 tensors: nothing rounded
    assert source_tags(out) == {"model_source": "gguf", "model_gguf_file": tiny_gguf["F32"].name,
                                "model_gguf_sha256": rec["sha256"], "model_dequantized_from": "none (float tensors)"}


def test_quantized_gguf_is_dequantized_and_says_so(tiny_dirs, tiny_gguf, tmp_path):
    from transformers import AutoTokenizer

    from qerl.models.gguf import convert, source_tags

    out = tmp_path / "q"
    rec = convert(tiny_gguf["Q8_0"], out)
    assert rec["dequantized"] and rec["tensor_types"]["Q8_0"] == 16
    assert source_tags(out)["model_dequantized_from"] == "Q8_0"
    ids = AutoTokenizer.from_pretrained(tiny_dirs["qwen2"])("3+4=").input_ids
    a, b = _logits(out, ids), _logits(tiny_dirs["qwen2"], ids)
    assert 0 < (a - b).abs().max() < 0.1 * b.abs().max()  # Q8_0 rounding, bf16 storage: close, not equal
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert convert(tiny_gguf["Q8_0"], out)["cached"]  # same file: nothing redone, nothing rewritten
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime


def test_outputs_are_replaced_only_when_they_are_models(tiny_gguf, tmp_path):
    from qerl.models.gguf import GGUFError, convert

    out = tmp_path / "m"
    convert(tiny_gguf["F32"], out)
    with pytest.raises(GGUFError, match="the conversion of another GGUF file; pass --force"):
        convert(tiny_gguf["Q8_0"], out)
    assert convert(tiny_gguf["Q8_0"], out, force=True)["tensor_types"]["Q8_0"] == 16
    other = tmp_path / "notes"
    other.mkdir()
    (other / "thesis.tex").write_text("mine")
    from qerl.owned import NotOwned

    for force in (False, True):
        with pytest.raises((GGUFError, NotOwned), match="files that are not a converted model|thesis.tex, which no "
                                                        "qerl command wrote there"):
            convert(tiny_gguf["F32"], other, force=force)
    assert (other / "thesis.tex").read_text() == "mine"


def test_bad_gguf_files_are_one_line_errors(tiny_gguf, tmp_path, monkeypatch):
    import gguf

    from qerl.models import gguf as g

    (tmp_path / "text.gguf").write_text("hello")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf["F32"].read_bytes()[:2000])
    arch = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(arch), "rwkv6")
    w.add_tensor("token_embd.weight", torch.zeros(4, 16).numpy())
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    cases = [(tmp_path / "none.gguf", "no such GGUF file"), (tmp_path / "text.gguf", "not a GGUF file"),
             (cut, "unreadable GGUF file"), (arch, "architecture 'rwkv6' is not one")]
    for path, want in cases:
        with pytest.raises(g.GGUFError, match=want):
            g.convert(path, tmp_path / "out")
    real = g._supported
    monkeypatch.setattr(g, "_supported", lambda: (real()[0], real()[1] - {"Q8_0"}))
    with pytest.raises(g.GGUFError, match=r"tensor type\(s\) Q8_0 cannot be dequantized"):
        g.convert(tiny_gguf["Q8_0"], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_cli_from_gguf(tiny_gguf, tmp_path):
    out = tmp_path / "cli"

    def run(*args):
        return subprocess.run([sys.executable, "-m", "qerl", "from-gguf", *args], capture_output=True, text=True)

    r = run("--gguf", str(tiny_gguf["Q8_0"]), "--output", str(out))
    assert r.returncode == 0 and "dequantized from F32 x11, Q8_0 x16" in r.stdout
    r = run("--gguf", str(tiny_gguf["Q8_0"]), "--output", str(out))
    assert r.returncode == 0 and "nothing to do" in r.stdout
    # issue 80: a damaged output is never "nothing to do": its manifest deleted and its weights cut, or its weights
    # zeroed at the same size (every file is hashed)
    weights = out / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(bytes(len(good)))
    r = run("--gguf", str(tiny_gguf["Q8_0"]), "--output", str(out))
    assert r.returncode != 0 and "model.safetensors no longer match what was written" in r.stderr
    (out / "qerl_files.json").unlink()
    weights.write_bytes(good[: len(good) // 2])
    r = run("--gguf", str(tiny_gguf["Q8_0"]), "--output", str(out))
    assert r.returncode != 0 and "has no qerl_files.json" in r.stderr and "Traceback" not in r.stderr
    r = run("--gguf", str(tiny_gguf["Q8_0"]), "--output", str(out), "--force")
    assert r.returncode == 0 and weights.read_bytes() == good
    r = run("--gguf", str(tmp_path / "missing.gguf"), "--output", str(tmp_path / "x"))
    assert r.returncode == 2 and "no such GGUF file" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("bad, message", [
    ({"block_count": 3}, "block_count is 3 but its tensors hold 2 layer(s) (layers 0..1)"),
    ({"eos": False}, "no end-of-sequence token id"),
])
def test_metadata_that_disagrees_with_the_tensors_is_refused(tiny_dirs, gguf_writer, tmp_path, bad, message):
    """A header claiming more layers than the file holds (transformers would initialise the missing one at random
    and convert with exit 0), or a file without an end-of-sequence id (train / evaluate crashed later): refused
    before anything is written."""
    from qerl.models.gguf import GGUFError, convert

    path = gguf_writer(tiny_dirs["qwen2"], tmp_path / "bad.gguf", "F32", **bad)
    with pytest.raises(GGUFError) as e:
        convert(path, tmp_path / "out")
    assert message in str(e.value) and not (tmp_path / "out").exists()


def test_float16_overflow_is_refused(tiny_dirs, gguf_writer, tmp_path):
    from qerl.models.gguf import GGUFError, convert

    path = gguf_writer(tiny_dirs["qwen2"], tmp_path / "big.gguf", "F32", scale=1e6)
    with pytest.raises(GGUFError, match="beyond float16's range .*--dtype bfloat16"):
        convert(path, tmp_path / "out", dtype="float16")
    assert not (tmp_path / "out").exists()
    assert convert(path, tmp_path / "out32", dtype="float32")["dtype"] == "float32"
