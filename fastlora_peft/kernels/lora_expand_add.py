"""``lora_expand_add(base, left, right, scale, out_dtype)``: ``base + scale * left @ right.T``, the LoRA
term added to the frozen layer's output in registers and rounded to ``out_dtype`` once; and
``lora_expand_add_``, the same in place. One of the three LoRA terms (see `lora_terms`, which hands
out all three ops). `expand_term`, the kernel's rank loop, is also the LoRA term of the gated
activation's forward and of `lora_addmm`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fastlora_peft.call_traces import trace_unit
from fastlora_peft.kernels import lora_terms_reference as reference
from fastlora_peft.kernels._backend import OP_NAMESPACE, runs_triton, skips_op_dispatch
from fastlora_peft.kernels._launch import BoundLaunch, CachedKernel, LaunchPlans, cdiv, empty_2d, tensor_key
from fastlora_peft.kernels._lora_common import (
    _CHECKED_DTYPES,
    _check_2d,
    _check_devices,
    _check_dim,
    _check_fp32,
    _rank_block,
)
from fastlora_peft.kernels.dots import expand_dot_precision, term_dot

# ---------------------------------------------------------------------------------------------------
# Kernels. Row offsets are widened to int64 before they meet a stride: M * stride passes 2**31 at,
# e.g., 16k tokens of a 128k-wide tensor. Tile offsets stay int32 and move the (64-bit) pointers.
# ---------------------------------------------------------------------------------------------------


@triton.jit
def expand_term(
    Left_ptr, Right_ptr, rows, mask_m, offs_n, mask_n, R,
    stride_lm, stride_lr, stride_rn, stride_rr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr,
    RANK_STAGES: tl.constexpr = None,
):  # fmt: skip
    """Left[rows, :R] @ Right[offs_n, :R]^T in fp32, [BLOCK_M, BLOCK_N], BLOCK_R ranks per dot; rows
    int64. The LoRA term of lora_expand_add, and of the gated activation that adds gate's and up's.
    RANK_STAGES: the rank loop's software-pipelining stages (None: the kernel's num_stages)."""
    offs_r = tl.arange(0, BLOCK_R)
    left_ptrs = Left_ptr + rows[:, None] * stride_lm + offs_r[None, :] * stride_lr
    right_ptrs = Right_ptr + offs_r[:, None] * stride_rr + offs_n[None, :] * stride_rn  # [BLOCK_R, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in tl.range(0, R, BLOCK_R, num_stages=RANK_STAGES):
        mask_r = offs_r + r0 < R
        left = tl.load(left_ptrs, mask=mask_m[:, None] & mask_r[None, :], other=0.0)
        right = tl.load(right_ptrs, mask=mask_r[:, None] & mask_n[None, :], other=0.0)
        acc = term_dot(left, right, acc, DOT_PRECISION=DOT_PRECISION)
        left_ptrs += BLOCK_R * stride_lr
        right_ptrs += BLOCK_R * stride_rr
    return acc


@CachedKernel
@triton.jit
def _lora_expand_add_kernel(
    Base_ptr, Left_ptr, Right_ptr, Out_ptr,
    M, N, R, scale,
    stride_bm, stride_bn, stride_lm, stride_lr, stride_rn, stride_rr, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Out[M, N] = Base + scale * Left[M, R] @ Right[N, R]^T; one program per (BLOCK_M, BLOCK_N) tile."""
    # Axis 0 walks along N so neighbouring programs share one Left tile and one band of Base rows.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    rows = offs_m.to(tl.int64)
    mask = mask_m[:, None] & mask_n[None, :]
    # Base is loaded before the rank loop, so its latency can overlap the dot (the loop has one or few
    # trips: nothing for the pipeliner). Alone it was within noise: with fp32 adapters (3xTF32 either
    # way) 57us against 60 before at M=8192, N=4096, rank 16, on two H200 machines of one session.
    base = tl.load(Base_ptr + rows[:, None] * stride_bm + offs_n[None, :] * stride_bn, mask=mask, other=0.0)
    acc = expand_term(
        Left_ptr, Right_ptr, rows, mask_m, offs_n, mask_n, R,
        stride_lm, stride_lr, stride_rn, stride_rr,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=BLOCK_R, DOT_PRECISION=DOT_PRECISION,
    )  # fmt: skip
    out = base.to(tl.float32) + scale * acc
    tl.store(
        Out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_on,
        out.to(Out_ptr.dtype.element_ty),
        mask=mask,
    )


# ---------------------------------------------------------------------------------------------------
# Launchers. Keyword-only block sizes default to the GPU choice; tests pass small ones to cover
# several tiles and loop trips on tiny shapes. Callers have checked shapes, dtypes and devices.
# ---------------------------------------------------------------------------------------------------


