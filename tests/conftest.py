"""Shared helpers of the test suite: tolerance tables, relative errors, dtype layouts, pins.

CI runs everything under TRITON_INTERPRET=1, so CPU tensors go through the Triton kernels; without
it they take the pure-torch references and the "Triton ran" pins skip.
"""

from __future__ import annotations

import os
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
FUSED_BACKWARD_NODE = "LoraSharedInputFunctionBackward"
MLP_BACKWARD_NODE = "LoraGatedMlpFunctionBackward"

requires_interpreter = pytest.mark.skipif(not TRITON_INTERPRET, reason="needs TRITON_INTERPRET=1")
# The sm_90 compile checks (shared memory, what the TTGIR holds) run where CI runs, on the CPU: Triton's
# ptxas needs no GPU. On the GPU machine the kernels themselves run at those launches (a misfit
# raises OutOfResources there), and the four compiles took 101 s of the GPU suite's part 2, which ran
# 524 s of its call's 600 in the forty-sixth session.
compiles_for_sm90_on_cpu = pytest.mark.skipif(
    torch.cuda.is_available(), reason="an sm_90 compile check: CI runs it on the CPU"
)


class OpCounter(TorchDispatchMode):
    """Counts the ops dispatched inside it by name: aten ops bare ("mm"), others with their namespace
    ("fastlora.lora_shrink"); the names in `ignored` are not counted. `order` lists the counted
    names in the order they were dispatched."""

    def __init__(self, ignored: frozenset[str] = frozenset()):
        super().__init__()
        self.ignored = ignored
        self.ops: Counter[str] = Counter()
        self.order: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func.namespace != "aten":
            name = f"{func.namespace}.{name}"
        if name not in self.ignored:
            self.ops[name] += 1
            self.order.append(name)
        return func(*args, **(kwargs or {}))


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected||, in float64; NaN anywhere gives inf (never passes)."""
    actual, expected = actual.double(), expected.double()
    if not torch.isfinite(actual).all() or not torch.isfinite(expected).all():
        return float("inf")
    denominator = expected.norm().item()
    difference = (actual - expected).norm().item()
    return difference / denominator if denominator > 0 else difference


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    error = rel_err(actual, expected)
    assert error <= tol, f"{what}: relative error {error:.3e} > {tol:.1e}"


@dataclass(frozen=True)
class Layout:
    """A dtype layout: the base weights, the adapters, the activations, and how the base is stored."""

    id: str
    base_dtype: torch.dtype  # dense weight dtype, or the 4-bit layer's compute dtype
    adapter_dtype: torch.dtype
    x_dtype: torch.dtype
    quant_type: Optional[str] = None  # "nf4"/"fp4" for bitsandbytes 4-bit bases
    nested: bool = False  # double quantization of the absmax
    autocast: Optional[torch.dtype] = None  # run inside torch.autocast("cpu", dtype)

    @property
    def quantized(self) -> bool:
        return self.quant_type is not None

    @property
    def autocast_adapter_dtype(self) -> bool:
        # PEFT's default (True) keeps fp32 adapters on 16-bit bases; False keeps the base's dtype.
        return self.adapter_dtype == torch.float32


F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16

LAYOUTS = [
    Layout("fp32", F32, F32, F32),
    Layout("bf16", BF16, BF16, BF16),
    Layout("fp16", F16, F16, F16),
    Layout("bf16-fp32adapters", BF16, F32, BF16),
    Layout("fp16-fp32adapters", F16, F32, F16),
    Layout("nf4-bf16adapters", BF16, BF16, BF16, quant_type="nf4", nested=True),
    Layout("nf4-fp32adapters", BF16, F32, BF16, quant_type="nf4", nested=True),
    Layout("fp4-fp16-fp32adapters", F16, F32, F16, quant_type="fp4"),
    Layout("nf4-fp32x", BF16, F32, F32, quant_type="nf4"),  # fp32 activations (upcast norms) on NF4
    Layout("fp32-autocast-bf16", F32, F32, F32, autocast=BF16),
]
LAYOUT_IDS = [layout.id for layout in LAYOUTS]

# The same layouts for tests that call the fused Functions directly (no model): id -> (x and base
# dtype, adapter dtype, 4-bit base). Feature sizes there must be multiples of 64 for the 4-bit ones.
FUNCTION_LAYOUTS = {
    "fp32": (F32, F32, False),
    "bf16": (BF16, BF16, False),
    "fp16": (F16, F16, False),
    "fp32-adapters-on-bf16": (BF16, F32, False),
    "fp32-adapters-on-fp16": (F16, F32, False),
    "nf4-bf16-adapters": (BF16, BF16, True),
    "nf4-fp32-adapters": (BF16, F32, True),
}


@contextmanager
def maybe_autocast(layout: Layout) -> Iterator[None]:
    if layout.autocast is None:
        yield
    else:
        with torch.autocast("cpu", dtype=layout.autocast):
            yield


def randomize_lora(model: nn.Module, seed: int = 0, std: float = 0.2) -> None:
    """Fills every lora_A/lora_B with random values (PEFT's zero lora_B would hide bugs)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                values = torch.randn(param.shape, generator=generator, dtype=torch.float32) * std
                param.copy_(values.to(param.dtype))


def copy_lora(source: nn.Module, target: nn.Module) -> None:
    """Copies every lora_ parameter by name (the two models have the same keys)."""
    target_params = dict(target.named_parameters())
    with torch.no_grad():
        for name, param in source.named_parameters():
            if "lora_" in name:
                target_params[name].copy_(param)


def add_second_adapter(fast: nn.Module, peft: nn.Module, seed: int, **config) -> None:
    """Adapter "second" on both models from one config (`FastLoraConfig` on `fast`, `LoraConfig` on
    `peft`), then every adapter of `fast` re-randomized with `seed` and copied into `peft`."""
    from peft import LoraConfig

    from fastlora_peft import FastLoraConfig

    fast.add_adapter("second", FastLoraConfig(**config))
    peft.add_adapter("second", LoraConfig(**config))
    randomize_lora(fast, seed=seed)
    copy_lora(fast, peft)


@contextmanager
def count_lora_sublayer_calls(model: nn.Module) -> Iterator[dict[str, int]]:
    """Counts forward calls of every PEFT lora_A/lora_B sub-layer: a fused model must show zero."""
    counts: dict[str, int] = {}
    handles = []
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 2)
        if len(leaf) == 3 and leaf[-2] in ("lora_A", "lora_B") and isinstance(module, nn.Linear):

            def hook(_module, _inputs, _output, name=name):
                counts[name] = counts.get(name, 0) + 1

            handles.append(module.register_forward_hook(hook))
    assert handles, "no lora_A/lora_B sub-layers found"
    try:
        yield counts
    finally:
        for handle in handles:
            handle.remove()


