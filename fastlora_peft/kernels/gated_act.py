"""Gated activation of an MLP block, fused: ``h = act(gate) * up`` and its backward, in Triton.

Shapes: ``gate, up, grad_h, h, grad_gate, grad_up: [M, I]`` (M tokens, I intermediate features).

* ``"silu"``: SwiGLU (Llama, Mistral, Qwen); ``"gelu_tanh"``: GeGLU (Gemma), gelu with the tanh
  approximation, as ``torch.nn.functional.gelu(x, approximate="tanh")``.
* Dtypes: gate and up are float32, bfloat16 or float16, both the same; grad_h may be any of the
  three. Everything is computed in float32 and rounded once, at the store, to gate's dtype.
* Layout: gate, up and grad_h may have any row stride, e.g. the two halves ``out[:, :I]`` and
  ``out[:, I:]`` of a fused gate_up projection ``out: [M, 2I]`` (Phi-3); nothing is copied then.
  Outputs are new contiguous tensors.
* The backward recomputes ``act(gate)``: the MLP saves only x and the gate/up pre-activations, and
  one kernel reads grad_h, gate and up once and writes both gradients.

The public ops are ``torch.library`` custom ops (``fastlora::gated_act_forward``,
``fastlora::gated_act_backward``) with fake implementations, so ``torch.compile`` traces through
them; ``gated_act_forward`` is differentiable through ``gated_act_backward``. They run the Triton
kernels or the pure-torch reference in :mod:`.gated_act_reference` by ``runs_triton(gate)``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import gated_act_reference as _reference
from ._backend import OP_NAMESPACE, runs_triton, skips_op_dispatch
from ._launch import CachedKernel, cdiv, next_power_of_2

ACTIVATIONS = ("silu", "gelu_tanh")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# float64 is accepted for gradcheck only: it always runs the reference, in float64 (see _backend).
_CHECKED_DTYPES = (*_FLOAT_DTYPES, torch.float64)

# gelu_tanh(g) = 0.5 g (1 + tanh(z)) with z = sqrt(2/pi) (g + 0.044715 g^3).
_GELU_TWO_K = tl.constexpr(2.0 * math.sqrt(2.0 / math.pi))
_GELU_C = tl.constexpr(0.044715)

# At most 1024 columns per program with 8 per thread: one 16-byte load per bf16/fp16 tensor and
# thread (two for fp32), 4 warps at full width; a small I gets a smaller block and fewer warps.
# H200, bf16, M=8192, I=14336 from halves of [M, 2I]: forward 0.166 ms, backward 0.276 ms, both
# 4.25 TB/s (a plain copy: 4.19); 2048 or 4096 columns with 8 warps: the same; 1024 columns with 8
# warps: forward 0.184 ms. Eager silu(g) * u: 0.628 ms.
_BLOCK_I_MAX = 1024
_COLUMNS_PER_WARP = 256


@triton.jit
def _activation_and_derivative(gate, ACTIVATION: tl.constexpr):
    """``(act(gate), act'(gate))`` in float32. The forward kernel drops the unused derivative."""
    if ACTIVATION == "silu":
        sig = tl.sigmoid(gate)
        act = gate * sig
        dact = sig * (1.0 + gate * (1.0 - sig))
    else:
        # 0.5 (1 + tanh(z)) == sigmoid(2z): no tanh needed, and no cancellation in 1 + tanh(z) for
        # gate << 0; d/dg sigmoid(2z) = sig (1 - sig) 2 dz/dg.
        gate_sq = gate * gate
        sig = tl.sigmoid(_GELU_TWO_K * gate * (1.0 + _GELU_C * gate_sq))
        act = gate * sig
        dact = sig + _GELU_TWO_K * gate * sig * (1.0 - sig) * (1.0 + 3.0 * _GELU_C * gate_sq)
    return act, dact


@CachedKernel
@triton.jit
def _gated_act_forward_kernel(
    gate_ptr,
    up_ptr,
    h_ptr,
    n_cols,
    n_col_blocks,
    stride_gate_m,
    stride_up_m,
    stride_h_m,
    ACTIVATION: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    # One program per (row, block of BLOCK_I columns); consecutive programs sweep one row.
    pid = tl.program_id(0)
    row = (pid // n_col_blocks).to(tl.int64)
    cols = (pid % n_col_blocks) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = cols < n_cols
    gate = tl.load(gate_ptr + row * stride_gate_m + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_up_m + cols, mask=mask, other=0.0).to(tl.float32)
    act, _ = _activation_and_derivative(gate, ACTIVATION)
    h = act * up
    tl.store(h_ptr + row * stride_h_m + cols, h.to(h_ptr.dtype.element_ty), mask=mask)


@CachedKernel
@triton.jit
def _gated_act_backward_kernel(
    grad_h_ptr,
    gate_ptr,
    up_ptr,
    grad_gate_ptr,
    grad_up_ptr,
    h_ptr,
    n_cols,
    n_col_blocks,
    stride_grad_h_m,
    stride_gate_m,
    stride_up_m,
    stride_grad_gate_m,
    stride_grad_up_m,
    stride_h_m,
    ACTIVATION: tl.constexpr,
    BLOCK_I: tl.constexpr,
    STORE_H: tl.constexpr,
):
    # STORE_H: also h = act(gate) * up into h_ptr (grad_h's own buffer for
    # `gated_act_backward_keeping_hidden_`: each program loads its grad_h elements before it stores).
    pid = tl.program_id(0)
    row = (pid // n_col_blocks).to(tl.int64)
    cols = (pid % n_col_blocks) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = cols < n_cols
    grad_h = tl.load(grad_h_ptr + row * stride_grad_h_m + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + row * stride_gate_m + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_up_m + cols, mask=mask, other=0.0).to(tl.float32)
    act, dact = _activation_and_derivative(gate, ACTIVATION)
    grad_gate = grad_h * up * dact
    grad_up = grad_h * act
    tl.store(
        grad_gate_ptr + row * stride_grad_gate_m + cols,
        grad_gate.to(grad_gate_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(grad_up_ptr + row * stride_grad_up_m + cols, grad_up.to(grad_up_ptr.dtype.element_ty), mask=mask)
    if STORE_H:  # h_ptr has gate's dtype (checked): h rounded once, as the forward rounded it
        tl.store(h_ptr + row * stride_h_m + cols, (act * up).to(h_ptr.dtype.element_ty), mask=mask)


def _launch_geometry(n_rows: int, n_cols: int) -> tuple[int, int, int, int]:
    """``(grid_size, n_col_blocks, BLOCK_I, num_warps)`` for an [n_rows, n_cols] launch."""
    block_i = min(_BLOCK_I_MAX, next_power_of_2(n_cols))
    n_col_blocks = cdiv(n_cols, block_i)
    num_warps = max(1, block_i // _COLUMNS_PER_WARP)
    return n_rows * n_col_blocks, n_col_blocks, block_i, num_warps


def _unit_column_stride(tensor: torch.Tensor) -> torch.Tensor:
    # The kernels index columns contiguously (16-byte loads); a transposed view is copied once here.
    # The MLP never passes one: its gate/up are rows of a GEMM output.
    return tensor if tensor.stride(1) == 1 or tensor.shape[1] <= 1 else tensor.contiguous()


def _gated_act_forward_triton(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    gate, up = _unit_column_stride(gate), _unit_column_stride(up)
    n_rows, n_cols = gate.shape
    h = torch.empty((n_rows, n_cols), dtype=gate.dtype, device=gate.device)
    if h.numel() == 0:
        return h
    grid_size, n_col_blocks, block_i, num_warps = _launch_geometry(n_rows, n_cols)
    _gated_act_forward_kernel[(grid_size,)](
        gate,
        up,
        h,
        n_cols,
        n_col_blocks,
        gate.stride(0),
        up.stride(0),
        h.stride(0),
        ACTIVATION=activation,
        BLOCK_I=block_i,
        num_warps=num_warps,
    )
    return h


def _gated_act_backward_triton(
    grad_h: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    in_place: bool = False,
    hidden_into_grad_h: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden_into_grad_h: grad_h <- h as well (grad_h needs a unit column stride then: no copy)."""
    if not hidden_into_grad_h:
        grad_h = _unit_column_stride(grad_h)
    gate, up = _unit_column_stride(gate), _unit_column_stride(up)
    n_rows, n_cols = gate.shape
    if in_place:  # each program loads its gate/up elements before it stores their gradients there
        grad_gate, grad_up = gate, up
    else:
        grad_gate = torch.empty((n_rows, n_cols), dtype=gate.dtype, device=gate.device)
        grad_up = torch.empty((n_rows, n_cols), dtype=gate.dtype, device=gate.device)
    if grad_gate.numel() == 0:
        return grad_gate, grad_up
    grid_size, n_col_blocks, block_i, num_warps = _launch_geometry(n_rows, n_cols)
    _gated_act_backward_kernel[(grid_size,)](
        grad_h,
        gate,
        up,
        grad_gate,
        grad_up,
        grad_h,
        n_cols,
        n_col_blocks,
        grad_h.stride(0),
        gate.stride(0),
        up.stride(0),
        grad_gate.stride(0),
        grad_up.stride(0),
        grad_h.stride(0),
        ACTIVATION=activation,
        BLOCK_I=block_i,
        STORE_H=hidden_into_grad_h,
        num_warps=num_warps,
    )
    return grad_gate, grad_up


def _check_inputs(gate: torch.Tensor, up: torch.Tensor, activation: str, grad_h: torch.Tensor | None = None):
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    if gate.dim() != 2:
        raise ValueError(f"gate: expected a 2-D tensor [M, I], got shape {tuple(gate.shape)}")
    named = [("up", up)] + ([] if grad_h is None else [("grad_h", grad_h)])
    for name, tensor in named:
        if tensor.shape != gate.shape:
            raise ValueError(
                f"{name}: expected shape {tuple(gate.shape)} (gate's), got {tuple(tensor.shape)}"
            )
        if tensor.device != gate.device:
            raise ValueError(f"{name}: expected device {gate.device} (gate's), got {tensor.device}")
    if gate.dtype not in _CHECKED_DTYPES:
        raise ValueError(f"gate: expected dtype in {_FLOAT_DTYPES}, got {gate.dtype}")
    if up.dtype != gate.dtype:
        raise ValueError(f"up: expected dtype {gate.dtype} (gate's), got {up.dtype}")
    if grad_h is not None and grad_h.dtype not in _CHECKED_DTYPES:
        raise ValueError(f"grad_h: expected dtype in {_FLOAT_DTYPES}, got {grad_h.dtype}")


@torch.library.custom_op(f"{OP_NAMESPACE}::gated_act_forward", mutates_args=())
def gated_act_forward(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """``h = act(gate) * up``. gate, up: [M, I], same float dtype; returns h: [M, I] in gate's dtype."""
    _check_inputs(gate, up, activation)
    if runs_triton(gate):
        return _gated_act_forward_triton(gate, up, activation)
    return _reference.gated_act_forward(gate, up, activation)


@gated_act_forward.register_fake
def _gated_act_forward_fake(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    _check_inputs(gate, up, activation)
    return gate.new_empty(gate.shape)


@torch.library.custom_op(f"{OP_NAMESPACE}::gated_act_backward", mutates_args=())
def gated_act_backward(
    grad_h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_gate, grad_up)`` of ``h = act(gate) * up``, recomputing ``act(gate)``.

    grad_h, gate, up: [M, I]; returns grad_gate = grad_h * up * act'(gate) and
    grad_up = grad_h * act(gate), both [M, I] in gate's dtype.
    """
    _check_inputs(gate, up, activation, grad_h)
    if runs_triton(gate):
        return _gated_act_backward_triton(grad_h, gate, up, activation)
    return _reference.gated_act_backward(grad_h, gate, up, activation)


@gated_act_backward.register_fake
def _gated_act_backward_fake(
    grad_h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_inputs(gate, up, activation, grad_h)
    return gate.new_empty(gate.shape), gate.new_empty(gate.shape)


def _forward_setup_context(ctx, inputs, output):
    gate, up, activation = inputs
    ctx.save_for_backward(gate, up)
    ctx.activation = activation


def _forward_backward(ctx, grad_h):
    gate, up = ctx.saved_tensors
    grad_gate, grad_up = gated_act_backward(grad_h, gate, up, ctx.activation)
    return grad_gate, grad_up, None


gated_act_forward.register_autograd(_forward_backward, setup_context=_forward_setup_context)


def gated_act_backward_(grad_h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str) -> None:
    """In place: gate <- grad_gate, up <- grad_up (same math as ``gated_act_backward``).

    For a caller that owns gate and up and needs them no more (the gated MLP's backward): saves two
    [M, I] buffers, the largest of a transformer layer's backward. gate and up need a unit column
    stride. `fastlora::gated_act_backward_`.
    """
    if skips_op_dispatch(grad_h, gate, up):
        _gated_act_backward_inplace_body(grad_h, gate, up, activation)
    else:
        _gated_act_backward_inplace_op(grad_h, gate, up, activation)


def _gated_act_backward_inplace_body(
    grad_h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str
) -> None:
    _check_inputs(gate, up, activation, grad_h)
    if gate.stride(-1) != 1 or up.stride(-1) != 1:
        raise ValueError("gated_act_backward_: gate and up need a unit column stride to be written in place")
    if runs_triton(gate):
        _gated_act_backward_triton(grad_h, gate, up, activation, in_place=True)
        return
    grad_gate, grad_up = _reference.gated_act_backward(grad_h, gate, up, activation)
    gate.copy_(grad_gate)
    up.copy_(grad_up)


_gated_act_backward_inplace_op = torch.library.custom_op(
    f"{OP_NAMESPACE}::gated_act_backward_", _gated_act_backward_inplace_body, mutates_args=("gate", "up")
)


def gated_act_backward_keeping_hidden_(
    grad_h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str
) -> None:
    """In place: gate <- grad_gate, up <- grad_up (as ``gated_act_backward_``), and grad_h <- h =
    act(gate) * up, rounded to gate's dtype as the forward stored it.

    For the gated MLP's backward past `gated_act_lora.FUSED_WEIGHT_GRAD_MAX_RANK`, whose dA_down then
    reads h from grad_h's buffer (`lora_weight_grad`): one more store than ``gated_act_backward_``
    and no buffer for h. grad_h needs gate's dtype and, like gate and up, a unit column stride.
    `fastlora::gated_act_backward_keeping_hidden_`.
    """
    if skips_op_dispatch(grad_h, gate, up):
        _keeping_hidden_body(grad_h, gate, up, activation)
    else:
        _keeping_hidden_op(grad_h, gate, up, activation)


def _keeping_hidden_body(grad_h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str) -> None:
    _check_inputs(gate, up, activation, grad_h)
    if grad_h.dtype != gate.dtype:
        raise ValueError(
            f"gated_act_backward_keeping_hidden_: grad_h must be {gate.dtype} (gate's), got {grad_h.dtype}"
        )
    if any(tensor.stride(-1) != 1 for tensor in (grad_h, gate, up)):
        raise ValueError("gated_act_backward_keeping_hidden_: grad_h, gate and up need a unit column stride")
    if runs_triton(gate):
        _gated_act_backward_triton(grad_h, gate, up, activation, in_place=True, hidden_into_grad_h=True)
        return
    hidden = _reference.gated_act_forward(gate, up, activation)
    grad_gate, grad_up = _reference.gated_act_backward(grad_h, gate, up, activation)
    gate.copy_(grad_gate)
    up.copy_(grad_up)
    grad_h.copy_(hidden)


_keeping_hidden_op = torch.library.custom_op(
    f"{OP_NAMESPACE}::gated_act_backward_keeping_hidden_",
    _keeping_hidden_body,
    mutates_args=("grad_h", "gate", "up"),
)
