"""The left operand of a dX GEMM that carries the LoRA term in its reduction (K) dimension.

    dX = g @ W + scale * (g @ B) @ A  =  [g | scale * gB | 0] @ [W ; A ; 0]

``lora_augmented_left(grad, grad_xa, scale, width)`` writes ``[grad | scale * grad_xa | 0]``, an
[M, width] tensor of grad's dtype, in one pass: grad copied, the fp32 ``grad_xa`` (``g @ B``, from
``lora_shrink``, token-major) scaled and rounded once, zeros up to ``width`` (the GEMM's K padded to a
multiple of 64 elements: on an H200 the GEMM of one 2048-row chunk of dh took 30-50 us (10-17%)
longer at K = 4112 than at 4160, the copy's time subtracted, `benchmarks.augmented_k_probe`).
torch's copy into the column slice of a wider buffer ran at about 1.1 TB/s there (30 us for a
[2048, 4096] bf16 g), which ate what the augmented GEMM saves.

A ``torch.library`` custom op (``fastlora::lora_augmented_left``) with a fake implementation; the
Triton kernel runs when ``runs_triton`` says so, the reference (``lora_augment_reference``) otherwise.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fastlora_peft.call_traces import trace_unit
from fastlora_peft.kernels import lora_augment_reference as reference
from fastlora_peft.kernels._backend import OP_NAMESPACE, runs_triton, skips_op_dispatch
from fastlora_peft.kernels._launch import BoundLaunch, CachedKernel, LaunchPlans, cdiv, empty_2d

_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@CachedKernel
@triton.jit
def _lora_augmented_left_kernel(
    Grad_ptr, Left_ptr, Out_ptr,
    M, N, R, W, scale,
    stride_gm, stride_gn, stride_lm, stride_lr, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Out[M, W] = [Grad[M, N] | scale * Left[M, R] | 0]; one program per (BLOCK_M, BLOCK_N) tile."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = rows < M
    in_grad = cols < N
    grad = tl.load(
        Grad_ptr + rows[:, None] * stride_gm + cols[None, :] * stride_gn,
        mask=mask_m[:, None] & in_grad[None, :],
        other=0.0,
    ).to(tl.float32)
    left_cols = cols - N
    in_left = (left_cols >= 0) & (left_cols < R)
    left = tl.load(
        Left_ptr + rows[:, None] * stride_lm + left_cols[None, :] * stride_lr,
        mask=mask_m[:, None] & in_left[None, :],
        other=0.0,
    )
    # Masked lanes load 0, so the padding columns come out as zeros.
    value = tl.where(in_grad[None, :], grad, scale * left.to(tl.float32))
    tl.store(
        Out_ptr + rows[:, None] * stride_om + cols[None, :],
        value.to(Out_ptr.dtype.element_ty),
        mask=mask_m[:, None] & (cols < W)[None, :],
    )


# 256 columns (8 16-bit elements a thread, one warp wide) by 16 rows, 4 warps: the copy's tiles.
_BLOCK_M, _BLOCK_N = 16, 256


def _lora_augmented_left_triton(
    grad: torch.Tensor, grad_xa: torch.Tensor, scale: float, width: int, *, block_m=_BLOCK_M, block_n=_BLOCK_N
) -> torch.Tensor:
    plan_key = None
    if block_m == _BLOCK_M and block_n == _BLOCK_N and _AUGMENTED_LEFT_PLANS.enabled:
        plan_key = _AUGMENTED_LEFT_PLANS.key(grad, grad_xa, width)
        plan = _AUGMENTED_LEFT_PLANS.get(plan_key)
        if plan is not None:
            return _run_augmented_left_plan(plan, grad, grad_xa, scale)
    tokens, out_features = grad.shape
    rank = grad_xa.shape[1]
    out = torch.empty((tokens, width), dtype=grad.dtype, device=grad.device)
    if out.numel() == 0:
        return out
    grid = (cdiv(width, block_n), cdiv(tokens, block_m))
    sizes = (tokens, out_features, rank, width)
    strides = (grad.stride(0), grad.stride(1), grad_xa.stride(0), grad_xa.stride(1), out.stride(0))
    bound = _lora_augmented_left_kernel[grid](
        grad, grad_xa, out, *sizes, float(scale), *strides, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4
    )
    if plan_key is not None and bound is not None:
        _AUGMENTED_LEFT_PLANS.add(
            plan_key, _AugmentedLeftPlan(bound, grad.dtype, grad.device, sizes, strides)
        )
    return out


class _AugmentedLeftPlan(NamedTuple):
    """What `_lora_augmented_left_triton` derived from its inputs' metadata, to launch the same again."""

    launch: BoundLaunch
    dtype: torch.dtype
    device: torch.device
    sizes: tuple[int, ...]  # tokens, out_features, rank, width
    strides: tuple[int, ...]


