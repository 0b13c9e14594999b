"""Compute seams between the model code and the kernels (reference on CPU, Triton on CUDA)."""
from qerl.ops.linear import nvfp4_linear, nvfp4_lora_linear, use_reference
from qerl.ops.lora_train import nvfp4_lora_train

__all__ = ["nvfp4_linear", "nvfp4_lora_linear", "nvfp4_lora_train", "use_reference"]
