"""Quantization: NVFP4 math (:mod:`qerl.quant.nvfp4`) and the compressed-tensors format
(:mod:`qerl.quant.format`). Pure functions, no model or file I/O."""
from qerl.quant.nvfp4 import (
    BLOCK_SIZE,
    NVFP4Error,
    dequantize,
    fused_global_scale,
    global_scale,
    pack_fp4,
    quantization_error,
    quantize,
    unpack_fp4,
)

__all__ = [
    "BLOCK_SIZE",
    "NVFP4Error",
    "dequantize",
    "fused_global_scale",
    "global_scale",
    "pack_fp4",
    "quantization_error",
    "quantize",
    "unpack_fp4",
]
