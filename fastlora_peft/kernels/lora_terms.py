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

This module holds the shrink (and its stacked form for a group); `lora_expand_add` and
`lora_weight_grad` live in modules of those names, what they share in `_lora_common`. All ops are
handed out here.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
import triton
import triton.language as tl

from fastlora_peft.call_traces import trace_unit
from fastlora_peft.kernels import lora_terms_reference as reference
from fastlora_peft.kernels._backend import OP_NAMESPACE, runs_triton, skips_op_dispatch
from fastlora_peft.kernels._launch import BoundLaunch, CachedKernel, LaunchPlans, Transposed, cdiv, empty_2d
from fastlora_peft.kernels._lora_common import (
    _check_2d,
    _check_devices,
    _check_dim,
    _num_sms,
    _programs_per_sm,
    _rank_block,
    one_wave_splits,
)
from fastlora_peft.kernels.dots import (
    FP32_DOT,
    NATIVE_DOT,
    SPLIT_DOT,
    dot_mode,
    dot_precision,
)
from fastlora_peft.kernels.lora_expand_add import (
    lora_expand_add,
    lora_expand_add_,
    lora_expand_add_inplace_op,
    lora_expand_add_op,
)
from fastlora_peft.kernels.lora_shrink_group import MAX_MEMBERS as MAX_GROUP_MEMBERS
from fastlora_peft.kernels.lora_shrink_group import (
    ShrinkGroupLaunch,
    ShrinkGroupSettings,
    launch_shrink_group,
)
from fastlora_peft.kernels.lora_weight_grad import lora_weight_grad, lora_weight_grad_op
from fastlora_peft.kernels.shrink_tiles import shrink_loop, store_shrink, store_weight_t
from fastlora_peft.kernels.split_sum import split_scratch

__all__ = [
    "lora_expand_add",
    "lora_expand_add_",
    "lora_expand_add_inplace_op",
    "lora_expand_add_op",
    "lora_shrink",
    "lora_shrink_keeping_weight_t",
    "lora_shrink_keeping_weight_t_op",
    "lora_shrink_op",
    "lora_shrink_stacked",
    "lora_shrink_stacked_of_transposed",
    "lora_shrink_stacked_op",
    "lora_weight_grad",
    "lora_weight_grad_op",
]


# ---------------------------------------------------------------------------------------------------
# Kernels. Row offsets are widened to int64 before they meet a stride: M * stride passes 2**31 at,
# e.g., 16k tokens of a 128k-wide tensor. Tile offsets stay int32 and move the (64-bit) pointers.
# ---------------------------------------------------------------------------------------------------


