"""A group's backward shrinks in one launch: ``out[:, i R : (i + 1) R] = scale_i * x_i @ w_i.T``.

`lora_shrink_stacked` (q/k/v's `g_i @ B_i`, gate's and up's) writes each member's shrink into its
columns of one token-major buffer; it launched `lora_shrink`'s kernel once per member, each launch
costing host time in blocks that are host-bound (docs/benchmarks.md). Here one launch walks every
member's programs: each program picks its member from its split index (member 0's splits first),
then runs `lora_shrink`'s loop over that member's columns of x. The members share M and the rank
(one rank tile, one row tile) and are tiled as `lora_shrink` tiles each; the column splits are
chosen for all the members' row blocks together (`group_k_per_split`). The op and its choice of tiles
live in `lora_terms`; this module holds the kernel and its launch.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
import triton
import triton.language as tl

from fastlora_peft.call_traces import VersionedSettings, trace_unit
from fastlora_peft.kernels._launch import BoundLaunch, CachedKernel, cdiv
from fastlora_peft.kernels.shrink_tiles import shrink_loop
from fastlora_peft.kernels.split_sum import split_scratch, split_total

MAX_MEMBERS = 3  # q/k/v


class ShrinkGroupSettings(metaclass=VersionedSettings):
    """Whether `lora_shrink_stacked` launches its members together (read at every call). False launches
    `lora_shrink`'s kernel per member (tests, `plans_ab --switch shrink`)."""

    enabled = True


@CachedKernel
@triton.jit
def _lora_shrink_group_kernel(
    X0_ptr, X1_ptr, X2_ptr, W0_ptr, W1_ptr, W2_ptr, Out_ptr, Partial_ptr, Counter_ptr,
    M, R, K0, K1, K2, k_per_split, splits0, splits1, splits2,
    scale0, scale1, scale2, stride_xm0, stride_xm1, stride_xm2, stride_wr, stride_wk0, stride_wk1, stride_wk2,
    stride_om, stride_or,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_MODE: tl.constexpr, SPLIT: tl.constexpr, MEMBERS: tl.constexpr,
):  # fmt: skip
    """Out[:, i R : (i + 1) R] = scale_i * X_i[M, K_i] @ W_i[R, K_i]^T in fp32 for i < MEMBERS (slots
    past MEMBERS are not read). X_i with unit column stride; the W_i of one rank stride.

    Programs (row block, rank tile, split over every member's splits), as in `lora_shrink`'s kernel;
    every member's splits are k_per_split columns long (one argument: picked per member like the
    others, it lost its divisibility by 16 in an sm_90 compile, and x's loads their 16-byte copies).
    With SPLIT, member i's fp32 partials start at (splits_0 + ... + splits_{i-1}) * M * R, and its
    tiles' counters at i * (row blocks) * (rank tiles); a member of one split stores directly.
    """
    pid_m = tl.program_id(0)
    pid_r = tl.program_id(1)
    pid_s = tl.program_id(2)
    # The member's pointers and numbers are picked first, so one loop serves every member.
    if pid_s < splits0:
        X_ptr, W_ptr, K, n_splits, scale = X0_ptr, W0_ptr, K0, splits0, scale0
        split, member, splits_before = pid_s, 0, 0
        stride_xm, stride_wk = stride_xm0, stride_wk0
    elif pid_s < splits0 + splits1:  # (with two members every program past member 0's is here)
        X_ptr, W_ptr, K, n_splits, scale = X1_ptr, W1_ptr, K1, splits1, scale1
        split, member, splits_before = pid_s - splits0, 1, splits0
        stride_xm, stride_wk = stride_xm1, stride_wk1
    else:
        X_ptr, W_ptr, K, n_splits, scale = X2_ptr, W2_ptr, K2, splits2, scale2
        split, member, splits_before = pid_s - splits0 - splits1, 2, splits0 + splits1
        stride_xm, stride_wk = stride_xm2, stride_wk2
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_r = offs_r < R
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    x_ptrs = X_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + (k_start + offs_k)[None, :]
    w_ptrs = W_ptr + (k_start + offs_k)[:, None] * stride_wk + offs_r[None, :] * stride_wr  # W^T tile
    acc = shrink_loop(
        x_ptrs, w_ptrs, k_start, k_end, mask_m, mask_r, 1, stride_wk,
        BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, BLOCK_R=BLOCK_R, DOT_PRECISION=DOT_PRECISION, DOT_MODE=DOT_MODE,
    )  # fmt: skip
    # Member i's columns of the stacked output start at i * R.
    offsets = offs_m.to(tl.int64)[:, None] * stride_om + (member * R + offs_r)[None, :] * stride_or
    mask = mask_m[:, None] & mask_r[None, :]
    if SPLIT:
        if n_splits > 1:
            partials = Partial_ptr + splits_before * M * R
            # The partials of one member laid out like its [M, R] block of Out, without the offset.
            local = offs_m.to(tl.int64)[:, None] * R + offs_r[None, :]
            tiles = tl.num_programs(0) * tl.num_programs(1)
            counter_ptr = Counter_ptr + member * tiles + pid_m * tl.num_programs(1) + pid_r
            is_last, total = split_total(acc, partials, local, mask, split, n_splits, M * R, counter_ptr)
            if is_last:
                tl.store(Out_ptr + offsets, scale * total, mask=mask)
        else:
            tl.store(Out_ptr + offsets, scale * acc, mask=mask)
    else:
        tl.store(Out_ptr + offsets, scale * acc, mask=mask)


