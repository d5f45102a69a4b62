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


_MISSING = object()  # no default given
_ABSENT = object()  # the default get_base_layer asks for: no such attribute
# Whether a module class has an attribute of its own (a property, say), by class and name: looked up
# once, since `hasattr` on a class without it raises and catches an AttributeError each time.
_CLASS_ATTRIBUTES: dict[tuple[type, str], bool] = {}


def module_attribute(module: nn.Module, name: str, default: Any = _MISSING) -> Any:
    """`getattr(module, name[, default])` for an `nn.Module`, cheaper on the hot path.

    `nn.Module.__getattr__` costs a Python call for every parameter or submodule it finds, and
    raises a formatted AttributeError for a missing name (about 2 us each on the CPU machine). The
    order is Python's: the class's own attribute (a property, which may raise) first, then the
    instance's, then the module's parameters, buffers and submodules. Missing without a default:
    `getattr` itself raises, with torch's message.
    """
    key = (type(module), name)
    has_class_attribute = _CLASS_ATTRIBUTES.get(key)
    if has_class_attribute is None:
        has_class_attribute = _CLASS_ATTRIBUTES[key] = hasattr(type(module), name)
    if has_class_attribute:
        return getattr(module, name) if default is _MISSING else getattr(module, name, default)
    namespace = module.__dict__
    if name in namespace:
        return namespace[name]
    for store in ("_parameters", "_buffers", "_modules"):
        values = namespace.get(store)
        if values is not None and name in values:
            return values[name]
    return getattr(module, name) if default is _MISSING else default


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

    def get_base_layer(self) -> nn.Module:
        """PEFT's `get_base_layer` (follow `base_layer` down to the wrapped layer), without its cost.

        PEFT's loop ends on `hasattr(layer, "base_layer")` failing, which goes through
        `nn.Module.__getattr__` and raises an AttributeError: about 4 us per call on the GPU
        machine's host, and a fused forward (a group: each member) asks for the base layer several
        times. `module_attribute` finds what `getattr` would, without raising.
        """
        child = self._modules.get("base_layer")
        known = self.__dict__.get("fastlora_base_layer")
        if known is not None and known is child and "base_layer" not in child._modules:
            return child
        layer = self
        while (next_layer := module_attribute(layer, "base_layer", _ABSENT)) is not _ABSENT:
            layer = next_layer
        if layer is child:
            # A chain of one level (PEFT's own), remembered. The check above answers anew when the
            # wrapped layer is replaced (by a module of any class: the walk runs for it) or wraps
            # another in turn (PEFT registers `base_layer` as a submodule). A q/k/v group asks each
            # member three times per call (checks, compute dtype, frozen base): 9 walks of 2 lookups.
            self.__dict__["fastlora_base_layer"] = child
        return layer

    # -- the decision -------------------------------------------------------------------------
    def static_blocker(self, adapter_name: str) -> Optional[str]:
        """Why `adapter_name` can never take the fused path on this layer (config-level), or None."""
        variant = self.lora_variant.get(adapter_name)
        if variant is not None:
            name = "use_dora" if type(variant).__name__.startswith("Dora") else type(variant).__name__
            return f"LoRA variant ({name})"
        if self.lora_bias.get(adapter_name, False):
            return "lora_bias=True"
        if module_attribute(self.get_base_layer(), "weight").requires_grad:
            return "trainable base weight"
        return None

    def fused_blocker(
        self, forward_kwargs: dict[str, Any], active: Optional[list[str]] = None
    ) -> Optional[str]:
        """Why this call cannot take the fused path, or None: the one predicate of this layer.

        active: `present_active_adapters()` when the caller has it already.
        """
        if forward_kwargs.get("adapter_names") is not None:
            return "adapter_names (mixed-adapter batch)"
        active = self.present_active_adapters() if active is None else active
        for adapter_name in active:
            reason = self.static_blocker(adapter_name)
            if reason is not None:
                return reason
        if len(active) == 1:
            return None
        if any(self.dropout_active(name) for name in active):
            return "several active adapters with lora_dropout while training"
        if len({self.lora_A[name].weight.dtype for name in active}) > 1:
            return "several active adapters of different dtypes"
        return None

    def present_active_adapters(self) -> list[str]:
        # lora_A's own module dict: `self.lora_A` and `in` on the ModuleDict are each a Python call
        # (1.2 against 0.4 us for this method on the CPU machine; a group asks each member per call).
        lora_a = self._modules["lora_A"]._modules
        return [name for name in self.active_adapters if name in lora_a]

    # -- the forward ----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        group = self.__dict__.get("fastlora_group")
        if group is not None and not args:
            out = group.output_for(self, x, kwargs)
            if out is not None:
                return out
        active = self.present_active_adapters()
        if self.disable_adapters or self.merged or not active:
            return super().forward(x, *args, **kwargs)  # the base layer alone, as PEFT runs it
        reason = self.fused_blocker(kwargs, active)
        if reason is not None:
            # Reasons announced at injection are only counted here; any other (a run-time one, or a
            # config-level one that arose later, e.g. a base weight unfrozen after injection) is announced.
            already_announced = reason in self.__dict__.get("fastlora_announced_reasons", ())
            self.record_fallback(reason, announce=not already_announced)
            return super().forward(x, *args, **kwargs)
        self.check_input(x)
        plan = self.dtype_plan(x)
        x_lora = self.dropped_input(active[0], x) if len(active) == 1 else None
        (out,) = fused_lora_projections(x, [self.frozen_base()], [self.lora_weights(active)], plan, x_lora)
        return out

    def dropout_active(self, adapter_name: str) -> bool:
        dropout = self._modules["lora_dropout"]._modules[adapter_name]
        return isinstance(dropout, nn.Dropout) and dropout.p > 0 and dropout.training

    def dropped_input(self, adapter_name: str, x: torch.Tensor) -> Optional[torch.Tensor]:
        """x after this adapter's lora_dropout (PEFT's own module, so the same random stream), or None.

        Like PEFT, the dropped-out copy is made only while dropout is active (training, p > 0).
        """
        if not self.dropout_active(adapter_name):
            return None
        return self.lora_dropout[adapter_name](x)

    def lora_weights(self, adapter_names: list[str]) -> LoraWeights:
        """The active adapters as one LoRA term. Several adapters sum: their A rows and their scaled B
        columns side by side (a rank-(r1 + r2 + ...) adapter), built by autograd ops outside the fused
        Function, so each adapter's gradient flows back through torch.cat and the scale."""
        if len(adapter_names) == 1:
            (name,) = adapter_names
            modules = self._modules  # and each ModuleDict's own `_modules`: `ModuleDict[name]` is a call
            lora_a = module_attribute(modules["lora_A"]._modules[name], "weight")
            lora_b = module_attribute(modules["lora_B"]._modules[name], "weight")
            return LoraWeights(lora_a, lora_b, float(self.scaling[name]))
        lora_a = torch.cat([self.lora_A[name].weight for name in adapter_names], dim=0)
        lora_b = torch.cat([self.lora_B[name].weight * self.scaling[name] for name in adapter_names], dim=1)
        return LoraWeights(lora_a, lora_b, 1.0)

    def dtype_plan(self, x: torch.Tensor, base_dtype: Optional[torch.dtype] = None) -> DtypePlan:
        """base_dtype: `base_compute_dtype(x)`, when the caller has it already."""
        base_dtype = self.base_compute_dtype(x) if base_dtype is None else base_dtype
        return plan_projection_dtypes(
            x.dtype, base_dtype, quantized=self.is_quantized, device_type=x.device.type
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
