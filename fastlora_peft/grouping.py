"""Finds the blocks to fuse by structure, not by model class, and verifies each before using it.

1. Trace: one forward of the model's dummy inputs (no grad, eval mode) records, for every parent of
   two or more FastLora layers, what it was called with and returned, and for every FastLora layer
   its input and output tensors.
2. Detect: members of one parent that received the very same input tensor form a shared-input group
   (q/k/v, any widths, biases, ranks). A parent with exactly gate, up (same input) and down, where
   down's input equals act(gate) * up for act SiLU or tanh-GELU and the parent returns down's
   output, is a gated MLP.
3. Verify: with each member's lora_B temporarily randomized (zero-initialized B would hide adapter
   wiring), the parent's own forward and the grouped one run on the recorded inputs and must agree;
   otherwise the group is not installed and the report says why. A grouped call that ran and gave
   other numbers is a fault of the fused path, not a structure it does not fit: the model announces
   it (`GroupVerificationWarning`; `FusedPathError` under `fused_only`), where it would otherwise
   only have slowed down (a mutated gated kernel passed the parity, PEFT-integration and block-group
   tests that way).
"""

from __future__ import annotations

import inspect
import math
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .blocks import BlockGroup, GatedMlpGroup, SharedInputGroup
from .layers.fused_projection import FusedProjectionMixin, suppress_fallback_records

# The start of `_verify`'s reason when the grouped call ran and its numbers differed.
VERIFICATION_MISMATCH = "verification mismatch"


class GroupVerificationWarning(UserWarning):
    """A block group's fused call did not reproduce its parent's own forward at injection, so it was not
    installed: its members run one by one (each still fused where it can), slower, with correct
    numbers. This points at a fault in fastlora_peft's grouped path for this model."""


