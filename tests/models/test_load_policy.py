"""``load_policy``: NVFP4 (ours and llm-compressor-style), bf16, NF4; bad checkpoints."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from qerl.checkpoint import CheckpointError
from qerl.models import NVFP4Linear, load_policy
from qerl.quant import nvfp4
from qerl.quant.format import CheckpointFormatError


def _logits(model, seed=0):
    x = torch.randint(3, 250, (2, 10), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(x).logits.float()


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_nvfp4_keeps_only_packed_tensors(arch, quantized_dirs):
    model = load_policy(quantized_dirs[arch], base="nvfp4")
    layers = [m for m in model.modules() if isinstance(m, NVFP4Linear)]
    assert len(layers) == 7 * model.config.num_hidden_layers
    for m in layers:
        assert {n for n, _ in m.named_parameters()} == set()  # frozen: buffers only
        names = {n for n, _ in m.named_buffers()}
        assert names <= {"weight_packed", "weight_scale", "weight_global_scale", "bias"}
        assert m.weight_packed.dtype == torch.uint8
    assert not any(isinstance(m, torch.nn.Linear) and m is not model.lm_head for m in model.modules())
    assert model.lm_head.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_nvfp4_equals_dequantized_dense(arch, quantized_dirs, tiny_dirs):
    q = load_policy(quantized_dirs[arch], base="nvfp4")
    d = load_policy(quantized_dirs[arch], base="bf16")  # the dequantized base, plain nn.Linear
    assert torch.equal(_logits(q), _logits(d))
    dense = load_policy(tiny_dirs[arch], base="bf16")
    assert (_logits(q) - _logits(dense)).abs().max() < 0.5  # quantization error, not garbage


def test_bf16_checkpoint_quantized_on_the_fly(tiny_dirs, quantized_dirs):
    a = load_policy(tiny_dirs["qwen2"], base="nvfp4")
    b = load_policy(quantized_dirs["qwen2"], base="nvfp4")
    assert torch.equal(_logits(a), _logits(b))


def test_greedy_generation_runs(quantized_dirs):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(quantized_dirs["qwen2"])
    model = load_policy(quantized_dirs["qwen2"])
    enc = tok(["1+1=", "hello"], return_tensors="pt", padding=True)
    out = model.generate(**enc, max_new_tokens=6, do_sample=False)
    assert out.shape == (2, enc.input_ids.shape[1] + 6)


def _llm_compressor_style(src, dst):
    """An NVFP4A16 checkpoint written with compressed-tensors' own primitives: per-tensor (unfused)
    global scales, a 're:' ignore pattern, and compressed-tensors' QuantizationConfig dump."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    out = {}
    for name, t in tensors.items():
        if name.endswith("_proj.weight"):
            w = t.float()
            n, k = w.shape
            gs = generate_gparam(w.amin().reshape(1), w.amax().reshape(1))
            g = w.reshape(n, k // 16, 16)
            scale, _ = calculate_qparams(g.amin(-1), g.amax(-1), scheme.weights, global_scale=gs)
            sd = NVFP4PackedCompressor.compress({"weight": t, "weight_scale": scale, "weight_global_scale": gs}, scheme)
            prefix = name[: -len(".weight")]
            out.update({f"{prefix}.{k2}": v for k2, v in sd.items()})
        else:
            out[name] = t
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    qc = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["re:.*lm_head"],
                            format="nvfp4-pack-quantized", quantization_status="compressed")
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = qc.model_dump(mode="json")
    cfg["quantization_config"]["quant_method"] = "compressed-tensors"
    (dst / "config.json").write_text(json.dumps(cfg))
    return out


def test_reads_llm_compressor_style_unfused_checkpoint(tiny_dirs, tmp_path):
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    dst = tmp_path / "llmc"
    written = _llm_compressor_style(tiny_dirs["qwen2"], dst)
    q = written["model.layers.0.self_attn.q_proj.weight_global_scale"]
    k = written["model.layers.0.self_attn.k_proj.weight_global_scale"]
    assert not torch.equal(q, k)  # global scales really are unfused
    ours = load_policy(dst, base="nvfp4")
    layer = ours.model.layers[0].self_attn.k_proj
    assert torch.equal(layer.weight_global_scale, k)
    hf = AutoModelForCausalLM.from_pretrained(dst)
    assert torch.equal(_logits(ours), _logits(hf))


