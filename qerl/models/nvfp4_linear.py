"""``NVFP4Linear``: a frozen Linear that keeps only its packed NVFP4 tensors.

Buffers (not parameters, so no optimizer ever sees them): ``weight_packed`` uint8 ``[N, K/2]``,
``weight_scale`` float8_e4m3fn ``[N, K/16]``, ``weight_global_scale`` float32 ``[1]``, and an
optional ``bias`` ``[N]``. The names match the compressed-tensors checkpoint, so
``state_dict()`` of a quantized model is exactly the on-disk format. ``forward`` goes through the
single seam :func:`qerl.ops.linear.nvfp4_linear` (reference on CPU, Triton kernels on CUDA).
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from qerl.ops import nvfp4_linear
from qerl.quant import nvfp4


class NVFP4Linear(nn.Module):
    """``y = x · dequant(W)ᵀ + b`` with W stored as NVFP4 (4.5 bits/weight); W is frozen."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 device=None, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        if in_features % nvfp4.BLOCK_SIZE:
            raise nvfp4.NVFP4Error(f"NVFP4Linear: in_features {in_features} is not a multiple of 16")
        self.in_features = in_features
        self.out_features = out_features
        self.compute_dtype = dtype  # activations' dtype; LoRA adapters are created to match
        self.register_buffer("weight_packed", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, in_features // 16, device=device).to(torch.float8_e4m3fn))
        self.register_buffer("weight_global_scale", torch.ones(1, dtype=torch.float32, device=device))
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device))
        else:
            self.bias = None
        self.dense = None  # dequant(W) while a dense_base block keeps it (never saved: not a buffer)

    @classmethod
    def from_linear(cls, linear: nn.Linear, global_scale: torch.Tensor | None = None) -> "NVFP4Linear":
        """Quantize a dense ``nn.Linear`` (optionally with a shared fused global scale)."""
        w = linear.weight.detach()
        mod = cls(linear.in_features, linear.out_features, linear.bias is not None,
                  device=w.device, dtype=w.dtype)
        packed, scale, gs = nvfp4.quantize(w, global_scale=global_scale)
        mod.load_packed(packed, scale, gs, None if linear.bias is None else linear.bias.detach())
        return mod

    def load_packed(self, packed, scale, global_scale, bias=None) -> None:
        """Install packed tensors (validated against this layer's shape)."""
        nvfp4.check_packed(packed, scale, "NVFP4Linear")
        want = (self.out_features, self.in_features // 2)
        if tuple(packed.shape) != want:
            raise nvfp4.NVFP4Error(f"NVFP4Linear: weight_packed shape {tuple(packed.shape)}, expected {want}")
        self.weight_packed = packed.contiguous()
        self.weight_scale = scale.contiguous()
        self.weight_global_scale = global_scale.reshape(1).to(torch.float32)
        if bias is not None:
            self.bias = bias

    @property
    def qweight(self) -> torch.Tensor:
        """The packed weight under the name PEFT probes to find a quantized layer's device."""
        return self.weight_packed

    def dequantized_weight(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The dense ``[N, K]`` weight (a temporary: never stored on the module)."""
        return nvfp4.dequantize(self.weight_packed, self.weight_scale, self.weight_global_scale, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return nvfp4_linear(x, self.weight_packed, self.weight_scale, self.weight_global_scale, bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, format=nvfp4"


def replace_linears(model: nn.Module, names: list[str], dtype: torch.dtype) -> None:
    """Swap the named ``nn.Linear`` submodules of ``model`` for empty ``NVFP4Linear`` ones."""
    for name in names:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, leaf)
        new = NVFP4Linear(old.in_features, old.out_features, old.bias is not None, device="cpu", dtype=dtype)
        setattr(parent, leaf, new)


def dequantize_model(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Replace every ``NVFP4Linear`` by a dense ``nn.Linear`` holding its dequantized weight."""
    for name, mod in list(model.named_modules()):
        if isinstance(mod, NVFP4Linear):
            parent_name, _, leaf = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            dense = nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None,
                              device=mod.weight_packed.device, dtype=dtype)
            with torch.no_grad():
                dense.weight.copy_(mod.dequantized_weight(dtype))
                if mod.bias is not None:
                    dense.bias.copy_(mod.bias)
            setattr(parent, leaf, dense)
    return model


@contextlib.contextmanager
def dense_base(model: nn.Module, dtype: torch.dtype | None = None, enabled: bool = True, modules: list | None = None):
    """Inside the block every :class:`NVFP4Linear` of ``model`` keeps its weight dequantized to ``dtype`` (default:
    the layer's ``compute_dtype``, its activations') (``layer.dense``, ``[N, K]``), which the training op multiplies directly
    (:func:`qerl.ops.nvfp4_lora_train` ``dense=``) instead of dequantizing it in every forward and backward call
    — for the update phase (``dense_update: true``): the same products, without a dequantization and the
    dispatch of the NVFP4 path per call, for 2 bytes per weight more memory while it runs (7B: +13 GB). Yields
    the bytes kept; the copies go when the block ends. ``enabled=False``: nothing (yields 0). ``modules``:
    ``list(model.modules())`` where the caller walked them already (a 0.5B model with LoRA has ~2,000)."""
    from qerl.ops.linear import dense_weight

    layers = [m for m in (model.modules() if modules is None else modules) if isinstance(m, NVFP4Linear)] \
        if enabled else []
    try:
        for m in layers:
            m.dense = dense_weight(m.weight_packed, m.weight_scale, m.weight_global_scale, dtype or m.compute_dtype)
        yield sum(m.dense.numel() * m.dense.element_size() for m in layers)
    finally:
        for m in layers:
            m.dense = None
