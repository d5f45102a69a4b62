"""``lora_weight_grads(lefts, xs, scales, k_major, out_dtype)``: a Function's weight gradients
``scale_i * lefts[i].T @ xs[i]`` (each summed over the same M tokens) in as few launches as their
shapes allow.

A projection's backward makes dA (`grad_xa` against x) and dB (`xa` against dY); a q/k/v group makes
dA of all three in one pass and a dB per member: four `lora_weight_grad` launches, each costing a
launch's host time in blocks that are host-bound (docs/benchmarks.md). Here the gradients that tile
alike (same rank, rank tile, row tile and warps (`weight_grad_tiling`) and activation dtype, the
lefts of one set of strides) run as one launch of a grouped kernel: o_proj's dA and dB, q/k/v's
three dB, the MLP's gate, up and down dB. Each program of the grouped kernel picks its problem from its column
tile (problem 0's tiles first) and then runs `lora_weight_grad`'s loop for that tile; the token
splits are chosen once for all the group's tiles. A gradient with no partner (q/k/v's dA, of rank 3r)
takes `lora_weight_grad`'s own kernel.

A `torch.library` custom op with a fake; on the CPU outside the interpreter it runs
``lora_terms_reference.lora_weight_grad`` per problem.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
import triton
import triton.language as tl

from fastlora_peft.call_traces import VersionedSettings, trace_unit
from fastlora_peft.kernels import lora_terms_reference as reference
from fastlora_peft.kernels._backend import OP_NAMESPACE, runs_triton, skips_op_dispatch
from fastlora_peft.kernels._launch import BoundLaunch, CachedKernel, LaunchPlans, cdiv, empty_2d
from fastlora_peft.kernels._lora_common import (
    _check_devices,
    _num_sms,
    _programs_per_sm,
    _rank_block,
    one_wave_splits,
)
from fastlora_peft.kernels.dots import dot_precision, weight_grad_dot_mode
from fastlora_peft.kernels.lora_weight_grad import (
    _MIN_ROWS_PER_SPLIT,
    _WEIGHT_GRAD_PLANS,
    _check_weight_grad,
    _lora_weight_grad_triton,
    _run_weight_grad_plan,
    _store_weight_grad,
    _weight_grad_loop,
    _weight_grad_plan_key,
    weight_grad_tiling,
)
from fastlora_peft.kernels.split_sum import split_scratch

# The most gradients one launch takes (a call may hand over more: `launch_groups` splits them). The
# fused Functions ask for at most four in a call: q/k/v's dA and three dB, the MLP's gate/up dA and
# three dB.
MAX_PROBLEMS = 4


class WeightGradGroupSettings(metaclass=VersionedSettings):
    """Whether `lora_weight_grads` groups launches (read at every call). False launches
    `lora_weight_grad`'s kernel per gradient (tests, `plans_ab --switch wgrad`)."""

    enabled = True


# A problem's numbers are picked at run time, and the picked value knows only what all problems'
# values share. The output strides differ between problems (dA [R, K] row-major beside a K-major dB;
# Triton would make the one that is 1 a constant) and are read once per tile: not specialized, so
# one compiled kernel serves every mix of layouts. The rest are, for what the specialization tells
# the compiler: with K and x's row stride multiples of 16, x's masked loads become 16-byte
# asynchronous copies (K unspecialized took them to 2-byte loads in an sm_90 compile); a problem of
# one column would take that from the whole launch, so `launch_groups` keeps it apart.
# `tests/test_lora_weight_grads.py` compiles both kernels for sm_90 and compares.
_UNSPECIALIZED = [f"{name}{i}" for name in ("stride_or", "stride_ok") for i in range(MAX_PROBLEMS)]


