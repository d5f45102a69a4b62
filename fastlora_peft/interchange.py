"""Plain-LoRA interchange: FASTLORA adapters are LoRA adapters with another `peft_type`.

The weights file of a FASTLORA adapter has exactly the keys, shapes and dtypes `LoraConfig` gives
for the same model, so only `adapter_config.json` differs. Stock PEFT cannot read a FASTLORA folder
unless `fastlora_peft` is imported first (PEFT raises a bare `KeyError: 'FASTLORA'` looking up the
config class); `to_plain_lora` writes a folder that any LoRA consumer loads, and
`load_plain_lora` loads a plain LoRA folder as a fused FastLora adapter.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Union

from peft import LoraConfig, PeftModel
from torch import nn

from .config import FastLoraConfig

_CONFIG_NAME = "adapter_config.json"
_FASTLORA_ONLY_FIELDS = ("fused_only", "fuse_blocks")


def to_plain_lora(fastlora_dir: Union[str, os.PathLike], lora_dir: Union[str, os.PathLike]) -> None:
    """Copies a saved FASTLORA adapter folder to `lora_dir` as a plain LoRA adapter (`peft_type: "LORA"`).

    Weight files are copied unchanged; the config keeps every LoRA field and drops ours.
    """
    os.makedirs(lora_dir, exist_ok=True)
    for entry in os.listdir(fastlora_dir):
        source = os.path.join(fastlora_dir, entry)
        if entry != _CONFIG_NAME and os.path.isfile(source):
            shutil.copy2(source, os.path.join(lora_dir, entry))
    with open(os.path.join(fastlora_dir, _CONFIG_NAME)) as handle:
        config = json.load(handle)
    if config.get("peft_type") not in ("FASTLORA", "LORA"):
        raise ValueError(
            f"{fastlora_dir} holds a {config.get('peft_type')!r} adapter, not a FASTLORA or LORA one"
        )
    config["peft_type"] = "LORA"
    for name in _FASTLORA_ONLY_FIELDS:
        config.pop(name, None)
    with open(os.path.join(lora_dir, _CONFIG_NAME), "w") as handle:
        json.dump(config, handle, indent=2, sort_keys=True)


def load_plain_lora(
    model: nn.Module,
    lora_dir: Union[str, os.PathLike],
    adapter_name: str = "default",
    is_trainable: bool = False,
    **config_overrides,
) -> PeftModel:
    """Loads a plain LoRA adapter folder as a FastLora adapter.

    `model` is either a base model (returns a new `PeftModel` around it) or a FastLora `PeftModel`
    (the adapter is added under `adapter_name`, and returned model is the same object).
    `config_overrides` set FastLoraConfig fields, e.g. `fused_only=True`.
    """
    lora_config = LoraConfig.from_pretrained(str(lora_dir))
    config = FastLoraConfig.from_lora_config(lora_config, **config_overrides)
    config.inference_mode = not is_trainable
    if isinstance(model, PeftModel):
        model.add_adapter(adapter_name, config)
        model.load_adapter(str(lora_dir), adapter_name, is_trainable=is_trainable)
        if is_trainable:
            model.set_requires_grad(adapter_name)
        return model
    return PeftModel.from_pretrained(
        model, str(lora_dir), adapter_name, is_trainable=is_trainable, config=config
    )