_ACTIVATIONS = {
    "silu": F.silu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
}


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 3e-2


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    if actual.shape != expected.shape:
        return math.inf
    actual, expected = actual.double(), expected.double()
    if not (torch.isfinite(actual).all() and torch.isfinite(expected).all()):
        return math.inf
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def _first_tensor(value: Any) -> Optional[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return getattr(value, "last_hidden_state", None)


class _Trace:
    def __init__(self):
        self.layer_io: dict[nn.Module, tuple[torch.Tensor, torch.Tensor]] = {}
        self.layer_calls: dict[nn.Module, int] = {}
        self.parent_calls: dict[nn.Module, tuple[tuple, dict, Any]] = {}


@contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    modes = {module: module.training for module in model.modules()}
    model.eval()
    try:
        yield
    finally:
        for module, training in modes.items():
            module.training = training


def _trace(model: nn.Module, parents: dict[str, nn.Module], layers: list[nn.Module], inputs: dict) -> _Trace:
    trace = _Trace()
    handles = []

    def layer_hook(module, args, output):
        trace.layer_calls[module] = trace.layer_calls.get(module, 0) + 1
        trace.layer_io.setdefault(module, (args[0], output))

    def parent_pre_hook(module, args, kwargs):
        trace.parent_calls.setdefault(module, (args, kwargs, None))

    def parent_hook(module, args, kwargs, output):
        recorded_args, recorded_kwargs, recorded_output = trace.parent_calls[module]
        if recorded_output is None:
            trace.parent_calls[module] = (recorded_args, recorded_kwargs, output)

    for layer in layers:
        handles.append(layer.register_forward_hook(layer_hook))
    for parent in parents.values():
        handles.append(parent.register_forward_pre_hook(parent_pre_hook, with_kwargs=True))
        handles.append(parent.register_forward_hook(parent_hook, with_kwargs=True))
    try:
        with torch.no_grad(), suppress_fallback_records():
            model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    return trace


def _gating_error(activation: str, gate_out, up_out, down_in) -> float:
    """How far down's traced input is from act(gate) * up (relative, in float64)."""
    return _rel_err(down_in, _ACTIVATIONS[activation](gate_out.double()) * up_out.double())


def _candidate_activation(parent: nn.Module, gate_out, up_out, down_in) -> Optional[str]:
    """The parent's activation, identified exactly by probing its `act_fn` where it has one (None if
    that is neither SiLU nor tanh-GELU), else the one that best explains the traced data."""
    act_fn = getattr(parent, "act_fn", None) or getattr(parent, "activation_fn", None)
    if callable(act_fn):
        probe = torch.linspace(-8, 8, 257, dtype=torch.float64)
        try:
            applied = act_fn(probe)
        except Exception:  # an activation that cannot run on a probe: judge by the data alone
            applied = None
        if applied is not None:
            matches = [name for name, fn in _ACTIVATIONS.items() if _rel_err(applied, fn(probe)) < 1e-7]
            return matches[0] if matches else None
    return min(_ACTIVATIONS, key=lambda name: _gating_error(name, gate_out, up_out, down_in))


def _detect_mlp(parent_name, parent, members: dict[str, nn.Module], trace: _Trace) -> Optional[GatedMlpGroup]:
    """Three members: two read one tensor (gate, up), the third (down) reads act(gate) * up, and the
    parent returns down's output. Or two: gate_up, whose output halves are gate and up, and down."""
    if len(members) == 2:
        return _detect_split_mlp(parent_name, parent, members, trace)
    if len(members) != 3:
        return None
    _, _, parent_output = trace.parent_calls[parent]
    for down_name, down in members.items():
        (first_name, first), (second_name, second) = [(n, m) for n, m in members.items() if n != down_name]
        first_in, first_out = trace.layer_io[first]
        second_in, second_out = trace.layer_io[second]
        down_in, down_out = trace.layer_io[down]
        if first_in is not second_in or _first_tensor(parent_output) is not down_out:
            continue
        if not first_out.shape == second_out.shape == down_in.shape:
            continue
        for (gate_name, gate, gate_out), (up_name, up, up_out) in (
            ((first_name, first, first_out), (second_name, second, second_out)),
            ((second_name, second, second_out), (first_name, first, first_out)),
        ):
            activation = _candidate_activation(parent, gate_out, up_out, down_in)
            if activation and _gating_error(activation, gate_out, up_out, down_in) < _tolerance(
                down_in.dtype
            ):
                members_in_order = [gate, up, down]
                return GatedMlpGroup(
                    parent_name, parent, members_in_order, [gate_name, up_name, down_name], activation
                )
    return None


def _detect_split_mlp(parent_name, parent, members: dict[str, nn.Module], trace: _Trace):
    _, _, parent_output = trace.parent_calls[parent]
    for down_name, down in members.items():
        ((gate_up_name, gate_up),) = [(n, m) for n, m in members.items() if n != down_name]
        gate_up_out = trace.layer_io[gate_up][1]
        down_in, down_out = trace.layer_io[down]
        if _first_tensor(parent_output) is not down_out or gate_up_out.shape[-1] != 2 * down_in.shape[-1]:
            continue
        gate_out, up_out = gate_up_out.chunk(2, dim=-1)
        if gate_out.shape != down_in.shape:
            continue
        activation = _candidate_activation(parent, gate_out, up_out, down_in)
        if activation and _gating_error(activation, gate_out, up_out, down_in) < _tolerance(down_in.dtype):
            return GatedMlpGroup(parent_name, parent, [gate_up, down], [gate_up_name, down_name], activation)
    return None


def _shared_input_groups(
    parent_name, parent, members: dict[str, nn.Module], trace: _Trace
) -> list[SharedInputGroup]:
    by_input: dict[int, list[str]] = {}
    for name, member in members.items():
        by_input.setdefault(id(trace.layer_io[member][0]), []).append(name)
    # One group per parent (it takes over the parent's forward): the largest set sharing an input.
    names = max(by_input.values(), key=len, default=[])
    if len(names) < 2:
        return []
    return [SharedInputGroup(parent_name, parent, [members[n] for n in names], names)]


@contextmanager
def _random_lora_b(members: list[nn.Module], seed: int = 0) -> Iterator[None]:
    """Temporarily gives every active lora_B random values; restores them exactly afterwards."""
    generator = torch.Generator().manual_seed(seed)
    saved = []
    with torch.no_grad():
        for member in members:
            for adapter in member.present_active_adapters():
                weight = member.lora_B[adapter].weight
                saved.append((weight, weight.detach().clone()))
                noise = torch.randn(weight.shape, generator=generator, dtype=torch.float32) * 0.1
                weight.copy_(noise.to(device=weight.device, dtype=weight.dtype))
    try:
        yield
    finally:
        with torch.no_grad():
            for weight, value in saved:
                weight.copy_(value)


def _output_tensors(value: Any) -> list[torch.Tensor]:
    """Every floating tensor in a module's output (tensors, tuples, lists, dicts, model outputs)."""
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _output_tensors(item)]
    return []