@CachedKernel
@triton.jit(do_not_specialize=_UNSPECIALIZED)
def _lora_weight_grad_group_kernel(
    Left0_ptr, Left1_ptr, Left2_ptr, Left3_ptr, X0_ptr, X1_ptr, X2_ptr, X3_ptr,
    Out0_ptr, Out1_ptr, Out2_ptr, Out3_ptr, Partial_ptr, Counter_ptr,
    M, R, K0, K1, K2, K3, scale0, scale1, scale2, scale3, rows_per_split, n_splits,
    stride_lr, stride_xm0, stride_xm1, stride_xm2, stride_xm3,
    stride_or0, stride_ok0, stride_or1, stride_ok1, stride_or2, stride_ok2, stride_or3, stride_ok3,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_MODE: tl.constexpr, SPLIT: tl.constexpr, PROBLEMS: tl.constexpr,
):  # fmt: skip
    """Out_i[R, K_i] = scale_i * Left_i[M, R]^T @ X_i[M, K_i] for i < PROBLEMS (slots past PROBLEMS are
    None), in Out_i's dtype and strides. Left_i token-major (unit token stride) with one rank
    stride; X_i with unit column stride.

    Programs (column tile over every problem's tiles, split, rank tile), as in `lora_weight_grad`'s
    kernel; problem i's fp32 split partials start at n_splits * R * (K_0 + ... + K_{i-1}), and each
    tile's counter is its program's (column tile, rank tile), unique across problems.
    """
    pid_k = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_r = tl.program_id(2)
    # Problem 0's pointers and numbers, then each later problem's over its own tiles: picked before
    # the loop, so one loop (one set of pipeline buffers) serves every problem, as in lora_addmm_group.
    # Slots past PROBLEMS hold None (a constant: nothing passed at the launch) and are never read.
    Left_ptr, X_ptr, Out_ptr, K, scale = Left0_ptr, X0_ptr, Out0_ptr, K0, scale0
    local_k, k_before = pid_k, K0 * 0
    stride_xm, stride_or, stride_ok = stride_xm0, stride_or0, stride_ok0
    tiles_before = tl.cdiv(K0, BLOCK_K)
    if PROBLEMS > 1:
        if pid_k >= tiles_before:
            Left_ptr, X_ptr, Out_ptr, K, scale = Left1_ptr, X1_ptr, Out1_ptr, K1, scale1
            local_k, k_before = pid_k - tiles_before, K0
            stride_xm, stride_or, stride_ok = stride_xm1, stride_or1, stride_ok1
        tiles_before += tl.cdiv(K1, BLOCK_K)
    if PROBLEMS > 2:
        if pid_k >= tiles_before:
            Left_ptr, X_ptr, Out_ptr, K, scale = Left2_ptr, X2_ptr, Out2_ptr, K2, scale2
            local_k, k_before = pid_k - tiles_before, K0 + K1
            stride_xm, stride_or, stride_ok = stride_xm2, stride_or2, stride_ok2
        tiles_before += tl.cdiv(K2, BLOCK_K)
    if PROBLEMS > 3:
        if pid_k >= tiles_before:
            Left_ptr, X_ptr, Out_ptr, K, scale = Left3_ptr, X3_ptr, Out3_ptr, K3, scale3
            local_k, k_before = pid_k - tiles_before, K0 + K1 + K2
            stride_xm, stride_or, stride_ok = stride_xm3, stride_or3, stride_ok3
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_k = local_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    mask_r = offs_r < R
    mask_k = offs_k < K
    m_start = pid_s * rows_per_split
    m_end = tl.minimum(m_start + rows_per_split, M)
    # X with unit column stride and Left token-major (unit token stride), as `launch_groups` groups them.
    acc = _weight_grad_loop(
        X_ptr, Left_ptr, offs_m, offs_k, offs_r, mask_k, mask_r, m_start, m_end, stride_xm, 1, 1, stride_lr,
        BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K, DOT_PRECISION=DOT_PRECISION, DOT_MODE=DOT_MODE,
    )  # fmt: skip
    _store_weight_grad(
        acc, scale, Out_ptr, Partial_ptr, Counter_ptr, offs_k, offs_r, mask_k, mask_r, pid_k, pid_r, pid_s,
        n_splits, R, K, k_before, stride_ok, stride_or, SPLIT=SPLIT,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# Launchers. Callers have checked shapes, dtypes and devices; lefts are token-major (unit token stride).
# ---------------------------------------------------------------------------------------------------


def _new_out(
    rank: int, columns: int, k_major: bool, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """[rank, columns] of `dtype`: row-major, or with k_major its transpose contiguous (strides (1, rank))."""
    return empty_2d(rank, columns, dtype, device, column_major=k_major)


def _slots(values: Sequence) -> list:
    """The kernel's MAX_PROBLEMS slots of one argument: None past the problems (a constant there, so
    the launch passes nothing for it)."""
    return [*values, *[None] * (MAX_PROBLEMS - len(values))]


class _GroupLaunch(NamedTuple):
    """A plan's launch of the grouped kernel: the same again with new tensors and scales."""

    members: tuple[int, ...]  # the call's problems it computes
    launch: BoundLaunch
    head: tuple  # its scalar arguments before the scales (M, R, the K_i) ...
    tail: tuple  # ... and after them
    scratch: Optional[tuple[int, int]]  # split_scratch's sizes when it splits the tokens
    buffers: tuple  # per member: (its output's shape, k_major: the output column-major)
    out_dtype: torch.dtype
    device: torch.device

    @trace_unit
    def __call__(self, lefts, xs, scales, outs) -> None:
        members, dtype, device = self.members, self.out_dtype, self.device
        group_outs = []
        for i, (shape, k_major) in zip(members, self.buffers):
            outs[i] = out = empty_2d(*shape, dtype, device, column_major=k_major)
            group_outs.append(out)
        scratch = self.scratch
        partial, counters = split_scratch(device, *scratch) if scratch else (group_outs[0],) * 2
        pad = self.pad
        self.launch(
            *[lefts[i] for i in members], *pad, *[xs[i] for i in members], *pad, *group_outs, *pad,
            partial, counters, *self.head, *[float(scales[i]) for i in members], *pad, *self.tail,
        )  # fmt: skip

    @property
    def pad(self) -> tuple:
        return _PADS[len(self.members)]


_PADS = {problems: (None,) * (MAX_PROBLEMS - problems) for problems in range(1, MAX_PROBLEMS + 1)}


class _SingleLaunch(NamedTuple):
    """A plan's launch of `lora_weight_grad`'s kernel for one problem, from that op's own plan."""

    index: int
    plan: object  # lora_weight_grad's `_WeightGradPlan`

    @trace_unit
    def __call__(self, lefts, xs, scales, outs) -> None:
        i = self.index
        outs[i] = _run_weight_grad_plan(self.plan, lefts[i], xs[i], scales[i])


_SCALES = slice(2 + MAX_PROBLEMS, 2 + 2 * MAX_PROBLEMS)  # after M, R and the K_i


def _scale_slots(scales: Sequence[float]) -> list:
    return [*map(float, scales), *[None] * (MAX_PROBLEMS - len(scales))]


def _launch_group(
    lefts: Sequence[torch.Tensor],
    xs: Sequence[torch.Tensor],
    scales: Sequence[float],
    outs: Sequence[torch.Tensor],
    *,
    split: int | None = None,
    block_m: int | None = None,
    block_k: int = 128,
    num_warps: int | None = None,
    num_stages: int = 3,
) -> Optional[tuple[BoundLaunch, tuple, tuple, Optional[tuple[int, int]]]]:
    """One launch of the grouped kernel for 1 to MAX_PROBLEMS problems of one rank, into `outs`.

    Returns (bound launch, its scalar arguments before and after the scales, its scratch sizes), or
    None when interpreted. The rank and column tiles are `_lora_weight_grad_triton`'s, the row tile
    and warps `weight_grad_tiling`'s (`launch_groups` groups only problems it tiles alike); the token
    splits fill one wave of the programs the SMs hold (`_group_split`; keyword arguments: tests'
    smaller tiles and forced splits)."""
    M, R = lefts[0].shape
    widths = [x.shape[1] for x in xs]
    block_r = _rank_block(R, cap=64)
    rows_per_step, warps = weight_grad_tiling(R, widths[0], M)
    block_m, num_warps = block_m or rows_per_step, num_warps or warps
    k_tiles = sum(cdiv(width, block_k) for width in widths)
    r_tiles = cdiv(R, block_r)
    if split is None:
        tile_bytes = block_m * (block_k * xs[0].element_size() + block_r * lefts[0].element_size())
        split = _group_split(M, k_tiles * r_tiles, num_stages * tile_bytes, xs[0].device)
    rows_per_split = cdiv(cdiv(M, max(split, 1)), block_m) * block_m
    split = cdiv(M, rows_per_split)  # no empty splits
    scratch = (split * R * sum(widths), k_tiles * r_tiles) if split > 1 else None
    partial, counters = split_scratch(xs[0].device, *scratch) if scratch else (outs[0], outs[0])
    pad = [None] * (MAX_PROBLEMS - len(xs))
    numbers = (
        M, R, *widths, *pad, *_scale_slots(scales), rows_per_split, split, lefts[0].stride(1),
        *[x.stride(0) for x in xs], *pad, *[stride for out in outs for stride in out.stride()], *pad, *pad,
    )  # fmt: skip
    bound = _lora_weight_grad_group_kernel[(k_tiles, split, r_tiles)](
        *_slots(lefts), *_slots(xs), *_slots(outs), partial, counters, *numbers,
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k,
        DOT_PRECISION=dot_precision(lefts[0].dtype, xs[0].dtype),
        DOT_MODE=weight_grad_dot_mode(xs[0], lefts[0], outs[0].dtype),
        SPLIT=split > 1, PROBLEMS=len(xs), num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if bound is None:
        return None
    return bound, numbers[: _SCALES.start], numbers[_SCALES.stop :], scratch


def _group_split(M: int, tiles: int, shared_bytes: int, device: torch.device) -> int:
    """Token splits of a grouped launch whose programs ask `shared_bytes` of shared memory each
    (estimated: the pipeline's stages of the x and left tiles): as many as keep its programs within
    one wave of the programs the SMs hold at once (at least one; none under _MIN_ROWS_PER_SPLIT rows).

    `lora_weight_grad`'s rule (two programs per SM) left a group's programs just over one wave where
    the SMs hold three: at rank tile 16 (63,488 bytes of shared memory per program in an sm_90
    compile, three stages of the x and left tiles and 2 KB more) an H200 SM's shared memory holds three
    (registers not counted; the timings below fit three), and the MLP's
    three dB (256 column tiles) split in two made 512 programs against 396 places. H200, bf16 x, fp32
    lefts, rank 16, kernel time in us back to back / with L2 flushed (`docs/benchmarks/session24/
    wgrad_split_probe.log`): the MLP's dB at 2048 tokens 56.9 / 61.0 split in two, 51.0 / 46.1 in
    one; at 8192 tokens 146.7 / 158.8 against 137.7 / 146.5 (this rule's pick, checked again in
    `wgrad_split_check.log`: 73.8 / 64.9 against 48.2 / 48.0, and 148.6 / 157.4 against 137.7 /
    146.0). o_proj's dA and dB (64 tiles) at 8192 tokens read 52.3 / 64.3 in eight splits (512
    programs again); its five and six, and q/k/v's six and eight, read even over the two runs (these
    short launches' times carry their host time).
    """
    slots = _programs_per_sm(device, shared_bytes) * _num_sms(device)
    return one_wave_splits(tiles, slots, cdiv(M, _MIN_ROWS_PER_SPLIT))


def launch_groups(lefts: Sequence[torch.Tensor], xs: Sequence[torch.Tensor]) -> list[tuple[int, ...]]:
    """The problems' indices by launch: those the grouped kernel tiles alike (rank, rank and row
    tiles, warps, activation dtype, unit column stride) with lefts of one rank stride, in order, at most
    MAX_PROBLEMS per launch; any other problem alone: every problem with no tokens, rank or columns
    (lora_weight_grad answers with zeros), and one of a single column or an x whose row stride is 1
    (its K or stride, picked beside the others', would leave the launch's x loads without the
    divisibility by 16 their 16-byte copies need)."""
    groups: dict[tuple, list[int]] = {}
    for index, (left, x) in enumerate(zip(lefts, xs)):
        (rows, rank), width = left.shape, x.shape[1]
        key: tuple = (index,)
        if (
            WeightGradGroupSettings.enabled
            and x.stride(1) == 1
            and x.stride(0) != 1
            and rows * rank > 0
            and width > 1
        ):
            key = (rank, weight_grad_tiling(rank, width, rows), x.dtype, left.stride(1))
        groups.setdefault(key, []).append(index)
    launches = []
    for members in groups.values():
        launches += [tuple(members[i : i + MAX_PROBLEMS]) for i in range(0, len(members), MAX_PROBLEMS)]
    return launches


def _lora_weight_grads_triton(
    lefts: Sequence[torch.Tensor],
    xs: Sequence[torch.Tensor],
    scales: Sequence[float],
    k_major: Sequence[bool],
    out_dtype: torch.dtype,
    plan_key: Optional[tuple] = None,
) -> list[torch.Tensor]:
    copied = tuple(left.stride(0) != 1 for left in lefts)  # token-major, as lora_weight_grad wants it
    lefts = [left.T.contiguous().T if copy else left for left, copy in zip(lefts, copied)]
    device = xs[0].device
    outs: list = [None] * len(lefts)
    steps: list = []  # what a plan launches: a _SingleLaunch or _GroupLaunch per launch
    for members in launch_groups(lefts, xs):
        if len(members) == 1:  # lora_weight_grad's kernel, and its plan
            (i,) = members
            outs[i] = _lora_weight_grad_triton(
                left=lefts[i], x=xs[i], scale=scales[i], k_major=k_major[i], out_dtype=out_dtype
            )
            single_plan = None
            if plan_key:  # the single launch's own plan, made just now (no rounded_to: out_dtype's dot)
                single_key = _weight_grad_plan_key(lefts[i], xs[i], k_major[i], out_dtype, None)
                single_plan = _WEIGHT_GRAD_PLANS.get(single_key)
            steps.append(None if single_plan is None else _SingleLaunch(i, single_plan))
            continue
        for i in members:
            outs[i] = _new_out(lefts[i].shape[1], xs[i].shape[1], k_major[i], out_dtype, device)
        pick = [lefts[i] for i in members], [xs[i] for i in members], [scales[i] for i in members]
        launched = _launch_group(*pick, [outs[i] for i in members])
        buffers = tuple((tuple(outs[i].shape), k_major[i]) for i in members)  # for the plan
        steps.append(
            None if launched is None else _GroupLaunch(members, *launched, buffers, out_dtype, device)
        )
    if plan_key is not None and None not in steps:
        _GROUP_PLANS.add(plan_key, _GroupPlan(copied if any(copied) else None, len(lefts), tuple(steps)))
    return outs


class _GroupPlan(NamedTuple):
    """What `_lora_weight_grads_triton` derived from its inputs' metadata, to launch the same again."""

    copy_left: Optional[tuple[bool, ...]]  # which lefts are copied token-major first (None: none)
    problems: int
    steps: tuple  # see _lora_weight_grads_triton


_GROUP_PLANS = LaunchPlans("lora_weight_grads")


@trace_unit
def _run_group_plan(plan: _GroupPlan, lefts, xs, scales) -> list[torch.Tensor]:
    if plan.copy_left is not None:
        lefts = [left.T.contiguous().T if copy else left for left, copy in zip(lefts, plan.copy_left)]
    outs: list = [None] * plan.problems
    for step in plan.steps:
        step(lefts, xs, scales, outs)
    return outs


# ---------------------------------------------------------------------------------------------------
# Public op: checks, dispatch, fake implementation. The body looks its launch plan up before its
# checks (lora_terms' `_PLANS_SKIP_CHECKS`).
# ---------------------------------------------------------------------------------------------------


def _check_weight_grads(lefts, xs, scales, k_major) -> None:
    op = "lora_weight_grads"
    if not len(lefts) == len(xs) == len(scales) == len(k_major) or not lefts:
        raise ValueError(
            f"{op}: needs one x, scale and k_major per left, at least one; got {len(lefts)} lefts, "
            f"{len(xs)} xs, {len(scales)} scales and {len(k_major)} k_major"
        )
    for left, x in zip(lefts, xs):
        _check_weight_grad(left, x)
        if left.shape[0] != lefts[0].shape[0]:
            raise ValueError(f"{op}: every left must be [M, R_i] with lefts[0]'s M, got {list(left.shape)}")
    tensors = {**{f"left{i}": t for i, t in enumerate(lefts)}, **{f"x{i}": t for i, t in enumerate(xs)}}
    _check_devices(op, **tensors)


def lora_weight_grads(
    lefts: Sequence[torch.Tensor],
    xs: Sequence[torch.Tensor],
    scales: Sequence[float],
    k_major: Sequence[bool],
    out_dtype: Optional[torch.dtype] = None,
) -> list[torch.Tensor]:
    """``[scales[i] * lefts[i].T @ xs[i] for i]``: `fastlora::lora_weight_grads` (see
    `_lora_weight_grads_body`)."""
    if skips_op_dispatch(*lefts, *xs):
        return _lora_weight_grads_body(lefts, xs, scales, k_major, out_dtype)
    return lora_weight_grads_op(list(lefts), list(xs), list(scales), list(k_major), out_dtype)


def _lora_weight_grads_body(
    lefts: list[torch.Tensor],
    xs: list[torch.Tensor],
    scales: list[float],
    k_major: list[bool],
    out_dtype: Optional[torch.dtype] = None,
) -> list[torch.Tensor]:
    """`lora_weight_grad(lefts[i], xs[i], scales[i], k_major[i], out_dtype)` for every i, the same
    numbers (fp32 sums over the M tokens, deterministic, rounded once to `out_dtype`), in as few
    launches as `launch_groups` allows.

    lefts[i]: [M, R_i] float32 (one M for all); xs[i]: [M, K_i], any float dtype and strides. Returns
    [R_i, K_i] tensors, contiguous, or with k_major[i] their transposes contiguous.
    """
    if xs and _GROUP_PLANS.serve(xs[0]):  # see lora_terms' `_PLANS_SKIP_CHECKS`
        enabled = WeightGradGroupSettings.enabled
        plan_key = _GROUP_PLANS.key(*lefts, *xs, tuple(k_major), out_dtype or torch.float32, enabled)
        plan = _GROUP_PLANS.get(plan_key)
        if plan is not None:
            return _run_group_plan(plan, lefts, xs, scales)
    else:
        plan_key = None
    _check_weight_grads(lefts, xs, scales, k_major)
    if runs_triton(xs[0]):
        return _lora_weight_grads_triton(lefts, xs, scales, k_major, out_dtype or torch.float32, plan_key)
    outs = []
    for left, x, scale, km in zip(lefts, xs, scales, k_major):
        result = reference.lora_weight_grad(left, x, scale)
        result = result if out_dtype is None else result.to(out_dtype)
        outs.append(result.T.contiguous().T if km else result.contiguous())
    return outs


lora_weight_grads_op = torch.library.custom_op(
    f"{OP_NAMESPACE}::lora_weight_grads", _lora_weight_grads_body, mutates_args=()
)


@lora_weight_grads_op.register_fake
def _(
    lefts: list[torch.Tensor],
    xs: list[torch.Tensor],
    scales: list[float],
    k_major: list[bool],
    out_dtype: Optional[torch.dtype] = None,
) -> list[torch.Tensor]:
    _check_weight_grads(lefts, xs, scales, k_major)
    outs = []
    for left, x, km in zip(lefts, xs, k_major):
        rank, features, dtype = left.shape[1], x.shape[1], out_dtype or left.dtype
        out = (
            x.new_empty((features, rank), dtype=dtype).T if km else x.new_empty((rank, features), dtype=dtype)
        )
        outs.append(out)
    return outs
