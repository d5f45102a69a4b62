"""fastlora_peft: LoRA and QLoRA for PEFT with fused forward and backward.

import fastlora_peft                      # registers the FASTLORA method with PEFT
model = get_peft_model(model, fastlora_peft.FastLoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
"""

from .config import FastLoraConfig, FastLoraPeftType
from .grouping import GroupVerificationWarning
from .interchange import load_plain_lora, to_plain_lora
from .layers.fused_projection import FastLoraFallbackWarning, FusedPathError
from .model import FastLoraModel, ModuleRoute
from .registration import register_fastlora

register_fastlora()

__version__ = "0.1.0"

__all__ = [
    "FastLoraConfig",
    "FastLoraFallbackWarning",
    "FastLoraModel",
    "FastLoraPeftType",
    "FusedPathError",
    "GroupVerificationWarning",
    "ModuleRoute",
    "load_plain_lora",
    "register_fastlora",
    "to_plain_lora",
]