def _verify(group: BlockGroup, trace: _Trace) -> Optional[str]:
    """Installs `group` if its output matches the parent's own forward; returns why not otherwise."""
    args, kwargs, _ = trace.parent_calls[group.parent]
    with torch.no_grad(), _random_lora_b(group.members), suppress_fallback_records():
        try:  # a parent that cannot be replayed, grouped or not, is reported, not raised
            expected = _output_tensors(group.original_forward(*args, **kwargs))
        except Exception as error:
            return f"the parent's forward could not be replayed: {type(error).__name__}: {error}"
        group.install()
        try:
            actual = _output_tensors(group.parent(*args, **kwargs))
        except Exception as error:
            group.uninstall()
            return f"grouped forward failed: {type(error).__name__}: {error}"
    if group.fused_calls == 0:
        group.uninstall()
        reasons = ", ".join(group.unfused_calls) or "the parent never used the grouped path"
        return f"group did not engage ({reasons})"
    shapes_match = [a.shape for a in actual] == [e.shape for e in expected]
    error = (
        max((_rel_err(a, e) for a, e in zip(actual, expected)), default=math.inf)
        if shapes_match
        else math.inf
    )
    if not expected or error > _tolerance(expected[0].dtype):
        group.uninstall()
        return f"{VERIFICATION_MISMATCH}: relative error {error:.2e}"
    group.fused_calls = 0
    group.unfused_calls.clear()
    return None


def parent_module_name(name: str) -> str:
    """The name of the module holding module `name` ("" for one right under the model's root)."""
    return name.rpartition(".")[0]


def group_blocks(
    model: nn.Module, already_grouped: set[nn.Module]
) -> tuple[list[BlockGroup], dict[str, str]]:
    """Finds, verifies and installs groups in `model`. Returns (installed groups, {parent: why not})."""
    layers = {name: m for name, m in model.named_modules() if isinstance(m, FusedProjectionMixin)}
    parents: dict[str, nn.Module] = {}
    for name in layers:
        parent_name = parent_module_name(name)
        parent = model.get_submodule(parent_name)
        if (
            parent not in already_grouped
            and sum(1 for n in layers if parent_module_name(n) == parent_name) >= 2
        ):
            parents[parent_name] = parent
    if not parents:
        return [], {}
    inputs = getattr(model, "dummy_inputs", None)
    if not isinstance(inputs, dict):
        return [], {name: "no dummy inputs to trace the model with" for name in parents}
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    device = embeddings.weight.device if embeddings is not None else next(model.parameters()).device
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    if "use_cache" in inspect.signature(model.forward).parameters or hasattr(
        getattr(model, "config", None), "use_cache"
    ):
        inputs["use_cache"] = False  # a cache filled by the trace would change what a replay sees
    with _eval_mode(model):
        try:
            trace = _trace(model, parents, list(layers.values()), inputs)
        except Exception as error:
            return [], {
                name: f"could not trace the model: {type(error).__name__}: {error}" for name in parents
            }
        installed, not_grouped = [], {}
        for parent_name, parent in parents.items():
            if parent not in trace.parent_calls or trace.parent_calls[parent][2] is None:
                not_grouped[parent_name] = "not called by the traced forward"
                continue
            members = {
                name.rpartition(".")[2]: layer
                for name, layer in layers.items()
                if parent_module_name(name) == parent_name and trace.layer_calls.get(layer) == 1
            }
            mlp = _detect_mlp(parent_name, parent, members, trace)
            candidates = (
                [mlp] if mlp is not None else _shared_input_groups(parent_name, parent, members, trace)
            )
            if not candidates:
                not_grouped[parent_name] = "no members share an input and no gated-MLP structure"
            for group in candidates:
                reason = _verify(group, trace)
                if reason is None:
                    installed.append(group)
                else:
                    not_grouped[parent_name] = f"{group.describe()}: {reason}"
    return installed, not_grouped
