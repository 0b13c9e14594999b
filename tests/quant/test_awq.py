"""AWQ for NVFP4 (qerl.quant.awq, `qerl quantize --calibration awq`): the fold is exact, the search never loses
to round-to-nearest on its calibration data, the AWQ checkpoint errs less than RTN's on held-out text (a model
with outlier activation channels, as real LLMs have), compressed-tensors still reads it, and it composes with
four-over-six and the bf16 tail."""
import copy
import json

import pytest
import torch

from qerl.quant import awq

CAL = "\n".join(f"What is {a} plus {b}? The answer is {a + b}." for a in range(40) for b in range(40))
HELD_OUT = [f"Tom has {a} apples and buys {b} more, so he has {a + b}." for a in range(50, 60) for b in range(3)]


def _model(tmp_path, arch="qwen2", kv_heads=2, outliers=True, name="m"):
    """A tiny bf16 model; ``outliers``: 4 channels of each norm scaled x20, so a few input channels of every linear
    carry large activations (the case AWQ exists for)."""
    from transformers import AutoModelForCausalLM

    from qerl.models.tiny import TinySpec, save_tiny_model

    src = save_tiny_model(tmp_path / name, TinySpec(arch=arch, seed=0, num_key_value_heads=kv_heads))
    if outliers:
        m = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for layer in m.model.layers:
                for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                    norm.weight[torch.randperm(norm.weight.numel(), generator=g)[:4]] *= 20.0
        m.to(torch.bfloat16).save_pretrained(src)
    return src


@pytest.mark.parametrize("arch, kv_heads", [("qwen2", 2), ("llama", 2), ("qwen2", 4)])
def test_folded_model_equals_the_unfolded_one_in_fp32(tmp_path, arch, kv_heads):
    """Every group folded (q/k/v and gate/up into the norms, down into up's rows, and without grouped-query
    attention o into v's rows): the fp32 model computes the same logits, and the search's loss is never above
    round-to-nearest's (alpha = 0 is on the grid)."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(_model(tmp_path, arch, kv_heads), dtype=torch.float32).eval()
    ids = torch.randint(3, 250, (3, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = m(ids).logits
    folded = copy.deepcopy(m)
    report = awq.smooth(folded, ids, grid=10, clip=False)  # the fold alone (clipping changes the function)
    with torch.no_grad():
        after = folded(ids).logits
    assert torch.allclose(before, after, atol=2e-5, rtol=1e-5), float((before - after).abs().max())
    groups = {"qkv", "gate_up", "down"} | ({"o"} if kv_heads == 4 else set())
    assert {k.rsplit(".", 1)[1] for k in report} == groups and len(report) == len(groups) * 2
    assert all(r["loss"] <= r["loss_rtn"] for r in report.values())
    assert any(r["alpha"] > 0 and r["loss"] < r["loss_rtn"] for r in report.values())
    changed = [n for n, p in folded.named_parameters() if not torch.equal(p, dict(m.named_parameters())[n])]
    assert any("input_layernorm" in n for n in changed) and any("q_proj" in n for n in changed)


def test_smooth_sees_the_inputs_the_model_computes(tmp_path):
    """The layer-by-layer pass feeds each linear the input a full forward gives it (mask, rotary, residuals)."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(_model(tmp_path), dtype=torch.float32).eval()
    ids = torch.randint(3, 250, (2, 16), generator=torch.Generator().manual_seed(2))
    seen: dict[str, list] = {}
    hooks = [layer.mlp.down_proj.register_forward_pre_hook(lambda mod, a, i=i: seen.setdefault(i, []).append(a[0]))
             for i, layer in enumerate(m.model.layers)]
    with torch.no_grad():
        m(ids)
    full = {i: v[0].reshape(-1, v[0].shape[-1]) for i, v in seen.items()}
    seen.clear()
    awq.smooth(m, ids, grid=1, clip=False)  # alpha 0 only: s = 1, the model unchanged; the hooks see the search's inputs
    for h in hooks:
        h.remove()
    for i, x in full.items():
        assert torch.allclose(seen[i][0].reshape(-1, x.shape[-1]), x, atol=1e-5), i


