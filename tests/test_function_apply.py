"""The fused Functions' C apply (`functions/function_apply.py`): taken in eager calls, and
`Function.apply` (with its wrapper's work) wherever that work does something."""

from __future__ import annotations

import pytest
import torch
from conftest import FUNCTION_LAYOUTS, FUSED_BACKWARD_NODE, MLP_BACKWARD_NODE

from fastlora_peft.dtypes import plan_projection_dtypes
from fastlora_peft.functions import gated_mlp, shared_input
from fastlora_peft.functions.frozen_base import FrozenBase, LoraWeights
from fastlora_peft.functions.function_apply import direct_apply
from fastlora_peft.functions.gated_mlp import LoraGatedMlpFunction, fused_gated_mlp
from fastlora_peft.functions.shared_input import LoraSharedInputFunction, fused_lora_projections

HIDDEN, INTERMEDIATE, RANK = 24, 40, 3


def _pairs(shapes):
    torch.manual_seed(0)
    bases, loras = [], []
    for in_features, out_features in shapes:
        bases.append(FrozenBase(torch.randn(out_features, in_features, dtype=torch.float64), None, None))
        lora_a = torch.randn(RANK, in_features, dtype=torch.float64, requires_grad=True)
        lora_b = torch.randn(out_features, RANK, dtype=torch.float64, requires_grad=True)
        loras.append(LoraWeights(lora_a, lora_b, 0.75))
    return bases, loras


def _qkv(x, bases, loras):
    plan = plan_projection_dtypes(x.dtype, x.dtype, quantized=False, device_type="cpu")
    return torch.stack([out.sum(-1) for out in fused_lora_projections(x, bases, loras, plan)]).sum()


def _mlp(x, bases, loras):
    plan = plan_projection_dtypes(x.dtype, x.dtype, quantized=False, device_type="cpu")
    return fused_gated_mlp(x, bases, loras, plan, "silu").sum()


_MLP_SHAPES = [(HIDDEN, INTERMEDIATE), (HIDDEN, INTERMEDIATE), (INTERMEDIATE, HIDDEN)]
CASES = {
    "qkv": (_qkv, [(HIDDEN, HIDDEN), (HIDDEN, 8), (HIDDEN, 8)], LoraSharedInputFunction, FUSED_BACKWARD_NODE),
    "mlp": (_mlp, _MLP_SHAPES, LoraGatedMlpFunction, MLP_BACKWARD_NODE),
}


@pytest.fixture
def counted_apply(monkeypatch):
    """Counts the calls of each fused Function's `Function.apply` (the Python wrapper)."""
    calls = {}
    for function in (LoraSharedInputFunction, LoraGatedMlpFunction):
        wrapped = function.apply

        def counting(*args, _function=function, _wrapped=wrapped):
            calls[_function] = calls.get(_function, 0) + 1
            return _wrapped(*args)

        monkeypatch.setattr(function, "apply", counting)
    return calls


def _grads(run, x, bases, loras):
    loss = run(x, bases, loras)
    params = [x] + [p for lora in loras for p in (lora.lora_a, lora.lora_b)]
    return loss, torch.autograd.grad(loss, params)


@pytest.mark.parametrize("case", list(CASES))
def test_eager_call_takes_the_c_apply_and_matches_function_apply(case, counted_apply, monkeypatch):
    run, shapes, function, node = CASES[case]
    bases, loras = _pairs(shapes)
    x = torch.randn(2, 5, HIDDEN, dtype=torch.float64, requires_grad=True)
    loss, grads = _grads(run, x, bases, loras)
    assert counted_apply.get(function, 0) == 0  # the wrapper was not reached ...
    output = _single_output(run, x, bases, loras)
    assert type(output.grad_fn).__name__ == node  # ... and the Function still made the output
    # The same call through `Function.apply`: bit for bit the same loss and gradients.
    module = shared_input if function is LoraSharedInputFunction else gated_mlp
    monkeypatch.setattr(module, "_APPLY", function.apply)
    loss_wrapped, grads_wrapped = _grads(run, x, bases, loras)
    assert counted_apply[function] == 1
    assert torch.equal(loss, loss_wrapped)
    for grad, grad_wrapped in zip(grads, grads_wrapped):
        assert torch.equal(grad, grad_wrapped)


def _layout_pairs(shapes, layout):
    """Bases and random adapters of one dtype layout (4-bit bases quantized by bitsandbytes: feature
    sizes are multiples of 64 for its CPU path)."""
    dtype, adapter_dtype, quantized = layout
    torch.manual_seed(0)
    bases, loras = [], []
    for in_features, out_features in shapes:
        weight = torch.randn(out_features, in_features, dtype=dtype) / in_features**0.5
        base = FrozenBase(weight, None, None)
        if quantized:
            import bitsandbytes.functional as bnb_functional

            from fastlora_peft.kernels.dequant4bit import Quant4bitState

            packed, state = bnb_functional.quantize_4bit(
                weight, blocksize=64, compress_statistics=True, quant_type="nf4"
            )
            base = FrozenBase(packed, None, Quant4bitState.from_bnb(state, packed))
        bases.append(base)
        lora_a = torch.randn(RANK, in_features, dtype=adapter_dtype, requires_grad=True)
        lora_b = torch.randn(out_features, RANK, dtype=adapter_dtype, requires_grad=True)
        loras.append(LoraWeights(lora_a, lora_b, 0.75))
    return bases, loras


