"""The pieces of a shrink program (``Out = scale * X @ W^T`` over one split of K, fp32) that the shrink
kernels share: `lora_terms`' `_lora_shrink_kernel`, `lora_shrink_stack`'s and `lora_shrink_group`'s.
Each kernel picks its own pointers (one weight, the members' rows side by side, one member per
split) and calls these for the loop and the stores. Inlined by Triton: the kernels compiled to the
same sm_90 PTX as with the loops written out (`docs/benchmarks/session40/cpu/ptx_compare.log`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from fastlora_peft.kernels.dots import activation_dot
from fastlora_peft.kernels.split_sum import split_total


@triton.jit
def shrink_loop(
    x_ptrs, w_ptrs, k_start, k_end, mask_m, mask_r, stride_xk, stride_wk,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_MODE: tl.constexpr,
):  # fmt: skip
    """The fp32 [BLOCK_M, BLOCK_R] sum of X tiles @ W^T tiles over the columns [k_start, k_end), from
    the pointers of the first X tile ([BLOCK_M, BLOCK_K]) and the first W^T tile ([BLOCK_K, BLOCK_R]):
    the loop of a shrink program."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        mask_k = offs_k + k0 < k_end
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_r[None, :], other=0.0)
        acc = activation_dot(x, w, acc, DOT_MODE=DOT_MODE, DOT_PRECISION=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    return acc


@triton.jit
def store_shrink(
    acc, scale, Out_ptr, Partial_ptr, Counter_ptr, offs_m, offs_r, mask_m, mask_r, pid_m, pid_r, pid_s,
    n_splits, M, R, stride_om, stride_or, SPLIT: tl.constexpr,
):  # fmt: skip
    """Out's [BLOCK_M, BLOCK_R] tile = scale * the program's sum, with SPLIT the splits' sums met in
    `split_total` (fp32 partials laid out like Out, split stride M * R; a counter per tile)."""
    offsets = offs_m.to(tl.int64)[:, None] * stride_om + offs_r[None, :] * stride_or
    mask = mask_m[:, None] & mask_r[None, :]
    if SPLIT:
        counter_ptr = Counter_ptr + pid_m * tl.num_programs(1) + pid_r
        is_last, total = split_total(acc, Partial_ptr, offsets, mask, pid_s, n_splits, M * R, counter_ptr)
        if is_last:
            tl.store(Out_ptr + offsets, scale * total, mask=mask)
    else:
        tl.store(Out_ptr + offsets, scale * acc, mask=mask)


@triton.jit
def store_weight_t(
    w_rows, WeightT_ptr, k_first, k_end, k_step, R, offs_r, mask_r, stride_wk, BLOCK_K: tl.constexpr
):
    """WeightT[k, r] = W[r, k] for the BLOCK_K columns from k_first, k_first + k_step, ... below k_end
    and the ranks `offs_r`, whose rows of W start at `w_rows` (one pointer per rank lane): W^T tiles
    as the shrink loads them, stored with the rank dim contiguous."""
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(k_first, k_end, k_step):
        rows = k0 + offs_k
        mask = (rows < k_end)[:, None] & mask_r[None, :]
        tile = tl.load(w_rows[None, :] + rows[:, None] * stride_wk, mask=mask)
        tl.store(WeightT_ptr + rows[:, None] * R + offs_r[None, :], tile, mask=mask)