def test_smooth_a_row_at_a_time_equals_smooth_in_one_forward(tmp_path):
    """The search reads the calibration rows in chunks (bounded memory at the paper's 256 x 2,048, where one forward
    would materialise a 56 GiB attention matrix): one row a chunk gives the same scales, losses, clip ratios and
    weights as all rows at once (up to fp32 summation order), and the chunks cover every row once."""
    from transformers import AutoModelForCausalLM

    assert awq.row_chunks(5, 4, tokens=8) == [(0, 2), (2, 4), (4, 5)]
    assert awq.row_chunks(3, 2048, tokens=16) == [(0, 1), (1, 2), (2, 3)]  # never 0 rows
    m = AutoModelForCausalLM.from_pretrained(_model(tmp_path), dtype=torch.float32).eval()
    ids = torch.randint(3, 250, (4, 24), generator=torch.Generator().manual_seed(3))
    whole, rows = copy.deepcopy(m), copy.deepcopy(m)
    r_whole = awq.smooth(whole, ids, grid=10)
    r_rows = awq.smooth(rows, ids, grid=10, chunk_tokens=24)  # one row of 24 tokens a forward
    assert r_whole.keys() == r_rows.keys()
    for k in r_whole:
        assert r_whole[k]["alpha"] == r_rows[k]["alpha"], k
        assert r_whole[k]["loss"] == pytest.approx(r_rows[k]["loss"], rel=1e-4), k
        assert r_whole[k]["clip"].keys() == r_rows[k]["clip"].keys(), k
        for lin, c in r_whole[k]["clip"].items():
            assert c == pytest.approx(r_rows[k]["clip"][lin], rel=1e-4), (k, lin)
    for (n, a), b in zip(whole.named_parameters(), rows.parameters()):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4), n


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_awq_checkpoint_errs_less_than_rtn_on_held_out_text(tmp_path, arch):
    """KL(bf16 || NVFP4) of next-token distributions on held-out sentences (another template, other numbers than
    the calibration text): AWQ's checkpoint below RTN's."""
    from transformers import AutoTokenizer

    from qerl.models import load_policy
    from qerl.stages.quantize import quantize_checkpoint

    src = _model(tmp_path, arch)
    (tmp_path / "cal.txt").write_text(CAL)
    quantize_checkpoint(src, tmp_path / "rtn", progress=False)
    s = quantize_checkpoint(src, tmp_path / "awq", progress=False, calibration="awq",
                            calibration_data=tmp_path / "cal.txt", calibration_samples=16, calibration_seq_len=64)
    assert s["calibration"] == "awq" and s["awq_loss_vs_rtn_mean"] < 1.0
    # the guard: AWQ's KL on the held-out tenth of the calibration text below its own alpha = 0 base's, so kept
    assert s["awq_kept"] == "awq" and s["awq_kl_awq"] < s["awq_kl_rtn"] and s["awq_held_out_samples"] == 64
    report = json.loads((tmp_path / "awq" / "quantization_report.json").read_text())
    qkv, down = report["awq"]["layers.0.self_attn.qkv"], report["awq"]["layers.0.mlp.down"]
    assert qkv["loss_on"] == "attention output" and report["awq"]["layers.0.mlp.gate_up"]["loss_on"] == "MLP output"
    assert down["loss_on"] == "the linear's own output" and qkv["tokens"] == qkv["tokens_total"] == 16 * 64
    assert set(qkv["clip"]) == {"v_proj"} and 0.5 <= down["clip"]["down_proj"]["ratio_mean"] <= 1.0
    assert qkv["s_min"] <= qkv["s_median"] <= qkv["s_max"] and report["awq_guard"]["kept"] == "awq"
    ids = AutoTokenizer.from_pretrained(src)(HELD_OUT, return_tensors="pt", padding=True).input_ids
    with torch.no_grad():
        ref = torch.log_softmax(load_policy(src, base="bf16", dtype=torch.float32)(ids).logits, -1)
        kl = {}
        for k in ("rtn", "awq"):
            q = torch.log_softmax(load_policy(tmp_path / k, base="nvfp4", dtype=torch.float32)(ids).logits, -1)
            kl[k] = float((ref.exp() * (ref - q)).sum(-1).mean())
    assert kl["awq"] < kl["rtn"], kl


