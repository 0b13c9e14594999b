"""qerl: reinforcement-learning post-training of LLMs on frozen NVFP4 bases with LoRA and
Adaptive Quantization Noise (QeRL, arXiv 2510.11696).

Layers (imports point down): ``quant`` (pure NVFP4 math, format) -> ``ops`` (compute seams) ->
``models`` (NVFP4Linear, load_policy, tiny models) -> ``lora`` -> ``stages`` (quantize, ...) ->
``cli``. Importing ``qerl`` itself loads no torch.
"""
__version__ = "0.1.0"