# Every fused backward that takes the augmented path launches this once: planned like the LoRA terms'
# launches (`_launch.LaunchPlans`), so a repeat skips the launcher's key and its input checks.
_AUGMENTED_LEFT_PLANS = LaunchPlans("lora_augmented_left")


@trace_unit
def _run_augmented_left_plan(plan: _AugmentedLeftPlan, grad, grad_xa, scale) -> torch.Tensor:
    tokens, width = plan.sizes[0], plan.sizes[3]
    out = empty_2d(tokens, width, plan.dtype, plan.device)
    plan.launch(grad, grad_xa, out, *plan.sizes, float(scale), *plan.strides)
    return out


def _check_augmented_left(grad: torch.Tensor, grad_xa: torch.Tensor, width: int) -> None:
    op = "lora_augmented_left"
    if grad.dim() != 2 or grad_xa.dim() != 2:
        raise ValueError(
            f"{op}: grad [M, N] and grad_xa [M, R] must be 2-D, got {grad.dim()}-D and {grad_xa.dim()}-D"
        )
    if grad.dtype not in _GRAD_DTYPES:
        raise ValueError(f"{op}: grad must be float32, bfloat16, float16 or float64, got {grad.dtype}")
    if grad_xa.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{op}: grad_xa must be float32 (a shrink's output), got {grad_xa.dtype}")
    if grad_xa.shape[0] != grad.shape[0]:
        raise ValueError(f"{op}: grad has {grad.shape[0]} rows, grad_xa {grad_xa.shape[0]}")
    if width < grad.shape[1] + grad_xa.shape[1]:
        raise ValueError(f"{op}: width {width} < N + R = {grad.shape[1] + grad_xa.shape[1]}")
    if grad.device != grad_xa.device:
        raise ValueError(
            f"{op}: grad and grad_xa must be on one device, got {grad.device} and {grad_xa.device}"
        )


def lora_augmented_left(grad: torch.Tensor, grad_xa: torch.Tensor, scale: float, width: int) -> torch.Tensor:
    """``[grad | scale * grad_xa | 0]`` ([M, width], grad's dtype): `fastlora::lora_augmented_left`."""
    if skips_op_dispatch(grad, grad_xa):
        return _lora_augmented_left_body(grad, grad_xa, scale, width)
    return lora_augmented_left_op(grad, grad_xa, scale, width)


def _lora_augmented_left_body(
    grad: torch.Tensor, grad_xa: torch.Tensor, scale: float, width: int
) -> torch.Tensor:
    """grad: [M, N] any float dtype and strides; grad_xa: [M, R] float32, any strides; width >= N + R.
    Returns [M, width] of grad's dtype, contiguous; ``scale * grad_xa`` is rounded once."""
    if _AUGMENTED_LEFT_PLANS.serve(grad):  # a plan's key holds what the checks read (lora_terms)
        plan = _AUGMENTED_LEFT_PLANS.get(_AUGMENTED_LEFT_PLANS.key(grad, grad_xa, width))
        if plan is not None:
            return _run_augmented_left_plan(plan, grad, grad_xa, scale)
    _check_augmented_left(grad, grad_xa, width)
    if runs_triton(grad) and grad_xa.dtype == torch.float32:
        return _lora_augmented_left_triton(grad, grad_xa, scale, width)
    return reference.lora_augmented_left(grad, grad_xa, scale, width)


lora_augmented_left_op = torch.library.custom_op(
    f"{OP_NAMESPACE}::lora_augmented_left", _lora_augmented_left_body, mutates_args=()
)


@lora_augmented_left_op.register_fake
def _(grad: torch.Tensor, grad_xa: torch.Tensor, scale: float, width: int) -> torch.Tensor:
    _check_augmented_left(grad, grad_xa, width)
    return grad.new_empty((grad.shape[0], width))
