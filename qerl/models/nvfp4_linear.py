"""``NVFP4Linear``: a frozen Linear that keeps only its packed NVFP4 tensors.

Buffers (not parameters, so no optimizer ever sees them): ``weight_packed`` uint8 ``[N, K/2]``,
``weight_scale`` float8_e4m3fn ``[N, K/16]``, ``weight_global_scale`` float32 ``[1]``, and an
optional ``bias`` ``[N]``. The names match the compressed-tensors checkpoint, so
``state_dict()`` of a quantized model is exactly the on-disk format. ``forward`` goes through the
single seam :func:`qerl.ops.linear.nvfp4_linear` (reference on CPU, Triton kernels on CUDA).

Layout: the buffers hold the checkpoint's row-major bytes, or (:meth:`NVFP4Linear.set_layout`, ``tiled``) the same
bytes in the tile-contiguous layout the rollout engine decodes from (:mod:`qerl_kernels.layout`), re-laid once in
place; every op then reads them as they lie (``tiled=True``) and the kernels route each call by M. ``state_dict()``
still gives the row-major format (copies), and ``load_state_dict`` takes it and keeps the module's layout.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from qerl.ops import nvfp4_linear
from qerl.quant import nvfp4


#: How many times any NVFP4Linear changed layout in this process (:meth:`NVFP4Linear.set_layout`): a rollout engine
#: built before a change reads stale views and graphs, so :func:`qerl.rollout.engine.engine_for` builds a new one.
LAYOUT_CHANGES = [0]


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
        self.tiled = False  # weight_packed / weight_scale in the tile-contiguous layout (set_layout)

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
        """Install packed tensors, row-major as a checkpoint holds them (validated against this layer's shape); a
        tiled module re-lays them (:meth:`set_layout`)."""
        nvfp4.check_packed(packed, scale, "NVFP4Linear")
        want = (self.out_features, self.in_features // 2)
        if tuple(packed.shape) != want:
            raise nvfp4.NVFP4Error(f"NVFP4Linear: weight_packed shape {tuple(packed.shape)}, expected {want}")
        self.weight_packed = packed.contiguous()
        self.weight_scale = scale.contiguous()
        self.weight_global_scale = global_scale.reshape(1).to(torch.float32)
        if bias is not None:
            self.bias = bias
        if self.tiled:
            self.tiled = False
            self.set_layout(True)

    def can_tile(self) -> bool:
        """Whether the weight has whole 64-row tiles and 128-wide K steps (:mod:`qerl_kernels.layout`)."""
        from qerl_kernels.layout import tileable

        return tileable(self.out_features, self.in_features)

    @torch.no_grad()
    def set_layout(self, tiled: bool) -> bool:
        """Re-lay ``weight_packed`` / ``weight_scale`` **in place** into the tile-contiguous layout (``tiled``) or back
        to row-major: the same tensors (views into them, e.g. the rollout engine's fused q/k/v, stay valid), the
        same bytes reordered. Returns whether the layout changed. Raises unless :meth:`can_tile` when tiling."""
        if tiled == self.tiled:
            return False
        if tiled and not self.can_tile():
            raise nvfp4.NVFP4Error(f"NVFP4Linear [{self.out_features}, {self.in_features}]: the tiled layout needs "
                                   "out_features % 64 == 0 and in_features % 128 == 0")
        from qerl_kernels import layout

        packed, scale = (layout.tile if tiled else layout.untile)(self.weight_packed, self.weight_scale)
        self.weight_packed.copy_(packed)
        self.weight_scale.copy_(scale)
        self.tiled = tiled
        LAYOUT_CHANGES[0] += 1
        return True

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.tiled:  # the checkpoint's row-major format, whatever the layout in memory
            from qerl_kernels.layout import untile

            rows = untile(self.weight_packed, self.weight_scale)
            destination[prefix + "weight_packed"], destination[prefix + "weight_scale"] = rows

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # row-major bytes come in: take them row-major, then re-lay (a state dict without them, e.g. PEFT loading
        # adapters into the whole model, leaves the layer as it is)
        tiled = self.tiled and any(prefix + k in state_dict for k in ("weight_packed", "weight_scale"))
        if tiled:
            self.set_layout(False)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if tiled:
            self.set_layout(True)

    @property
    def qweight(self) -> torch.Tensor:
        """The packed weight under the name PEFT probes to find a quantized layer's device."""
        return self.weight_packed

    def dequantized_weight(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The dense ``[N, K]`` weight (a temporary: never stored on the module)."""
        from qerl.ops.linear import rows_of

        return nvfp4.dequantize(*rows_of(self.weight_packed, self.weight_scale, self.tiled), self.weight_global_scale,
                                dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return nvfp4_linear(x, self.weight_packed, self.weight_scale, self.weight_global_scale, bias, tiled=self.tiled)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"format=nvfp4{', layout=tiled' if self.tiled else ''}")


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
            m.dense = dense_weight(m.weight_packed, m.weight_scale, m.weight_global_scale, dtype or m.compute_dtype,
                                   m.tiled)
        yield sum(m.dense.numel() * m.dense.element_size() for m in layers)
    finally:
        for m in layers:
            m.dense = None