def _lora_expand_add_triton(
    *,
    base: torch.Tensor,
    left: torch.Tensor,
    right: torch.Tensor,
    scale: float,
    out_dtype: torch.dtype,
    block_m: int | None = None,
    block_n: int | None = None,
    block_r: int | None = None,
    out: torch.Tensor | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
) -> torch.Tensor:
    plan_key = None
    defaults = block_m is None and block_n is None and block_r is None and num_stages is None
    if defaults and _EXPAND_ADD_PLANS.enabled:
        plan_key = _expand_add_plan_key(base, left, right, out_dtype, out, num_warps)
        plan = _EXPAND_ADD_PLANS.get(plan_key)
        if plan is not None:
            return _run_expand_add_plan(plan, base, left, right, scale, out)
    M, N = base.shape
    R = left.shape[1]
    # out may be base itself: each program loads its base tile before it stores the same tile.
    out = torch.empty((M, N), dtype=out_dtype, device=base.device) if out is None else out
    if out.numel() == 0:
        return out
    # tl.dot's second operand wants its reduction (rank) dim contiguous: with right = lora_a.T the op
    # took 214us instead of 104us on an H200 (M=8192, N=4096, rank 64), so copy that small adapter.
    right_copied = right.stride(1) != 1
    right = right.contiguous() if right_copied else right
    block_r = block_r or _rank_block(R, cap=64)
    precision = expand_dot_precision(out_dtype, right.dtype)
    # H200, M=8192, in place (scratch sweep of 36 configs: 32/64/128 x 64/128/256 tiles, 4/8 warps,
    # 1/2 stages; `benchmarks.tune_lora_terms --expand-add` sweeps a superset), then the launcher's
    # defaults timed alone, against an in-place `mul_` (a pure read and write) at 36 and 114us:
    # * plain tf32 (into bf16; with 16-bit adapters here, fp32 ones since the ninth session took 41 and
    #   128us at rank 16 with the tiles below, `benchmarks.dot_modes_probe`): 32 x 256 tiles, 49us at
    #   N=4096 and 163us at N=14336 for rank 16, 66 and 211us for rank 64; before (3xTF32, 64 x 128,
    #   3 stages) 62, 191, 157, 527us.
    #   Seventh session, same machine type, 6 candidates x ranks 8/16/64/128 x M 2048/8192 (bf16
    #   adapters, `docs/benchmarks/session7/tune_expand_add_ranks.log`): up to rank 16, 64 x 128 with 3 stages
    #   beat 32 x 256 with 2 (rank 16: 41.8 against 47.5us at N=4096, 129 against 155 at N=14336;
    #   M=2048 N=14336, an MLP chunk's dh: 37.5 against 43.4; rank 8 within 3%); at rank 64 it was
    #   2-6% slower, so wider rank tiles keep 32 x 256.
    # * 3xTF32 (fp32/fp16 outputs; fp32 adapters before): 64 x 128 at rank 16, 57 and 181us; 64 x 64 above,
    #   104 and 340us at rank 64 (32 x 256 took 3000us at rank 64 there: three dots of that tile spill).
    if precision == "tf32" and block_r <= 16:
        block_m, block_n, num_stages = block_m or 64, block_n or 128, num_stages or 3
    elif precision == "tf32":
        block_m, block_n = block_m or 32, block_n or 256
    else:
        block_m, block_n = block_m or 64, block_n or (128 if block_r <= 16 else 64)
    num_stages = num_stages or 2
    grid = (cdiv(N, block_n), cdiv(M, block_m))
    bound = _lora_expand_add_kernel[grid](
        base, left, right, out,
        M, N, R, float(scale),
        base.stride(0), base.stride(1), left.stride(0), left.stride(1),
        right.stride(0), right.stride(1), out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r,
        DOT_PRECISION=precision,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if plan_key is not None and bound is not None:
        _EXPAND_ADD_PLANS.add(plan_key, _ExpandAddPlan(
            bound, right_copied, out_dtype, base.device, (M, N), (M, N, R),
            (base.stride(0), base.stride(1), left.stride(0), left.stride(1),
             right.stride(0), right.stride(1), out.stride(0), out.stride(1)),
        ))  # fmt: skip
    return out


class _ExpandAddPlan(NamedTuple):
    """What `_lora_expand_add_triton` derived from its inputs' metadata, to launch the same again."""

    launch: BoundLaunch
    copy_right: bool  # right was copied to a contiguous one first (its strides below are the copy's)
    out_dtype: torch.dtype
    device: torch.device
    out_shape: tuple[int, int]
    sizes: tuple[int, ...]  # M, N, R
    strides: tuple[int, ...]


_EXPAND_ADD_PLANS = LaunchPlans("lora_expand_add")


def _expand_add_plan_key(base, left, right, out_dtype, out, num_warps=4) -> tuple:
    # `out` is base itself (in place), a buffer of the caller's (its metadata in the key) or new.
    out_key = "base" if out is base else None if out is None else tensor_key(out)
    return _EXPAND_ADD_PLANS.key(base, left, right, out_dtype, out_key, num_warps)


@trace_unit
def _run_expand_add_plan(plan, base, left, right, scale, out) -> torch.Tensor:
    right = right.contiguous() if plan.copy_right else right
    out = empty_2d(*plan.out_shape, plan.out_dtype, plan.device) if out is None else out
    plan.launch(base, left, right, out, *plan.sizes, float(scale), *plan.strides)
    return out


# ---------------------------------------------------------------------------------------------------
# Public ops: checks, dispatch, fake implementations. The op bodies look their launch plan up before
# their checks (lora_terms' `_PLANS_SKIP_CHECKS`).
# ---------------------------------------------------------------------------------------------------


def _check_expand_add(
    base: torch.Tensor, left: torch.Tensor, right: torch.Tensor, out_dtype: torch.dtype
) -> None:
    op = "lora_expand_add"
    _check_2d(op, "base", base, "[M, N]")
    _check_2d(op, "left", left, "[M, R]")
    _check_2d(op, "right", right, "[N, R]")
    _check_fp32(op, "left", left)
    _check_dim(op, "left", left, "[M, R]", 0, base.shape[0], "M (base.shape[0])")
    _check_dim(op, "right", right, "[N, R]", 0, base.shape[1], "N (base.shape[1])")
    _check_dim(op, "right", right, "[N, R]", 1, left.shape[1], "R (left.shape[1])")
    if out_dtype not in _CHECKED_DTYPES:
        raise ValueError(f"{op}: out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    _check_devices(op, base=base, left=left, right=right)


def lora_expand_add(
    base: torch.Tensor, left: torch.Tensor, right: torch.Tensor, scale: float, out_dtype: torch.dtype
) -> torch.Tensor:
    """``base + scale * left @ right.T``: `fastlora::lora_expand_add` (see `_lora_expand_add_body`)."""
    if skips_op_dispatch(base, left, right):
        return _lora_expand_add_body(base, left, right, scale, out_dtype)
    return lora_expand_add_op(base, left, right, scale, out_dtype)


def _lora_expand_add_body(
    base: torch.Tensor, left: torch.Tensor, right: torch.Tensor, scale: float, out_dtype: torch.dtype
) -> torch.Tensor:
    """``base + scale * left @ right.T``, computed in fp32 and rounded once to ``out_dtype``.

    base: [M, N], any float dtype; left: [M, R] float32; right: [N, R], any float dtype and strides
    (``lora_a.T`` is fine). Returns [M, N] out_dtype, contiguous.
    """
    if _EXPAND_ADD_PLANS.serve(base):  # see lora_terms' `_PLANS_SKIP_CHECKS`
        plan = _EXPAND_ADD_PLANS.get(_expand_add_plan_key(base, left, right, out_dtype, None))
        if plan is not None:
            return _run_expand_add_plan(plan, base, left, right, scale, None)
    _check_expand_add(base, left, right, out_dtype)
    if runs_triton(base):
        return _lora_expand_add_triton(base=base, left=left, right=right, scale=scale, out_dtype=out_dtype)
    return reference.lora_expand_add(base, left, right, scale, out_dtype).contiguous()


def lora_expand_add_(
    base: torch.Tensor, left: torch.Tensor, right: torch.Tensor, scale: float
) -> torch.Tensor:
    """In place: ``base += scale * left @ right.T`` (fp32 sum, one rounding to base's dtype); returns base.

    For a caller that owns ``base`` (a fresh base-matmul output): saves one [M, N] buffer per call.
    base must be contiguous. `fastlora::lora_expand_add_` (see `_lora_expand_add_inplace_body`).
    """
    if skips_op_dispatch(base, left, right):
        _lora_expand_add_inplace_body(base, left, right, scale)
    else:
        lora_expand_add_inplace_op(base, left, right, scale)
    return base


def _lora_expand_add_inplace_body(
    base: torch.Tensor, left: torch.Tensor, right: torch.Tensor, scale: float
) -> None:
    if _EXPAND_ADD_PLANS.serve(base):  # see lora_terms' `_PLANS_SKIP_CHECKS`
        plan = _EXPAND_ADD_PLANS.get(_expand_add_plan_key(base, left, right, base.dtype, base))
        if plan is not None:
            _run_expand_add_plan(plan, base, left, right, scale, base)
            return
    _check_expand_add(base, left, right, base.dtype)
    if not base.is_contiguous():
        raise ValueError(f"lora_expand_add_: base must be contiguous, got strides {base.stride()}")
    if runs_triton(base):
        _lora_expand_add_triton(
            base=base, left=left, right=right, scale=scale, out_dtype=base.dtype, out=base
        )
    else:
        base.copy_(reference.lora_expand_add(base, left, right, scale, base.dtype))


lora_expand_add_inplace_op = torch.library.custom_op(
    f"{OP_NAMESPACE}::lora_expand_add_", _lora_expand_add_inplace_body, mutates_args=("base",)
)


lora_expand_add_op = torch.library.custom_op(
    f"{OP_NAMESPACE}::lora_expand_add", _lora_expand_add_body, mutates_args=()
)


@lora_expand_add_op.register_fake
def _(
    base: torch.Tensor, left: torch.Tensor, right: torch.Tensor, scale: float, out_dtype: torch.dtype
) -> torch.Tensor:
    _check_expand_add(base, left, right, out_dtype)
    return base.new_empty(base.shape, dtype=out_dtype)
