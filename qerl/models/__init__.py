"""Models: loading policies on bf16 / NVFP4 / NF4 bases, the NVFP4 Linear, tiny test models."""
from qerl.models.loading import BASES, load_policy, quantize_model
from qerl.models.nvfp4_linear import NVFP4Linear, dequantize_model

__all__ = ["BASES", "NVFP4Linear", "dequantize_model", "load_policy", "quantize_model"]
