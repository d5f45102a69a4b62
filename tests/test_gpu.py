"""GPU tests at Llama-3.1-8B block sizes (skipped without CUDA).

Same rules as the CPU suite: per layout, the fused error against a float64 computation on the same
(rounded or dequantized) weights is at most twice PEFT's, for the output and every gradient; the
fused Function ran and PEFT's sub-layers did not; blocks run as one call each.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import (
    FUSED_BACKWARD_NODE,
    LAYOUTS,
    MLP_BACKWARD_NODE,
    Layout,
    autograd_node_names,
    copy_lora,
    count_lora_sublayer_calls,
    lora_grads,
    randomize_lora,
    rel_err,
)
from peft import LoraConfig, get_peft_model
from test_projection_numerics import ERROR_FLOOR, adapt, float64_reference, make_projection, run_projection

from fastlora_peft import FastLoraConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128
TOKENS = 2048
GPU_LAYOUTS = [layout for layout in LAYOUTS if layout.autocast is None]


# (in, out) of the 8B projections: o_proj, q_proj, k/v_proj, gate/up_proj, down_proj
PROJECTIONS = {"o": (4096, 4096), "k": (4096, 1024), "gate": (4096, 14336), "down": (14336, 4096)}


@pytest.mark.parametrize("projection", list(PROJECTIONS))
@pytest.mark.parametrize("layout", GPU_LAYOUTS, ids=[layout.id for layout in GPU_LAYOUTS])
def test_projection_at_8b_sizes(layout: Layout, projection: str):
    in_features, out_features = PROJECTIONS[projection]
    base = make_projection(layout, in_features, out_features, bias=False).cuda()
    fast = adapt(copy.deepcopy(base), layout, fast=True)
    peft = adapt(base, layout, fast=False)
    randomize_lora(fast, seed=1, std=0.02)
    copy_lora(fast, peft)
    generator = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(2, TOKENS // 2, in_features, generator=generator, device="cuda").to(layout.x_dtype)
    grad_out = torch.randn(2, TOKENS // 2, out_features, generator=generator, device="cuda")
    with count_lora_sublayer_calls(fast) as calls:
        fast_out, fast_results = run_projection(fast, layout, x, grad_out)
    _, peft_results = run_projection(peft, layout, x, grad_out)
    assert not calls and type(fast_out.grad_fn).__name__ == FUSED_BACKWARD_NODE
    reference = float64_reference(fast.base_model.model.proj, x, grad_out.to(fast_out.dtype))
    for key, expected in reference.items():
        fast_error, peft_error = rel_err(fast_results[key], expected), rel_err(peft_results[key], expected)
        assert fast_error <= 2 * peft_error + ERROR_FLOOR, f"{key}: {fast_error:.2e} vs PEFT {peft_error:.2e}"


LORA_ADDMM_LAYOUTS = [layout for layout in GPU_LAYOUTS if layout.x_dtype != torch.float32]


@pytest.mark.parametrize("projection", ["o", "k", "down"])
@pytest.mark.parametrize("layout", LORA_ADDMM_LAYOUTS, ids=[layout.id for layout in LORA_ADDMM_LAYOUTS])
def test_projection_dx_through_lora_addmm_at_8b_sizes(layout: Layout, projection: str, monkeypatch):
    """The same float64 bound with the forward's GEMM and dX made by `lora_addmm` (forced with
    "always", so every layout below takes it whatever "auto" decides; at these sizes its TMA kernel,
    with k's forward on the few-tiles config)."""
    from test_lora_addmm import count_lora_addmm_launches

    from fastlora_peft.kernels.lora_addmm import LoraAddmmSettings

    monkeypatch.setattr(LoraAddmmSettings, "mode", "always")
    calls = []
    count_lora_addmm_launches(monkeypatch, lambda *args: calls.append(args))
    test_projection_at_8b_sizes(layout, projection)
    assert len(calls) == 2  # the forward (no bias here) and dX


def test_lora_addmm_auto_choice_on_this_gpu(monkeypatch):
    """In "auto", lora_addmm takes dX from `min_tokens` rows on a Hopper GPU, and nowhere else."""
    from fastlora_peft.kernels.lora_addmm import LoraAddmmSettings, lora_addmm_pays_off

    monkeypatch.setattr(LoraAddmmSettings, "mode", "auto")

    hopper = torch.cuda.get_device_capability()[0] == 9
    rows = LoraAddmmSettings.min_tokens
    grad, weight = (
        torch.zeros(rows, 64, device="cuda", dtype=torch.bfloat16),
        torch.zeros(64, 32, device="cuda"),
    )
    assert lora_addmm_pays_off(grad, weight.bfloat16(), torch.bfloat16) == hopper
    assert not lora_addmm_pays_off(grad[: rows - 1], weight.bfloat16(), torch.bfloat16)


def llama_8b_layer(dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, num_hidden_layers=1, vocab_size=1024,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device="cuda", dtype=dtype)


@pytest.mark.parametrize(
    "adapter_dtype", [torch.float32, torch.bfloat16], ids=["fp32adapters", "bf16adapters"]
)
def test_blocks_at_8b_sizes(adapter_dtype):
    base = llama_8b_layer(torch.bfloat16)
    config = dict(r=16, lora_alpha=32, target_modules="all-linear")
    autocast = adapter_dtype == torch.float32
    fast = get_peft_model(copy.deepcopy(base), FastLoraConfig(**config), autocast_adapter_dtype=autocast)
    peft = get_peft_model(base, LoraConfig(**config), autocast_adapter_dtype=autocast)
    randomize_lora(fast, seed=3, std=0.02)
    copy_lora(fast, peft)
    kinds = sorted(group.describe() for group in fast.fastlora_groups())
    assert kinds == ["gated_mlp(silu):model.layers.0.mlp", "shared_input:model.layers.0.self_attn"]

    input_ids = torch.randint(0, 1024, (2, TOKENS // 2), device="cuda")
    with count_lora_sublayer_calls(fast) as calls:
        fast_logits = fast(input_ids=input_ids).logits
    peft_logits = peft(input_ids=input_ids).logits
    assert not calls
    nodes = autograd_node_names(fast_logits)
    assert nodes.count(FUSED_BACKWARD_NODE) == 2 and nodes.count(MLP_BACKWARD_NODE) == 1
    assert rel_err(fast_logits, peft_logits) < 3e-2
    weight = torch.randn_like(fast_logits, dtype=torch.float32)
    (fast_logits.float() * weight).sum().backward()
    (peft_logits.float() * weight).sum().backward()
    fast_grads, peft_grads = lora_grads(fast), lora_grads(peft)
    assert len(fast_grads) == 14
    for name, grad in fast_grads.items():
        assert grad.dtype == adapter_dtype
        assert rel_err(grad, peft_grads[name]) < 5e-2, name