def test_awq_composes_with_four_over_six_and_the_bf16_tail_and_compressed_tensors_reads_it(tmp_path):
    pytest.importorskip("compressed_tensors")
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from qerl.models import load_policy
    from qerl.stages.quantize import quantize_checkpoint

    src = _model(tmp_path)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": q}) + "\n" for q in CAL.splitlines()[:200]))
    dst = tmp_path / "q"
    s = quantize_checkpoint(src, dst, progress=False, calibration="awq", calibration_data=data,
                            calibration_samples=8, calibration_seq_len=32, scale_rule="four-over-six",
                            keep_bf16_last=1)
    manifest = json.loads((dst / "qerl_quantize.json").read_text())["settings"]
    assert manifest["scale_rule"] == "four-over-six" and manifest["calibration"]["method"] == "awq"
    assert manifest["calibration"]["samples"] == 8 and len(manifest["calibration"]["data_sha256"]) == 64
    report = json.loads((dst / "quantization_report.json").read_text())
    assert set(report["awq"]) == {"layers.0.self_attn.qkv", "layers.0.mlp.gate_up", "layers.0.mlp.down"}
    assert s["quantized_linears"] == 7  # layer 1 kept in bf16
    out, orig = load_file(dst / "model.safetensors"), load_file(src / "model.safetensors")
    for name, t in orig.items():  # the bf16 tail (layer 1) and its norms: the source's, untouched by the fold
        if ".layers.1." in name:
            assert torch.equal(out[name], t), name
    assert not torch.equal(out["model.layers.0.input_layernorm.weight"], orig["model.layers.0.input_layernorm.weight"])
    hf = AutoModelForCausalLM.from_pretrained(dst)  # transformers' compressed-tensors loader reads it
    ours = load_policy(dst, base="nvfp4")
    x = torch.randint(3, 250, (2, 9))
    with torch.no_grad():
        assert torch.equal(hf(x).logits, ours(x).logits)
    # another calibration file: not up to date, refused without --force (nothing lost)
    other = tmp_path / "other.txt"
    other.write_text(CAL)
    from qerl.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="--force"):
        quantize_checkpoint(src, dst, progress=False, calibration="awq", calibration_data=other,
                            calibration_samples=8, calibration_seq_len=32, scale_rule="four-over-six",
                            keep_bf16_last=1)


def test_the_guard_keeps_round_to_nearest_where_awq_would_lose_on_held_out_tokens(tmp_path, capsys):
    """A model without outlier channels, calibrated on prompts + worked solutions: AWQ lowers its calibration loss
    but raises KL(bf16 || NVFP4) on the held-out samples, so the quantizer says so and writes round-to-nearest's
    checkpoint (byte-equal weights): AWQ never leaves a base worse than its own alpha = 0."""
    from safetensors.torch import load_file

    from qerl.stages.quantize import quantize_checkpoint

    src = _model(tmp_path, "qwen2", outliers=False)
    data = tmp_path / "cal.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {a} plus {b}?", "answer": f"{a} + {b} = {a + b}. "
                                        f"#### {a + b}"}) + "\n" for a in range(40) for b in range(40)))
    s = quantize_checkpoint(src, tmp_path / "awq", progress=False, calibration="awq", calibration_data=data,
                            calibration_solution_field="answer", calibration_samples=16, calibration_seq_len=64)
    assert s["awq_loss_vs_rtn_mean"] < 1.0 and s["awq_kl_awq"] > s["awq_kl_rtn"]
    assert s["awq_kept"] == "round-to-nearest" and s["awq_worse_than_rtn"] is True
    assert "AWQ would make this base worse, so the checkpoint is round-to-nearest's" in capsys.readouterr().err
    quantize_checkpoint(src, tmp_path / "rtn", progress=False)
    a, r = load_file(tmp_path / "awq/model.safetensors"), load_file(tmp_path / "rtn/model.safetensors")
    assert a.keys() == r.keys() and all(torch.equal(a[k], r[k]) for k in a)
    manifest = json.loads((tmp_path / "awq" / "qerl_quantize.json").read_text())["settings"]["calibration"]
    assert manifest["solution_field"] == "answer"


