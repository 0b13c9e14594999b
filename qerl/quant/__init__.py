"""Quantization: NVFP4 math (:mod:`qerl.quant.nvfp4`) and the compressed-tensors format
(:mod:`qerl.quant.format`). Pure functions, no model or file I/O.

Names are re-exported lazily so that ``qerl.quant.format`` (no torch) stays light to import.
"""
_EXPORTS = ("BLOCK_SIZE", "NVFP4Error", "dequantize", "fused_global_scale", "global_scale",
            "pack_fp4", "quantization_error", "quantize", "unpack_fp4")
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        from qerl.quant import nvfp4

        return getattr(nvfp4, name)
    raise AttributeError(f"module 'qerl.quant' has no attribute {name!r}")
