"""`LoraGatedMlpFunction`: a whole gated MLP block with LoRA on gate, up and down, in one autograd call.

    gate = x @ Wg.T + sg (x Ag.T) Bg.T        up = x @ Wu.T + su (x Au.T) Bu.T     (one pass over x)
    h    = act(gate) * up                     act: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    y    = h @ Wd.T + sd (h Ad.T) Bd.T

Saves x, the gate/up pre-activations and the small fp32 `x @ [Ag; Au].T` and `h @ Ad.T`; h is
recomputed in backward by the same fused activation kernel instead of being kept ([tokens, I] per
block is the largest activation of a transformer layer).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..dtypes import DtypePlan
from ..kernels.gated_act import gated_act_backward, gated_act_forward
from .frozen_base import FrozenBase, LoraWeights
from .shared_input import shared_input_backward, shared_input_forward
from .tensor_groups import flatten_tensors, unflatten_tensors, values_in_tensor_slots

# apply(x, plan, activation, layout, *tensors)
_FIRST_TENSOR_ARG = 4


class LoraGatedMlpFunction(torch.autograd.Function):
    """Forward and backward of `down(act(gate(x)) * up(x))` with a LoRA adapter on each projection.

    x: `[..., hidden]` (fp32, bf16 or fp16); returns `[..., hidden]` of `plan.out_dtype`. The layout
    holds `((gate, up, down) bases, (gate, up, down) loras)`. Gate/up outputs and h have
    `plan.out_dtype`; the down projection takes h in that dtype under the same plan. dX has x's
    dtype; every adapter gradient has its adapter's dtype and is accumulated in fp32.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, plan: DtypePlan, activation: str, layout, *tensors: torch.Tensor):
        (gate_base, up_base, down_base), (gate_lora, up_lora, down_lora) = unflatten_tensors(layout, tensors)
        x_2d = x.reshape(-1, x.shape[-1])
        (gate, up), xa_gate_up = shared_input_forward(x_2d, [gate_base, up_base], [gate_lora, up_lora], plan)
        hidden = gated_act_forward(gate, up, activation)
        (out,), ha_down = shared_input_forward(hidden, [down_base], [down_lora], plan)
        ctx.plan, ctx.activation, ctx.layout = plan, activation, layout
        ctx.save_for_backward(x, xa_gate_up, gate, up, ha_down, *tensors)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, xa_gate_up, gate, up, ha_down, *tensors = ctx.saved_tensors
        plan: DtypePlan = ctx.plan
        bases, loras = unflatten_tensors(ctx.layout, tensors)
        needs_bases, needs_loras = unflatten_tensors(ctx.layout, ctx.needs_input_grad[_FIRST_TENSOR_ARG:])
        x_2d = x.reshape(-1, x.shape[-1])
        grad_2d = grad_out.reshape(x_2d.shape[0], grad_out.shape[-1])
        with torch.autocast(x.device.type, enabled=False):
            hidden = gated_act_forward(gate, up, ctx.activation)  # recomputed, not saved
            down = shared_input_backward(
                hidden, ha_down, bases[2:], loras[2:], plan, [grad_2d], True, needs_loras[2:], needs_bases[2:]
            )
            del hidden
            grad_gate, grad_up = gated_act_backward(down.grad_x, gate, up, ctx.activation)
            gate_up = shared_input_backward(
                x_2d,
                xa_gate_up,
                bases[:2],
                loras[:2],
                plan,
                [grad_gate, grad_up],
                ctx.needs_input_grad[0],
                needs_loras[:2],
                needs_bases[:2],
            )
        grad_x = None if gate_up.grad_x is None else gate_up.grad_x.view(x.shape)
        grad_tree = (gate_up.bases + down.bases, gate_up.loras + down.loras)
        return (grad_x, None, None, None, *values_in_tensor_slots(ctx.layout, grad_tree))


def fused_gated_mlp(
    x: torch.Tensor,
    bases: Sequence[FrozenBase],
    loras: Sequence[LoraWeights],
    plan: DtypePlan,
    activation: str,
) -> torch.Tensor:
    """Runs `LoraGatedMlpFunction` on (gate, up, down) bases and adapters, autocast off inside."""
    tensors, layout = flatten_tensors((tuple(bases), tuple(loras)))
    with torch.autocast(x.device.type, enabled=False):
        return LoraGatedMlpFunction.apply(x, plan, activation, layout, *tensors)
