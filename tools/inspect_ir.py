"""Compile the NVFP4 kernels for sm_90 on any machine (no GPU needed) and report what the generated
code does: load widths, async copies (software pipelining), tensor-core ops, shared memory, registers and
the resulting resident programs per SM (``resident_programs``), and —
from the SASS that Triton's bundled ``nvdisasm`` prints — the instruction mix of the main loop and
its cost in **SASS instructions per weight** (issued per thread x threads / weights per iteration),
the static number that decides whether dequantization can keep up with memory.

``python tools/inspect_ir.py [--kind fwd|bwd|gemv|mmv] [--bm 16 --bn 64 --bk 256 --warps 4 --stages 4
--split 1 --swap 0] [--sass FILE]``
Pointer and integer arguments are specialised as multiples of 16, as Triton's JIT does at run time
when the actual values are. ``--kind mmv``: BM 8|16 (activation rows), warps = BN / 16, stages = register
prefetch depth (1|2), ``QERL_INSPECT_XPRE=0`` loads activations at use, ``QERL_INSPECT_L2=256`` /
``QERL_INSPECT_PFD=4``: L2 prefetch size hint / prefetch distance of the weight loads, ``QERL_INSPECT_FUSED=1``:
the fused LoRA-32 launch, ``QERL_INSPECT_UNROLL=1``: the unrolled (no-rotation) loop, ``QERL_INSPECT_TRACE=1``: with the timeline stamps, ``QERL_INSPECT_PDL=1|2``: LoRA-32 with ``xa`` (bf16 | the fp32 accumulator) from a
preceding PDL launch (``--kind loraxa``: that launch's kernel, ``--bk`` its K chunk, ``QERL_INSPECT_XA_STAGES``
its chunk-loop pipeline depth), ``QERL_INSPECT_RB=2``: two
blocks of 16 weight rows per warp (bn = 32 x warps).
``--kind wgmma``: the warpgroup-MMA kernel (``nvfp4_wgmma``, Gluon): ``--bm`` = BT activation rows, ``--warps`` =
4 x warpgroups, ``--stages`` = ring stages, ``QERL_INSPECT_XG=0``: pre-permuted activations.
"""
import argparse
import collections
import json
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from qerl_kernels.nvfp4_gemv import _nvfp4_gemv_kernel
from qerl_kernels.nvfp4_matmul import _nvfp4_bwd_kernel, _nvfp4_fwd_kernel

FWD_SIG = {"x_ptr": "*bf16", "wp_ptr": "*u8", "ws_ptr": "*u8", "gs_ptr": "*fp32", "out_ptr": "*bf16",
           "bias_ptr": "*bf16", "xa_ptr": "*bf16", "lb_ptr": "*bf16", "part_ptr": "*fp32", "lock_ptr": "*i32",
           "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_om": "i32", "stride_wn": "i32",
           "stride_sn": "i32", "lora_scale": "fp32", "SPLIT": "i32"}
BWD_SIG = {"dy_ptr": "*bf16", "wp_ptr": "*u8", "ws_ptr": "*u8", "gs_ptr": "*fp32", "out_ptr": "*bf16",
           "dyb_ptr": "*bf16", "la_ptr": "*bf16", "part_ptr": "*fp32", "lock_ptr": "*i32",
           "M": "i32", "N": "i32", "K": "i32", "stride_dm": "i32", "stride_om": "i32", "stride_wn": "i32",
           "stride_sn": "i32", "lora_scale": "fp32", "SPLIT": "i32"}


