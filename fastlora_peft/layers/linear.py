"""`FastLoraLinear`: PEFT's `lora.Linear` over a dense `nn.Linear`, with the fused forward."""

from __future__ import annotations

import warnings
from typing import Optional

import torch
from peft.tuners.lora import Linear as PeftLoraLinear
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from ..functions.frozen_base import FrozenBase
from .fused_projection import FusedProjectionMixin, module_attribute

_DENSE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class FastLoraLinear(FusedProjectionMixin, PeftLoraLinear):
    """A LoRA adapter on a dense `nn.Linear` (fp32, bf16 or fp16 weight)."""

    def frozen_base(self) -> FrozenBase:
        base = self.get_base_layer()
        return FrozenBase(module_attribute(base, "weight"), module_attribute(base, "bias"), None)

    def base_compute_dtype(self, x: torch.Tensor) -> torch.dtype:
        return module_attribute(self.get_base_layer(), "weight").dtype

    def __repr__(self) -> str:
        return "fastlora." + super().__repr__()


def is_dense_linear(module: nn.Module) -> bool:
    """A plain `nn.Linear` with a floating weight: not a quantized subclass (bitsandbytes, torchao, ...)."""
    return (
        isinstance(module, nn.Linear)
        and type(module.weight) in (nn.Parameter, torch.Tensor)
        and module.weight.dtype in _DENSE_DTYPES
    )


def dispatch_fastlora_linear(target: nn.Module, adapter_name: str, config, **kwargs) -> Optional[nn.Module]:
    base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
    if not is_dense_linear(base):
        return None
    if config.fan_in_fan_out:  # PEFT corrects this the same way for nn.Linear targets
        warnings.warn(
            "fan_in_fan_out is set to True but the target module is `torch.nn.Linear`; setting it to False.",
            stacklevel=2,
        )
        config.fan_in_fan_out = False
    return FastLoraLinear(target, adapter_name, config=config, **kwargs)
