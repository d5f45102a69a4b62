"""The autograd Functions gradchecked in float64 (float64 runs the kernels' references in float64),
with biases, unequal ranks and scales, and every subset of inputs requiring grad."""

from __future__ import annotations

import pytest
import torch

from fastlora_peft.dtypes import DtypePlan
from fastlora_peft.functions.frozen_base import FrozenBase, LoraWeights
from fastlora_peft.functions.gated_mlp import GatedMlpSettings, fused_gated_mlp
from fastlora_peft.functions.shared_input import fused_lora_projections

F64 = torch.float64
PLAN = DtypePlan(F64, F64)


def random_projection(in_features, out_features, rank, scale, bias, generator, trainable_bias=False):
    def tensor(*shape, grad=False):
        return torch.randn(*shape, generator=generator, dtype=F64).requires_grad_(grad)

    bias_tensor = tensor(out_features, grad=trainable_bias) if bias else None
    base = FrozenBase(tensor(out_features, in_features), bias_tensor, None)
    lora = LoraWeights(tensor(rank, in_features, grad=True), tensor(out_features, rank, grad=True), scale)
    return base, lora


@pytest.mark.parametrize("dropped_input", [False, True], ids=["x", "x-and-dropped-x"])
@pytest.mark.parametrize("projections", [1, 3], ids=["single", "qkv"])
def test_shared_input_function_gradcheck(projections, dropped_input):
    generator = torch.Generator().manual_seed(0)
    shapes = [(7, 3, 0.5, True), (5, 2, 2.0, False), (4, 6, 1.25, True)][:projections]
    pairs = [
        random_projection(9, out, rank, scale, bias, generator, trainable_bias=bias)
        for out, rank, scale, bias in shapes
    ]
    bases, loras = [p[0] for p in pairs], [p[1] for p in pairs]
    x = torch.randn(2, 5, 9, generator=generator, dtype=F64, requires_grad=True)
    # The LoRA terms may read another tensor than the base (x after lora_dropout).
    x_lora = (
        torch.randn(2, 5, 9, generator=generator, dtype=F64, requires_grad=True) if dropped_input else None
    )
    inputs = [x] + [t for lora in loras for t in (lora.lora_a, lora.lora_b)]
    inputs += [base.bias for base in bases if base.bias is not None]
    inputs += [x_lora] if dropped_input else []

    def function(x, *tensors):
        it = iter(tensors)
        new_loras = [LoraWeights(next(it), next(it), lora.scale) for lora in loras]
        new_bases = [FrozenBase(b.weight, next(it) if b.bias is not None else None, None) for b in bases]
        return fused_lora_projections(x, new_bases, new_loras, PLAN, next(it, None))

    assert torch.autograd.gradcheck(function, inputs)


def test_shared_input_function_honours_needs_input_grad():
    generator = torch.Generator().manual_seed(1)
    base, lora = random_projection(6, 4, 2, 1.0, True, generator)
    lora = LoraWeights(lora.lora_a.detach(), lora.lora_b, lora.scale)  # only B trains
    x = torch.randn(3, 6, generator=generator, dtype=F64)  # no dX wanted
    (out,) = fused_lora_projections(x, [base], [lora], PLAN)
    out.sum().backward()
    assert lora.lora_b.grad is not None and lora.lora_a.grad is None and x.grad is None


@pytest.fixture
def keep_saved_preactivations(monkeypatch):
    """gradcheck runs backward many times through one graph: keep the saved gate/up intact."""
    monkeypatch.setattr(GatedMlpSettings, "overwrite_saved_preactivations", False)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_mlp_function_gradcheck(activation, keep_saved_preactivations):
    generator = torch.Generator().manual_seed(2)
    gate = random_projection(8, 11, 3, 0.5, False, generator)
    up = random_projection(8, 11, 2, 1.5, True, generator)
    down = random_projection(11, 8, 4, 0.75, False, generator)
    bases, loras = [gate[0], up[0], down[0]], [gate[1], up[1], down[1]]
    x = torch.randn(2, 3, 8, generator=generator, dtype=F64, requires_grad=True)
    inputs = [x] + [t for lora in loras for t in (lora.lora_a, lora.lora_b)]

    def function(x, *tensors):
        it = iter(tensors)
        new_loras = [LoraWeights(next(it), next(it), lora.scale) for lora in loras]
        return fused_gated_mlp(x, bases, new_loras, PLAN, activation)

    assert torch.autograd.gradcheck(function, inputs)


def test_gated_mlp_second_backward_needs_the_switch():
    generator = torch.Generator().manual_seed(3)
    projections = [random_projection(8, 11, 2, 1.0, False, generator) for _ in range(2)]
    projections.append(random_projection(11, 8, 2, 1.0, False, generator))
    bases, loras = [p[0] for p in projections], [p[1] for p in projections]
    x = torch.randn(5, 8, generator=generator, dtype=F64, requires_grad=True)
    out = fused_gated_mlp(x, bases, loras, PLAN, "silu")
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="overwrite_saved_preactivations"):
        out.sum().backward()
