"""``lora_weight_grad(left, x, scale)``: ``scale * left.T @ x`` summed over the tokens, the gradient
of A or (transposed) B, accumulated in fp32 and rounded once. One of the three LoRA terms (see
`lora_terms`, which hands out all three ops).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from fastlora_peft.call_traces import trace_unit
from fastlora_peft.kernels import lora_terms_reference as reference
from fastlora_peft.kernels._backend import OP_NAMESPACE, runs_triton, skips_op_dispatch
from fastlora_peft.kernels._launch import BoundLaunch, CachedKernel, LaunchPlans, cdiv, empty_2d
from fastlora_peft.kernels._lora_common import (
    _check_2d,
    _check_devices,
    _check_dim,
    _check_fp32,
    _num_sms,
    _rank_block,
    one_wave_splits,
)
from fastlora_peft.kernels.dots import activation_dot, dot_precision, weight_grad_dot_mode
from fastlora_peft.kernels.split_sum import split_scratch, split_total

# ---------------------------------------------------------------------------------------------------
# Kernels. Row offsets are widened to int64 before they meet a stride: M * stride passes 2**31 at,
# e.g., 16k tokens of a 128k-wide tensor. Tile offsets stay int32 and move the (64-bit) pointers.
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _weight_grad_loop(
    X_ptr, Left_ptr, offs_m, offs_k, offs_r, mask_k, mask_r, m_start, m_end,
    stride_xm, stride_xk, stride_lm, stride_lr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_MODE: tl.constexpr,
):  # fmt: skip
    """The fp32 [BLOCK_K, BLOCK_R] tile of Out^T = X^T @ Left over the token rows [m_start, m_end), in
    steps of BLOCK_M rows (`offs_m`: 0 to BLOCK_M - 1):
    the loop of a weight-gradient program (`_lora_weight_grad_kernel`, `lora_weight_grad_group`'s)."""
    # Computed as its transpose, Out^T[K, R] = X^T @ Left, so the activation is tl.dot's first operand,
    # which may come from registers in any layout; a 32-bit second operand wants its reduction (token)
    # dim contiguous, which the launcher arranges for Left. On an H200 (M=8192, K=4096, rank 64) this
    # takes 91us against 189us for Left^T @ X with X, token-strided, as the second operand.
    acc = tl.zeros((BLOCK_K, BLOCK_R), dtype=tl.float32)
    for m0 in range(m_start, m_end, BLOCK_M):
        rows = m0 + offs_m
        mask_m = rows < m_end
        rows = rows.to(tl.int64)
        # X^T tile [BLOCK_K, BLOCK_M], loaded through transposed pointers.
        x_t_ptrs = X_ptr + offs_k[:, None] * stride_xk + rows[None, :] * stride_xm
        # Left is always fp32 (a shrink's output): the split dot for a bf16 X, else the fp32 one.
        x_t = tl.load(x_t_ptrs, mask=mask_k[:, None] & mask_m[None, :], other=0.0)
        left_ptrs = Left_ptr + rows[:, None] * stride_lm + offs_r[None, :] * stride_lr
        left = tl.load(left_ptrs, mask=mask_m[:, None] & mask_r[None, :], other=0.0)
        acc = activation_dot(x_t, left, acc, DOT_MODE=DOT_MODE, DOT_PRECISION=DOT_PRECISION)
    return acc


@triton.jit
def _store_weight_grad(
    acc, scale, Out_ptr, Partial_ptr, Counter_ptr, offs_k, offs_r, mask_k, mask_r, pid_k, pid_r, pid_s,
    n_splits, R, K, k_before, stride_ok, stride_or, SPLIT: tl.constexpr,
):  # fmt: skip
    """Out's [R, K] tile (its transpose in `acc`) = scale * the program's sum in Out's dtype; with
    SPLIT the splits' sums met in `split_total`: fp32 partials from n_splits * R * k_before past
    Partial_ptr (a group's earlier problems' before them), split stride R * K, one counter per
    (column tile, rank tile)."""
    offsets = offs_k[:, None] * stride_ok + offs_r[None, :] * stride_or
    mask = mask_k[:, None] & mask_r[None, :]
    if SPLIT:
        partials = Partial_ptr + n_splits * R * k_before
        counter_ptr = Counter_ptr + pid_k * tl.num_programs(2) + pid_r
        is_last, total = split_total(acc, partials, offsets, mask, pid_s, n_splits, R * K, counter_ptr)
        if is_last:
            tl.store(Out_ptr + offsets, (scale * total).to(Out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(Out_ptr + offsets, (scale * acc).to(Out_ptr.dtype.element_ty), mask=mask)


@CachedKernel
@triton.jit
def _lora_weight_grad_kernel(
    Left_ptr, X_ptr, Out_ptr, Partial_ptr, Counter_ptr,
    M, R, K, scale, rows_per_split, n_splits,
    stride_lm, stride_lr, stride_xm, stride_xk, stride_or, stride_ok,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_MODE: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """Out[R, K] = scale * Left[M, R]^T @ X[M, K], in Out's dtype and strides.

    One program per (BLOCK_K columns, split, BLOCK_R ranks); split s sums rows [s * rows_per_split,
    ...). With SPLIT (n_splits > 1), the splits meet in `split_total` through fp32 partials laid out
    like Out ([n_splits, ...], split stride R * K) and one counter per tile.
    """
    pid_k = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_r = tl.program_id(2)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    mask_r = offs_r < R
    mask_k = offs_k < K
    m_start = pid_s * rows_per_split
    m_end = tl.minimum(m_start + rows_per_split, M)
    acc = _weight_grad_loop(
        X_ptr, Left_ptr, offs_m, offs_k, offs_r, mask_k, mask_r, m_start, m_end,
        stride_xm, stride_xk, stride_lm, stride_lr,
        BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K, DOT_PRECISION=DOT_PRECISION, DOT_MODE=DOT_MODE,
    )  # fmt: skip
    _store_weight_grad(
        acc, scale, Out_ptr, Partial_ptr, Counter_ptr, offs_k, offs_r, mask_k, mask_r, pid_k, pid_r, pid_s,
        n_splits, R, K, 0, stride_ok, stride_or, SPLIT=SPLIT,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# Launchers. Keyword-only block sizes default to the GPU choice; tests pass small ones to cover
# several tiles and loop trips on tiny shapes. Callers have checked shapes, dtypes and devices.
# ---------------------------------------------------------------------------------------------------


# Fewest token rows one split of lora_weight_grad covers. Each split writes and the sum re-reads an
# [R, K] fp32 partial (8 * R * K bytes) against 2 * rows * K bytes of 16-bit x it streams; at rank 64
# and 512 rows the partials cost half the x traffic, so splits stop there.
_MIN_ROWS_PER_SPLIT = 512


# Token rows per step of `lora_weight_grad`'s kernel, at every rank. H200, bf16 x, fp32 left (the split
# dot), each launch timed by its kernel with L2 flushed (docs/benchmarks/session30/
# wgrad_rows_probe.log): at 8192 tokens and K=4096, ranks 32, 48 (q/k/v's stacked dA), 64 and 128
# took 30.0 / 39.9 / 42.6 / 70.0us in 64-row steps against 36.4 / 49.6 / 51.2 / 99.8 in the 128-row
# steps they took before (the grouped kernel's rule, tuned for the tf32x3 dot the split dot replaced). At
# 2048 tokens 128 rows were ahead by at most 2.5us (rank 64), and behind by 5.7us at rank 128.
_SINGLE_BLOCK_M = 64


def weight_grad_tiling(rank: int, columns: int, tokens: int) -> tuple[int, int]:
    """(token rows per step, warps) of the grouped kernel's programs (`lora_weight_grad_group`) for
    problems of `rank` ranks over `columns` (K) columns and `tokens` rows; its rank tile is
    `_rank_block(rank, cap=64)`."""
    block_r = _rank_block(rank, cap=64)
    # H200, M=8192, bf16 x, fp32 left (tf32x3): at K=4096 and rank 32, 128-row steps took 58us against
    # 127us for 64 rows; at rank 16, or K=14336, 64 rows were as fast or faster. With the split dot, o's
    # dA and dB at rank 32 and 8192 tokens still took 59.5us in 128-row steps against 71.7 in 64; at
    # 2048 tokens rank 32 went the other way, 24.8 against 20.5 (session30/wgrad_rows_probe.log). Rank
    # 16, the usual, takes 64 rows either way.
    # 64-wide rank tiles (33+ ranks) over up to 8192 columns: 64 rows and 4 warps, against 128 rows
    # and 8 warps, read at 8192 tokens 0.90 / 0.95 / 0.78x (q/k/v's three dB at rank 48 / 64 / 128)
    # and 0.89 / 0.92 / 0.84x (o_proj's dA and dB); at 2048 tokens 0.87 / 0.88-0.92x at rank 128 but
    # 1.00-1.12x at 48 and 64, which keep the old tiling there (one rank tile, under 8192 tokens).
    # 64 rows with 8 warps read no better than before (q/k/v's dB 87.9us at rank 64 against 81.5,
    # 155.7 at 128, split once, against 164.1; 77.6 / 130.8 with 4 warps). Past 8192 columns (the
    # MLP's gate/up dB, 64 rows already) 8 warps stayed ahead: 4 read 1.03 / 1.15 / 1.10x at ranks
    # 32 / 64 / 128.
    # (docs/benchmarks/session48/wgrad_rank_probe.log, wgrad_rule_ab.log.)
    if block_r == 64 and columns <= 8192 and (rank > 64 or tokens >= 8192):
        return 64, 4
    return (128 if block_r >= 32 and columns <= 8192 else 64), 8


def token_splits(M: int, tiles: int, device: torch.device) -> int:
    """Token splits of `lora_weight_grad`'s launch of `tiles` (column x rank) tiles over M tokens: as
    many as keep every program within one wave of two programs per SM, none under
    `_MIN_ROWS_PER_SPLIT` rows a split.

    One program per column tile walking all rows instead was 1.1-1.6x slower at 8192 and 2048
    tokens, except at K=14336, rank 16, 2048 tokens (29 against 30us; `tune_lora_terms
    --weight-grad-unsplit`). Rounded up instead (a wave and a bit, the rule before), q/k/v's dA at
    8192 tokens made 9 splits: 52.3us against 39.8 in 8 (`_SINGLE_BLOCK_M`'s log). At K=14336 and
    rank 16 that rule's 3 splits were faster, 72.6 against 77.4us; no fused Function launches that
    shape alone (the MLP groups its dB, and its dA is fused into the gated backward).
    """
    return one_wave_splits(tiles, 2 * _num_sms(device), cdiv(M, _MIN_ROWS_PER_SPLIT))


def _lora_weight_grad_triton(
    *,
    left: torch.Tensor,
    x: torch.Tensor,
    scale: float,
    k_major: bool = False,
    out_dtype: torch.dtype = torch.float32,
    rounded_to: torch.dtype | None = None,
    split: int | None = None,
    block_m: int | None = None,
    block_k: int = 128,
    block_r: int | None = None,
    num_warps: int = 8,
    num_stages: int = 3,
) -> torch.Tensor:
    plan_key = None
    defaults = split is None and block_m is None and block_k == 128 and block_r is None
    if defaults and num_warps == 8 and num_stages == 3 and _WEIGHT_GRAD_PLANS.enabled:
        plan_key = _weight_grad_plan_key(left, x, k_major, out_dtype, rounded_to)
        plan = _WEIGHT_GRAD_PLANS.get(plan_key)
        if plan is not None:
            return _run_weight_grad_plan(plan, left, x, scale)
    M, R = left.shape
    K = x.shape[1]
    # K-major ([K, R] in memory) when the caller wants the transpose contiguous (dB = result.T).
    out = empty_2d(R, K, out_dtype, x.device, column_major=k_major)
    if M == 0 or R == 0 or K == 0:
        return out.zero_()
    # The kernel wants left's token dim contiguous (see there): 91 vs 116us at rank 64, 157 vs 227us at
    # rank 128 on an H200 (M=8192, K=4096), for a transposed copy of left (M * R * 4 bytes, 2 MB).
    left_copied = left.stride(0) != 1
    left = left.T.contiguous().T if left_copied else left
    block_r = block_r or _rank_block(R, cap=64)
    block_m = block_m or _SINGLE_BLOCK_M
    k_tiles, r_tiles = cdiv(K, block_k), cdiv(R, block_r)
    if split is None:
        split = token_splits(M, k_tiles * r_tiles, x.device)
    rows_per_split = cdiv(cdiv(M, max(split, 1)), block_m) * block_m
    split = cdiv(M, rows_per_split)  # no empty splits
    # Deterministic: the splits' fp32 partials are summed in split order inside the kernel (split_sum).
    partial, counters = split_scratch(x.device, split * R * K, k_tiles * r_tiles) if split > 1 else (out, out)
    grid = (k_tiles, split, r_tiles)
    bound = _lora_weight_grad_kernel[grid](
        left, x, out, partial, counters,
        M, R, K, float(scale), rows_per_split, split,
        left.stride(0), left.stride(1), x.stride(0), x.stride(1), out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k,
        DOT_PRECISION=dot_precision(left.dtype, x.dtype),
        DOT_MODE=weight_grad_dot_mode(x, left, rounded_to or out_dtype), SPLIT=split > 1,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if plan_key is not None and bound is not None:
        _WEIGHT_GRAD_PLANS.add(plan_key, _WeightGradPlan(
            bound, left_copied, out_dtype, x.device, k_major, (R, K),
            (split * R * K, k_tiles * r_tiles) if split > 1 else None,
            (M, R, K), (rows_per_split, split),
            (left.stride(0), left.stride(1), x.stride(0), x.stride(1), out.stride(0), out.stride(1)),
        ))  # fmt: skip
    return out


class _WeightGradPlan(NamedTuple):
    """What `_lora_weight_grad_triton` derived from its inputs' metadata, to launch the same again."""

    launch: BoundLaunch
    copy_left: bool  # left was copied token-major first (its strides below are the copy's)
    out_dtype: torch.dtype
    device: torch.device
    k_major: bool
    out_shape: tuple[int, int]  # (R, K): column-major when k_major
    scratch: Optional[tuple[int, int]]
    sizes: tuple[int, ...]  # M, R, K
    splits: tuple[int, int]  # rows_per_split, n_splits
    strides: tuple[int, ...]


_WEIGHT_GRAD_PLANS = LaunchPlans("lora_weight_grad")


def _weight_grad_plan_key(left, x, k_major: bool, out_dtype: torch.dtype, rounded_to) -> tuple:
    """The one key of a weight-grad plan (out_dtype resolved: None is float32; rounded_to as given)."""
    return _WEIGHT_GRAD_PLANS.key(left, x, k_major, out_dtype, rounded_to)


@trace_unit
def _run_weight_grad_plan(plan: _WeightGradPlan, left, x, scale) -> torch.Tensor:
    left = left.T.contiguous().T if plan.copy_left else left
    out = empty_2d(*plan.out_shape, plan.out_dtype, plan.device, column_major=plan.k_major)
    partial, counters = split_scratch(plan.device, *plan.scratch) if plan.scratch else (out, out)
    plan.launch(left, x, out, partial, counters, *plan.sizes, float(scale), *plan.splits, *plan.strides)
    return out


# ---------------------------------------------------------------------------------------------------
# Public ops: checks, dispatch, fake implementations. The op bodies look their launch plan up before
# their checks (lora_terms' `_PLANS_SKIP_CHECKS`).
# ---------------------------------------------------------------------------------------------------


def _check_weight_grad(left: torch.Tensor, x: torch.Tensor) -> None:
    op = "lora_weight_grad"
    _check_2d(op, "left", left, "[M, R]")
    _check_2d(op, "x", x, "[M, K]")
    _check_fp32(op, "left", left)
    _check_dim(op, "x", x, "[M, K]", 0, left.shape[0], "M (left.shape[0])")
    _check_devices(op, left=left, x=x)


def lora_weight_grad(
    left: torch.Tensor,
    x: torch.Tensor,
    scale: float,
    k_major: bool = False,
    out_dtype: Optional[torch.dtype] = None,
    rounded_to: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """``scale * left.T @ x``: `fastlora::lora_weight_grad` (see `_lora_weight_grad_body`)."""
    if skips_op_dispatch(left, x):
        return _lora_weight_grad_body(left, x, scale, k_major, out_dtype, rounded_to)
    return lora_weight_grad_op(left, x, scale, k_major, out_dtype, rounded_to)


def _lora_weight_grad_body(
    left: torch.Tensor,
    x: torch.Tensor,
    scale: float,
    k_major: bool = False,
    out_dtype: Optional[torch.dtype] = None,
    rounded_to: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """``scale * left.T @ x``, summed over the M tokens in fp32 (deterministically), rounded once to
    `out_dtype` (None: left's dtype, float32; an adapter's dtype saves the caller a cast).

    rounded_to: the dtype the caller rounds an fp32 result to in the end (after summing several, as
    the gated MLP sums dA_down's chunks); None: out_dtype's. The dot's arithmetic follows the final
    rounding, not the result's dtype (`dots.weight_grad_dot_mode`).

    left: [M, R] float32; x: [M, K], any float dtype and strides. Returns [R, K], contiguous, or with
    k_major its transpose contiguous (strides (1, R)): dB = result.T then is a dense [K, R] tensor that
    autograd takes over as lora_B's gradient instead of copying it. Zeros when M == 0.
    """
    if _WEIGHT_GRAD_PLANS.serve(x):  # see lora_terms' `_PLANS_SKIP_CHECKS`
        key = _weight_grad_plan_key(left, x, k_major, out_dtype or torch.float32, rounded_to)
        plan = _WEIGHT_GRAD_PLANS.get(key)
        if plan is not None:
            return _run_weight_grad_plan(plan, left, x, scale)
    _check_weight_grad(left, x)
    if runs_triton(x):
        out_dtype = out_dtype or torch.float32
        return _lora_weight_grad_triton(
            left=left, x=x, scale=scale, k_major=k_major, out_dtype=out_dtype, rounded_to=rounded_to
        )
    result = reference.lora_weight_grad(left, x, scale)
    result = result if out_dtype is None else result.to(out_dtype)
    return result.T.contiguous().T if k_major else result.contiguous()


lora_weight_grad_op = torch.library.custom_op(
    f"{OP_NAMESPACE}::lora_weight_grad", _lora_weight_grad_body, mutates_args=()
)


@lora_weight_grad_op.register_fake
def _(
    left: torch.Tensor,
    x: torch.Tensor,
    scale: float,
    k_major: bool = False,
    out_dtype: Optional[torch.dtype] = None,
    rounded_to: Optional[torch.dtype] = None,
) -> torch.Tensor:
    _check_weight_grad(left, x)
    rank, features, dtype = left.shape[1], x.shape[1], out_dtype or left.dtype
    if k_major:
        return x.new_empty((features, rank), dtype=dtype).T
    return x.new_empty((rank, features), dtype=dtype)
