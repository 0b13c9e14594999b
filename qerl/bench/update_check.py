"""``python -m qerl.bench.update_check OUT.json``: the update phase's fused elementwise path against transformers'
eager layers, on this machine's GPU.

:func:`qerl.train.fused.fused_elementwise` routes the update's RMSNorms and SiLU gates through compiled kernels. Its
judge is the eager model: for a random-weight Qwen2.5-shaped policy (NVFP4 and bf16 bases, LoRA rank 32 on every
projection, ``B`` drawn so that every adapter has a gradient) and random tokens, the mean next-token log-prob's
gradient with respect to every trainable parameter, with the routing on and off:

* every trainable parameter has a gradient on both sides (a forward-only kernel inside the block leaves some
  without one, or cuts the path through a norm: both fail here);
* the routed gradients no farther from the fp32 model's (the same weights, eager, in fp32) than the eager ones:
  per parameter the relative L2 error against fp32, median and max, within 1.25× / 1.5× the eager side's (+1e-3);
  the two bf16 sides sum their reductions in other orders, so they differ from each other by rounding, reported
  as ``grad_rel_*`` (the routed against the eager);
* the log-probs within bf16 rounding, and the routed forward under ``torch.no_grad`` (the old-log-prob pass) equal
  bit for bit to the routed forward with gradients (the update's), so ``exp(log π - log π_old)`` is 1 where it
  should be.

Writes the results as JSON and exits 1 if a check fails. ``ew`` (tests): the elementwise functions to route through
in place of the compiled ones, which lets the check run on CPU.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

from qerl.files import write_text_atomic


def _mean_logprob(policy, ids: torch.Tensor) -> torch.Tensor:
    """Mean log-prob of each next token of ``ids [B, T]`` (fp32 logits)."""
    logits = policy(ids).logits[:, :-1].float()
    return logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).mean()


def fp32_copy(policy):
    """``policy`` with every bf16 / fp16 parameter and buffer in fp32 (the packed NVFP4 codes and fp8 scales as
    they are): the same weights, computed in fp32."""
    ref = copy.deepcopy(policy)
    for mod in ref.modules():
        for name, t in list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False)):
            if t is not None and t.dtype in (torch.bfloat16, torch.float16):
                t.data = t.data.float()
        if hasattr(mod, "compute_dtype"):
            mod.compute_dtype = torch.float32
    return ref


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def compare(policy, ids: torch.Tensor, ew=None) -> dict:
    """Gradients of :func:`_mean_logprob` w.r.t. ``policy``'s trainable parameters, eager vs routed, each against
    the fp32 copy's (module docstring); returns the per-check results and ``ok``."""
    from qerl.train.fused import fused_elementwise

    names = [n for n, p in policy.named_parameters() if p.requires_grad]
    params = [p for p in policy.parameters() if p.requires_grad]

    def grads(loss, ps=params):  # (a loss cut from every parameter has no gradient at all)
        return torch.autograd.grad(loss, ps, allow_unused=True) if loss.requires_grad else [None] * len(ps)

    want_loss = _mean_logprob(policy, ids)
    want = grads(want_loss)
    with fused_elementwise(policy, ew=ew) as routed:
        with torch.no_grad():
            quiet = _mean_logprob(policy, ids)
        got_loss = _mean_logprob(policy, ids)
        got = grads(got_loss)
    missing = [n for n, w, g in zip(names, want, got) if w is None or g is None or not bool(g.abs().sum() > 0)]
    rel = {n: _rel(g, w) for n, w, g in zip(names, want, got) if n not in missing}
    res = {
        "routed_modules": routed, "trainable": len(names), "missing_gradients": missing[:20],
        "n_missing": len(missing), "grad_rel_max": max(rel.values(), default=float("nan")),
        "grad_rel_median": _median(rel.values()), "worst": sorted(rel.items(), key=lambda kv: -kv[1])[:5],
        "loss_eager": want_loss.item(), "loss_routed": got_loss.item(),
        "no_grad_equals_grad": bool(torch.equal(quiet, got_loss.detach())),
    }
    ok = routed > 0 and not missing and res["no_grad_equals_grad"]
    ref = fp32_copy(policy)
    ref_ps = [p for p in ref.parameters() if p.requires_grad]
    ref_loss = _mean_logprob(ref, ids)
    exact = grads(ref_loss, ref_ps)
    del ref
    e = {n: _rel(w, x) for n, w, x in zip(names, want, exact) if n not in missing}
    r = {n: _rel(g, x) for n, g, x in zip(names, got, exact) if n not in missing}
    res.update(loss_fp32=ref_loss.item(), fp32_rel_median_eager=_median(e.values()),
               fp32_rel_median_routed=_median(r.values()), fp32_rel_max_eager=max(e.values(), default=0.0),
               fp32_rel_max_routed=max(r.values(), default=0.0))
    ok = ok and (res["fp32_rel_median_routed"] <= 1.25 * res["fp32_rel_median_eager"] + 1e-3
                 and res["fp32_rel_max_routed"] <= 1.5 * res["fp32_rel_max_eager"] + 1e-3)
    res["ok"] = bool(ok and abs(res["loss_eager"] - res["loss_routed"]) <= 1e-2 * max(1.0, abs(res["loss_eager"])))
    return res


def _median(vals) -> float:
    vals = list(vals)
    return float(torch.tensor(vals).median()) if vals else float("nan")


def _policy(model: str, base: str, seed: int = 0):
    from qerl.lora import LoraSettings, apply_lora
    from qerl.models.random import build

    policy = apply_lora(build(model, base, seed=seed), LoraSettings(r=32, alpha=32))
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if "lora_B" in n:  # PEFT starts B at 0, which leaves A without a gradient
                p.copy_(torch.randn(p.shape, device=p.device, generator=g, dtype=torch.float32) * 0.02)
    return policy


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qerl.bench.update_check", description=__doc__.split("\n\n")[0])
    p.add_argument("output", type=Path, help="the JSON file to write")
    p.add_argument("--model", default="0.5B", help="Qwen2.5 shapes (default 0.5B)")
    p.add_argument("--bases", nargs="+", default=["nvfp4", "bf16"], choices=["nvfp4", "bf16"])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--tokens", type=int, default=256, help="tokens per row")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("update_check: needs a CUDA GPU (the routed kernels are compiled for it)", file=sys.stderr)
        return 2
    out = {"device": torch.cuda.get_device_name(), "model": a.model, "results": {}}
    for base in a.bases:
        policy = _policy(a.model, base)
        ids = torch.randint(0, policy.config.vocab_size, (a.batch, a.tokens), device="cuda",
                            generator=torch.Generator(device="cuda").manual_seed(7))
        r = compare(policy, ids)
        out["results"][base] = r
        print(f"{base}: ok={r['ok']} routed {r['routed_modules']}, {r['trainable']} trainable, "
              f"{r['n_missing']} without a gradient, grad rel max {r['grad_rel_max']:.2e} median "
              f"{r['grad_rel_median']:.2e}; against fp32 median / max eager {r['fp32_rel_median_eager']:.2e} / "
              f"{r['fp32_rel_max_eager']:.2e}, routed {r['fp32_rel_median_routed']:.2e} / "
              f"{r['fp32_rel_max_routed']:.2e}; loss {r['loss_eager']:.6f} / {r['loss_routed']:.6f}, "
              f"no-grad == grad: {r['no_grad_equals_grad']}", flush=True)
        del policy
        torch.cuda.empty_cache()
    out["ok"] = all(r["ok"] for r in out["results"].values())
    write_text_atomic(a.output, json.dumps(out, indent=1, default=str) + "\n")
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
