"""`LoraGatedMlpFunction`: a whole gated MLP block with LoRA on every projection, in one autograd call.

    gate = x @ Wg.T + sg (x Ag.T) Bg.T        up = x @ Wu.T + su (x Au.T) Bu.T     (one pass over x)
    h    = act(gate) * up                     act: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    y    = h @ Wd.T + sd (h Ad.T) Bd.T

Gate and up are either two projections (Llama, Gemma, ...) or the two halves of one fused
`gate_up_proj` (Phi-3). Saves x, the gate/up pre-activations and the small fp32 `x @ A.T` and
`h @ Ad.T`; h is recomputed in backward by the same fused activation kernel instead of being kept
([tokens, I] per block is the largest activation of a transformer layer). Backward overwrites the
saved gate/up with their gradients, so a second backward through the same graph
(`retain_graph=True`) stops with a clear error instead of computing garbage.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..dtypes import DtypePlan
from ..kernels.gated_act import gated_act_backward_, gated_act_forward
from .frozen_base import FrozenBase, LoraWeights
from .shared_input import (
    hoisted_grad_xa,
    shared_input_backward,
    shared_input_forward,
    shared_input_grad_x,
    shared_input_weight_grads,
)
from .tensor_groups import flatten_tensors, unflatten_tensors, values_in_tensor_slots

# apply(x, plan, activation, layout, *tensors)
_FIRST_TENSOR_ARG = 4


def _gate_and_up(pre_activations: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up): two projections' outputs, or the halves of one `[tokens, 2I]` gate_up output (views)."""
    if len(pre_activations) == 2:
        return pre_activations[0], pre_activations[1]
    (gate_up,) = pre_activations
    half = gate_up.shape[1] // 2
    return gate_up[:, :half], gate_up[:, half:]


class LoraGatedMlpFunction(torch.autograd.Function):
    """Forward and backward of `down(act(gate(x)) * up(x))` with a LoRA adapter on each projection.

    x: `[..., hidden]` (fp32, bf16 or fp16); returns `[..., hidden]` of `plan.out_dtype`. The layout
    holds `(bases, loras)` of `(gate, up, down)` or `(gate_up, down)`. Gate/up outputs and h have
    `plan.out_dtype`; the down projection takes h in that dtype under the same plan. dX has x's
    dtype; every adapter gradient has its adapter's dtype and is accumulated in fp32.
    """

    # Backward writes the gate/up gradients into the saved gate/up buffers (two [tokens, I] tensors
    # less at the peak). False keeps them, for a second backward through the same graph.
    overwrite_saved_preactivations = True

    @staticmethod
    def forward(ctx, x: torch.Tensor, plan: DtypePlan, activation: str, layout, *tensors: torch.Tensor):
        bases, loras = unflatten_tensors(layout, tensors)
        x_2d = x.reshape(-1, x.shape[-1])
        pre_activations, xa_in = shared_input_forward(x_2d, bases[:-1], loras[:-1], plan)
        hidden = gated_act_forward(*_gate_and_up(pre_activations), activation)
        (out,), ha_down = shared_input_forward(hidden, bases[-1:], loras[-1:], plan)
        ctx.plan, ctx.activation, ctx.layout = plan, activation, layout
        ctx.overwrite = LoraGatedMlpFunction.overwrite_saved_preactivations
        ctx.pre_activation_count = len(pre_activations)
        ctx.save_for_backward(x, xa_in, ha_down, *pre_activations, *tensors)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        try:
            x, xa_in, ha_down, *saved = ctx.saved_tensors
        except RuntimeError as error:
            if ctx.overwrite and "inplace operation" in str(error):
                raise RuntimeError(
                    "fastlora_peft: a second backward through a fused gated MLP: its first backward "
                    "reused the saved gate/up buffers. Set LoraGatedMlpFunction."
                    "overwrite_saved_preactivations = False (fastlora_peft.functions.gated_mlp) before "
                    "the forward to keep them."
                ) from error
            raise
        pre_activations, tensors = saved[: ctx.pre_activation_count], saved[ctx.pre_activation_count :]
        if not ctx.overwrite:
            pre_activations = [t.clone() for t in pre_activations]
        gate, up = _gate_and_up(pre_activations)
        plan: DtypePlan = ctx.plan
        bases, loras = unflatten_tensors(ctx.layout, tensors)
        needs_bases, needs_loras = unflatten_tensors(ctx.layout, ctx.needs_input_grad[_FIRST_TENSOR_ARG:])
        x_2d = x.reshape(-1, x.shape[-1])
        grad_2d = grad_out.reshape(x_2d.shape[0], grad_out.shape[-1])
        with torch.autocast(x.device.type, enabled=False):
            # Down projection: its weight gradients need h, its input gradient does not, so h (recomputed,
            # not saved) is freed before dh is made. Then dh becomes the gate/up gradients in the
            # saved gate/up buffers themselves: the backward holds at most three [tokens, I] tensors.
            down_bases, down_loras = bases[-1:], loras[-1:]
            grad_ha, down_scale = hoisted_grad_xa([grad_2d], down_loras)
            hidden = gated_act_forward(gate, up, ctx.activation)
            down_grad_loras, down_grad_bases = shared_input_weight_grads(
                hidden, ha_down, [grad_2d], grad_ha, down_scale, down_bases, down_loras,
                needs_loras[-1:], needs_bases[-1:],
            )  # fmt: skip
            del hidden
            grad_hidden = shared_input_grad_x(
                [grad_2d], grad_ha, down_scale, down_bases, down_loras, plan, gate.dtype
            )
            gated_act_backward_(grad_hidden, gate, up, ctx.activation)  # the buffers now hold their grads
            del grad_hidden
            gate_up = shared_input_backward(
                x_2d, xa_in, bases[:-1], loras[:-1], plan, pre_activations, ctx.needs_input_grad[0],
                needs_loras[:-1], needs_bases[:-1],
            )  # fmt: skip
        grad_x = None if gate_up.grad_x is None else gate_up.grad_x.view(x.shape)
        grad_tree = (gate_up.bases + down_grad_bases, gate_up.loras + down_grad_loras)
        return (grad_x, None, None, None, *values_in_tensor_slots(ctx.layout, grad_tree))


def fused_gated_mlp(
    x: torch.Tensor,
    bases: Sequence[FrozenBase],
    loras: Sequence[LoraWeights],
    plan: DtypePlan,
    activation: str,
) -> torch.Tensor:
    """Runs `LoraGatedMlpFunction` on (gate, up, down) or (gate_up, down), autocast off inside."""
    tensors, layout = flatten_tensors((tuple(bases), tuple(loras)))
    with torch.autocast(x.device.type, enabled=False):
        return LoraGatedMlpFunction.apply(x, plan, activation, layout, *tensors)
