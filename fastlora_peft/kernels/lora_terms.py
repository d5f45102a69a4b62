"""Triton kernels for the three low-rank terms of a LoRA projection, and the ops that run them.

For ``y = x W^T + scale * (x A^T) B^T`` the forward and backward need only these three:

* ``lora_shrink(x, weight, scale)``: ``scale * x @ weight.T`` into fp32, the rank-R bottleneck
  (``x @ A.T``, ``grad_out @ B``; a scale so a q/k/v group's ``g_i @ B_i`` come out scaled).
* ``lora_expand_add(base, left, right, scale, out_dtype)``: ``base + scale * left @ right.T``, added
  to the frozen layer's output in registers and rounded to ``out_dtype`` once.
* ``lora_weight_grad(left, x, scale)``: ``scale * left.T @ x`` summed over the tokens, the gradient of
  A or (transposed) B.

Each kernel loads its operands in their own dtype and strides and converts them to fp32 in registers,
so no fp32 copy of an activation or gradient is ever made in memory. The launchers may copy the small
rank-R operands (an adapter, or ``left`` of lora_weight_grad) into the layout tl.dot runs fastest on.

Each op is a ``torch.library`` custom op with a fake implementation; it runs the Triton launcher when
``runs_triton`` says so and the pure-torch reference (``lora_terms_reference``) otherwise.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Sequence

import torch
import triton
import triton.language as tl

from fastlora_peft.kernels import lora_terms_reference as reference
from fastlora_peft.kernels._backend import OP_NAMESPACE, runs_triton, skips_op_dispatch
from fastlora_peft.kernels._launch import (
    BoundLaunch,
    CachedKernel,
    LaunchPlans,
    cdiv,
    next_power_of_2,
    tensor_key,
)
from fastlora_peft.kernels.dots import (
    FP32_DOT,
    NATIVE_DOT,
    SPLIT_DOT,
    activation_dot,
    dot_mode,
    dot_precision,
    expand_dot_precision,
)
from fastlora_peft.kernels.split_sum import split_scratch, split_total

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# float64 is accepted for gradcheck only: it always runs the reference, in float64 (see _backend).
_CHECKED_DTYPES = (*_SUPPORTED_DTYPES, torch.float64)


def _rank_block(rank: int, cap: int) -> int:
    """Rank tile: a power of two >= 16 (tl.dot's minimum) covering ``rank``, at most ``cap``."""
    return min(max(16, next_power_of_2(rank)), cap)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # the interpreter runs programs one by one: no point splitting the work further


# ---------------------------------------------------------------------------------------------------
# Kernels. Row offsets are widened to int64 before they meet a stride: M * stride passes 2**31 at,
# e.g., 16k tokens of a 128k-wide tensor. Tile offsets stay int32 and move the (64-bit) pointers.
# ---------------------------------------------------------------------------------------------------


@CachedKernel
@triton.jit
def _lora_shrink_kernel(
    X_ptr, W_ptr, Out_ptr, Partial_ptr, Counter_ptr,
    M, K, R, k_per_split, n_splits, scale,
    stride_xm, stride_xk, stride_wr, stride_wk, stride_om, stride_or,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_MODE: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """Out[M, R] = scale * X[M, K] @ W[R, K]^T in fp32.

    One program per (BLOCK_M rows, BLOCK_R ranks, split), looping over its split's columns [s *
    k_per_split, ...). With SPLIT (n_splits > 1), the splits meet in `split_total` through fp32
    partials laid out like Out ([n_splits, ...], split stride M * R) and one counter per tile.
    """
    pid_m = tl.program_id(0)
    pid_r = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_r = offs_r < R
    k_start = pid_s * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    x_ptrs = X_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + (k_start + offs_k)[None, :] * stride_xk
    w_ptrs = W_ptr + (k_start + offs_k)[:, None] * stride_wk + offs_r[None, :] * stride_wr  # W^T tile
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        mask_k = offs_k + k0 < k_end
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_r[None, :], other=0.0)
        acc = activation_dot(x, w, acc, DOT_MODE=DOT_MODE, DOT_PRECISION=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
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
def expand_term(
    Left_ptr, Right_ptr, rows, mask_m, offs_n, mask_n, R,
    stride_lm, stride_lr, stride_rn, stride_rr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Left[rows, :R] @ Right[offs_n, :R]^T in fp32, [BLOCK_M, BLOCK_N], BLOCK_R ranks per dot; rows
    int64. The LoRA term of lora_expand_add, and of the gated activation that adds gate's and up's."""
    offs_r = tl.arange(0, BLOCK_R)
    left_ptrs = Left_ptr + rows[:, None] * stride_lm + offs_r[None, :] * stride_lr
    right_ptrs = Right_ptr + offs_r[:, None] * stride_rr + offs_n[None, :] * stride_rn  # [BLOCK_R, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        mask_r = offs_r + r0 < R
        left = tl.load(left_ptrs, mask=mask_m[:, None] & mask_r[None, :], other=0.0).to(tl.float32)
        right = tl.load(right_ptrs, mask=mask_r[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
        acc = tl.dot(left, right, acc, input_precision=DOT_PRECISION)
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
    # Computed as its transpose, Out^T[K, R] = X^T @ Left, so the activation is tl.dot's first operand,
    # which may come from registers in any layout; a 32-bit second operand wants its reduction (token)
    # dim contiguous, which the launcher arranges for Left. On an H200 (M=8192, K=4096, rank 64) this
    # takes 91us against 189us for Left^T @ X with X, token-strided, as the second operand.
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
    offsets = offs_k[:, None] * stride_ok + offs_r[None, :] * stride_or
    mask = mask_k[:, None] & mask_r[None, :]
    if SPLIT:
        counter_ptr = Counter_ptr + pid_k * tl.num_programs(2) + pid_r
        is_last, total = split_total(acc, Partial_ptr, offsets, mask, pid_s, n_splits, R * K, counter_ptr)
        if is_last:
            tl.store(Out_ptr + offsets, (scale * total).to(Out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(Out_ptr + offsets, (scale * acc).to(Out_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------------
# Launchers. Keyword-only block sizes default to the GPU choice; tests pass small ones to cover
# several tiles and loop trips on tiny shapes. Callers have checked shapes, dtypes and devices.
# ---------------------------------------------------------------------------------------------------


# (BLOCK_M, BLOCK_K) of lora_shrink by dot mode; 16-bit operands of one dtype take NATIVE_DOT's
# (also under the interpreter, where they run FP32_DOT). H200, x [8192, 4096] bf16, rank 16.
_SHRINK_TILES = {
    NATIVE_DOT: (32, 128),  # 28us, against 45us for tf32 dots of 32 x 64 (K=14336: 70 against 115us)
    FP32_DOT: (64, 64),  # fp32 weights under tf32x3: 51us, 1.3 TB/s
    # Split (bf16 x, fp32 weight): of six tiles timed once, 64 x 64 was fastest at K=14336 (81us);
    # at K=4096 128 x 128 read 40 against 47us in the same run, while the default launch of 64 x 64
    # read 32us before it (`docs/benchmarks/session9/dot_modes_probe_1_with_tiles.log`): noise there.
    SPLIT_DOT: (64, 64),
}
# The split dot over a 64-wide rank tile (a q/k/v group's stacked A, rank 48):
# 128 x 64 tiles, 8 warps, 3 stages took 51.5us at M=8192, K=4096 against 67.2us for the 64 x 64
# default with 4 warps and 4 stages (a bf16 weight: 39.3us); at ranks 16 and 32 those tiles were no
# faster (H200, `python -m benchmarks.tune_lora_terms --split-shrink`, session16/tune_split_shrink.log).
_WIDE_SPLIT_LAUNCH = (128, 64, 8, 3)  # BLOCK_M, BLOCK_K, num_warps, num_stages


def _lora_shrink_triton(
    *,
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: float = 1.0,
    out: torch.Tensor | None = None,
    split: int | None = None,
    block_m: int | None = None,
    block_k: int | None = None,
    block_r: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """out: an fp32 [M, R] tensor to write into (e.g. columns of a group's stacked result), or None."""
    # The default launch of these inputs' shapes, strides, dtypes and alignment again: its plan.
    plan_key = None
    defaults = split is None and block_m is None and block_k is None and block_r is None
    defaults = defaults and num_warps is None and num_stages is None
    if defaults and _SHRINK_PLANS.enabled:
        plan_key = _shrink_plan_key(x, weight, out)
        plan = _SHRINK_PLANS.get(plan_key)
        if plan is not None:
            return _run_shrink_plan(plan, x, weight, scale, out)
    M, K = x.shape
    R = weight.shape[0]
    if M == 0 or R == 0 or K == 0:
        return torch.zeros((M, R), dtype=torch.float32, device=x.device) if out is None else out.zero_()
    # Timings on an H200, x [8192, 4096] bf16, rank 16 (benchmarks/tune_lora_terms.py): 16-bit weights
    # fed to native dots with 32-row tiles, 128-wide K steps and 4 stages took 28us, against 45us for
    # tf32 dots of 32 x 64 x 3 stages (K=14336: 70 against 115us). fp32 weights (tf32x3) were fastest
    # with 64 x 64 (51us, 1.3 TB/s) and only with weight's K dim contiguous (162us for lora_b.T), so
    # such an adapter (R * K * 4 bytes, ~1 MB) is copied first. The split dot (bf16 x, fp32 weight)
    # splits the tile into bf16 parts in registers and reads lora_b.T as it is: 51.4us against 41.3 for
    # copy and shrink at K=4096, 77.5 against 82.1 at K=14336 (H200, 8192 tokens, rank 16,
    # `session9/shrink_fp32_b_transposed_scratch.log`), about even over an MLP's three, while the copy
    # is one more op's host time in every projection's backward in PEFT's default layout.
    mode = dot_mode(x, weight)
    weight_copied = mode == FP32_DOT and weight.dtype == torch.float32 and weight.stride(1) != 1
    weight = weight.contiguous() if weight_copied else weight
    # Up to rank 128 one program covers every rank, so x is streamed from memory exactly once.
    block_r = block_r or _rank_block(R, cap=128)
    default_m, default_k = _SHRINK_TILES[mode if torch.float32 in (x.dtype, weight.dtype) else NATIVE_DOT]
    default_warps, default_stages = 8 if block_r > 64 else 4, 4
    if mode == SPLIT_DOT and 32 < block_r <= 64:  # measured there only
        default_m, default_k, default_warps, default_stages = _WIDE_SPLIT_LAUNCH
    block_m, block_k = block_m or default_m, block_k or default_k
    num_warps, num_stages = num_warps or default_warps, num_stages or default_stages
    row_blocks = cdiv(M, block_m)
    if split is None:
        # Fewer row blocks than SMs (a few thousand tokens, a chunk of the MLP's down projection):
        # each program would walk all of K alone, latency-bound. Split K so every SM gets about two
        # programs, each still at least four K steps long; the fp32 partials are M * R * 4 bytes each.
        sms = _num_sms(x.device)
        split = 1 if row_blocks >= sms else min(cdiv(2 * sms, row_blocks), cdiv(K, 4 * block_k))
    k_per_split = cdiv(cdiv(K, max(split, 1)), block_k) * block_k
    split = cdiv(K, k_per_split)  # no empty splits
    # The result is handed out token-major ([M, R] with strides (1, M)), the layout lora_weight_grad
    # wants its left operand in, so xa and dY @ B reach it without a transposed copy. Deterministic:
    # the splits' partials are summed in split order inside the kernel (split_sum).
    out = torch.empty((R, M), dtype=torch.float32, device=x.device).T if out is None else out
    r_tiles = cdiv(R, block_r)
    partial, counters = (
        split_scratch(x.device, split * M * R, row_blocks * r_tiles) if split > 1 else (out, out)
    )
    grid = (row_blocks, r_tiles, split)
    bound = _lora_shrink_kernel[grid](
        x, weight, out, partial, counters,
        M, K, R, k_per_split, split, float(scale),
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_R=block_r,
        DOT_PRECISION=dot_precision(x.dtype, weight.dtype), DOT_MODE=mode, SPLIT=split > 1,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if plan_key is not None and bound is not None:
        _SHRINK_PLANS.add(plan_key, _ShrinkPlan(
            bound, weight_copied, x.device,
            (R, M), (split * M * R, row_blocks * r_tiles) if split > 1 else None,
            (M, K, R, k_per_split, split),
            (x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1)),
        ))  # fmt: skip
    return out


class _ShrinkPlan(NamedTuple):
    """What `_lora_shrink_triton` derived from its inputs' metadata, to launch the same again."""

    launch: BoundLaunch
    copy_weight: bool  # the weight was copied to a contiguous one first (its strides below are the copy's)
    device: torch.device
    out_shape: tuple[int, int]  # (R, M) of a new result's buffer (its transpose) where none is given
    scratch: Optional[tuple[int, int]]  # split_scratch's sizes when the launch splits K
    sizes: tuple[int, ...]  # M, K, R, k_per_split, n_splits
    strides: tuple[int, ...]


_SHRINK_PLANS = LaunchPlans("lora_shrink")


def _shrink_plan_key(x, weight, out=None) -> tuple:
    """The one key of a shrink plan: the launcher's and the op bodies' lookups must agree. A given
    `out` is part of it (its strides and alignment are the launch's); None keys a new result."""
    return _SHRINK_PLANS.key(x, weight, out)


def _run_shrink_plan(
    plan: _ShrinkPlan, x: torch.Tensor, weight: torch.Tensor, scale: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    weight = weight.contiguous() if plan.copy_weight else weight
    if out is None:
        out = torch.empty(plan.out_shape, dtype=torch.float32, device=plan.device).T
    partial, counters = split_scratch(plan.device, *plan.scratch) if plan.scratch else (out, out)
    plan.launch(x, weight, out, partial, counters, *plan.sizes, float(scale), *plan.strides)
    return out


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
    precision = expand_dot_precision(out_dtype)
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


def _run_expand_add_plan(plan, base, left, right, scale, out) -> torch.Tensor:
    right = right.contiguous() if plan.copy_right else right
    out = torch.empty(plan.out_shape, dtype=plan.out_dtype, device=plan.device) if out is None else out
    plan.launch(base, left, right, out, *plan.sizes, float(scale), *plan.strides)
    return out


# Fewest token rows one split of lora_weight_grad covers. Each split writes and the sum re-reads an
# [R, K] fp32 partial (8 * R * K bytes) against 2 * rows * K bytes of 16-bit x it streams; at rank 64
# and 512 rows the partials cost half the x traffic, so splits stop there.
_MIN_ROWS_PER_SPLIT = 512


def _lora_weight_grad_triton(
    *,
    left: torch.Tensor,
    x: torch.Tensor,
    scale: float,
    k_major: bool = False,
    out_dtype: torch.dtype = torch.float32,
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
        plan_key = _weight_grad_plan_key(left, x, k_major, out_dtype)
        plan = _WEIGHT_GRAD_PLANS.get(plan_key)
        if plan is not None:
            return _run_weight_grad_plan(plan, left, x, scale)
    M, R = left.shape
    K = x.shape[1]
    # K-major ([K, R] in memory) when the caller wants the transpose contiguous (dB = result.T).
    out = torch.empty((K, R) if k_major else (R, K), dtype=out_dtype, device=x.device)
    out = out.T if k_major else out
    if M == 0 or R == 0 or K == 0:
        return out.zero_()
    # The kernel wants left's token dim contiguous (see there): 91 vs 116us at rank 64, 157 vs 227us at
    # rank 128 on an H200 (M=8192, K=4096), for a transposed copy of left (M * R * 4 bytes, 2 MB).
    left_copied = left.stride(0) != 1
    left = left.T.contiguous().T if left_copied else left
    block_r = block_r or _rank_block(R, cap=64)
    # H200, M=8192, bf16 x, fp32 left (tf32x3): at K=4096 and rank 32, 128-row steps took 58us against
    # 127us for 64 rows; at rank 16, or K=14336, 64 rows were as fast or faster. Not retuned for the
    # split dot bf16 x now takes (one run at rank 16: 64 rows 56us, 128 rows 40us at K=4096; 83 and
    # 97us at K=14336, `dot_modes_probe_1_with_tiles.log`, where the default launch read 36us).
    block_m = block_m or (128 if block_r >= 32 and K <= 8192 else 64)
    k_tiles, r_tiles = cdiv(K, block_k), cdiv(R, block_r)
    if split is None:
        # Split the token dimension only as far as needed to give every SM two programs. One program
        # per column tile walking all rows instead was 1.1-1.6x slower at 8192 and 2048 tokens, except
        # at K=14336, rank 16, 2048 tokens (29 against 30us; `tune_lora_terms --weight-grad-unsplit`).
        split = min(cdiv(2 * _num_sms(x.device), k_tiles * r_tiles), cdiv(M, _MIN_ROWS_PER_SPLIT))
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
        DOT_PRECISION=dot_precision(left.dtype, x.dtype), DOT_MODE=dot_mode(x, left), SPLIT=split > 1,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if plan_key is not None and bound is not None:
        _WEIGHT_GRAD_PLANS.add(plan_key, _WeightGradPlan(
            bound, left_copied, out_dtype, x.device, k_major, (K, R) if k_major else (R, K),
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
    out_shape: tuple[int, int]  # of the buffer; the result is its transpose when k_major
    scratch: Optional[tuple[int, int]]
    sizes: tuple[int, ...]  # M, R, K
    splits: tuple[int, int]  # rows_per_split, n_splits
    strides: tuple[int, ...]


_WEIGHT_GRAD_PLANS = LaunchPlans("lora_weight_grad")


def _weight_grad_plan_key(left, x, k_major: bool, out_dtype: torch.dtype) -> tuple:
    """The one key of a weight-grad plan (out_dtype resolved: None is float32)."""
    return _WEIGHT_GRAD_PLANS.key(left, x, k_major, out_dtype)


def _run_weight_grad_plan(plan: _WeightGradPlan, left, x, scale) -> torch.Tensor:
    left = left.T.contiguous().T if plan.copy_left else left
    out = torch.empty(plan.out_shape, dtype=plan.out_dtype, device=plan.device)
    out = out.T if plan.k_major else out
    partial, counters = split_scratch(plan.device, *plan.scratch) if plan.scratch else (out, out)
    plan.launch(left, x, out, partial, counters, *plan.sizes, float(scale), *plan.splits, *plan.strides)
    return out


# ---------------------------------------------------------------------------------------------------
# Public ops: checks, dispatch, fake implementations.
#
# _PLANS_SKIP_CHECKS: an op body looks its launch plan up before its input checks, and a hit launches
# without them. The checks read only what a plan's key holds (shapes, strides, dtypes, devices,
# out_dtype, in place or not), and a plan is made only by a launch with the launcher's default tiles,
# which the op bodies reach after their checks (the other callers of the private launchers are this
# package's tests and tuning tools). So a hit has the metadata of a call that passed the checks:
# they would pass again. About 2-4 us per op on the CPU machine, a dozen ops per q/k/v step.
# ---------------------------------------------------------------------------------------------------


def _check_2d(op: str, name: str, tensor: torch.Tensor, layout: str) -> None:
    if tensor.dim() != 2:
        raise ValueError(f"{op}: {name} must be 2-D {layout}, got shape {list(tensor.shape)}")
    if tensor.dtype not in _CHECKED_DTYPES:
        raise ValueError(f"{op}: {name} must be float32, bfloat16 or float16, got {tensor.dtype}")


def _check_dim(
    op: str, name: str, tensor: torch.Tensor, layout: str, dim: int, expected: int, what: str
) -> None:
    if tensor.shape[dim] != expected:
        raise ValueError(
            f"{op}: {name} must be {layout} with {what}={expected}, got shape {list(tensor.shape)}"
        )


def _check_fp32(op: str, name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{op}: {name} must be float32 (the output of lora_shrink), got {tensor.dtype}")


def _check_devices(op: str, **tensors: torch.Tensor) -> None:
    first, *others = tensors.values()
    device = first.device
    for tensor in others:  # a loop: this runs on every op call
        if tensor.device == device:
            continue
        devices = {name: t.device for name, t in tensors.items()}
        raise ValueError(f"{op}: all inputs must be on one device, got {devices}")


def _check_shrink(x: torch.Tensor, weight: torch.Tensor) -> None:
    op = "lora_shrink"
    _check_2d(op, "x", x, "[M, K]")
    _check_2d(op, "weight", weight, "[R, K]")
    _check_dim(op, "weight", weight, "[R, K]", 1, x.shape[1], "K (x.shape[1])")
    _check_devices(op, x=x, weight=weight)


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


def _check_weight_grad(left: torch.Tensor, x: torch.Tensor) -> None:
    op = "lora_weight_grad"
    _check_2d(op, "left", left, "[M, R]")
    _check_2d(op, "x", x, "[M, K]")
    _check_fp32(op, "left", left)
    _check_dim(op, "x", x, "[M, K]", 0, left.shape[0], "M (left.shape[0])")
    _check_devices(op, left=left, x=x)


def lora_shrink(x: torch.Tensor, weight: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``scale * x @ weight.T`` with fp32 accumulation: `fastlora::lora_shrink` (see `_lora_shrink_body`)."""
    if skips_op_dispatch(x, weight):
        return _lora_shrink_body(x, weight, scale)
    return lora_shrink_op(x, weight, scale)


def _lora_shrink_body(x: torch.Tensor, weight: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``scale * x @ weight.T`` with fp32 accumulation (the scale applied to the fp32 sum).

    x: [M, K] float32/bfloat16/float16; weight: [R, K], any of those dtypes (may differ from x's) and
    any strides (``lora_b.T`` is fine). Returns [M, R] float32, token-major (strides (1, M)).
    """
    return _shrink(x, weight, scale)


def _shrink(
    x: torch.Tensor, weight: torch.Tensor, scale: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The shrink ops' common body: into `out` ([M, R], e.g. a member's columns of a stacked result)
    when given, else into a new token-major result."""
    if _SHRINK_PLANS.serve(x):  # see `_PLANS_SKIP_CHECKS`
        plan = _SHRINK_PLANS.get(_shrink_plan_key(x, weight, out))
        if plan is not None:
            return _run_shrink_plan(plan, x, weight, scale, out)
    _check_shrink(x, weight)
    if runs_triton(x):
        return _lora_shrink_triton(x=x, weight=weight, scale=scale, out=out)
    result = reference.lora_shrink(x, weight, scale)
    return result.T.contiguous().T if out is None else out.copy_(result)


lora_shrink_op = torch.library.custom_op(f"{OP_NAMESPACE}::lora_shrink", _lora_shrink_body, mutates_args=())


@lora_shrink_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    _check_shrink(x, weight)
    return x.new_empty((weight.shape[0], x.shape[0]), dtype=torch.float32).T


def _check_stacked_members(xs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor], scales) -> None:
    """What the stacked shrink checks on every call: one weight and scale per x, one M for all."""
    op = "lora_shrink_stacked"
    if not len(xs) == len(weights) == len(scales) or not xs:
        raise ValueError(
            f"{op}: needs one weight and one scale per x, at least one, got {len(xs)} x, "
            f"{len(weights)} weights and {len(scales)} scales"
        )
    rows = xs[0].shape[0]
    for x in xs:
        if x.dim() != 2 or x.shape[0] != rows:
            raise ValueError(f"{op}: every x must be [M, K_i] with M={rows} (xs[0]'s), got {list(x.shape)}")


def _check_shrink_stacked(xs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor], scales) -> None:
    _check_stacked_members(xs, weights, scales)
    for x, weight in zip(xs, weights):
        _check_shrink(x, weight)
    _check_devices(
        "lora_shrink_stacked",
        **{f"x{i}": x for i, x in enumerate(xs)},
        **{f"w{i}": w for i, w in enumerate(weights)},
    )


def _stacked_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32, or float64 beside float64 inputs (gradcheck runs the reference in float64)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def lora_shrink_stacked(
    xs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor], scales: Sequence[float]
) -> torch.Tensor:
    """``[scales[0] * xs[0] @ weights[0].T | scales[1] * xs[1] @ weights[1].T | ...]``, fp32 `[M,
    sum R_i]`: `fastlora::lora_shrink_stacked` (see `_lora_shrink_stacked_body`)."""
    if skips_op_dispatch(*xs, *weights):
        return _lora_shrink_stacked_body(xs, weights, scales)
    return lora_shrink_stacked_op(list(xs), list(weights), list(scales))


def _lora_shrink_stacked_body(
    xs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor], scales: Sequence[float]
) -> torch.Tensor:
    """A group's `g_i @ B_i` side by side, each shrink written into its columns of one buffer.

    xs[i]: [M, K_i] and weights[i]: [R_i, K_i] as `lora_shrink` takes them (each pair its own dtypes
    and strides). Returns [M, sum R_i] float32, token-major (strides (1, M)): the layout
    lora_weight_grad wants its left operand in. One allocation and one launch per member, where
    separate shrinks and a cat of their results were one allocation and one launch each, then the
    cat's own allocation and launch.
    """
    _check_stacked_members(xs, weights, scales)  # each member's own checks: in `_shrink`
    ranks = [weight.shape[0] for weight in weights]
    stacked = torch.empty((sum(ranks), xs[0].shape[0]), dtype=_stacked_dtype(xs[0]), device=xs[0].device)
    start = 0
    for x, weight, scale, rank in zip(xs, weights, scales, ranks):
        _shrink(x, weight, float(scale), stacked[start : start + rank].T)
        start += rank
    return stacked.T


lora_shrink_stacked_op = torch.library.custom_op(
    f"{OP_NAMESPACE}::lora_shrink_stacked", _lora_shrink_stacked_body, mutates_args=()
)


@lora_shrink_stacked_op.register_fake
def _(xs: list[torch.Tensor], weights: list[torch.Tensor], scales: list[float]) -> torch.Tensor:
    _check_shrink_stacked(xs, weights, scales)
    rows, ranks = xs[0].shape[0], sum(weight.shape[0] for weight in weights)
    return xs[0].new_empty((ranks, rows), dtype=_stacked_dtype(xs[0])).T


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
    if _EXPAND_ADD_PLANS.serve(base):  # see `_PLANS_SKIP_CHECKS`
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
    if _EXPAND_ADD_PLANS.serve(base):  # see `_PLANS_SKIP_CHECKS`
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


def lora_weight_grad(
    left: torch.Tensor,
    x: torch.Tensor,
    scale: float,
    k_major: bool = False,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """``scale * left.T @ x``: `fastlora::lora_weight_grad` (see `_lora_weight_grad_body`)."""
    if skips_op_dispatch(left, x):
        return _lora_weight_grad_body(left, x, scale, k_major, out_dtype)
    return lora_weight_grad_op(left, x, scale, k_major, out_dtype)


def _lora_weight_grad_body(
    left: torch.Tensor,
    x: torch.Tensor,
    scale: float,
    k_major: bool = False,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """``scale * left.T @ x``, summed over the M tokens in fp32 (deterministically), rounded once to
    `out_dtype` (None: left's dtype, float32; an adapter's dtype saves the caller a cast).

    left: [M, R] float32; x: [M, K], any float dtype and strides. Returns [R, K], contiguous, or with
    k_major its transpose contiguous (strides (1, R)): dB = result.T then is a dense [K, R] tensor that
    autograd takes over as lora_B's gradient instead of copying it. Zeros when M == 0.
    """
    if _WEIGHT_GRAD_PLANS.serve(x):  # see `_PLANS_SKIP_CHECKS`
        plan = _WEIGHT_GRAD_PLANS.get(_weight_grad_plan_key(left, x, k_major, out_dtype or torch.float32))
        if plan is not None:
            return _run_weight_grad_plan(plan, left, x, scale)
    _check_weight_grad(left, x)
    if runs_triton(x):
        out_dtype = out_dtype or torch.float32
        return _lora_weight_grad_triton(left=left, x=x, scale=scale, k_major=k_major, out_dtype=out_dtype)
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
) -> torch.Tensor:
    _check_weight_grad(left, x)
    rank, features, dtype = left.shape[1], x.shape[1], out_dtype or left.dtype
    if k_major:
        return x.new_empty((features, rank), dtype=dtype).T
    return x.new_empty((rank, features), dtype=dtype)
