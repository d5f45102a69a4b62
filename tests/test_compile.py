"""torch.compile over a whole FastLora model: one graph, the fused Functions inside it, eager's results.

A graph break per block would leave a compiled model host-bound (and CUDA graphs impossible), as
the q/k/v group's hand-off of pending outputs once did (`x._version` cannot be guarded on: one break
per member call) and the gated MLP's class-level settings did. Under compile the q/k/v group stands
down and each member runs its own fused projection; the gated MLP stays one fused call. Compiled
against eager in every dtype layout of the fused path (fp32, bf16, fp16, fp32 adapters on 16-bit
bases, NF4 with 16-bit or fp32 adapters, FP4, fp32 activations on NF4).
"""

from __future__ import annotations

import re

import pytest
import torch
from conftest import (
    LAYOUTS,
    Layout,
    assert_rel_close,
    count_lora_sublayer_calls,
    lora_grads,
    randomize_lora,
    tiny_llama_4bit,
    tiny_llama_config,
)
from peft import get_peft_model, prepare_model_for_kbit_training
from transformers import LlamaForCausalLM

from fastlora_peft import FastLoraConfig

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Compiled against eager: fp32 models bit-identical but for the order of fp32 sums. 16-bit bases: k
# and v come from their own shrink instead of the group's stacked one (another fp32 summation order),
# so a few k/v elements round to the other 16-bit neighbour and attention carries that on (2.1e-3
# measured for bf16 with fp32 adapters, on the k/v adapter gradients only). A lost scale, an unfused
# block or a skipped term is O(1).
GRAD_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
# Every dtype layout of the fused path without autocast: 16-bit and NF4 bases with 16-bit adapters
# and with PEFT's default fp32 ones, fp32, FP4 on fp16, fp32 activations on NF4.
COMPILE_LAYOUTS = [layout for layout in LAYOUTS if layout.autocast is None]


def tiny_fastlora_llama(layout: Layout = LAYOUTS[0], tmp_path_factory=None):
    """A one-layer Llama in `layout` (4-bit: through BitsAndBytesConfig) with FastLora on every
    projection and random adapters of the layout's dtype."""
    if layout.quantized:
        model = tiny_llama_4bit(tmp_path_factory, layout)
        if layout.x_dtype == torch.float32:  # QLoRA's recipe: norms and embeddings upcast to fp32
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    else:
        torch.manual_seed(0)
        model = LlamaForCausalLM(tiny_llama_config()).to(layout.base_dtype)
    model.config.use_cache = False
    config = FastLoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0)
    model = get_peft_model(model.train(), config, autocast_adapter_dtype=layout.autocast_adapter_dtype)
    for name, param in model.named_parameters():
        if "lora_" in name:
            param.data = param.data.to(layout.adapter_dtype)
    randomize_lora(model, seed=1, std=0.1)
    return model


def loss_of(model, ids):
    return model(input_ids=ids, labels=ids).loss


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_whole_model_is_one_graph_with_the_fused_functions_inside():
    model = tiny_fastlora_llama()
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    explanation = torch._dynamo.explain(loss_of)(model, ids)
    reasons = [reason.reason.splitlines()[0] for reason in explanation.break_reasons]
    assert explanation.graph_break_count == 0, reasons
    # The fused Functions are traced in as autograd-function applies, each with its forward and
    # backward bodies calling our kernel ops: q, k, v and o one each (the group stands down under
    # compile) and the whole MLP as one.
    bodies = {
        name: set(re.findall(r"torch\.ops\.fastlora\.(\w+)", module.code))
        for name, module in explanation.graphs[0].named_modules()
        if name.startswith(("fwd_body", "bwd_body"))
    }
    forward_ops = {name: ops for name, ops in bodies.items() if name.startswith("fwd_body")}
    assert len(forward_ops) == 5, bodies
    for name, ops in forward_ops.items():
        assert "lora_expand_add_" in ops and {"lora_shrink", "lora_shrink_keeping_weight_t"} & ops, bodies
        # A forward keeps A.T for dX's term exactly where its backward makes dX (an expand-add
        # there): not q/k/v here, whose input (the frozen embedding's output) needs no gradient.
        # ctx.needs_input_grad, read in the forward, is traced.
        makes_dx = "lora_expand_add_" in bodies[name.replace("fwd", "bwd")]
        assert ("lora_shrink_keeping_weight_t" in ops) == makes_dx, (name, bodies)
    assert sum("lora_shrink_keeping_weight_t" in ops for ops in forward_ops.values()) == 2, bodies  # o, MLP
    mlp_bodies = [name for name, ops in bodies.items() if "gated_act_lora_forward_" in ops]
    assert len(mlp_bodies) == 1, bodies
    assert "gated_act_backward_weight_grad_" in bodies[mlp_bodies[0].replace("fwd", "bwd")], bodies


@pytest.mark.parametrize("layout", COMPILE_LAYOUTS, ids=[layout.id for layout in COMPILE_LAYOUTS])
def test_compiled_loss_and_adapter_grads_equal_eager(layout: Layout, tmp_path_factory):
    model = tiny_fastlora_llama(layout, tmp_path_factory)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    eager_loss = loss_of(model, ids)
    eager_loss.backward()
    eager_grads = lora_grads(model)
    model.zero_grad(set_to_none=True)

    compiled = torch.compile(loss_of, backend="aot_eager", fullgraph=True)
    with count_lora_sublayer_calls(model) as calls:
        loss = compiled(model, ids)
        loss.backward()
    assert not calls, f"PEFT's lora_A/lora_B ran under compile: {calls}"
    torch.testing.assert_close(loss, eager_loss, rtol=1e-6, atol=0)
    grads = lora_grads(model)
    assert grads.keys() == eager_grads.keys() and len(grads) == 2 * len(TARGETS)
    for name, grad in grads.items():
        assert grad.dtype == layout.adapter_dtype, name  # fp32 adapters keep fp32 gradients
        assert_rel_close(grad, eager_grads[name], GRAD_TOLERANCE[layout.base_dtype], name)


def test_later_steps_reuse_the_compiled_graph():
    """No recompilation from step to step: a counter the model bumps in traced code (the groups' call
    counts once were) becomes a guard on its value, so every step compiled anew until the cache
    limit, after which dynamo runs the frame eagerly."""
    model = tiny_fastlora_llama()
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    compiled = torch.compile(loss_of, backend="eager", fullgraph=True)
    compiled(model, ids).backward()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            compiled(model, ids).backward()