# The grouped launch aims for this many programs per SM, its members' programs within BALANCE times
# one another's length. H200, rank 16, every even split forced, kernel time from torch.profiler
# (`docs/benchmarks/session25/shrink_group_sweep.log`), us: q/k/v's g_i @ B_i at 8192 tokens with
# fp32 weights 48.3 unsplit (q's 128 programs walk 4096 columns, k's and v's 1024) against 36.8 with
# q in two; at 4096 tokens 39.2 against 18.9 with q in four; MLP gate/up with fp32 weights at 8192
# tokens 150.2 unsplit (256 programs) against 128.9 in two (512); bf16 weights at 8192 tokens
# 109.0 unsplit (512 programs) against 130.8 in two. Summed over 20 shapes (1024-16384 tokens, both
# groups and weight dtypes) this rule read 38.5 us over the fastest split of each when run after the
# change (`shrink_group_sweep_after.log`), the rule before it 146.1: 1231 us in all against 1339.
GROUP_PROGRAMS_PER_SM = 3
GROUP_BALANCE = 2


def group_k_per_split(widths: Sequence[int], tiles: int, block_k: int, sms: int) -> int:
    """The columns of one split, for every member: the widest member cut evenly into the fewest splits
    that give every SM about GROUP_PROGRAMS_PER_SM programs over all the members (`tiles`: a
    member's row blocks x rank tiles), each split no longer than GROUP_BALANCE times the narrowest
    member's columns and at least four column steps long (or the widest member whole, when it is
    shorter than that). Narrower members are cut into splits of the same length."""
    steps = [cdiv(width, block_k) for width in widths]
    widest, narrowest = max(steps), min(steps)
    length = widest
    for count in range(1, widest // 4 + 1):  # count <= widest / 4: every split at least 4 steps
        length = cdiv(widest, count)
        programs = tiles * sum(cdiv(member, length) for member in steps)
        if programs >= GROUP_PROGRAMS_PER_SM * sms and length <= GROUP_BALANCE * narrowest:
            break
    return length * block_k


class ShrinkGroupLaunch(NamedTuple):
    """A plan's launch of the grouped kernel: the same again with new tensors and scales."""

    launch: BoundLaunch
    head: tuple  # its scalar arguments before the scales (M, R, the K_i, splits) ...
    tail: tuple  # ... and after them
    scratch: Optional[tuple[int, int]]  # split_scratch's sizes when a member splits
    device: torch.device

    @trace_unit
    def __call__(self, xs, weights, scales, out) -> None:
        partial, counters = split_scratch(self.device, *self.scratch) if self.scratch else (out, out)
        scalars = (*self.head, *_scale_slots(scales), *self.tail)
        self.launch(*_slots(xs), *_slots(weights), out, partial, counters, *scalars)


def _slots(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The kernel's MAX_MEMBERS tensor slots: slots past the members repeat the first (never read)."""
    return [*tensors, *[tensors[0]] * (MAX_MEMBERS - len(tensors))]


def _scale_slots(scales: Sequence[float]) -> list[float]:
    return [*map(float, scales), *[0.0] * (MAX_MEMBERS - len(scales))]


def launch_shrink_group(
    xs: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor],
    scales: Sequence[float],
    out: torch.Tensor,
    *,
    block_m: int,
    block_k: int,
    block_r: int,
    num_warps: int,
    num_stages: int,
    dot_mode: int,
    dot_precision: str,
    sms: int,
    k_per_split: Optional[int] = None,
) -> Optional[ShrinkGroupLaunch]:
    """Launches the grouped kernel for 2 to MAX_MEMBERS members into `out` ([M, members * R], strides
    of the caller's buffer), with the tiles the caller chose (`lora_terms`: `lora_shrink`'s for these
    operands) and `group_k_per_split` (or the given split length: tests). Returns the plan's launch,
    None when interpreted."""
    M, R = xs[0].shape[0], weights[0].shape[0]
    widths = [x.shape[1] for x in xs]
    row_blocks, r_tiles = cdiv(M, block_m), cdiv(R, block_r)
    k_per_split = k_per_split or group_k_per_split(widths, row_blocks * r_tiles, block_k, sms)
    splits = [cdiv(width, k_per_split) for width in widths]
    split = max(splits) > 1
    scratch = (sum(splits) * M * R, len(xs) * row_blocks * r_tiles) if split else None
    partial, counters = split_scratch(out.device, *scratch) if scratch else (out, out)
    pad = [0] * (MAX_MEMBERS - len(xs))
    head = (M, R, *widths, *pad, k_per_split, *splits, *pad)
    tail = (
        *[x.stride(0) for x in xs], *pad, weights[0].stride(0), *[w.stride(1) for w in weights], *pad,
        out.stride(0), out.stride(1),
    )  # fmt: skip
    bound = _lora_shrink_group_kernel[(row_blocks, r_tiles, sum(splits))](
        *_slots(xs), *_slots(weights), out, partial, counters, *head, *_scale_slots(scales), *tail,
        BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_R=block_r, DOT_PRECISION=dot_precision, DOT_MODE=dot_mode,
        SPLIT=split, MEMBERS=len(xs), num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return None if bound is None else ShrinkGroupLaunch(bound, head, tail, scratch, out.device)
