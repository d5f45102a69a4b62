"""`FastLoraModel`: PEFT's `LoraModel` whose layers are the fused FastLora layers where they can be.

Injection, state-dict keys, merge/unload and adapter management are `LoraModel`'s. This class
changes which layer class each target becomes (dispatchers, first match wins, PEFT's own after
ours) and, after injection, says which modules take the fused path and which do not, and why.
"""

from __future__ import annotations

import sys
import warnings
from collections import Counter
from typing import NamedTuple, Optional

from peft.tuners.lora import LoraModel
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from .blocks import BlockGroup
from .grouping import VERIFICATION_MISMATCH, GroupVerificationWarning, group_blocks, parent_module_name
from .layers.fused_projection import FusedPathError, FusedProjectionMixin, announce_fallback
from .layers.linear import dispatch_fastlora_linear


def dispatch_fastlora_4bit(target: nn.Module, adapter_name: str, config, **kwargs) -> Optional[nn.Module]:
    bnb = sys.modules.get("bitsandbytes")
    if bnb is None:  # no bitsandbytes layer can exist: keep it unimported
        return None
    base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
    if not isinstance(base, bnb.nn.Linear4bit):
        return None
    from .layers.bnb_4bit import dispatch_fastlora_4bit as dispatch

    return dispatch(target, adapter_name, config, **kwargs)


FASTLORA_DISPATCHERS = (dispatch_fastlora_4bit, dispatch_fastlora_linear)


class ModuleRoute(NamedTuple):
    """One adapted module in `fastlora_report()`."""

    name: str  # module path in the model
    layer: str  # class of the LoRA layer
    base: str  # class of the wrapped base layer
    path: str  # "fused" or "peft"
    reasons: tuple[str, ...]  # why not fused (static), then run-time fallbacks seen so far with their counts
    group: str  # the block group it runs in ("shared_input:...", "gated_mlp(silu):..."), or why not, or ""