def autograd_node_names(*roots: torch.Tensor) -> list[str]:
    """Class names of every node in the autograd graph above `roots`."""
    seen, names = set(), []
    stack = [root.grad_fn for root in roots if root.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


def assert_lora_grads_match(fast: nn.Module, peft: nn.Module, tol: float) -> None:
    """Every adapter gradient of `fast` within `tol` of PEFT's (both None, or zero, where PEFT has none)."""
    peft_params = dict(peft.named_parameters())
    for name, param in fast.named_parameters():
        if "lora_" not in name:
            continue
        expected = peft_params[name].grad
        if expected is None:  # a projection that never reached the loss
            assert param.grad is None or torch.count_nonzero(param.grad) == 0, name
        else:
            assert param.grad is not None, name
            assert rel_err(param.grad, expected) <= tol, f"{name}: {rel_err(param.grad, expected):.2e}"


def lora_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: param.grad
        for name, param in model.named_parameters()
        if "lora_" in name and param.grad is not None
    }


def _kernel_objects() -> dict[str, object]:
    """Every Triton kernel of the package, by name: the `CachedKernel` launchers its modules hold."""
    import importlib
    import pkgutil

    import fastlora_peft.kernels as kernels_package
    from fastlora_peft.kernels._launch import CachedKernel

    found = {}
    for info in pkgutil.iter_modules(kernels_package.__path__):
        module = importlib.import_module(f"{kernels_package.__name__}.{info.name}")
        for name, value in vars(module).items():
            if isinstance(value, CachedKernel):
                found[name] = value
    return found


@contextmanager
def observed_launches(kernels, observe: Callable[[tuple, tuple, dict], None]) -> Iterator[None]:
    """Calls `observe(grid, args, meta)` ahead of every launch of `kernels` (`CachedKernel`s) that
    passes their `launch` (turn launch plans off for the GPU: a planned launch does not). The
    wrappers are instance attributes, put back as found afterwards: monkeypatch would leave the bound
    method behind as one (see `triton_launches`), and they nest over `triton_launches`' own."""
    found = [kernel.__dict__.get("launch") for kernel in kernels]
    for kernel in kernels:

        def observing(grid, args, meta, _launch=kernel.launch):
            observe(grid, args, meta)
            return _launch(grid, args, meta)

        kernel.launch = observing
    try:
        yield
    finally:
        for kernel, launch in zip(kernels, found):
            if launch is None:
                del kernel.launch
            else:
                kernel.launch = launch


