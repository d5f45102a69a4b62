"""Makes PEFT know the FASTLORA method: its config class, model class and state-dict prefix.

`register_peft_method` of PEFT 0.21 accepts only members of PEFT's own `PeftType` enum, so the
mapping tables are filled directly with our `str` enum member (PEFT looks them up by the string
read from `adapter_config.json`, which our member equals). The prefix is LoRA's `lora_`, which
keeps every state-dict key identical to a plain LoRA adapter's.
"""

from __future__ import annotations

from .config import FastLoraConfig, FastLoraPeftType
from .model import FastLoraModel


def register_fastlora() -> None:
    """Idempotent: importing `fastlora_peft` calls it once; calling it again changes nothing."""
    from peft import mapping

    peft_type = FastLoraPeftType.FASTLORA
    mapping.PEFT_TYPE_TO_CONFIG_MAPPING[peft_type] = FastLoraConfig
    mapping.PEFT_TYPE_TO_TUNER_MAPPING[peft_type] = FastLoraModel
    mapping.PEFT_TYPE_TO_PREFIX_MAPPING[peft_type] = FastLoraModel.prefix