def compile_sm90(kind="fwd", bm=16, bn=64, bk=256, warps=4, stages=4, split=1, swap=0, red=1):
    consts = {"R": 0, "USE_SPLIT": split > 1, "EVEN_K": True, "BM": bm, "BN": bn, "BK": bk, "FAST": True, "DOT_FP32": False}
    if kind == "mmv":  # register-fragment tensor-core decode path (nvfp4_mmv)
        from qerl_kernels.nvfp4_mmv import _nvfp4_mmv_kernel
        fn = _nvfp4_mmv_kernel
        base = {}
        for k, v in FWD_SIG.items():  # + the fused LoRA's lora_a, partials and flags after lock_ptr
            base[k] = v
            if k == "lock_ptr":
                base.update(la_ptr="*bf16", xap_ptr="*fp32", xlock_ptr="*i32")
        consts = {"HAS_BIAS": False, "R": 0, "USE_SPLIT": split > 1, "EVEN_K": True, "WARPS": warps,
                  "NB": max(1, bm // 8), "PREFETCH": max(1, min(stages, 2)),
                  "XPRE": int(os.environ.get("QERL_INSPECT_XPRE", "1")),
                  "L2": int(os.environ.get("QERL_INSPECT_L2", "0")), "PFD": int(os.environ.get("QERL_INSPECT_PFD", "0")),
                  "FUSED": os.environ.get("QERL_INSPECT_FUSED", "0") == "1",
                  "UNROLL": os.environ.get("QERL_INSPECT_UNROLL", "0") == "1",
                  "TRACE": os.environ.get("QERL_INSPECT_TRACE", "0") == "1",
                  "PDL": int(os.environ.get("QERL_INSPECT_PDL", "0")),
                  "RB": int(os.environ.get("QERL_INSPECT_RB", "1"))}
        if consts["FUSED"] or consts["PDL"]:
            consts["R"] = 32
    elif kind == "loraxa":  # the LoRA down-projection launched before a PDL decode launch (lora_xa)
        from qerl_kernels.lora_xa import _lora_xa_kernel
        fn = _lora_xa_kernel
        base = {"x_ptr": "*bf16", "la_ptr": "*bf16", "xa_ptr": "*bf16", "xap_ptr": "*fp32", "lock_ptr": "*i32",
                "tr_ptr": "*i64", "M": "i32", "K": "i32", "stride_xm": "i32", "XP": "i32"}
        consts = {"R": 32, "KB": bk, "QB": 16, "PDL": int(os.environ.get("QERL_INSPECT_PDL", "1")),
                  "TRACE": os.environ.get("QERL_INSPECT_TRACE", "0") == "1",
                  "STAGES": int(os.environ.get("QERL_INSPECT_XA_STAGES", "1"))}
    elif kind == "gemv":  # CUDA-core decode path (nvfp4_gemv)
        fn, base = _nvfp4_gemv_kernel, FWD_SIG
        consts.update(HAS_BIAS=False)
        consts.pop("DOT_FP32")
    elif kind == "fwd":
        fn, base = _nvfp4_fwd_kernel, FWD_SIG
        consts.update(HAS_BIAS=False, SWAP=bool(swap), RED=red)
    else:
        fn, base = _nvfp4_bwd_kernel, BWD_SIG
        consts.update(SWAP=bool(swap), RED=red)
    sig = {**base, **{k: "constexpr" for k in consts}}
    if kind == "mmv":
        sig["XP"] = "i32"
    if kind == "mmv":  # RB (constexpr) comes after XP in the kernel's signature
        sig["RB"] = sig.pop("RB")  # the fused LoRA's producer count (runtime, after the constexprs)
    names = list(sig)
    div16 = [k for k in base if k.endswith("_ptr") or (base[k] == "i32" and k not in ("M", "SPLIT"))]
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in div16}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    opts = {"num_warps": warps, "num_stages": stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


WGMMA_SIG = {"xp_ptr": "*bf16", "wp_ptr": "*u8", "ws_ptr": "*u8", "gs_ptr": "*fp32", "out_ptr": "*bf16",
             "bias_ptr": "*bf16", "part_ptr": "*fp32", "lock_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32",
             "stride_xm": "i32", "stride_om": "i32", "stride_wn": "i32", "stride_sn": "i32", "SPLIT": "i32",
             "xa_ptr": "*bf16", "lb_ptr": "*bf16", "lora_scale": "fp32"}


def compile_wgmma(WG=1, BT=64, NS=3, split=False, bias=False, XG=True, PIPE=False, NSW=0, MT=1, R=0, PDL=False,
                  XS=False, SK=False, TILED=False, EW=False, TRIG=False, RED=1):
    """The warpgroup-MMA kernel (:mod:`qerl_kernels.nvfp4_wgmma`, Gluon) for sm_90: WG warpgroups, BT
    activation rows, NS ring stages, in-kernel activation gather XG, LoRA rank R (PDL: ``xa`` from the
    preceding launch), activations staged through registers XS, stream-K schedule SK, the launch chain's early
    weights EW, releasing the next launch at the start TRIG, split-K partials loaded per round RED."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from qerl_kernels.nvfp4_wgmma import _nvfp4_wgmma_kernel

    consts = {"HAS_BIAS": bool(bias), "USE_SPLIT": bool(split), "WG": WG, "BT": BT, "NS": NS, "XG": bool(XG),
              "PIPE": bool(PIPE), "NSW": max(NSW, NS) if PIPE else 0, "MT": MT, "R": R, "PDL": bool(PDL),
              "XS": bool(XS), "SK": bool(SK), "TILED": bool(TILED), "EW": bool(EW), "TRIG": bool(TRIG), "RED": RED}
    sig = {**WGMMA_SIG, **{k: "constexpr" for k in consts}}
    names = list(sig)
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in WGMMA_SIG
             if k.endswith("_ptr") or k not in ("M", "SPLIT", "lora_scale")}
    src = GluonASTSource(_nvfp4_wgmma_kernel, sig, {(names.index(k),): v for k, v in consts.items()}, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4 * WG})


def compile_ws(C=2, MT=1, BT=64, NS=4, split=False, bias=False, R=0, PDL=False, OCC=1, SK=False, DB=False,
               KS=False, XWAIT=False, TILED=False, TRIG=False):
    """The warp-specialised warpgroup-MMA kernel (:mod:`qerl_kernels.nvfp4_wgmma_ws`, Gluon) for sm_90: C consumer
    warpgroups of MT m64 tiles, BT activation rows, NS ring stages, OCC programs per SM (the register split),
    stream-K schedule SK, TILED weights (:mod:`qerl_kernels.layout`)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from qerl_kernels.nvfp4_wgmma_ws import PRODUCER_WARPS, _nvfp4_ws_kernel, register_split

    maxnreg, creg, _ = register_split(C, OCC)
    consts = {"HAS_BIAS": bool(bias), "USE_SPLIT": bool(split), "C": C, "MT": MT, "BT": BT, "NS": NS, "CREGS": creg,
              "R": R, "PDL": bool(PDL), "SK": bool(SK), "DB": bool(DB),
              "KS": bool(KS), "XWAIT": bool(XWAIT), "TILED": bool(TILED), "TRIG": bool(TRIG)}
    sig = {**WGMMA_SIG, **{k: "constexpr" for k in consts}}
    names = list(sig)
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in WGMMA_SIG
             if k.endswith("_ptr") or k not in ("M", "SPLIT", "lora_scale")}
    src = GluonASTSource(_nvfp4_ws_kernel, sig, {(names.index(k),): v for k, v in consts.items()}, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": PRODUCER_WARPS, "maxnreg": maxnreg})


def compile_ws_tma(C=2, MT=1, BT=64, NS=4, split=False, bias=False, R=0, PDL=False, OCC=1, SK=False, DB=False,
                   KS=False, XWAIT=False, TILED=False, TRIG=False):
    """:func:`compile_ws` with the TMA producer (:func:`qerl_kernels.nvfp4_wgmma_ws._nvfp4_ws_tma_kernel`)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from qerl_kernels.nvfp4_wgmma_ws import PRODUCER_WARPS, W_TMA_LAYOUT, X_TMA_LAYOUT, _nvfp4_ws_tma_kernel, \
        register_split

    maxnreg, creg, _ = register_split(C, OCC)
    consts = {"HAS_BIAS": bool(bias), "USE_SPLIT": bool(split), "C": C, "MT": MT, "BT": BT, "NS": NS, "CREGS": creg,
              "R": R, "PDL": bool(PDL), "SK": bool(SK), "DB": bool(DB),
              "KS": bool(KS), "XWAIT": bool(XWAIT), "TILED": bool(TILED), "TRIG": bool(TRIG)}
    box = 64 if TILED else 64 * MT * (1 if KS else C)  # (TILED: one 4 KB box per 64-row tile and K step)
    args = {"w_desc": f"tensordesc<u8[{box}, 64],{W_TMA_LAYOUT!r}>",
            "x_desc": f"tensordesc<bf16[{BT}, 128],{X_TMA_LAYOUT!r}>",
            **{k: v for k, v in WGMMA_SIG.items() if k not in ("xp_ptr", "wp_ptr", "stride_xm", "stride_wn")}}
    order = ["w_desc", "x_desc", "ws_ptr", "gs_ptr", "out_ptr", "bias_ptr", "part_ptr", "lock_ptr", "M", "N", "K",
             "stride_om", "stride_sn", "SPLIT", "xa_ptr", "lb_ptr", "lora_scale"]
    sig = {**{k: args[k] for k in order}, **{k: "constexpr" for k in consts}}
    names = list(sig)
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in order
             if k.endswith("_ptr") or k in ("N", "K", "stride_om", "stride_sn")}
    src = GluonASTSource(_nvfp4_ws_tma_kernel, sig, {(names.index(k),): v for k, v in consts.items()}, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": PRODUCER_WARPS, "maxnreg": maxnreg})


def sass_of(kernel) -> str:
    nvdisasm = os.path.join(triton.__path__[0], "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout


def ptxas_warnings(kernel) -> list[str]:
    """ptxas's performance warnings (``C75xx``, e.g. C7512 / C7513: every wgmma serialised) for the kernel's PTX,
    re-assembled with ``ptxas -v`` for sm_90a (Triton's own ptxas call does not show them)."""
    ptxas = os.path.join(triton.__path__[0], "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(kernel.asm["ptx"])
        r = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", src, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True, check=True)
    return [line.strip() for line in (r.stdout + r.stderr).splitlines() if re.search(r"\(C75\d\d\)", line)]


def mbarrier_overlaps(ptx: str) -> list[tuple[int, int]]:
    """``(scratch offset, mbarrier offset)`` pairs where a plain ``ld`` / ``st.shared`` at a constant offset of the
    kernel's shared memory (``global_smem+N``, e.g. a scalar broadcast or a layout-conversion scratch) touches the 8
    bytes of an mbarrier the kernel initialises (``mbarrier.init`` at ``global_smem + M``). Triton's allocator may
    give a dead allocation's bytes to later scratch; for an mbarrier that is undefined unless it was invalidated
    first — the cause of the split-K ticket failures found with ``KS`` (reports/kernels/README.md)."""
    base = set(re.findall(r"mov\.b32 \t(%r\d+), global_smem;", ptx))
    offsets = {r: int(n) for r, b, n in re.findall(r"add\.s32 \t(%r\d+), (%r\d+), (\d+);", ptx) if b in base}
    bars = {offsets[r] for r in re.findall(r"mbarrier\.init\.shared::cta\.b64 \[(%r\d+)\]", ptx) if r in offsets}
    invalidated = {offsets[r] for r in re.findall(r"mbarrier\.inval\.shared::cta\.b64 \[(%r\d+)\]", ptx)
                   if r in offsets}
    scratch = {int(m) for m in re.findall(r"(?:ld|st)\.shared(?:\.v\d)?\.b\d+ \t?[^;]*global_smem\+(\d+)\]", ptx)}
    scratch |= {offsets[r] for r in re.findall(r"(?:ld|st)\.shared(?:\.v\d)?\.b\d+ \t?\[ ?(%r\d+) \+ 0 ?\]", ptx)
                if r in offsets}
    return sorted((s, b) for s in scratch for b in bars - invalidated if b <= s < b + 8)


def _resource_usage(kernel) -> str:
    cuobjdump = os.path.join(triton.__path__[0], "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout


def registers_of(kernel) -> int:
    """Registers per thread of the compiled kernel (``cuobjdump --dump-resource-usage``)."""
    return int(re.search(r"REG:(\d+)", _resource_usage(kernel)).group(1))


def stack_of(kernel) -> int:
    """Bytes of per-thread stack (register spills) of the compiled kernel."""
    return int(re.search(r"STACK:(\d+)", _resource_usage(kernel)).group(1))


def resident_programs(registers: int, shared: int, warps: int) -> int:
    """Programs of this kernel resident per SM on Hopper (sm_90): the least of 32 blocks, 2048 threads,
    the 64K-register file (registers allocated per warp in units of 256) and 228 KB of shared memory (1 KB
    reserved per block). A kernel's registers and shared memory are those of its largest code path, so a
    rarely taken path (the fused LoRA producers) sets the residency of every program of the launch."""
    per_warp = -(-registers * 32 // 256) * 256
    by_regs = 65536 // (per_warp * warps)
    by_smem = (228 * 1024) // (shared + 1024) if shared else 32
    return min(32, 2048 // (32 * warps), by_regs, by_smem)


def main_loop(sass: str) -> tuple[int, collections.Counter]:
    """Instructions of the largest loop (a backward branch) and their opcode counts."""
    ins, labels, pending = [], {}, []
    for line in sass.splitlines():
        m = re.match(r"\s*(\.L_x_\d+):", line)
        if m:
            pending.append(m.group(1))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            addr = int(m.group(1), 16)
            labels.update({p: addr for p in pending})
            pending = []
            ins.append((addr, m.group(2).strip()))
    best: list[str] = []
    for addr, text in ins:
        m = re.search(r"BRA\s.*?(\.L_x_\d+)", text)
        if m and labels.get(m.group(1), addr) < addr:
            body = [t for a, t in ins if labels[m.group(1)] <= a <= addr]
            best = max(best, body, key=len)
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in best)
    return len(best), ops


def inspect(bm=16, bn=64, bk=256, warps=4, stages=4, split=1, swap=0, kind="fwd", sass_file=None) -> dict:
    if kind == "wgmma":  # bm = BT activation rows, warps = 4 x warpgroups (64 weight rows each), stages = ring
        k = compile_wgmma(max(1, warps // 4), bm, stages, split > 1, False, os.environ.get("QERL_INSPECT_XG", "1") == "1")
        bn, bk = 16 * warps, 128
    else:
        k = compile_sm90(kind, bm, bn, bk, warps, stages, split, swap)
    ptx, ttgir = k.asm["ptx"], k.asm["ttgir"]
    sass = sass_of(k)
    if sass_file:
        with open(sass_file, "w") as f:
            f.write(sass)
    n, ops = main_loop(sass)
    if kind == "mmv":  # one loop iteration: one step of 128 k, or PREFETCH + 1 of them (QERL_INSPECT_UNROLL=1)
        bk = 128 * ((max(1, min(stages, 2)) + 1) if os.environ.get("QERL_INSPECT_UNROLL", "0") == "1" else 1)
    loads = collections.Counter(re.sub(r"\.L1::\w+|\.L2::\w+", "", m) for m in re.findall(r"ld\.global[\w.:]*", ptx))
    return {"kind": kind, "k_per_loop": bk, "config": dict(BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages, SPLIT=split, SWAP=swap),
            "global_loads": dict(loads), "cp_async": ptx.count("cp.async"), "wgmma": ptx.count("wgmma.mma_async"),
            "mma_sync": ptx.count("mma.sync"), "ttgir_async_copies": ttgir.count("async_copy_global_to_local"),
            "ttgir_convert_layout": ttgir.count("convert_layout"), "shared_bytes": k.metadata.shared,
            "registers": registers_of(k), "resident_programs_per_sm": resident_programs(registers_of(k), k.metadata.shared, warps),
            "loop_sass_instructions": n, "loop_sass_per_weight": round(n * 32 * warps / (bn * bk), 3),
            "loop_top_ops": dict(ops.most_common(12))}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kind", choices=("fwd", "bwd", "gemv", "mmv", "loraxa", "wgmma"), default="fwd")
    for name, default in (("bm", 16), ("bn", 64), ("bk", 256), ("warps", 4), ("stages", 4), ("split", 1), ("swap", 0)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--sass", default=None, help="also write the SASS listing here")
    a = p.parse_args()
    print(json.dumps(inspect(a.bm, a.bn, a.bk, a.warps, a.stages, a.split, a.swap, a.kind, a.sass), indent=1))
