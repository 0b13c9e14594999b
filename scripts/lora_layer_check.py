"""GPU: the NVFP4 LoRA layer of the model (``qerl.lora``'s PEFT layer over ``NVFP4Linear``) in
rollout mode (no autograd, rank 32, fp32 adapters as PEFT keeps them): the fused call (one kernel
launch for base + LoRA, ``qerl.ops.nvfp4_lora_linear``) against PEFT's own forward (base kernel,
then the two adapter matmuls, scale and add) on the same layer — agreement, and eager time per call
(the rollout engine runs eagerly), on Qwen2.5 projection shapes.

``python scripts/lora_layer_check.py OUT.json``
"""
import json
import sys

import torch
from peft import LoraConfig

from qerl.lora import _lora_linear_cls
from qerl.models import NVFP4Linear

SHAPES = {"7B qkv": (4608, 3584), "7B down": (3584, 18944), "32B o": (5120, 5120), "32B gate_up": (55296, 5120)}


def _eager_us(fn, iters=200) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / iters


def main(out: str) -> int:
    torch.manual_seed(0)
    cls = _lora_linear_cls()
    res = {"device": torch.cuda.get_device_name(), "rank": 32, "rows": []}
    for name, (N, K) in SHAPES.items():
        dense = torch.nn.Linear(K, N, bias=False, device="cuda", dtype=torch.bfloat16)
        torch.nn.init.normal_(dense.weight, std=0.02)
        layer = cls(NVFP4Linear.from_linear(dense), "default", LoraConfig(r=32, lora_alpha=64), r=32, lora_alpha=64)
        layer.to("cuda").eval()
        with torch.no_grad():
            torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.02)
        layer.lora_A["default"].float()  # PEFT's get_peft_model upcasts adapters to fp32 (as in qerl.lora.apply_lora)
        layer.lora_B["default"].float()
        for M in (1, 16, 64):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            with torch.no_grad():
                fused = layer(x)
                peft = cls.__mro__[1].forward(layer, x)  # PEFT's lora.Linear.forward on the same layer
                t_fused = _eager_us(lambda: layer(x))
                t_peft = _eager_us(lambda: cls.__mro__[1].forward(layer, x))
                t_base = _eager_us(lambda: layer.get_base_layer()(x))
            rel = float((fused.float() - peft.float()).norm() / peft.float().norm())
            row = {"shape": name, "N": N, "K": K, "M": M, "rel_err_vs_peft": rel, "fused_us": t_fused,
                   "peft_us": t_peft, "base_only_us": t_base, "speedup_vs_peft": t_peft / t_fused,
                   "lora_overhead_fused": t_fused / t_base - 1, "lora_overhead_peft": t_peft / t_base - 1}
            res["rows"].append(row)
            print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
    bad = [r for r in res["rows"] if not r["rel_err_vs_peft"] < 1e-2]
    print(json.dumps({"rows": len(res["rows"]), "bad": bad}))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
