"""Block groups: q/k/v reading one input, and gated MLPs, each run as one fused autograd call.

Groups are installed by `grouping.group_blocks` after injection. Each takes over its parent
module's `forward` (an instance attribute, removed again by `uninstall`) and falls back to the
parent's own forward, which calls every member layer one by one, whenever a member cannot take
the fused path right now (disabled, merged, another adapter, ...) or lora_dropout is active. That
fallback is still each member's fused single-projection path unless the member itself says why not.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence

import torch
from torch import nn

from .functions.gated_mlp import fused_gated_mlp
from .functions.shared_input import fused_lora_projections


def _group_blocker(
    members: Sequence[nn.Module], x: torch.Tensor, kwargs: dict[str, Any]
) -> tuple[Optional[str], list[str]]:
    """(why the members cannot run as one fused call on `x` now, or None; the active adapters they
    all share when they can)."""
    shared = None
    for member in members:
        if member.disable_adapters or member.merged:
            return "adapters disabled or merged", []
        active = member.present_active_adapters()
        if not active:
            return "a member has no active adapter", []
        if shared is None:
            shared = active
        elif active != shared:
            return "members have different active adapters", []
        if member.fused_blocker(kwargs, active) is not None:
            return "a member cannot take the fused path", []
        for name in active:  # (a loop, not `any` over a generator: this runs per member per call)
            if member.dropout_active(name):  # each member draws its own mask
                return "lora_dropout while training (members run one by one)", []
    if x.shape[-1] != members[0].in_features or not x.is_floating_point():
        return "unexpected input", []
    return None, shared


class BlockGroup:
    """What both group kinds share: the parent, its members, installation, and run-time notes."""

    kind = "group"

    def __init__(self, parent_name: str, parent: nn.Module, members: Sequence[nn.Module], member_names):
        self.parent_name = parent_name
        self.parent = parent
        self.members = list(members)
        self.member_names = list(member_names)
        self.fused_calls = 0
        self.unfused_calls: Counter[str] = Counter()

    def install(self) -> None:
        self.parent.__dict__["forward"] = self
        for member in self.members:
            member.__dict__["fastlora_group"] = self

    def uninstall(self) -> None:
        if self.parent.__dict__.get("forward") is self:
            del self.parent.__dict__["forward"]
        for member in self.members:
            if member.__dict__.get("fastlora_group") is self:
                del member.__dict__["fastlora_group"]

    def count_call(self, unfused_reason: Optional[str] = None) -> None:
        """Counts a fused call, or an unfused one with its reason, for the report.

        Not while torch.compile traces: dynamo would guard on the counter's value and recompile the
        model at every step (measured: a recompile per call of the gated MLP, until the cache limit).
        """
        if torch.compiler.is_compiling():
            return
        if unfused_reason is None:
            self.fused_calls += 1
        else:
            self.unfused_calls[unfused_reason] += 1

    def output_for(
        self, member: nn.Module, x: torch.Tensor, kwargs: dict[str, Any]
    ) -> Optional[torch.Tensor]:
        return None  # only shared-input groups answer their members' calls; others drive the parent

    def original_forward(self, *args, **kwargs):
        return type(self.parent).forward(self.parent, *args, **kwargs)

    def plan(self, x: torch.Tensor):
        """The members' one dtype plan for `x`, or None where they differ. Plans of one x differ only
        by each member's base compute dtype and quantization (`plan_projection_dtypes`), so those
        are compared and one plan is made."""
        first = self.members[0]
        base_dtype = first.base_compute_dtype(x)
        for member in self.members[1:]:
            if member.is_quantized != first.is_quantized or member.base_compute_dtype(x) != base_dtype:
                return None
        return first.dtype_plan(x, base_dtype)

    def describe(self) -> str:
        return f"{self.kind}:{self.parent_name}"


class SharedInputGroup(BlockGroup):
    """Projections of one parent that read the same tensor (q/k/v): one fused call computes them all.

    The parent still calls each member; the first call on a tensor runs the group and keeps the other
    members' outputs until they are asked for with that same tensor (unchanged), or until the parent's
    forward returns. Any other pattern (another tensor, one member only, a second call) stays correct:
    a member without a pending output runs the group again, or its own path.
    """

    kind = "shared_input"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._depth = 0
        self._pending: dict[int, torch.Tensor] = {}
        self._pending_input: Optional[torch.Tensor] = None
        self._pending_version = -1

    def __call__(self, *args, **kwargs):
        with self.scope():
            return self.original_forward(*args, **kwargs)

    @contextmanager
    def scope(self) -> Iterator[None]:
        """While open, member calls are served by the group, as inside the parent's forward.

        The parent's forward opens it; a caller that drives the members itself (a benchmark timing
        q/k/v without the rest of attention) may open it too. Pending outputs end with it.
        """
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:  # nothing outlives the parent's forward
                self._clear()

    def _clear(self) -> None:
        self._pending.clear()
        self._pending_input = None

    def output_for(
        self, member: nn.Module, x: torch.Tensor, kwargs: dict[str, Any]
    ) -> Optional[torch.Tensor]:
        """`member`'s output for `x` from the group's fused call, or None (the member runs itself)."""
        if self._depth == 0:
            return None
        if torch.compiler.is_compiling():
            # Under torch.compile each member runs its own fused projection: handing pending outputs
            # over needs `x._version` (an in-place change of x between member calls must not get a
            # stale output), which dynamo cannot guard on, so every member call broke the graph.
            # Unbroken graphs (and CUDA graphs over them) are worth more than one pass over x.
            return None
        index = self.members.index(member)
        if x is self._pending_input and x._version == self._pending_version and index in self._pending:
            return self._pending.pop(index)
        reason, adapter_names = _group_blocker(self.members, x, kwargs)
        plan = self.plan(x) if reason is None else None
        if plan is None:
            self.count_call(reason or "members' dtype plans differ")
            return None
        outputs = fused_lora_projections(
            x,
            [m.frozen_base() for m in self.members],
            [m.lora_weights(adapter_names) for m in self.members],
            plan,
        )
        self.count_call()
        self._pending = {i: out for i, out in enumerate(outputs) if i != index}
        self._pending_input, self._pending_version = x, x._version
        return outputs[index]


class GatedMlpGroup(BlockGroup):
    """`down(act(gate(x)) * up(x))` with act SiLU (SwiGLU) or tanh-GELU (GeGLU) as one fused call.

    Members: (gate, up, down), or (gate_up, down) where gate and up are the halves of one projection.
    """

    kind = "gated_mlp"

    def __init__(self, parent_name, parent, members, member_names, activation: str):
        super().__init__(parent_name, parent, members, member_names)
        self.activation = activation

    def describe(self) -> str:
        return f"{self.kind}({self.activation}):{self.parent_name}"

    def __call__(self, x: torch.Tensor, *args, **kwargs):
        reason, adapter_names = (
            ("extra arguments", []) if args or kwargs else _group_blocker(self.members, x, {})
        )
        # Hooks on a member may change its call (PEFT passes `adapter_names` batches to each layer
        # through a forward pre-hook), and the members' own calls are what the group replaces.
        if reason is None and any(member._forward_pre_hooks for member in self.members):
            reason = "a member has forward pre-hooks (e.g. an adapter_names batch)"
        # down reads h, of the plan's output dtype, not x: every member planning x alike is enough,
        # as down then plans h alike too by `plan_projection_dtypes`' rules (pinned over every dtype,
        # base and autocast in tests/test_block_groups.py), without a probe tensor of h's dtype.
        plan = self.plan(x) if reason is None else None
        if plan is None:
            self.count_call(reason or "members' dtype plans differ")
            return self.original_forward(x, *args, **kwargs)
        self.count_call()
        return fused_gated_mlp(
            x,
            [m.frozen_base() for m in self.members],
            [m.lora_weights(adapter_names) for m in self.members],
            plan,
            self.activation,
        )
