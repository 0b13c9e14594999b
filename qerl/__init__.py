"""qerl: reinforcement-learning post-training of LLMs on frozen NVFP4 bases with LoRA and
Adaptive Quantization Noise (QeRL, arXiv 2510.11696).

Layers (imports point down): ``quant`` (pure NVFP4 math, format) -> ``ops`` (compute seams) ->
``models`` (NVFP4Linear, load_policy, tiny models) -> ``lora`` -> ``stages`` (quantize, ...) ->
``cli``. Importing ``qerl`` itself loads no torch.
"""
__version__ = "0.1.0"

import logging as _logging

# bitsandbytes (imported by peft / transformers wherever it is installed) probes, on CPUs with AVX512-BF16, for a CPU
# kernel that the Hugging Face `kernels` package would download from the hub at import time; qerl runs offline and
# never calls that kernel (NF4 runs through bitsandbytes' own ops), so the failed probe's warning would only stand in
# every job's log. Its other warnings stay.
_logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
    lambda record: "from kernels-community" not in record.getMessage())
