"""`lora_shrink_stacking_weights`: a group's forward shrink read from each member's lora_A as it is.

A shared-input group (q/k/v, gate/up) reads x once for all of its members' As:
``xa = x @ [A_1; A_2; A_3].T`` (fp32, ``[tokens, sum r]``). Its backward's dX term reads the As
stacked and transposed, ``[A_1; ...].T`` (``[K, sum r]``, the rank dim contiguous). Both used to come
from one `torch.cat` of the As' transposes, made in the forward before the shrink: an op and a copy
kernel on the path to the forward's big GEMM, which the GPU waits for when the step starts on an empty
launch queue (the q/k/v block; about 15 us of host time on the H200 machine, the cat and its three
views, `docs/benchmarks/session39/a/op_costs.log`).

Here the shrink's weight tile is read from the members' lora_A directly: each rank lane of the tile
points into its own member's rows (member 0 below R0, member 1 below R01, member 2 past it), and the
programs also write the stacked transpose, as `lora_shrink_keeping_weight_t` does for one projection.
One op, one launch, no cat. The tiles and splits are `lora_shrink`'s for these operands.

A `torch.library` custom op with a fake; the reference (a cat and `lora_shrink_keeping_weight_t`'s)
runs on the CPU outside the interpreter and in float64. Where the kernel cannot read the members as
one weight (their dtypes or strides differ, a row of A not contiguous, more than three members), the
op body makes the cat and calls `lora_shrink`: every caller gets the same contract.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Sequence

import torch
import triton
import triton.language as tl

from fastlora_peft.call_traces import trace_unit
from fastlora_peft.kernels import lora_terms_reference as reference
from fastlora_peft.kernels._backend import OP_NAMESPACE, runs_triton, skips_op_dispatch
from fastlora_peft.kernels._launch import BoundLaunch, CachedKernel, LaunchPlans, cdiv, empty_2d
from fastlora_peft.kernels._lora_common import _check_devices
from fastlora_peft.kernels.dots import dot_precision
from fastlora_peft.kernels.lora_terms import (
    _check_shrink,
    _shrink_config,
    lora_shrink,
    shrink_k_splits,
)
from fastlora_peft.kernels.shrink_tiles import shrink_loop, store_shrink, store_weight_t
from fastlora_peft.kernels.split_sum import split_scratch

MAX_MEMBERS = 3


@CachedKernel
@triton.jit
def _lora_shrink_stack_kernel(
    X_ptr, W0_ptr, W1_ptr, W2_ptr, Out_ptr, Partial_ptr, Counter_ptr, WeightT_ptr,
    M, K, R, R0, R01, k_per_split, n_splits,
    stride_xm, stride_xk, stride_wr, stride_wk, stride_om, stride_or,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_MODE: tl.constexpr, SPLIT: tl.constexpr, MEMBERS: tl.constexpr,
):  # fmt: skip
    """Out[M, R] = X[M, K] @ W[R, K]^T in fp32, W the members' weights stacked by rows (member 0's R0
    rows, member 1's up to R01, member 2's up to R; one set of strides), and WeightT[K, R] = W^T.

    The grid and the K splits are `_lora_shrink_kernel`'s: one program per (BLOCK_M rows, BLOCK_R
    ranks, split); after its loop each writes W^T for its ranks over a share of its split's columns.
    """
    pid_m = tl.program_id(0)
    pid_r = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_r = offs_r < R
    # Each rank lane's row of its own member's weight (lanes past R are masked off below).
    w_rows = tl.where(offs_r < R0, W0_ptr + offs_r * stride_wr, W1_ptr + (offs_r - R0) * stride_wr)
    if MEMBERS > 2:
        w_rows = tl.where(offs_r < R01, w_rows, W2_ptr + (offs_r - R01) * stride_wr)
    k_start = pid_s * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    x_ptrs = X_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + (k_start + offs_k)[None, :] * stride_xk
    w_ptrs = w_rows[None, :] + (k_start + offs_k)[:, None] * stride_wk  # W^T tile
    acc = shrink_loop(
        x_ptrs, w_ptrs, k_start, k_end, mask_m, mask_r, stride_xk, stride_wk,
        BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, BLOCK_R=BLOCK_R, DOT_PRECISION=DOT_PRECISION, DOT_MODE=DOT_MODE,
    )  # fmt: skip
    store_shrink(
        acc, 1.0, Out_ptr, Partial_ptr, Counter_ptr, offs_m, offs_r, mask_m, mask_r, pid_m, pid_r, pid_s,
        n_splits, M, R, stride_om, stride_or, SPLIT=SPLIT,
    )  # fmt: skip
    # W^T: the row blocks take turns over the split's K steps (as in `_lora_shrink_kernel`).
    k_first = k_start + pid_m * BLOCK_K
    k_step = tl.num_programs(0) * BLOCK_K
    store_weight_t(w_rows, WeightT_ptr, k_first, k_end, k_step, R, offs_r, mask_r, stride_wk, BLOCK_K)


# Any number of ranks: over 64 the tiles are 64 wide (`shrink_rank_block`) and the stack matched
# the cat and `lora_shrink` on the same tiles, kernel time with L2 flushed, x [8192, 4096] bf16, us:
# 2 x 64 ranks fp32 / bf16 63.5 / 44.4 against 2.7 + 62.2 / 2.4 + 44.5, 3 x 64 113.7 / 62.3 against
# 3.3 + 113.7 / 2.7 + 62.2, 2 x 128 113.6 / 80.2 against 3.8 + 116.1 / 2.9 + 79.6 (H200,
# `python3 scratch_gpu/stack_wide_probe.py`, `docs/benchmarks/session45/c/s45_c.log`). It stopped at
# 128 ranks while those took one 128-wide tile, slower than the cat and shrink past it (session 39).


def stacks_in_one_launch(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> bool:
    """Whether the kernel reads the members as one weight: 2 to MAX_MEMBERS of them, one dtype and one
    set of strides, each row contiguous (lora_A as PEFT makes it), and every dimension non-empty."""
    if not 1 < len(weights) <= MAX_MEMBERS or x.shape[0] == 0 or x.shape[1] == 0:
        return False
    first = weights[0]
    for weight in weights:
        if weight.dtype != first.dtype or weight.stride() != first.stride() or weight.shape[0] == 0:
            return False
    return first.stride(1) == 1


class _StackPlan(NamedTuple):
    """What `_lora_shrink_stack_triton` derived from its inputs' metadata, to launch the same again."""

    launch: BoundLaunch
    device: torch.device
    weight_dtype: torch.dtype
    out_shape: tuple[int, int]  # (M, R): the token-major result
    weight_t_shape: tuple[int, int]  # (K, R)
    scratch: Optional[tuple[int, int]]  # split_scratch's sizes when the launch splits K
    scalars: tuple[int, ...]  # sizes, then strides


