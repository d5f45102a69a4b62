"""One adapted projection, every dtype layout: PEFT parity, float64 error bound, and the fused-path pins.

The inputs are exact in their dtype and the float64 reference uses the very weights the layer sees
(16-bit-rounded, or dequantized by bitsandbytes), so the errors measure the arithmetic alone: PEFT's
fp32 adapter path gets dA/dB to ~1e-7 here, and a path that rounded them to 16 bits would show ~1e-3.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import (
    FUSED_BACKWARD_NODE,
    LAYOUT_IDS,
    LAYOUTS,
    TRITON_INTERPRET,
    Layout,
    copy_lora,
    count_lora_sublayer_calls,
    maybe_autocast,
    randomize_lora,
    rel_err,
)
from peft import LoraConfig, get_peft_model
from torch import nn

from fastlora_peft import FastLoraConfig

RANK, ALPHA = 5, 7
# Added to "2x PEFT's error" so fp32-exact results do not fail on rounding-order noise; far below
# the ~1e-3 a 16-bit rounding of fp32 adapter gradients would cause.
ERROR_FLOOR = 2e-6
# The rule for the all-fp32 layout: fused and PEFT agree to 1e-4 relative.
FP32_PARITY = 1e-4


class OneProjection(nn.Module):
    def __init__(self, proj: nn.Module):
        super().__init__()
        self.proj = proj

    def forward(self, x):
        return self.proj(x)


def make_projection(
    layout: Layout, in_features: int, out_features: int, bias: bool, seed: int = 0
) -> nn.Module:
    torch.manual_seed(seed)
    dense = nn.Linear(in_features, out_features, bias=bias)
    if not layout.quantized:
        return OneProjection(dense.to(layout.base_dtype)).requires_grad_(False)
    import bitsandbytes as bnb

    layer = bnb.nn.Linear4bit(
        in_features,
        out_features,
        bias=bias,
        compute_dtype=layout.base_dtype,
        compress_statistics=layout.nested,
        quant_type=layout.quant_type,
    )
    layer.weight = bnb.nn.Params4bit(
        dense.weight.data.to(layout.base_dtype),
        requires_grad=False,
        quant_type=layout.quant_type,
        compress_statistics=layout.nested,
    )
    if bias:
        layer.bias = nn.Parameter(dense.bias.data.to(layout.base_dtype), requires_grad=False)
    model = OneProjection(layer.to("cpu"))
    model.is_loaded_in_4bit = True  # what transformers sets; PEFT's 4-bit dispatch reads it
    return model


def adapt(model: nn.Module, layout: Layout, fast: bool, **config_kwargs) -> nn.Module:
    config_cls = FastLoraConfig if fast else LoraConfig
    config = config_cls(r=RANK, lora_alpha=ALPHA, target_modules=["proj"], **config_kwargs)
    peft_model = get_peft_model(model, config, autocast_adapter_dtype=layout.autocast_adapter_dtype)
    for name, param in peft_model.named_parameters():
        if "lora_" in name:
            param.data = param.data.to(layout.adapter_dtype)
    return peft_model


def dense_weight(layer: nn.Module) -> torch.Tensor:
    """The weight the layer computes with: the dense one, or bitsandbytes' own dequantization."""
    base = layer.get_base_layer()
    if hasattr(base.weight, "quant_state"):
        import bitsandbytes.functional as bnbf

        return bnbf.dequantize_4bit(base.weight.data, base.weight.quant_state)
    return base.weight


def float64_reference(layer, x: torch.Tensor, grad_out: torch.Tensor) -> dict[str, torch.Tensor]:
    base = layer.get_base_layer()
    weight = dense_weight(layer).detach().double()
    bias = None if base.bias is None else base.bias.detach().double()
    lora_a = layer.lora_A["default"].weight.detach().double().requires_grad_()
    lora_b = layer.lora_B["default"].weight.detach().double().requires_grad_()
    x64 = x.detach().double().requires_grad_()
    out = nn.functional.linear(x64, weight, bias) + layer.scaling["default"] * (x64 @ lora_a.T) @ lora_b.T
    out.backward(grad_out.double())
    return {"out": out.detach(), "grad_x": x64.grad, "grad_a": lora_a.grad, "grad_b": lora_b.grad}


def run_projection(model: nn.Module, layout: Layout, x: torch.Tensor, grad_out: torch.Tensor):
    x = x.clone().requires_grad_()
    with maybe_autocast(layout):
        out = model(x)
    out.backward(grad_out.to(out.dtype))
    layer = model.base_model.model.proj
    results = {
        "out": out.detach(),
        "grad_x": x.grad,
        "grad_a": layer.lora_A["default"].weight.grad,
        "grad_b": layer.lora_B["default"].weight.grad,
    }
    return out, results


