"""Compile the NVFP4 forward kernel for sm_90 on any machine (no GPU needed) and report what the
generated code does with memory: load widths, async copies (software pipelining), tensor-core ops.

``python -m qerl_kernels.inspect_ir [--bm 128 --bn 128 --bk 64 --warps 8 --stages 3]``
Pointer and integer arguments are specialised as multiples of 16, as Triton's JIT does at run time
when the actual values are.
"""
import argparse
import collections
import json
import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from qerl_kernels.nvfp4_matmul import _nvfp4_fwd_kernel

SIG = {"x_ptr": "*bf16", "wp_ptr": "*u8", "ws_ptr": "*u8", "gs_ptr": "*fp32", "out_ptr": "*bf16", "bias_ptr": "*bf16",
       "xa_ptr": "*bf16", "lb_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32",
       "stride_om": "i32", "stride_wn": "i32", "stride_sn": "i32", "lora_scale": "fp32"}


def inspect(bm=128, bn=128, bk=64, warps=8, stages=3, split=1) -> dict:
    consts = {"HAS_BIAS": False, "R": 0, "SPLIT_K": split, "BM": bm, "BN": bn, "BK": bk, "DOT_FP32": False}
    sig = {**SIG, **{k: "constexpr" for k in consts}}
    div16 = [i for i, k in enumerate(SIG) if k.endswith("_ptr") or k in ("N", "K", "stride_xm", "stride_om", "stride_wn", "stride_sn")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in div16}
    src = ASTSource(fn=_nvfp4_fwd_kernel, signature=sig, constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    ptx, ttgir = k.asm["ptx"], k.asm["ttgir"]
    loads = collections.Counter(re.sub(r"\.L1::\w+|\.L2::\w+", "", m) for m in re.findall(r"ld\.global[\w.:]*", ptx))
    return {"config": dict(BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages, SPLIT=split),
            "global_loads": dict(loads), "cp_async": ptx.count("cp.async"), "wgmma": ptx.count("wgmma.mma_async"),
            "mma_sync": ptx.count("mma.sync"), "ttgir_async_copies": ttgir.count("async_copy_global_to_local"),
            "ttgir_convert_layout": ttgir.count("convert_layout")}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("bm", 128), ("bn", 128), ("bk", 64), ("warps", 8), ("stages", 3), ("split", 1)):
        p.add_argument(f"--{name}", type=int, default=default)
    a = p.parse_args()
    print(json.dumps(inspect(a.bm, a.bn, a.bk, a.warps, a.stages, a.split), indent=1))