@pytest.mark.parametrize("layout_id", list(FUNCTION_LAYOUTS))
@pytest.mark.parametrize("case", list(CASES))
def test_every_layout_takes_the_c_apply_with_function_apply_results(
    case, layout_id, counted_apply, monkeypatch
):
    # The choice of apply reads no dtype: in every layout the fused Function runs through the C apply
    # and gives, bit for bit, what it gives through `Function.apply`.
    run, _, function, node = CASES[case]
    shapes = [(64, 64), (64, 64), (64, 128)] if case == "qkv" else [(64, 128), (64, 128), (128, 64)]
    layout = FUNCTION_LAYOUTS[layout_id]
    bases, loras = _layout_pairs(shapes, layout)
    x = torch.randn(2, 5, 64, dtype=layout[0], requires_grad=True)
    loss, grads = _grads(run, x, bases, loras)
    assert counted_apply.get(function, 0) == 0
    assert type(_single_output(run, x, bases, loras).grad_fn).__name__ == node
    module = shared_input if function is LoraSharedInputFunction else gated_mlp
    monkeypatch.setattr(module, "_APPLY", function.apply)
    loss_wrapped, grads_wrapped = _grads(run, x, bases, loras)
    assert counted_apply[function] == 1
    assert torch.equal(loss, loss_wrapped)
    assert all(torch.equal(g, w) for g, w in zip(grads, grads_wrapped))


def _single_output(run, x, bases, loras):
    plan = plan_projection_dtypes(x.dtype, x.dtype, quantized=False, device_type="cpu")
    if run is _qkv:
        return fused_lora_projections(x, bases, loras, plan)[0]
    return fused_gated_mlp(x, bases, loras, plan, "silu")


@pytest.mark.parametrize("case", list(CASES))
def test_functorch_transform_goes_through_function_apply(case, counted_apply):
    # Inside a transform the wrapper's functorch path runs (and asks for setup_context, as before).
    run, shapes, function, _ = CASES[case]
    bases, loras = _pairs(shapes)
    x = torch.randn(2, 5, HIDDEN, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda t: run(t, bases, loras))(x)
    assert counted_apply[function] == 1


@pytest.mark.parametrize("case", list(CASES))
def test_transform_over_the_weights_alone_goes_through_function_apply(case, counted_apply):
    # x is a plain tensor here; only lora_A is wrapped (by the transform, alive while it runs).
    run, shapes, function, _ = CASES[case]
    bases, loras = _pairs(shapes)
    x = torch.randn(2, 5, HIDDEN, dtype=torch.float64)

    def loss_of_first_a(lora_a):
        return run(x, bases, [loras[0]._replace(lora_a=lora_a), *loras[1:]])

    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(loss_of_first_a)(loras[0].lora_a.detach())
    assert counted_apply[function] == 1


def _dead_wrapper_of(x: torch.Tensor) -> torch.Tensor:
    """x's values in a functorch wrapper whose transform has finished (a "dead" wrapper)."""
    kept = []
    torch.func.grad(lambda t: (kept.append(t * 1), t.sum())[1])(x)
    assert torch._C._functorch.is_functorch_wrapped_tensor(kept[0])
    return kept[0]


@pytest.mark.parametrize("case", list(CASES))
def test_dead_functorch_wrapper_goes_through_function_apply(case, counted_apply):
    # A tensor left over from a finished transform: `Function.apply` unwraps it; the C apply would not.
    run, shapes, function, _ = CASES[case]
    bases, loras = _pairs(shapes)
    x = torch.randn(2, 5, HIDDEN, dtype=torch.float64)
    loss = run(_dead_wrapper_of(x), bases, loras)
    assert counted_apply[function] == 1
    assert torch.equal(loss, run(x.clone(), bases, loras))


def test_shared_input_dropout_copy_wrapped_goes_through_function_apply(counted_apply):
    # The second activation (x after dropout) is checked too.
    _, shapes, function, _ = CASES["qkv"]
    bases, loras = _pairs(shapes)
    x = torch.randn(2, 5, HIDDEN, dtype=torch.float64)
    plan = plan_projection_dtypes(x.dtype, x.dtype, quantized=False, device_type="cpu")
    outputs = fused_lora_projections(x, bases, loras, plan, x_lora=_dead_wrapper_of(x))
    assert counted_apply[function] == 1
    expected = fused_lora_projections(x, bases, loras, plan, x_lora=x.clone())
    assert all(torch.equal(a, b) for a, b in zip(outputs, expected))


def test_direct_apply_refuses_a_function_with_setup_context():
    class WithSetup(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return x * 2

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

    with pytest.raises(TypeError, match="setup_context"):
        direct_apply(WithSetup)