_STACK_PLANS = LaunchPlans("lora_shrink_stack")


@trace_unit
def _run_stack_plan(plan: _StackPlan, x: torch.Tensor, weights: Sequence[torch.Tensor]):
    out = empty_2d(*plan.out_shape, torch.float32, plan.device, column_major=True)
    weight_t = empty_2d(*plan.weight_t_shape, plan.weight_dtype, plan.device)
    partial, counters = split_scratch(plan.device, *plan.scratch) if plan.scratch else (out, out)
    last = weights[-1]
    plan.launch(x, weights[0], weights[1], last, out, partial, counters, weight_t, *plan.scalars)
    return out, weight_t


def _lora_shrink_stack_triton(
    *,
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    split: int | None = None,
    block_m: int | None = None,
    block_k: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's launch for inputs that `stacks_in_one_launch`; split and tiles: tests' overrides."""
    plan_key = None
    if split is None and block_m is None and block_k is None and _STACK_PLANS.enabled:
        plan_key = _STACK_PLANS.key(x, *weights)
        plan = _STACK_PLANS.get(plan_key)
        if plan is not None:
            return _run_stack_plan(plan, x, weights)
    M, K = x.shape
    ranks = [weight.shape[0] for weight in weights]
    R = sum(ranks)
    # `lora_shrink`'s launch for x against one weight of all the ranks (the members' dtype and layout).
    config = _shrink_config(x, weights[0], ranks=R)
    block_r = config.block_r
    block_m, block_k = block_m or config.block_m, block_k or config.block_k
    num_warps, num_stages = config.num_warps, config.num_stages
    row_blocks = cdiv(M, block_m)
    split, k_per_split = shrink_k_splits(config, x, weights[0], R, block_m, block_k, num_stages, split)
    out = empty_2d(M, R, torch.float32, x.device, column_major=True)
    weight_t = empty_2d(K, R, weights[0].dtype, x.device)
    r_tiles = cdiv(R, block_r)
    scratch = (split * M * R, row_blocks * r_tiles) if split > 1 else None
    partial, counters = split_scratch(x.device, *scratch) if scratch else (out, out)
    scalars = (
        M, K, R, ranks[0], ranks[0] + ranks[1], k_per_split, split,
        x.stride(0), x.stride(1), weights[0].stride(0), weights[0].stride(1), out.stride(0), out.stride(1),
    )  # fmt: skip
    bound = _lora_shrink_stack_kernel[(row_blocks, r_tiles, split)](
        x, weights[0], weights[1], weights[-1], out, partial, counters, weight_t, *scalars,
        BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_R=block_r,
        DOT_PRECISION=dot_precision(x.dtype, weights[0].dtype), DOT_MODE=config.mode, SPLIT=split > 1,
        MEMBERS=len(weights), num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if plan_key is not None and bound is not None:
        _STACK_PLANS.add(
            plan_key,
            _StackPlan(bound, x.device, weights[0].dtype, (M, R), (K, R), scratch, scalars),
        )
    return out, weight_t


def _check_stack(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> None:
    if not weights:
        raise ValueError("lora_shrink_stacking_weights: needs at least one weight")
    for weight in weights:
        _check_shrink(x, weight)
    _check_devices("lora_shrink_stacking_weights", x=x, **{f"w{i}": w for i, w in enumerate(weights)})


def lora_shrink_stacking_weights(
    x: torch.Tensor, weights: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``x @ W.T`` in fp32, ``W.T`` contiguous) for W the weights stacked by rows:
    `fastlora::lora_shrink_stacking_weights` (see `_lora_shrink_stacking_weights_body`)."""
    if skips_op_dispatch(x, *weights):
        return _lora_shrink_stacking_weights_body(x, weights)
    return lora_shrink_stacking_weights_op(x, list(weights))


def _stacked_dtype(weights: Sequence[torch.Tensor]) -> torch.dtype:
    dtypes = [weight.dtype for weight in weights]
    return functools.reduce(torch.promote_types, dtypes)


def _lora_shrink_stacking_weights_body(
    x: torch.Tensor, weights: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K]; weights[i]: [R_i, K] (lora_A of member i), any float dtypes. Returns (xa [M, sum R_i]
    fp32, token-major as `lora_shrink` hands it out; W^T [K, sum R_i] contiguous, of the weights'
    promoted dtype), W = cat(weights)."""
    if _STACK_PLANS.serve(x):  # a hit skips the checks: see lora_terms' `_PLANS_SKIP_CHECKS`
        plan = _STACK_PLANS.get(_STACK_PLANS.key(x, *weights))
        if plan is not None:
            return _run_stack_plan(plan, x, weights)
    _check_stack(x, weights)
    if runs_triton(x) and stacks_in_one_launch(x, weights):
        return _lora_shrink_stack_triton(x=x, weights=weights)
    dtype = _stacked_dtype(weights)
    weight_t = torch.cat([weight.t().to(dtype) for weight in weights], dim=1)
    if runs_triton(x):
        return lora_shrink(x, weight_t.t()), weight_t
    result = reference.lora_shrink(x, weight_t.t())
    return result.T.contiguous().T, weight_t


lora_shrink_stacking_weights_op = torch.library.custom_op(
    f"{OP_NAMESPACE}::lora_shrink_stacking_weights", _lora_shrink_stacking_weights_body, mutates_args=()
)


@lora_shrink_stacking_weights_op.register_fake
def _(x: torch.Tensor, weights: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    _check_stack(x, weights)
    ranks = sum(weight.shape[0] for weight in weights)
    out_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    xa = x.new_empty((ranks, x.shape[0]), dtype=out_dtype).T
    return xa, x.new_empty((x.shape[1], ranks), dtype=_stacked_dtype(weights))