class FastLoraModel(LoraModel):
    """`LoraModel` with fused layers. Use through `get_peft_model(model, FastLoraConfig(...))`."""

    @staticmethod
    def _create_new_module(lora_config, adapter_name, target, **kwargs):
        # Custom modules and parameter targets are PEFT features with their own layers: leave them to it.
        if not lora_config._custom_modules and kwargs.get("parameter_name") is None:
            for dispatch in FASTLORA_DISPATCHERS:
                new_module = dispatch(target, adapter_name, lora_config, **kwargs)
                if new_module is not None:
                    return new_module
        return LoraModel._create_new_module(lora_config, adapter_name, target, **kwargs)

    def inject_adapter(self, model: nn.Module, adapter_name: str, *args, **kwargs) -> None:
        super().inject_adapter(model, adapter_name, *args, **kwargs)
        self._announce_routes(model, adapter_name)
        config = self.peft_config[adapter_name]
        if getattr(config, "fuse_blocks", False):
            self._group_blocks(model, fused_only=bool(getattr(config, "fused_only", False)))

    def _group_blocks(self, model: nn.Module, fused_only: bool) -> None:
        groups = self.__dict__.setdefault("_fastlora_groups", [])
        not_grouped = self.__dict__.setdefault("_fastlora_not_grouped", {})
        installed, reasons = group_blocks(model, {group.parent for group in groups})
        groups.extend(installed)
        for group in installed:
            not_grouped.pop(group.parent_name, None)
        not_grouped.update(reasons)
        _announce_group_mismatches(reasons, fused_only)

    def fastlora_groups(self) -> list[BlockGroup]:
        """The installed block groups (q/k/v, gated MLPs), each one fused autograd call."""
        return list(self.__dict__.get("_fastlora_groups", []))

    def _remove_groups(self) -> None:
        for group in self.__dict__.pop("_fastlora_groups", []):
            group.uninstall()
        self.__dict__.pop("_fastlora_not_grouped", None)

    def _unload_and_optionally_merge(self, *args, **kwargs):
        self._remove_groups()  # the parents get their own forward back before the layers go
        return super()._unload_and_optionally_merge(*args, **kwargs)

    def _announce_routes(self, model: nn.Module, adapter_name: str) -> None:
        config = self.peft_config[adapter_name]
        fused_only = bool(getattr(config, "fused_only", False))
        reason_counts: Counter[str] = Counter()
        for module in model.modules():
            if not isinstance(module, BaseTunerLayer) or adapter_name not in getattr(module, "lora_A", {}):
                continue
            if isinstance(module, FusedProjectionMixin):
                module.fastlora_fused_only = fused_only
            reason = _static_reason(module, adapter_name)
            if reason is not None:
                reason_counts[reason] += 1
                # The layer will not warn again for this reason at run time; others it will.
                module.__dict__.setdefault("fastlora_announced_reasons", set()).add(reason)
        for reason, count in reason_counts.items():
            announce_fallback(reason, count, fused_only=fused_only)

    def fastlora_report(self) -> list[ModuleRoute]:
        """Every adapted module with the path its active adapter takes and why."""
        routes = []
        group_of = {id(m): _describe_group(g) for g in self.fastlora_groups() for m in g.members}
        not_grouped = self.__dict__.get("_fastlora_not_grouped", {})
        for name, module in self.model.named_modules():
            if not isinstance(module, BaseTunerLayer) or not hasattr(module, "lora_A"):
                continue
            # The active adapters, or (none active) the first one, whose static reasons still apply.
            active = [a for a in module.active_adapters if a in module.lora_A]
            active = active or list(module.lora_A.keys())[:1]
            reasons = [r for r in (_static_reason(module, a) for a in active) if r is not None]
            runtime = module.__dict__.get("fastlora_fallbacks", {})
            reasons += [f"{reason} (run time, {count} call(s))" for reason, count in runtime.items()]
            routes.append(
                ModuleRoute(
                    name=name,
                    layer=type(module).__name__,
                    base=type(module.get_base_layer()).__name__,
                    path="peft" if reasons else "fused",
                    reasons=tuple(reasons),
                    group=group_of.get(id(module), not_grouped.get(parent_module_name(name), "")),
                )
            )
        return routes

    def format_fastlora_report(self) -> str:
        """`fastlora_report()` as a table, one module a line."""
        lines = [f"{'module':50} {'base':10} {'path':6} {'block group':36} why not fused"]
        for route in self.fastlora_report():
            reasons = "; ".join(route.reasons)
            lines.append(f"{route.name:50} {route.base:10} {route.path:6} {route.group:36} {reasons}")
        return "\n".join(lines)


def _announce_group_mismatches(not_grouped: dict[str, str], fused_only: bool) -> None:
    """Every group whose grouped call gave other numbers than its parent's own forward at injection
    (`grouping.VERIFICATION_MISMATCH`): a warning each, or `FusedPathError` under `fused_only`. The
    other reasons a parent is not grouped (a structure the groups do not fit) stay in the report."""
    for parent_name, reason in not_grouped.items():
        if VERIFICATION_MISMATCH not in reason:
            continue
        message = (
            f"fastlora_peft: the fused block group of {parent_name or 'the model'} did not reproduce its "
            f"parent's own forward ({reason}); its members run one by one. This is a fault of the fused "
            "path for this model; model.fastlora_report() lists it."
        )
        if fused_only:
            raise FusedPathError(message)
        warnings.warn(message, GroupVerificationWarning, stacklevel=4)


def _static_reason(module: nn.Module, adapter_name: str) -> Optional[str]:
    if isinstance(module, FusedProjectionMixin):
        return module.static_blocker(adapter_name)
    base_name = type(module.get_base_layer()).__name__
    return f"no fused layer for {base_name} ({type(module).__name__})"


def _describe_group(group: BlockGroup) -> str:
    """The group, and the calls (if any) where its members ran one by one instead, with why."""
    if not group.unfused_calls:
        return group.describe()
    why = "; ".join(f"{reason}: {count} call(s)" for reason, count in group.unfused_calls.items())
    return f"{group.describe()} (members ran one by one: {why})"
