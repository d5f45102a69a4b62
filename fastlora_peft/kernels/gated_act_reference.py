"""Pure-torch reference for the gated activation of an MLP block: ``h = act(gate) * up``.

Same signatures and dtype contract as the ops of :mod:`fastlora_peft.kernels.gated_act` (and
:mod:`~fastlora_peft.kernels.gated_act_lora`, :mod:`~fastlora_peft.kernels.gated_act_lora_forward`),
which run these on plain CPU tensors and whose tests compare the Triton kernels with them. Everything
is computed in float32 and rounded once to ``gate``'s dtype; outputs are contiguous.
Inputs are checked by the public ops.

* ``"silu"``: SwiGLU (Llama, Mistral, Qwen), ``act = silu``.
* ``"gelu_tanh"``: GeGLU (Gemma), ``act = gelu`` with the tanh approximation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .lora_terms_reference import lora_expand_add

# Outputs are contiguous whatever the inputs' layout, as the Triton kernels write them.
_CONTIGUOUS = torch.contiguous_format


def _wide(tensor: torch.Tensor) -> torch.Tensor:
    """float32, or float64 for float64 inputs (gradcheck runs the references in float64)."""
    return tensor.double() if tensor.dtype == torch.float64 else tensor.float()


def _activation(gate: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return F.silu(gate)
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh")
    raise ValueError(f"activation: expected 'silu' or 'gelu_tanh', got {activation!r}")


def _activation_backward(grad_act: torch.Tensor, gate: torch.Tensor, activation: str) -> torch.Tensor:
    """``grad_act * act'(gate)``, through torch's own derivative kernels."""
    if activation == "silu":
        return torch.ops.aten.silu_backward(grad_act, gate)
    if activation == "gelu_tanh":
        return torch.ops.aten.gelu_backward(grad_act, gate, approximate="tanh")
    raise ValueError(f"activation: expected 'silu' or 'gelu_tanh', got {activation!r}")


def gated_act_forward(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """``h = act(gate) * up``. gate, up: [M, I]; returns h: [M, I] in gate's dtype."""
    return (_activation(_wide(gate), activation) * _wide(up)).to(gate.dtype, memory_format=_CONTIGUOUS)


def gated_act_backward(
    grad_h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_gate, grad_up)`` of ``h = act(gate) * up``, all [M, I], in gate's dtype."""
    grad_h, gate32, up32 = _wide(grad_h), _wide(gate), _wide(up)
    grad_gate = _activation_backward(grad_h * up32, gate32, activation)
    grad_up = grad_h * _activation(gate32, activation)
    return (
        grad_gate.to(gate.dtype, memory_format=_CONTIGUOUS),
        grad_up.to(gate.dtype, memory_format=_CONTIGUOUS),
    )


def gated_act_backward_weight_grad(
    grad_h: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    left: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad_gate, grad_up, grad_weight)``: :func:`gated_act_backward`'s two, and
    ``grad_weight = scale * left.T @ h`` [R, I] for left: [M, R] float32 (float64 under gradcheck),
    summed over the M tokens in float32 (float64). h is :func:`gated_act_forward`'s, rounded to gate's
    dtype, as the forward stored it and the unfused backward reads it."""
    grad_gate, grad_up = gated_act_backward(grad_h, gate, up, activation)
    hidden = gated_act_forward(gate, up, activation)
    grad_weight = scale * (_wide(left).T @ _wide(hidden))
    return grad_gate, grad_up, grad_weight.contiguous()


def gated_act_lora_forward(
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    gate_left: torch.Tensor,
    gate_right: torch.Tensor,
    gate_scale: float,
    up_left: torch.Tensor,
    up_right: torch.Tensor,
    up_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(gate', up', h)``: ``gate' = gate + gate_scale * gate_left @ gate_right.T`` and up' likewise,
    each summed in float32 (float64) and rounded once to gate's dtype, and :func:`gated_act_forward`
    of the rounded two. left: [M, R] float32, right: [I, R]."""
    new_gate = lora_expand_add(gate, gate_left, gate_right, gate_scale, gate.dtype)
    new_up = lora_expand_add(up, up_left, up_right, up_scale, up.dtype)
    return new_gate, new_up, gated_act_forward(new_gate, new_up, activation)
