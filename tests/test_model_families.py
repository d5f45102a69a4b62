"""Model families built from their transformers configs: which blocks are fused, and parity with PEFT."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import (
    FUSED_BACKWARD_NODE,
    MLP_BACKWARD_NODE,
    autograd_node_names,
    copy_lora,
    count_lora_sublayer_calls,
    lora_grads,
    randomize_lora,
    rel_err,
)
from peft import LoraConfig, get_peft_model

from fastlora_peft import FastLoraConfig

SMALL = dict(
    hidden_size=48, intermediate_size=88, num_hidden_layers=1, vocab_size=61, max_position_embeddings=64
)
HEADS = dict(num_attention_heads=4, num_key_value_heads=2)


def _build(config_name: str, model_name: str, **values):
    import transformers

    config = getattr(transformers, config_name)(**values)
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config)


# family: (builder, targets, expected {group kind: count}, shared-input Function calls, MLP Function calls)
FAMILIES = {
    "llama": (
        lambda: _build("LlamaConfig", "LlamaForCausalLM", **SMALL, **HEADS),
        {"shared_input": 1, "gated_mlp(silu)": 1},
    ),
    "mistral": (
        lambda: _build("MistralConfig", "MistralForCausalLM", **SMALL, **HEADS, sliding_window=None),
        {"shared_input": 1, "gated_mlp(silu)": 1},
    ),
    "qwen2-qkv-bias": (
        lambda: _build("Qwen2Config", "Qwen2ForCausalLM", **SMALL, **HEADS),
        {"shared_input": 1, "gated_mlp(silu)": 1},
    ),
    "qwen3": (
        lambda: _build("Qwen3Config", "Qwen3ForCausalLM", **SMALL, **HEADS, head_dim=12),
        {"shared_input": 1, "gated_mlp(silu)": 1},
    ),
    "gemma-geglu": (
        lambda: _build("GemmaConfig", "GemmaForCausalLM", **SMALL, **HEADS, head_dim=12),
        {"shared_input": 1, "gated_mlp(gelu_tanh)": 1},
    ),
    "gemma2": (
        lambda: _build("Gemma2Config", "Gemma2ForCausalLM", **SMALL, **HEADS, head_dim=12, sliding_window=16),
        {"shared_input": 1, "gated_mlp(gelu_tanh)": 1},
    ),
    "phi3-fused-projections": (  # qkv_proj is one projection; gate_up_proj's halves feed the MLP
        lambda: _build("Phi3Config", "Phi3ForCausalLM", **SMALL, **HEADS, pad_token_id=0),
        {"gated_mlp(silu)": 1},
    ),
}


def group_kinds(model) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for group in model.fastlora_groups():
        kind = group.describe().split(":")[0]
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


# (base dtype, adapter dtype, tolerance against PEFT): fp32, and PEFT's default layout on a bf16 base.
FAMILY_LAYOUTS = {
    "fp32": (torch.float32, torch.float32, 1e-4),
    "bf16-fp32adapters": (torch.bfloat16, torch.float32, 5e-2),
}


@pytest.mark.parametrize("layout", list(FAMILY_LAYOUTS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_groups_and_parity(family, layout):
    build, expected_groups = FAMILIES[family]
    base_dtype, adapter_dtype, tolerance = FAMILY_LAYOUTS[layout]
    base = build().to(base_dtype)
    config = dict(r=4, lora_alpha=8, target_modules="all-linear")
    fast = get_peft_model(copy.deepcopy(base), FastLoraConfig(**config))
    peft = get_peft_model(base, LoraConfig(**config))
    for model in (fast, peft):  # PEFT's default keeps fp32 adapters on a 16-bit base
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.data = param.data.to(adapter_dtype)
    randomize_lora(fast, seed=2, std=0.1)
    copy_lora(fast, peft)
    assert group_kinds(fast) == expected_groups, fast.format_fastlora_report()
    assert all(route.path == "fused" for route in fast.fastlora_report())

    input_ids = torch.randint(0, 61, (2, 7), generator=torch.Generator().manual_seed(3))
    with count_lora_sublayer_calls(fast) as calls:
        fast_logits = fast(input_ids=input_ids).logits
    peft_logits = peft(input_ids=input_ids).logits
    assert not calls
    nodes = autograd_node_names(fast_logits)
    adapted = len(fast.fastlora_report())
    grouped_members = sum(len(group.members) for group in fast.fastlora_groups())
    mlp_groups = sum(1 for group in fast.fastlora_groups() if group.kind == "gated_mlp")
    shared_groups = len(fast.fastlora_groups()) - mlp_groups
    # Every adapted projection is in exactly one fused call: its group's, or its own.
    assert nodes.count(MLP_BACKWARD_NODE) == mlp_groups
    assert nodes.count(FUSED_BACKWARD_NODE) == shared_groups + adapted - grouped_members
    assert rel_err(fast_logits, peft_logits) < tolerance

    fast_logits.float().square().mean().backward()
    peft_logits.float().square().mean().backward()
    fast_grads, peft_grads = lora_grads(fast), lora_grads(peft)
    assert fast_grads.keys() == peft_grads.keys() and len(fast_grads) == 2 * adapted
    for name, grad in fast_grads.items():
        assert grad.dtype == adapter_dtype
        assert rel_err(grad, peft_grads[name]) < tolerance, name
