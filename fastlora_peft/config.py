"""`FastLoraConfig`: PEFT's `LoraConfig` with the FASTLORA method type and the fused path's own switches."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields

from peft import LoraConfig


class FastLoraPeftType(str, enum.Enum):
    """The PEFT method type of this package.

    PEFT 0.21 keys its mapping tables by `PeftType` members; a `str` enum of our own hashes and
    compares equal to the plain string "FASTLORA" that `adapter_config.json` stores, so PEFT's
    lookups (`PEFT_TYPE_TO_CONFIG_MAPPING[...]`) find it without patching PEFT's enum.
    """

    FASTLORA = "FASTLORA"


@dataclass
class FastLoraConfig(LoraConfig):
    """Every `LoraConfig` field, with the same defaults, plus the switches of the fused path.

    The adapter weights it produces have the same keys, shapes and dtypes as `LoraConfig`'s.
    """

    fused_only: bool = field(
        default=False,
        metadata={
            "help": (
                "Raise instead of falling back to PEFT's LoRA forward. By default a module that cannot "
                "take the fused path (DoRA, lora_bias, adapter_names batches, "
                "an unsupported module type, ...) runs PEFT's forward, warns once per reason and is "
                "listed in `model.fastlora_report()`; with `fused_only=True` any such module is an error."
            )
        },
    )

    fuse_blocks: bool = field(
        default=True,
        metadata={
            "help": (
                "After injection, find q/k/v projections reading one input and gated MLPs (SwiGLU, "
                "GeGLU) by tracing the model once on its dummy inputs, verify each group against the "
                "parent's own forward, and run each verified group as one fused autograd call. False "
                "keeps one call per projection."
            )
        },
    )

    def __post_init__(self):
        super().__post_init__()
        self.peft_type = FastLoraPeftType.FASTLORA

    @classmethod
    def from_lora_config(cls, lora_config: LoraConfig, **overrides) -> FastLoraConfig:
        """A `FastLoraConfig` with every field of a plain `LoraConfig` copied over (then `overrides`)."""
        values = {f.name: getattr(lora_config, f.name) for f in fields(LoraConfig) if f.init}
        values.pop("peft_type", None)
        values.update(overrides)
        return cls(**values)

    def to_lora_config(self) -> LoraConfig:
        """The plain `LoraConfig` that stock PEFT (and serving stacks that only know LoRA) can load."""
        values = {f.name: getattr(self, f.name) for f in fields(LoraConfig) if f.init}
        values.pop("peft_type", None)
        return LoraConfig(**values)