@CachedKernel
@triton.jit
def _lora_shrink_kernel(
    X_ptr, W_ptr, Out_ptr, Partial_ptr, Counter_ptr, WeightT_ptr,
    M, K, R, k_per_split, n_splits, scale,
    stride_xm, stride_xk, stride_wr, stride_wk, stride_om, stride_or,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_MODE: tl.constexpr, SPLIT: tl.constexpr, STORE_WEIGHT_T: tl.constexpr,
):  # fmt: skip
    """Out[M, R] = scale * X[M, K] @ W[R, K]^T in fp32.

    One program per (BLOCK_M rows, BLOCK_R ranks, split), looping over its split's columns [s *
    k_per_split, ...). With SPLIT (n_splits > 1), the splits meet in `split_total` through fp32
    partials laid out like Out ([n_splits, ...], split stride M * R) and one counter per tile.
    With STORE_WEIGHT_T the programs also write W^T ([K, R] contiguous, W's dtype) to WeightT, after
    their own loop (a loop of its own, so the shrink's loop compiles as without): the row blocks
    take turns over their split's K steps, most of them one tile or none. (In the first row block
    alone, a walk over all of K, it had made the launch 6-66 us longer at Llama sizes on the H200.)
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
    acc = shrink_loop(
        x_ptrs, w_ptrs, k_start, k_end, mask_m, mask_r, stride_xk, stride_wk,
        BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, BLOCK_R=BLOCK_R, DOT_PRECISION=DOT_PRECISION, DOT_MODE=DOT_MODE,
    )  # fmt: skip
    store_shrink(
        acc, scale, Out_ptr, Partial_ptr, Counter_ptr, offs_m, offs_r, mask_m, mask_r, pid_m, pid_r, pid_s,
        n_splits, M, R, stride_om, stride_or, SPLIT=SPLIT,
    )  # fmt: skip
    if STORE_WEIGHT_T:
        k_first = k_start + pid_m * BLOCK_K
        k_step = tl.num_programs(0) * BLOCK_K
        w_rows = W_ptr + offs_r * stride_wr
        store_weight_t(w_rows, WeightT_ptr, k_first, k_end, k_step, R, offs_r, mask_r, stride_wk, BLOCK_K)


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
# 16-bit weights over a rank tile of 32 to 64 (a q/k/v group's stacked A at rank 48 with bf16
# adapters, an MLP's gate/up A at rank 32, a rank-64 adapter): 64 x 128 tiles, 4 warps, 4 stages, K
# split into at most one program per SM (`shrink_splits`). H200, x [M, 4096] bf16, the weight read
# transposed, kernel time with L2 flushed, us, the 32 x 128 tiles with the 16-bit rule before ->
# this launch: rank 48 at 2048 tokens 14.1 -> 10.8, 4096 19.0 -> 16.1, 8192 31.1 -> 26.5, 16384
# 74.5 -> 44.5; rank 64: 12.9 -> 10.6, 17.0 -> 15.8, 28.8 -> 25.1, 60.1 -> 44.0; rank 32: 10.1 ->
# 9.7, 16.2 -> 14.6, 24.8 -> 24.6, 43.8 -> 41.1 (`docs/benchmarks/session31/native_wide_shrink_probe.log`).
# The shared-memory count of `shrink_shared_bytes` would allow two programs per SM at rank 32, so
# twice the splits: 2048 tokens in eight, 4096 in four. Not timed with these tiles; with 3 stages,
# four splits at 4096 tokens read 15.8 against 14.6 for this launch's two.
_WIDE_NATIVE_LAUNCH = (64, 128, 4, 4)  # BLOCK_M, BLOCK_K, num_warps, num_stages
# 16-bit weights past 64 ranks (64-wide tiles, `shrink_rank_block`; a q/k/v group's stacked A at rank
# 32 and more, a rank-128 adapter): 64-wide K steps, one wave of one program per SM. H200, x [8192,
# 4096] bf16, kernel time with L2 flushed, us, `_WIDE_NATIVE_LAUNCH` on the same tiles against this:
# 96 ranks 44.0 -> 34.2, 128 44.3 -> 34.6, 192 62.1 -> 35.6 (one 128-wide tile of 32 x 128 steps,
# the launch before: 55.6, 53.2, and two tiles at 192, 106.6). Of the 20 launches timed (10 tilings,
# each unsplit and in two K splits) it was the fastest at 192; at 96 and 128 a 128-wide tile of 64 x
# 64 steps, 8 warps, two K splits read 29.2 and 30.7 (`python -m benchmarks.tune_lora_terms --high-rank`,
# `docs/benchmarks/session45/c/s45_c.log`).
_MANY_RANKS_NATIVE_LAUNCH = (64, 64, 4, 4)
# `lora_shrink_group`'s members keep 32-row tiles with 16-bit weights up to this many ranks each (one
# rank tile, where it was measured; see `_shrink_config`); past it they take the launch one such
# shrink alone takes. H200, bf16, do_bench with L2 flushed, two rounds, 32-row tiles -> this: the
# MLP's dgate B_gate + dup B_up at rank 128 312-315 -> 224-226 us at 8192 tokens, 89-102 -> 74-78 at
# 2048; q/k/v's three dY_i B_i at rank 128 within that probe's spread (77-115 against 78); at rank
# 64 (unchanged) the same launch read 59-98 us for q/k/v from round to round
# (docs/benchmarks/session51/g/shrink_group_probe.log).
_GROUPED_NARROW_MAX_RANKS = 64


def shrink_splits(tiles: int, k_steps: int, fills_wave: bool, sms: int, per_sm: int) -> int:
    """How many splits `lora_shrink` cuts K into (about four K steps long at the least). With few
    tiles (row blocks x rank tiles: a few thousand tokens) each program would walk all of K alone,
    latency-bound; the splits give the SMs more programs, at the cost of fp32 partials of M * R * 4
    bytes each.

    fills_wave: the launch's tiles want one wave of `per_sm` programs an SM (`_ShrinkConfig.fills_wave`).
    16-bit weights over a rank tile of at most 16 split only below one row block per SM, into about
    two programs per SM. Over a wider rank tile (`_WIDE_NATIVE_LAUNCH`) they fill one wave of one
    program per SM. The split dot (an fp32 weight against a 16-bit x) does more work per byte of x
    and wants the SMs full: as many splits as keep every program in one wave of the programs an SM
    holds (`shrink_shared_bytes`), the rule of the grouped weight gradients (`_group_split`). One program
    past a wave costs a second wave; a split fewer costs a longer program. H200, each split forced
    (kernel time, `docs/benchmarks/session25/shrink_group_sweep_after.log` and session26's
    `shrink_group_sweep_ranks_contiguous_a.log`; the rule's picks timed after it in
    `session26/shrink_sweep_after.log`), us: a group's stacked A at rank 32 (three programs per SM),
    8192 tokens, 3 splits (384 programs) 31.5 against 40.5 in four (512); at 16384 tokens unsplit
    63.7 against 73.6 in two. Rank 48 (the wide tile, two per SM) at 8192 tokens 36.2 in four (256
    programs) against 49.0 in five; at 16384 tokens 63.8 in two against 84.3 in three. Rank 16 (four
    per SM), K=14336: 16384 tokens 128.6 in two against 149.0 in three; 4096 tokens 37.3 in eight
    against 41.4 in seven."""
    most = cdiv(k_steps, 4)
    if fills_wave:
        return one_wave_splits(tiles, per_sm * sms, most)
    if tiles >= sms:
        return 1
    return min(cdiv(2 * sms, tiles), most)


def shrink_shared_bytes(
    block_m: int, block_k: int, block_r: int, num_stages: int, x_bytes: int, weight_bytes: int
) -> int:
    """Shared memory of one `lora_shrink` program, estimated: the pipeline's stages of its x and weight
    tiles. The split rule counts programs per SM by it (`_lora_common._programs_per_sm`): on an H200
    (228 KiB an SM) four at rank 16, three at rank 32 (64 x 64 tiles, four stages), two for the wide
    tile (`_WIDE_SPLIT_LAUNCH`), with bf16 x and fp32 weights."""
    return num_stages * (block_m * block_k * x_bytes + block_k * block_r * weight_bytes)


def shrink_rank_block(ranks: int) -> int:
    """The shrinks' rank tile for `ranks` ranks: up to 64 one tile covers them all, so x is streamed
    from memory once; past 64, tiles of 64 (each rank tile's programs read x again, in part from L2).
    One 128-wide tile was 2.5-3x slower than two or three 64-wide ones. H200, x [8192, 4096] bf16,
    kernel time with L2 flushed, us, the default launches before -> after: fp32 A (the split dot) of
    96 ranks (q/k/v at rank 32) 161.4 -> 65.4, 128 ranks 166.6 -> 62.4, 192 (q/k/v at rank 64) 336.4
    -> 114.1, 384 (rank 128) 496.8 -> 191.7; bf16 A of 192 ranks 107.7 -> 35.6 with
    `_MANY_RANKS_NATIVE_LAUNCH` (`python -m benchmarks.tune_lora_terms --high-rank`,
    `docs/benchmarks/session45/b/tune_high_rank.log` and `c/s45_c.log`)."""
    return _rank_block(ranks, cap=64)


class _ShrinkConfig(NamedTuple):
    """`lora_shrink`'s default launch for an x and a weight (see `_lora_shrink_triton`)."""

    mode: int  # dots.dot_mode
    copy_weight: bool  # an fp32 weight copied contiguous first
    block_r: int
    block_m: int
    block_k: int
    num_warps: int
    num_stages: int
    # The K splits fill one wave of `per_sm` programs an SM (`shrink_splits`): the split dot's, by
    # its tiles' shared memory, and the wide 16-bit tile's, one.
    fills_wave: bool = False
    per_sm: Optional[int] = None  # None: as many as the tiles' shared memory allows


def shrink_k_splits(
    config: _ShrinkConfig,
    x: torch.Tensor,
    weight: torch.Tensor,
    ranks: int,
    block_m: int,
    block_k: int,
    num_stages: int,
    split: int | None = None,
) -> tuple[int, int]:
    """(splits, K columns a split) of a shrink launch of x `[M, K]` against `ranks` ranks in
    `config`'s rank tiles (`lora_shrink`'s, `lora_shrink_stack`'s): the given `split`, else
    `shrink_splits`' for every rank tile's row blocks, with the programs an SM holds by the tiles'
    shared memory where the config does not fix them. Splits cover whole `block_k` steps; none is
    empty."""
    M, K = x.shape
    if split is None:
        per_sm = config.per_sm
        if per_sm is None:
            shared_bytes = shrink_shared_bytes(
                block_m, block_k, config.block_r, num_stages, x.element_size(), weight.element_size()
            )
            per_sm = _programs_per_sm(x.device, shared_bytes)
        tiles = cdiv(M, block_m) * cdiv(ranks, config.block_r)
        split = shrink_splits(tiles, cdiv(K, block_k), config.fills_wave, _num_sms(x.device), per_sm)
    k_per_split = cdiv(cdiv(K, max(split, 1)), block_k) * block_k
    return cdiv(K, k_per_split), k_per_split


def _shrink_config(
    x: torch.Tensor,
    weight: torch.Tensor,
    block_r: int | None = None,
    grouped: bool = False,
    ranks: int | None = None,
) -> _ShrinkConfig:
    """ranks: the ranks of the whole launch (a stack of members' weights), default weight's.
    block_r: a rank tile the caller chose (tests, tuners), which the warps and wide tiles follow.
    grouped: the tiles of `lora_shrink_group`'s members, which keep 32-row tiles with 16-bit weights
    over a wide rank tile: H200, q/k/v's three dY_i @ B_i with bf16 B at ranks 32 and 64, kernel time,
    us, 32-row tiles against `_WIDE_NATIVE_LAUNCH`: 13.7 / 15.2 and 18.3 / 22.7 at 2048 tokens, 36.0 /
    33.8 and 41.6 / 41.6 at 8192, 63.8 / 61.7 and 77.0 / 76.5 at 16384
    (`docs/benchmarks/session31/native_wide_group_probe.log`); past `_GROUPED_NARROW_MAX_RANKS` ranks
    a member (two or more rank tiles) takes the launch it would take alone."""
    mode = dot_mode(x, weight)
    copy_weight = mode == FP32_DOT and weight.dtype == torch.float32 and weight.stride(1) != 1
    ranks = ranks or weight.shape[0]
    block_r = block_r or shrink_rank_block(ranks)
    sixteen_bit = torch.float32 not in (x.dtype, weight.dtype)
    block_m, block_k = _SHRINK_TILES[NATIVE_DOT if sixteen_bit else mode]
    num_warps, num_stages = 8 if block_r > 64 else 4, 4
    if mode == SPLIT_DOT and 32 < block_r <= 64:  # measured there only (ranks 48 to 384)
        block_m, block_k, num_warps, num_stages = _WIDE_SPLIT_LAUNCH
    narrow = grouped and ranks <= _GROUPED_NARROW_MAX_RANKS
    if sixteen_bit and 32 <= block_r <= 64 and not narrow:  # measured there only (ranks 32 to 192)
        launch = _MANY_RANKS_NATIVE_LAUNCH if ranks > 64 else _WIDE_NATIVE_LAUNCH
        block_m, block_k, num_warps, num_stages = launch
        return _ShrinkConfig(mode, copy_weight, block_r, block_m, block_k, num_warps, num_stages, True, 1)
    return _ShrinkConfig(
        mode, copy_weight, block_r, block_m, block_k, num_warps, num_stages, mode == SPLIT_DOT
    )


def _lora_shrink_triton(
    *,
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: float = 1.0,
    out: torch.Tensor | None = None,
    weight_t: torch.Tensor | None = None,
    split: int | None = None,
    block_m: int | None = None,
    block_k: int | None = None,
    block_r: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """out: an fp32 [M, R] tensor to write into (e.g. columns of a group's stacked result), or None.
    weight_t: a contiguous [K, R] tensor of weight's dtype that the launch also copies weight.T into
    (`lora_shrink_keeping_weight_t`), or None."""
    # The default launch of these inputs' shapes, strides, dtypes and alignment again: its plan.
    plan_key = None
    defaults = split is None and block_m is None and block_k is None and block_r is None
    defaults = defaults and num_warps is None and num_stages is None
    if defaults and _SHRINK_PLANS.enabled:
        plan_key = _shrink_plan_key(x, weight, out, weight_t is not None)
        plan = _SHRINK_PLANS.get(plan_key)
        if plan is not None:
            return _run_shrink_plan(plan, x, weight, scale, out, weight_t)
    M, K = x.shape
    R = weight.shape[0]
    if M == 0 or R == 0 or K == 0:
        if weight_t is not None:
            weight_t.copy_(weight.t())
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
    config = _shrink_config(x, weight, block_r)
    mode, weight_copied = config.mode, config.copy_weight
    weight = weight.contiguous() if weight_copied else weight
    block_r = config.block_r
    block_m, block_k = block_m or config.block_m, block_k or config.block_k
    num_warps, num_stages = num_warps or config.num_warps, num_stages or config.num_stages
    row_blocks = cdiv(M, block_m)
    split, k_per_split = shrink_k_splits(config, x, weight, R, block_m, block_k, num_stages, split)
    # The result is handed out token-major ([M, R] with strides (1, M)), the layout lora_weight_grad
    # wants its left operand in, so xa and dY @ B reach it without a transposed copy. Deterministic:
    # the splits' partials are summed in split order inside the kernel (split_sum).
    out = empty_2d(M, R, torch.float32, x.device, column_major=True) if out is None else out
    r_tiles = cdiv(R, block_r)
    partial, counters = (
        split_scratch(x.device, split * M * R, row_blocks * r_tiles) if split > 1 else (out, out)
    )
    grid = (row_blocks, r_tiles, split)
    bound = _lora_shrink_kernel[grid](
        x, weight, out, partial, counters, out if weight_t is None else weight_t,
        M, K, R, k_per_split, split, float(scale),
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_R=block_r,
        DOT_PRECISION=dot_precision(x.dtype, weight.dtype), DOT_MODE=mode, SPLIT=split > 1,
        STORE_WEIGHT_T=weight_t is not None, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if plan_key is not None and bound is not None:
        _SHRINK_PLANS.add(plan_key, _ShrinkPlan(
            bound, weight_copied, x.device,
            (M, R), (split * M * R, row_blocks * r_tiles) if split > 1 else None,
            (M, K, R, k_per_split, split),
            (x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1)),
        ))  # fmt: skip
    return out


class _ShrinkPlan(NamedTuple):
    """What `_lora_shrink_triton` derived from its inputs' metadata, to launch the same again."""

    launch: BoundLaunch
    copy_weight: bool  # the weight was copied to a contiguous one first (its strides below are the copy's)
    device: torch.device
    out_shape: tuple[int, int]  # (M, R) of a new (token-major) result where none is given
    scratch: Optional[tuple[int, int]]  # split_scratch's sizes when the launch splits K
    sizes: tuple[int, ...]  # M, K, R, k_per_split, n_splits
    strides: tuple[int, ...]


_SHRINK_PLANS = LaunchPlans("lora_shrink")


def _shrink_plan_key(x, weight, out=None, keeps_weight_t: bool = False) -> tuple:
    """The one key of a shrink plan: the launcher's and the op bodies' lookups must agree. A given
    `out` is part of it (its strides and alignment are the launch's); None keys a new result.
    keeps_weight_t: the launch also writes weight.T (a new contiguous tensor: weight's key fixes it)."""
    return _SHRINK_PLANS.key(x, weight, out, keeps_weight_t)


@trace_unit
def _run_shrink_plan(
    plan: _ShrinkPlan,
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    weight_t: torch.Tensor | None = None,
) -> torch.Tensor:
    weight = weight.contiguous() if plan.copy_weight else weight
    if out is None:
        out = empty_2d(*plan.out_shape, torch.float32, plan.device, column_major=True)
    partial, counters = split_scratch(plan.device, *plan.scratch) if plan.scratch else (out, out)
    weight_t = out if weight_t is None else weight_t
    plan.launch(x, weight, out, partial, counters, weight_t, *plan.sizes, float(scale), *plan.strides)
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


def _check_shrink(x: torch.Tensor, weight: torch.Tensor) -> None:
    op = "lora_shrink"
    _check_2d(op, "x", x, "[M, K]")
    _check_2d(op, "weight", weight, "[R, K]")
    _check_dim(op, "weight", weight, "[R, K]", 1, x.shape[1], "K (x.shape[1])")
    _check_devices(op, x=x, weight=weight)


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


def lora_shrink_keeping_weight_t(
    x: torch.Tensor, weight: torch.Tensor, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``scale * x @ weight.T`` as `lora_shrink` gives it, ``weight.T`` contiguous):
    `fastlora::lora_shrink_keeping_weight_t` (see `_lora_shrink_keeping_weight_t_body`)."""
    if skips_op_dispatch(x, weight):
        return _lora_shrink_keeping_weight_t_body(x, weight, scale)
    return lora_shrink_keeping_weight_t_op(x, weight, scale)


def _lora_shrink_keeping_weight_t_body(
    x: torch.Tensor, weight: torch.Tensor, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """`lora_shrink`'s result, and weight.T ([K, R], weight's dtype, the rank dim contiguous) written by
    the same launch: the layout a dX term's right operand wants (see `lora_expand_add`), which the
    shrink loads tile by tile anyway, where a `.contiguous()` of lora_a.T in backward is one more op."""
    if _SHRINK_PLANS.serve(x):  # see `_PLANS_SKIP_CHECKS`
        plan = _SHRINK_PLANS.get(_shrink_plan_key(x, weight, None, True))
        if plan is not None:
            weight_t = empty_2d(weight.shape[1], weight.shape[0], weight.dtype, plan.device)
            return _run_shrink_plan(plan, x, weight, scale, None, weight_t), weight_t
    _check_shrink(x, weight)
    if runs_triton(x):
        weight_t = empty_2d(weight.shape[1], weight.shape[0], weight.dtype, weight.device)
        return _lora_shrink_triton(x=x, weight=weight, scale=scale, weight_t=weight_t), weight_t
    result, weight_t = reference.lora_shrink_keeping_weight_t(x, weight, scale)
    return result.T.contiguous().T, weight_t


lora_shrink_keeping_weight_t_op = torch.library.custom_op(
    f"{OP_NAMESPACE}::lora_shrink_keeping_weight_t", _lora_shrink_keeping_weight_t_body, mutates_args=()
)


@lora_shrink_keeping_weight_t_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    _check_shrink(x, weight)
    return x.new_empty((weight.shape[0], x.shape[0]), dtype=torch.float32).T, weight.new_empty(weight.T.shape)


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


def lora_shrink_stacked_of_transposed(
    xs: Sequence[torch.Tensor], weights_t: Sequence[torch.Tensor], scales: Sequence[float]
) -> torch.Tensor:
    """`lora_shrink_stacked(xs, [w.t() for w in weights_t], scales)` for a caller that holds each
    weight's transpose (`g_i @ B_i`: lora_B, `[K_i, R_i]`): a plan's hit launches with lora_B itself,
    the address of its transpose, where three `.t()` views cost a q/k/v backward about 4.5 us of host
    time on the H200 machine. The key takes each as its transpose (`Transposed`): the plan of
    `lora_shrink_stacked`'s own call with these transposes."""
    if _STACKED_PLANS.serve(xs[0]) and skips_op_dispatch(*xs, *weights_t):
        transposes = map(Transposed, weights_t)
        plan = _STACKED_PLANS.get(_STACKED_PLANS.key(*xs, *transposes, ShrinkGroupSettings.enabled))
        if plan is not None and len(scales) == len(xs):
            stacked = empty_2d(*plan.shape, torch.float32, plan.device, column_major=True)
            plan.launch(xs, weights_t, scales, stacked)
            return stacked
    return lora_shrink_stacked(xs, [weight_t.t() for weight_t in weights_t], scales)


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
    plan_key = None
    if _STACKED_PLANS.serve(xs[0]):  # see `_PLANS_SKIP_CHECKS`
        plan_key = _STACKED_PLANS.key(*xs, *weights, ShrinkGroupSettings.enabled)
        plan = _STACKED_PLANS.get(plan_key)
        if plan is not None:
            stacked = empty_2d(*plan.shape, torch.float32, plan.device, column_major=True)
            plan.launch(xs, weights, scales, stacked)
            return stacked
    ranks = [weight.shape[0] for weight in weights]
    stacked = torch.empty((sum(ranks), xs[0].shape[0]), dtype=_stacked_dtype(xs[0]), device=xs[0].device)
    if runs_triton(xs[0]) and _shrinks_group(xs, weights):
        _check_shrink_stacked(xs, weights, scales)
        config = _shrink_config(xs[0], weights[0], grouped=True)
        launched = launch_shrink_group(
            xs, weights, scales, stacked.T, block_m=config.block_m, block_k=config.block_k,
            block_r=config.block_r, num_warps=config.num_warps, num_stages=config.num_stages,
            dot_mode=config.mode, dot_precision=dot_precision(xs[0].dtype, weights[0].dtype),
            sms=_num_sms(xs[0].device),
        )  # fmt: skip
        if plan_key is not None and launched is not None:
            _STACKED_PLANS.add(plan_key, _StackedPlan(launched, stacked.T.shape, stacked.device))
        return stacked.T
    start = 0
    for x, weight, scale, rank in zip(xs, weights, scales, ranks):
        _shrink(x, weight, float(scale), stacked[start : start + rank].T)
        start += rank
    return stacked.T


def _shrinks_group(xs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor]) -> bool:
    """Whether a stacked shrink's members take one launch of `lora_shrink_group`'s kernel: 2 to
    MAX_MEMBERS of them, `ShrinkGroupSettings.enabled`, every member tiled as `lora_shrink` tiles the
    first (one dot mode, one rank, no weight copied) with weights of one set of strides, and each x of
    unit column stride, more than one column and a row stride other than 1 (a 1 there, picked beside
    the others', would leave the launch's x loads without the divisibility by 16 their 16-byte copies
    need)."""
    if not (ShrinkGroupSettings.enabled and 1 < len(xs) <= MAX_GROUP_MEMBERS):
        return False
    config = _shrink_config(xs[0], weights[0])
    if config.copy_weight or xs[0].shape[0] == 0 or weights[0].shape[0] == 0:
        return False
    for x, weight in zip(xs, weights):
        if (
            x.dtype != xs[0].dtype
            or weight.dtype != weights[0].dtype
            or weight.stride() != weights[0].stride()
        ):
            return False
        if weight.shape[0] != weights[0].shape[0] or x.stride(1) != 1 or x.stride(0) == 1 or x.shape[1] < 2:
            return False
    return True


class _StackedPlan(NamedTuple):
    """A grouped stacked shrink's launch and its result's shape ([M, sum R], token-major)."""

    launch: ShrinkGroupLaunch
    shape: torch.Size
    device: torch.device


_STACKED_PLANS = LaunchPlans("lora_shrink_stacked")


lora_shrink_stacked_op = torch.library.custom_op(
    f"{OP_NAMESPACE}::lora_shrink_stacked", _lora_shrink_stacked_body, mutates_args=()
)


@lora_shrink_stacked_op.register_fake
def _(xs: list[torch.Tensor], weights: list[torch.Tensor], scales: list[float]) -> torch.Tensor:
    _check_shrink_stacked(xs, weights, scales)
    rows, ranks = xs[0].shape[0], sum(weight.shape[0] for weight in weights)
    return xs[0].new_empty((ranks, rows), dtype=_stacked_dtype(xs[0])).T
