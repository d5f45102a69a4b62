"""What every FastLora projection layer shares: the fused-or-not predicate, the announced fallback,
and the forward that hands the layer's tensors to `LoraSharedInputFunction`.

A layer class mixes this in *before* PEFT's layer class, so merge, unmerge, disable, adapter
switching and the state-dict keys stay PEFT's, and only `forward` changes.
"""

from __future__ import annotations

import warnings
from collections import Counter
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
from torch import nn

from ..dtypes import DtypePlan, plan_projection_dtypes
from ..functions.frozen_base import FrozenBase, LoraWeights
from ..functions.shared_input import fused_lora_projections


class FusedPathError(RuntimeError):
    """A module could not take the fused path and `FastLoraConfig(fused_only=True)` forbids falling back."""


class FastLoraFallbackWarning(UserWarning):
    """A module runs PEFT's LoRA forward instead of the fused one (the message names the reason)."""


# Reasons already warned about at run time: one warning per reason per process, not one per call.
_WARNED_RUNTIME_REASONS: set[str] = set()
# Above zero while the model is traced or groups are verified at injection: those forwards are ours,
# not the user's, and must not show up as fallbacks.
_SUPPRESS_RECORDS = [0]


@contextmanager
def suppress_fallback_records() -> Iterator[None]:
    _SUPPRESS_RECORDS[0] += 1
    try:
        yield
    finally:
        _SUPPRESS_RECORDS[0] -= 1


def announce_fallback(reason: str, module_count: int, *, fused_only: bool) -> None:
    """The one way a fallback is made known: an error under `fused_only`, else a warning."""
    message = (
        f"fastlora_peft: {module_count} module(s) use PEFT's LoRA forward instead of the fused path: "
        f"{reason}. See model.fastlora_report(); FastLoraConfig(fused_only=True) makes this an error."
    )
    if fused_only:
        raise FusedPathError(message)
    warnings.warn(message, FastLoraFallbackWarning, stacklevel=3)


class FusedProjectionMixin:
    """Forward of a LoRA projection through one fused autograd call.

    Subclasses provide `frozen_base()` (the base weight, bias and quantization state) and
    `base_compute_dtype(x)` with `is_quantized`.
    """

    is_quantized = False
    # Set by FastLoraModel from the config; a class default so a bare layer also behaves.
    fastlora_fused_only = False

    # -- what subclasses provide -------------------------------------------------------------
    def frozen_base(self) -> FrozenBase:
        raise NotImplementedError

    def base_compute_dtype(self, x: torch.Tensor) -> torch.dtype:
        raise NotImplementedError

    # -- the decision -------------------------------------------------------------------------
    def static_blocker(self, adapter_name: str) -> Optional[str]:
        """Why `adapter_name` can never take the fused path on this layer (config-level), or None."""
        variant = self.lora_variant.get(adapter_name)
        if variant is not None:
            name = "use_dora" if type(variant).__name__.startswith("Dora") else type(variant).__name__
            return f"LoRA variant ({name})"
        if self.lora_bias.get(adapter_name, False):
            return "lora_bias=True"
        if self.get_base_layer().weight.requires_grad:
            return "trainable base weight"
        return None

    def fused_blocker(self, forward_kwargs: dict[str, Any]) -> Optional[str]:
        """Why this call cannot take the fused path, or None: the one predicate of this layer."""
        if forward_kwargs.get("adapter_names") is not None:
            return "adapter_names (mixed-adapter batch)"
        active = self.present_active_adapters()
        if len(active) > 1:
            return "several active adapters"
        adapter_name = active[0]
        return self.static_blocker(adapter_name)

    def present_active_adapters(self) -> list[str]:
        return [name for name in self.active_adapters if name in self.lora_A]

    # -- the forward ----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        group = self.__dict__.get("fastlora_group")
        if group is not None and not args:
            out = group.output_for(self, x, kwargs)
            if out is not None:
                return out
        if self.disable_adapters or self.merged or not self.present_active_adapters():
            return super().forward(x, *args, **kwargs)  # the base layer alone, as PEFT runs it
        reason = self.fused_blocker(kwargs)
        if reason is not None:
            # Config-level reasons were announced at injection; run-time ones are announced here.
            already_announced = reason == self.static_blocker(self.present_active_adapters()[0])
            self.record_fallback(reason, announce=not already_announced)
            return super().forward(x, *args, **kwargs)
        self.check_input(x)
        (adapter_name,) = self.present_active_adapters()
        plan = self.dtype_plan(x)
        x_lora = self.dropped_input(adapter_name, x)
        lora = self.lora_weights(adapter_name)
        (out,) = fused_lora_projections(x, [self.frozen_base()], [lora], plan, x_lora)
        return out

    def dropout_active(self, adapter_name: str) -> bool:
        dropout = self.lora_dropout[adapter_name]
        return isinstance(dropout, nn.Dropout) and dropout.p > 0 and dropout.training

    def dropped_input(self, adapter_name: str, x: torch.Tensor) -> Optional[torch.Tensor]:
        """x after this adapter's lora_dropout (PEFT's own module, so the same random stream), or None.

        Like PEFT, the dropped-out copy is made only while dropout is active (training, p > 0).
        """
        if not self.dropout_active(adapter_name):
            return None
        return self.lora_dropout[adapter_name](x)

    def lora_weights(self, adapter_name: str) -> LoraWeights:
        return LoraWeights(
            self.lora_A[adapter_name].weight,
            self.lora_B[adapter_name].weight,
            float(self.scaling[adapter_name]),
        )

    def dtype_plan(self, x: torch.Tensor) -> DtypePlan:
        return plan_projection_dtypes(
            x.dtype, self.base_compute_dtype(x), quantized=self.is_quantized, device_type=x.device.type
        )

    def check_input(self, x: torch.Tensor) -> None:
        in_features = self.in_features
        if x.dim() == 0 or x.shape[-1] != in_features:
            shape = tuple(x.shape)
            raise ValueError(
                f"{type(self).__name__}: expected input of shape [..., {in_features}] "
                f"(in_features={in_features}), got {shape}"
            )
        if not x.is_floating_point():
            raise ValueError(f"{type(self).__name__}: expected a floating-point input, got {x.dtype}")

    # -- reporting ------------------------------------------------------------------------------
    def record_fallback(self, reason: str, announce: bool = True) -> None:
        """Counts a call that ran PEFT's forward (for the report) and announces the reason once."""
        if _SUPPRESS_RECORDS[0]:
            return
        counts = self.__dict__.setdefault("fastlora_fallbacks", Counter())
        counts[reason] += 1
        if announce and (self.fastlora_fused_only or reason not in _WARNED_RUNTIME_REASONS):
            _WARNED_RUNTIME_REASONS.add(reason)
            announce_fallback(reason, 1, fused_only=self.fastlora_fused_only)