def test_bad_calibration_inputs_are_named(tmp_path):
    from qerl.checkpoint import CheckpointError
    from qerl.stages.quantize import quantize_checkpoint

    src = _model(tmp_path, outliers=False)
    with pytest.raises(CheckpointError, match="needs calibration data"):
        quantize_checkpoint(src, tmp_path / "a", progress=False, calibration="awq")
    with pytest.raises(CheckpointError, match="expected 'none' or 'awq'"):
        quantize_checkpoint(src, tmp_path / "a", progress=False, calibration="gptq")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1+1"}\n{"prompt": "2+2"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl: line 2 has no text field 'question'"):
        quantize_checkpoint(src, tmp_path / "a", progress=False, calibration="awq", calibration_data=bad)
    with pytest.raises(FileNotFoundError, match="no such file"):
        awq.calibration_texts(tmp_path / "none.txt")
    # calibrating on prompt + solution: a row without its worked solution is named, never skipped
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"question": "1+1", "answer": "2"}\n{"question": "2+2"}\n')
    with pytest.raises(CheckpointError, match=r"prompts.jsonl: line 2 has no solution field 'answer'"):
        quantize_checkpoint(src, tmp_path / "a", progress=False, calibration="awq", calibration_data=prompts,
                            calibration_solution_field="answer")
    (tmp_path / "c.txt").write_text("a line of text\n")
    with pytest.raises(ValueError, match="a text file has no fields"):
        awq.calibration_texts(tmp_path / "c.txt", "question", "answer")
    assert not (tmp_path / "a").exists()


def test_awq_out_of_gpu_memory_is_a_message_with_the_sizes(tmp_path, monkeypatch):
    """A search that runs out of GPU memory (the H200 did, at 256 x 2,048 before the search read its rows in chunks)
    ends in one message naming the calibration size and what to lower, and leaves no output and no temporary copy."""
    from qerl.checkpoint import CheckpointError
    from qerl.stages.quantize import quantize_checkpoint

    def oom(*a, **k):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 56.00 GiB.")
    monkeypatch.setattr(awq, "smooth", oom)
    src = _model(tmp_path, outliers=False)
    cal = tmp_path / "cal.jsonl"
    cal.write_text("".join(json.dumps({"question": f"{a}+1", "answer": str(a + 1)}) + "\n" for a in range(20)))
    out = tmp_path / "out" / "q"
    out.parent.mkdir()
    with pytest.raises(CheckpointError, match=r"AWQ ran out of GPU memory on 8 x 32 calibration tokens .*lower "
                                              r"--calibration-samples or --calibration-seq-len.*56.00 GiB"):
        quantize_checkpoint(src, out, progress=False, calibration="awq", calibration_data=cal,
                            calibration_samples=8, calibration_seq_len=32, calibration_solution_field="answer")
    assert list(out.parent.iterdir()) == []


def test_base_kl_bench_ranks_awq_below_rtn_on_cpu(tmp_path):
    """`python -m qerl.bench.base_kl` (run on the GPU for the real base comparison) on CPU: perplexities and
    KL(bf16 || base) per checkpoint in a CSV; the reference's own KL is 0 and AWQ's is below RTN's."""
    import csv

    from qerl.bench import base_kl
    from qerl.stages.quantize import quantize_checkpoint

    src = _model(tmp_path)
    (tmp_path / "cal.txt").write_text(CAL)
    quantize_checkpoint(src, tmp_path / "rtn", progress=False)
    quantize_checkpoint(src, tmp_path / "awq", progress=False, calibration="awq", calibration_data=tmp_path / "cal.txt",
                        calibration_samples=16, calibration_seq_len=64)
    data = tmp_path / "held.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": " ok"}) + "\n" for q in HELD_OUT))
    out = tmp_path / "kl.csv"
    assert base_kl.main(["--reference", str(src), "--bases", f"rtn={tmp_path / 'rtn'}", f"awq={tmp_path / 'awq'}",
                         "--data", str(data), "--template", "raw", "--device", "cpu", "--output", str(out)]) == 0
    rows = {r["model"]: r for r in csv.DictReader(open(out))}
    assert float(rows["reference"]["kl_vs_reference"]) == 0 and rows["rtn"]["device"] == "cpu"
    assert 0 < float(rows["awq"]["kl_vs_reference"]) < float(rows["rtn"]["kl_vs_reference"])
    assert float(rows["reference"]["ppl"]) > 1 and int(rows["awq"]["tokens"]) > 100
