"""Models: loading policies on bf16 / NVFP4 / NF4 bases, the NVFP4 Linear, tiny test models.

Names are re-exported lazily so that ``qerl.models.arch`` (no torch) stays light to import.
"""
_EXPORTS = {
    "BASES": "qerl.models.loading", "load_policy": "qerl.models.loading",
    "quantize_model": "qerl.models.loading", "NVFP4Linear": "qerl.models.nvfp4_linear",
    "dequantize_model": "qerl.models.nvfp4_linear",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'qerl.models' has no attribute {name!r}")
