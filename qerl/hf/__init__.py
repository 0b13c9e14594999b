"""qerl in the Hugging Face stack (extra ``qerl[hf]``): NVFP4 through ``from_pretrained``, LoRA through PEFT on it,
and TRL's ``GRPOTrainer`` rolling out on qerl's engine.

    from transformers import AutoModelForCausalLM
    from peft import LoraConfig, get_peft_model
    from qerl.hf import QerlNVFP4Config, rollout_func, AQNCallback

    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=QerlNVFP4Config())
    model = get_peft_model(model, LoraConfig(r=32, lora_alpha=32, target_modules="all-linear"))
    trainer = GRPOTrainer(model=model, ..., rollout_func=rollout_func(), callbacks=[AQNCallback()])

Importing this package registers the quantization method ``qerl_nvfp4`` with transformers
(:mod:`qerl.hf.quantizer`) and the NVFP4 LoRA layer with PEFT (:mod:`qerl.hf.peft_integration`).
"""
from qerl.hf.peft_integration import register as _register_peft
from qerl.hf.quantizer import QerlNVFP4Config, QerlNVFP4HfQuantizer
from qerl.hf.trl import AQNCallback, rollout_func

_register_peft()

__all__ = ["AQNCallback", "QerlNVFP4Config", "QerlNVFP4HfQuantizer", "rollout_func"]