def shapes_for(layout: Layout) -> tuple[int, int]:
    # bitsandbytes' CPU 4-bit path needs feature sizes that are multiples of 64; dense ones stay odd.
    return (128, 192) if layout.quantized else (70, 45)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_projection_matches_peft_and_float64(layout: Layout, bias: bool, triton_launches):
    in_features, out_features = shapes_for(layout)
    base = make_projection(layout, in_features, out_features, bias)
    fast = adapt(copy.deepcopy(base), layout, fast=True)
    peft = adapt(copy.deepcopy(base), layout, fast=False)
    randomize_lora(fast, seed=1)
    copy_lora(fast, peft)

    generator = torch.Generator().manual_seed(2)
    x = torch.randn(3, 7, in_features, generator=generator).to(layout.x_dtype)  # exact in its dtype
    grad_out = torch.randn(3, 7, out_features, generator=generator)

    with count_lora_sublayer_calls(fast) as fast_calls:
        fast_out, fast_results = run_projection(fast, layout, x, grad_out)
    with count_lora_sublayer_calls(peft) as peft_calls:
        peft_out, peft_results = run_projection(peft, layout, x, grad_out)

    # Pins: the fused Function produced the output and gradients, PEFT's sub-layers never ran, and
    # (under the interpreter) our Triton kernels did the LoRA terms in both directions.
    assert type(fast_out.grad_fn).__name__ == FUSED_BACKWARD_NODE
    assert not fast_calls, f"PEFT lora_A/lora_B ran on the fused path: {fast_calls}"
    assert peft_calls, "the hook saw no PEFT sub-layer calls: the pin would be blind"
    if TRITON_INTERPRET:
        # The forward's term and dX's by an expand-add each: these shapes never save the augmented
        # dX's host time (augmented_k's rule), which test_augmented_k pins where it is taken.
        for kernel in ("_lora_shrink_kernel", "_lora_expand_add_kernel"):
            assert triton_launches.get(kernel, 0) >= 2, f"{kernel} launches: {triton_launches}"
        # dA (reading x) and dB (reading dY) in one launch (`lora_weight_grads`) where x and dY have
        # one dtype; else one launch each (autocast: fp32 x, 16-bit dY).
        grouped = x.dtype == fast_out.dtype
        kernel, launches = (
            ("_lora_weight_grad_group_kernel", 1) if grouped else ("_lora_weight_grad_kernel", 2)
        )
        assert triton_launches.get(kernel) == launches, triton_launches
        assert "_lora_augmented_left_kernel" not in triton_launches, triton_launches
        if layout.quantized:
            assert triton_launches.get("_dequantize_4bit_kernel", 0) >= 2, triton_launches

    # The dtype contract: PEFT's output dtype, dX in x's dtype, adapter grads in the adapters' dtype.
    assert fast_out.dtype == peft_out.dtype
    assert fast_results["grad_x"].dtype == x.dtype
    assert fast_results["grad_a"].dtype == layout.adapter_dtype
    assert fast_results["grad_b"].dtype == layout.adapter_dtype

    reference = float64_reference(fast.base_model.model.proj, x, grad_out.to(fast_out.dtype))
    for key, expected in reference.items():
        fast_error = rel_err(fast_results[key], expected)
        peft_error = rel_err(peft_results[key], expected)
        assert fast_error <= 2 * peft_error + ERROR_FLOOR, (
            f"{key}: fused error {fast_error:.2e} > 2 x PEFT's {peft_error:.2e} (+{ERROR_FLOOR:.0e})"
        )
        if layout.id == "fp32":
            assert rel_err(fast_results[key], peft_results[key]) <= FP32_PARITY, key


def test_fp32_activations_on_16bit_dense_weight():
    """fp32 x (norms upcast by prepare_model_for_kbit_training) reaching a bf16 nn.Linear.

    PEFT's dense layer raises here (mat1 and mat2 dtypes differ); the fused path computes the base
    matmul in bf16, returns x's dtype like bitsandbytes' 4-bit layer, and keeps fp32 adapter
    gradients exact to fp32 rounding.
    """
    layout = Layout("bf16-fp32adapters", torch.bfloat16, torch.float32, torch.float32)
    base = make_projection(layout, 70, 45, bias=True)
    fast = adapt(base, layout, fast=True)
    randomize_lora(fast, seed=3)
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(2, 9, 70, generator=generator)
    grad_out = torch.randn(2, 9, 45, generator=generator)
    with count_lora_sublayer_calls(fast) as calls:
        out, results = run_projection(fast, layout, x, grad_out)
    assert not calls and type(out.grad_fn).__name__ == FUSED_BACKWARD_NODE
    assert out.dtype == torch.float32 and results["grad_x"].dtype == torch.float32
    reference = float64_reference(fast.base_model.model.proj, x.to(torch.bfloat16).float(), grad_out)
    # The base term sees x rounded to bf16, so the output carries bf16 rounding; the adapters see x exactly.
    assert rel_err(results["out"], reference["out"]) < 1e-2
    exact = float64_reference(fast.base_model.model.proj, x, grad_out)
    assert rel_err(results["grad_a"], exact["grad_a"]) < ERROR_FLOOR
    assert rel_err(results["grad_b"], exact["grad_b"]) < ERROR_FLOOR


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_projection_with_dropout_matches_peft(layout: Layout):
    """Training with lora_dropout: PEFT's dropout module draws the mask, the fused Function does the rest."""
    in_features, out_features = shapes_for(layout)
    base = make_projection(layout, in_features, out_features, bias=True)
    fast = adapt(copy.deepcopy(base), layout, fast=True, lora_dropout=0.25).train()
    peft = adapt(base, layout, fast=False, lora_dropout=0.25).train()
    randomize_lora(fast, seed=1)
    copy_lora(fast, peft)
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(3, 7, in_features, generator=generator).to(layout.x_dtype)
    grad_out = torch.randn(3, 7, out_features, generator=generator)
    torch.manual_seed(3)
    with count_lora_sublayer_calls(fast) as calls:
        fast_out, fast_results = run_projection(fast, layout, x, grad_out)
    torch.manual_seed(3)
    _, peft_results = run_projection(peft, layout, x, grad_out)
    assert not calls and type(fast_out.grad_fn).__name__ == FUSED_BACKWARD_NODE
    tolerance = 1e-5 if layout.id == "fp32" else 1e-2  # 16-bit: where each rounds differs
    for key, expected in peft_results.items():
        assert rel_err(fast_results[key], expected) <= tolerance, key