@pytest.fixture
def triton_launches(monkeypatch) -> Iterator[dict[str, int]]:
    """Counts launches of each of the package's Triton kernels during a test, by kernel name (on a GPU
    too: every launch passes `CachedKernel.launch` or, from a launcher's plan, `BoundLaunch.__call__`)."""
    from fastlora_peft.kernels._launch import BoundLaunch

    counts: dict[str, int] = {}

    def counting_plan_launch(bound, *args):
        counts[bound.name] = counts.get(bound.name, 0) + 1
        bound.launch(*args)

    monkeypatch.setattr(BoundLaunch, "__call__", counting_plan_launch)
    kernels = _kernel_objects().values()
    for kernel in kernels:
        original_launch = kernel.launch

        def counting_launch(*args, _name=kernel.name, _launch=original_launch, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _launch(*args, **kwargs)

        # An instance attribute, deleted afterwards: monkeypatch would put the bound method back as
        # one, and a later test patching `CachedKernel.launch` on the class would never be reached.
        kernel.launch = counting_launch
    yield counts
    for kernel in kernels:
        del kernel.launch


def tiny_llama_config(**overrides):
    """A Llama config small enough for the interpreter, with odd dense sizes unless overridden."""
    from transformers import LlamaConfig

    values = dict(
        hidden_size=48,
        intermediate_size=88,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=61,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    values.update(overrides)
    return LlamaConfig(**values)


def tiny_llama(dtype: torch.dtype = torch.float32, seed: int = 0, **overrides) -> nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(**overrides)).to(dtype)


def tiny_llama_4bit(tmp_path_factory, layout: Layout, seed: int = 0) -> nn.Module:
    """A tiny Llama saved in the layout's 16-bit dtype and loaded back through BitsAndBytesConfig (QLoRA).

    bitsandbytes' CPU path needs feature sizes that are multiples of 64.
    """
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    directory = tmp_path_factory.mktemp(f"llama-{layout.id}")
    tiny_llama(layout.base_dtype, seed, hidden_size=128, intermediate_size=192).save_pretrained(directory)
    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=layout.quant_type,
        bnb_4bit_compute_dtype=layout.base_dtype,
        bnb_4bit_use_double_quant=layout.nested,
    )
    return LlamaForCausalLM.from_pretrained(
        directory, quantization_config=quantization, dtype=layout.base_dtype, device_map="cpu"
    )


@pytest.fixture(autouse=True)
def _fresh_call_traces():
    """Each test starts with no call trace: a trace recorded by another test would replay that test's
    decisions where this one patched a module function (`fastlora_peft.call_traces`)."""
    from fastlora_peft.call_traces import clear_all_traces

    clear_all_traces()
    yield


@pytest.fixture(autouse=True)
def _fresh_runtime_fallback_warnings():
    """Run-time fallbacks warn once per reason per process; each test starts with none warned yet."""
    from fastlora_peft.layers import fused_projection

    fused_projection._WARNED_RUNTIME_REASONS.clear()
    yield


class LaunchSpy:
    """Stands in for a Triton kernel (monkeypatched over the module's name for it) and records each
    launch's grid before launching it, so a test can tell the kernel ran, and how often."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


@contextmanager
def programs_in_shuffled_order(seed: int) -> Iterator[None]:
    """Under TRITON_INTERPRET=1, every launch inside runs its programs in a seeded random order instead
    of the interpreter's fixed one (the grid's first axis outermost, each program to its end before
    the next starts). Kernels whose last program to count in sums the others' parts (`split_sum`,
    `lora_grad_pass`) then meet other arrival orders: a sum keyed to a program's index rather than to
    its arrival, or counters shared where they should not be, gives wrong sums. Programs still run one
    at a time: races between them remain a GPU matter. The interpreter's loop tells its builder each
    program's index (`set_grid_idx`); this maps the k-th call to the k-th index of a shuffled grid."""
    import itertools
    import random

    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    set_grid_dim, set_grid_idx = builder.set_grid_dim, builder.set_grid_idx
    rng = random.Random(seed)
    state: dict = {}

    def shuffled_dim(nx, ny, nz):
        order = list(itertools.product(range(nx), range(ny), range(nz)))
        rng.shuffle(order)
        state["order"], state["next"] = order, 0
        return set_grid_dim(nx, ny, nz)

    def shuffled_idx(x, y, z):
        index = state["next"]
        state["next"] = index + 1
        return set_grid_idx(*state["order"][index])

    builder.set_grid_dim, builder.set_grid_idx = shuffled_dim, shuffled_idx
    try:
        yield
    finally:
        builder.set_grid_dim, builder.set_grid_idx = set_grid_dim, set_grid_idx
