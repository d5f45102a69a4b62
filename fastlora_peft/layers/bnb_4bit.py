"""`FastLoraLinear4bit`: PEFT's `lora.bnb.Linear4bit` over a bitsandbytes `Linear4bit` (NF4 or FP4).

Imported only when bitsandbytes is (see `model.dispatch_fastlora_4bit`). The base weight is
dequantized by our Triton kernel (bit-identical to bitsandbytes') in forward and again in backward.
"""

from __future__ import annotations

from typing import Optional

import bitsandbytes as bnb
import torch
from peft.tuners.lora.bnb import Linear4bit as PeftLoraLinear4bit
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from ..functions.frozen_base import FrozenBase
from ..kernels.dequant4bit import BnbStateReader
from .fused_projection import FusedProjectionMixin


class FastLoraLinear4bit(FusedProjectionMixin, PeftLoraLinear4bit):
    """A LoRA adapter on a bitsandbytes 4-bit layer (any compute dtype, quant storage, nesting)."""

    is_quantized = True

    def frozen_base(self) -> FrozenBase:
        base = self.get_base_layer()
        # bitsandbytes restores a quant state lost by some wrappers (FSDP) from the module; do the same.
        bnb.nn.modules.fix_4bit_weight_quant_state_from_module(base)
        weight = base.weight
        reader = self.__dict__.get("fastlora_state_reader")
        if reader is None:  # one per layer (not an nn.Module attribute: nothing to register or save)
            reader = self.__dict__["fastlora_state_reader"] = BnbStateReader()
        return FrozenBase(weight.data, base.bias, reader(weight))

    def base_compute_dtype(self, x: torch.Tensor) -> torch.dtype:
        base = self.get_base_layer()
        if not base.compute_type_is_set:  # bitsandbytes picks the compute dtype from the first input
            base.set_compute_type(x)
            base.compute_type_is_set = True
        return base.compute_dtype if base.compute_dtype is not None else x.dtype

    def __repr__(self) -> str:
        return "fastlora." + super().__repr__()


def dispatch_fastlora_4bit(target: nn.Module, adapter_name: str, config, **kwargs) -> Optional[nn.Module]:
    base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
    if not isinstance(base, bnb.nn.Linear4bit):
        return None
    fourbit_kwargs = dict(kwargs)
    fourbit_kwargs.update(
        compute_dtype=base.compute_dtype,
        compress_statistics=base.weight.compress_statistics,
        quant_type=base.weight.quant_type,
    )
    return FastLoraLinear4bit(target, adapter_name, config=config, **fourbit_kwargs)
