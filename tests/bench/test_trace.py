"""The decode-step timeline split (qerl.bench.trace): parts by kernel name, overlaps and gaps, on hand-made traces."""
import pytest

from qerl.bench import trace


@pytest.mark.parametrize("name,part", [
    ("_nvfp4_wgmma_kernel", "projections"), ("_nvfp4_ws_tma_kernel", "projections"), ("_lora_xa_kernel", "projections"),
    ("_permute_kernel", "projections"), ("_attn_partial_kernel", "attention"), ("_attn_combine_kernel", "attention"),
    ("_rope_cache_kernel", "attention"), ("_sample_partial_kernel", "sampling"), ("_sample_combine_kernel", "sampling"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32", "head"), ("nvjet_tst_128x8_64x12_2x1_v_bz_TNT", "head"),
    ("_sample_kernel", "sampling"), ("triton_red_fused_add_mean_mul_pow_rsqrt_0", "other"), ("_rms_kernel", "other"),
    ("_silu_mul_kernel", "other"),
    ("void at::native::vectorized_elementwise_kernel<4, ...>", "other")])
def test_part_of_names(name, part):
    assert trace.part_of(name) == part


def _k(name, start, dur):
    return {"name": name, "start_us": start, "dur_us": dur}


def test_split_adds_up_with_gaps_and_overlaps():
    """norm 0-2, gap 2-5, lora_xa 5-7 overlapped by the projection 6-16 (PDL), gap 16-17, attention 17-20 and,
    inside it, a short copy 18-19: attention owns 17-20 (the earliest start still running), the copy nothing."""
    ks = [_k("triton_poi_fused_rms", 0, 2), _k("_lora_xa_kernel", 5, 2), _k("_nvfp4_wgmma_kernel", 6, 10),
          _k("_decode_attention_kernel", 17, 3), _k("copy_kernel", 18, 1)]
    got = trace.split(list(reversed(ks)))  # any order
    assert got["kernels"] == 5 and got["step"] == pytest.approx(0.020)
    assert got["gaps"] == pytest.approx(0.004)  # 2-5 and 16-17
    assert got["projections"] == pytest.approx(0.011)  # 5-16
    assert got["attention"] == pytest.approx(0.003)  # 17-20
    assert got["other"] == pytest.approx(0.002)  # 0-2
    parts = sum(got[p] for p in ("projections", "attention", "sampling", "head", "other", "gaps"))
    assert parts == pytest.approx(got["step"])


def test_split_of_a_launch_chain_charges_each_wait_to_the_kernel_waited_for():
    """The launch chain: the projection 0-10 releases the norm at 1, which waits and runs 10-12 and releases the next
    projection at 10.5, which waits and runs 12-20: the projections own 0-10 and 12-20, the norm 10-12, no gaps."""
    ks = [_k("_nvfp4_wgmma_kernel", 0, 10), _k("_rms_kernel", 1, 11), _k("_nvfp4_wgmma_kernel", 10.5, 9.5)]
    got = trace.split(ks)
    assert got["projections"] == pytest.approx(0.018) and got["other"] == pytest.approx(0.002)
    assert got["gaps"] == 0 and got["step"] == pytest.approx(0.020)


def test_split_of_nothing():
    assert trace.split([]) == {"projections": 0.0, "attention": 0.0, "sampling": 0.0, "head": 0.0, "other": 0.0,
                               "gaps": 0.0, "step": 0.0, "kernels": 0}


def test_by_name_and_chrome_trace():
    doc = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "_nvfp4_wgmma_kernel", "ts": 10.0, "dur": 4.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1.0, "dur": 50.0},  # not a kernel
        {"ph": "X", "cat": "kernel", "name": "_nvfp4_wgmma_kernel", "ts": 20.0, "dur": 6.0},
        {"ph": "X", "cat": "kernel", "name": "_sample_kernel", "ts": 30.0, "dur": 1.0}]}
    ks = trace.kernels_of_chrome_trace(doc)
    assert [k["start_us"] for k in ks] == [10.0, 20.0, 30.0]
    rows = trace.by_name(ks)
    assert rows[0] == {"name": "_nvfp4_wgmma_kernel", "part": "projections", "calls": 2, "total_us": 10.0,
                       "mean_us": 5.0}
    assert rows[1]["part"] == "sampling" and len(trace.by_name(ks, top=1)) == 1


def test_rollout_trace_report(tmp_path):
    """``qerl bench rollout --trace-batches``' report: one section per traced row, its split and longest kernels."""
    from qerl.bench.rollout import build_parser, write_traces

    ks = [_k("_nvfp4_wgmma_kernel", 0, 8), _k("_sample_kernel", 9, 1)]
    row = {"model": "7B", "base": "nvfp4", "batch": 8, "prompt_len": 256, "gen_len": 1024}
    sp = {**trace.split(ks), "replay": 0.0095}
    path = write_traces([(row, sp, trace.by_name(ks))], tmp_path, "NVIDIA H100 80GB HBM3")
    text = path.read_text()
    assert path.name == "NVIDIA_H100_80GB_HBM3_trace.md" and "## 7B nvfp4 batch 8 (prompt 256, gen 1024)" in text
    assert "| projections | attention | sampling | head | other | gaps | step | kernels | replay |" in text
    assert "| 0.008 | 0.0 | 0.001 | 0.0 | 0.0 | 0.001 | 0.01 | 2 | 0.0095 |" in text
    assert "| `_nvfp4_wgmma_kernel` | projections | 1 | 8.0 | 8.0 |" in text
    assert build_parser().parse_args(["--trace-batches", "1", "8"]).trace_batches == [1, 8]


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_trace_kernels_calls_setup_outside_the_trace(monkeypatch):
    """``setup`` runs before every call of ``fn`` (warm-ups and the traced one) and ``fn`` once more under the
    profiler; on the CPU the trace holds no GPU kernels."""
    import torch

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    calls = []
    got = trace.trace_kernels(lambda: calls.append("fn"), warmup=2, setup=lambda: calls.append("setup"))
    assert calls == ["setup", "fn", "setup", "fn", "setup", "fn"] and got == []