def test_nf4_base_loads_and_runs(tiny_dirs):
    bnb = pytest.importorskip("bitsandbytes")
    model = load_policy(tiny_dirs["qwen2"], base="nf4")
    layer = model.model.layers[0].self_attn.q_proj
    assert isinstance(layer, bnb.nn.Linear4bit)
    assert layer.weight.quant_state.quant_type == "nf4"
    dense = load_policy(tiny_dirs["qwen2"], base="bf16")
    assert (_logits(model) - _logits(dense)).abs().max() < 0.5


def test_bad_base_and_nf4_on_nvfp4(quantized_dirs):
    with pytest.raises(ValueError, match="base='fp8'"):
        load_policy(quantized_dirs["qwen2"], base="fp8")
    with pytest.raises(CheckpointError, match="nf4.*dense"):
        load_policy(quantized_dirs["qwen2"], base="nf4")


def _corrupt(quantized_dirs, tmp_path, edit_tensors=None, edit_config=None):
    dst = tmp_path / "corrupt"
    shutil.copytree(quantized_dirs["qwen2"], dst)
    if edit_tensors:
        t = load_file(dst / "model.safetensors")
        edit_tensors(t)
        save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if edit_config:
        cfg = json.loads((dst / "config.json").read_text())
        edit_config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


P = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda t: t.pop(f"{P}.weight_scale"), "missing.*q_proj.weight_scale"),
        (lambda t: t.__setitem__(f"{P}.weight_scale", t[f"{P}.weight_scale"].float()), "float8_e4m3fn"),
        (lambda t: t.__setitem__(f"{P}.weight_packed", t[f"{P}.weight_packed"][:, :8].contiguous()), "shape"),
        (lambda t: t.__setitem__(f"{P}.weight_global_scale", 1 / t[f"{P}.weight_global_scale"]), "reciprocal"),
        (lambda t: t.__setitem__(f"{P}.weight_global_scale", t[f"{P}.weight_global_scale"].half()), "must be float32"),
        (lambda t: t.__setitem__(f"{P}.input_global_scale", torch.ones(1)), "does not expect"),
    ],
)
def test_bad_tensors_raise_named_errors(quantized_dirs, tmp_path, edit, match):
    d = _corrupt(quantized_dirs, tmp_path, edit_tensors=edit)
    with pytest.raises(CheckpointError, match=match):
        load_policy(d, base="nvfp4")


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda c: c["quantization_config"].__setitem__("format", "pack-quantized"), "format"),
        (lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].__setitem__("group_size", 32), "group_size"),
        (lambda c: c["quantization_config"]["config_groups"]["group_0"].__setitem__("input_activations", {"num_bits": 4}), "W4A4"),
    ],
)
def test_bad_quantization_config(quantized_dirs, tmp_path, edit, match):
    d = _corrupt(quantized_dirs, tmp_path, edit_config=edit)
    with pytest.raises(CheckpointFormatError, match=match):
        load_policy(d, base="nvfp4")


def test_truncated_shard(quantized_dirs, tmp_path):
    d = _corrupt(quantized_dirs, tmp_path)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        load_policy(d, base="nvfp4")


def test_tied_embeddings(tmp_path):
    from qerl.models.tiny import TinySpec, save_tiny_model
    from qerl.stages.quantize import quantize_checkpoint

    src = save_tiny_model(tmp_path / "tied", TinySpec(tie_word_embeddings=True))
    quantize_checkpoint(src, tmp_path / "tiedq", progress=False)
    q = load_policy(tmp_path / "tiedq")
    assert q.lm_head.weight.data_ptr() == q.model.embed_tokens.weight.data_ptr()
    assert torch.equal(_logits(q), _logits(load_policy(tmp_path / "tiedq", base="bf16")))
