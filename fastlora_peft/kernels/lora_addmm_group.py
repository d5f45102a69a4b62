"""A group's forward in one launch: ``out_i = a @ b_i + scale_i * left_i @ right_i.T`` for every member.

The members of a shared-input group (q/k/v) read the same x. `lora_addmm` makes each output in a
launch of its own; here one persistent TMA kernel walks the output tiles of every member (member 0's
first, each member's in `lora_addmm`'s grouped order), and a tile starts its accumulator with its
member's LoRA term and runs that member's K loop over the shared a, as `lora_addmm`'s kernel does.
One launch instead of one per member, and one wave schedule over all their tiles (at 8192 tokens
q's 512 wide tiles, k's and v's 128 each fill 3.9 + 1.0 + 1.0 waves of the H200's 132 SMs in three
launches, 5.8 in one). H200, bf16, fp32 adapters, kernel time per step (`python -m
benchmarks.kernel_ab --switch group --block qkv --base bf16 --tokens T`,
docs/benchmarks/session22/kab_group_qkv_*.log): at 8192 tokens 564.2 us against 561.5 for three
`lora_addmm` (even: the waves did not show), at 2048 tokens 145.0 against 156.0.

Each tile picks its member's descriptors, pointers and sizes before its one K loop: a K loop per
member (three branches) got pipeline buffers of its own each, 295-361 KB of shared memory against
the H200's 227 KB (`tests/test_lora_addmm_group.py` compiles the kernels for sm_90 and checks).

Taken where `lora_addmm` would take every member's forward GEMM (`LoraAddmmSettings`, see
`lora_addmm_group_pays_off`), for groups of up to `MAX_MEMBERS`. Where TMA cannot read an operand the
op calls `lora_addmm` per member, so every caller gets the same contract. A `torch.library` custom op
with a fake; the reference (``lora_addmm_reference.lora_addmm`` per member) runs on the CPU outside the
Triton interpreter, as for every op here.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from fastlora_peft.call_traces import trace_unit
from fastlora_peft.kernels import lora_addmm_reference as reference
from fastlora_peft.kernels._backend import OP_NAMESPACE, runs_triton, skips_op_dispatch
from fastlora_peft.kernels._launch import BoundLaunch, CachedKernel, LaunchPlans, cdiv, empty_2d
from fastlora_peft.kernels.dots import expand_dot_precision
from fastlora_peft.kernels.lora_addmm import (
    _SIXTEEN_BIT,
    LoraAddmmSettings,
    _auto_device_and_rows,
    _k_major,
    _rows_fit_tma,
    _tile_with_term,
    _transpose_fits_tma,
    copies_left,
    lora_addmm,
    term_tiling,
    tma_config,
    tma_programs,
)
from fastlora_peft.kernels.lora_addmm_sum import MAX_MEMBERS


@triton.jit
def _member_tile(
    a_desc, b_desc, out_desc, Left_ptr, Right_ptr, tile, M, N, K, R, scale,
    stride_lm, stride_lr, stride_rn, stride_rr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr, FP32_DOT: tl.constexpr, RANK_STAGES: tl.constexpr,
):  # fmt: skip
    """Output tile `tile` (numbered within its member) of A @ B + scale * Left @ Right^T, B K-major
    (read as its [N, K] transpose)."""
    off_m, off_n, acc = _tile_with_term(
        Left_ptr, Right_ptr, tile, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), M, N, R, scale,
        stride_lm, stride_lr, stride_rn, stride_rr,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=BLOCK_R, GROUP_M=GROUP_M, DOT_PRECISION=DOT_PRECISION,
        RANK_STAGES=RANK_STAGES,
    )  # fmt: skip
    for k0 in range(0, K, BLOCK_K):
        a = a_desc.load([off_m, k0])
        b = b_desc.load([off_n, k0]).T
        if FP32_DOT:  # the interpreter computes 16-bit dots wrongly; 16-bit products are exact in fp32
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="tf32")
        else:
            acc = tl.dot(a, b, acc)
    out_desc.store([off_m, off_n], acc.to(out_desc.dtype))


@CachedKernel
@triton.jit
def _lora_addmm_group_tma_kernel(
    a_desc, b0_desc, b1_desc, b2_desc, out0_desc, out1_desc, out2_desc,
    Left0_ptr, Left1_ptr, Left2_ptr, Right0_ptr, Right1_ptr, Right2_ptr,
    M, N0, N1, N2, K, R0, R1, R2, scale0, scale1, scale2,
    stride_lm, stride_lr, stride_rn0, stride_rr0, stride_rn1, stride_rr1, stride_rn2, stride_rr2,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr, MEMBERS: tl.constexpr, PROGRAMS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FP32_DOT: tl.constexpr, RANK_STAGES: tl.constexpr,
):  # fmt: skip
    """Out_i = A @ B_i + scale_i * Left_i @ Right_i^T for i < MEMBERS, persistent: PROGRAMS programs
    walk member 0's tiles, then member 1's, then member 2's (slots past MEMBERS are not read). The
    Left_i share their strides (columns of one xa)."""
    blocks_m = tl.cdiv(M, BLOCK_M)
    tiles0 = blocks_m * tl.cdiv(N0, BLOCK_N)
    tiles1 = blocks_m * tl.cdiv(N1, BLOCK_N) if MEMBERS > 1 else 0
    tiles2 = blocks_m * tl.cdiv(N2, BLOCK_N) if MEMBERS > 2 else 0
    for tile in tl.range(tl.program_id(0), tiles0 + tiles1 + tiles2, PROGRAMS):
        # The member's descriptors and numbers are picked first, so one K loop (one pipeline, one set
        # of shared-memory buffers) serves every member: a loop per member asked for 295-361 KB.
        if tile < tiles0:
            b_desc, out_desc, Left_ptr, Right_ptr = b0_desc, out0_desc, Left0_ptr, Right0_ptr
            local, N, R, scale, stride_rn, stride_rr = tile, N0, R0, scale0, stride_rn0, stride_rr0
        elif tile < tiles0 + tiles1:
            b_desc, out_desc, Left_ptr, Right_ptr = b1_desc, out1_desc, Left1_ptr, Right1_ptr
            local, N, R, scale, stride_rn, stride_rr = tile - tiles0, N1, R1, scale1, stride_rn1, stride_rr1
        else:
            b_desc, out_desc, Left_ptr, Right_ptr = b2_desc, out2_desc, Left2_ptr, Right2_ptr
            local, N, R, scale = tile - tiles0 - tiles1, N2, R2, scale2
            stride_rn, stride_rr = stride_rn2, stride_rr2
        _member_tile(
            a_desc, b_desc, out_desc, Left_ptr, Right_ptr, local, M, N, K, R, scale,
            stride_lm, stride_lr, stride_rn, stride_rr,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, BLOCK_R=BLOCK_R, GROUP_M=GROUP_M,
            DOT_PRECISION=DOT_PRECISION, FP32_DOT=FP32_DOT, RANK_STAGES=RANK_STAGES,
        )  # fmt: skip


def group_fits_tma(a: torch.Tensor, b: Sequence[torch.Tensor], left: Sequence[torch.Tensor]) -> bool:
    """Whether the TMA kernel reads every member: 1 to MAX_MEMBERS of them, a row-major [M, K] and
    each b_i K-major (a weight's transpose, [K, N_i]) of a's 16-bit dtype, every row 16-byte
    aligned, and the lefts with one set of strides (columns of one xa)."""
    if not 0 < len(b) <= MAX_MEMBERS or len(left) != len(b):
        return False
    if a.dtype not in _SIXTEEN_BIT or a.numel() == 0 or not _rows_fit_tma(a):
        return False
    for b_i, left_i in zip(b, left):
        if b_i.dtype != a.dtype or b_i.numel() == 0 or not _k_major(b_i) or not _transpose_fits_tma(b_i):
            return False
        if (b_i.shape[1] * a.element_size()) % 16 != 0 or left_i.stride() != left[0].stride():
            return False
    return True


def lora_addmm_group_may_take(a: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """What `lora_addmm_group_pays_off` checks before the weights are materialized: where
    `lora_addmm` would take a's GEMMs ("always": wherever the dtypes allow; "auto": a Hopper GPU, at
    least `min_tokens` rows), a 16-bit a of the output's dtype, `LoraAddmmSettings.group_forward` on."""
    mode = LoraAddmmSettings.mode
    if mode == "never" or not LoraAddmmSettings.group_forward:
        return False
    if a.dtype != out_dtype or a.dtype not in _SIXTEEN_BIT:
        return False
    return mode == "always" or _auto_device_and_rows(a)


def lora_addmm_group_pays_off(
    a: torch.Tensor, b: Sequence[torch.Tensor], left: Sequence[torch.Tensor], out_dtype: torch.dtype
) -> bool:
    """Whether a group's forward (`a @ b_i` plus each member's term into `out_dtype`) should run as
    one `lora_addmm_group` call: `lora_addmm_group_may_take`, and the TMA kernel reads every member."""
    return lora_addmm_group_may_take(a, out_dtype) and group_fits_tma(a, b, left)


def lora_addmm_group_where_it_pays_off(
    a: torch.Tensor,
    b: Sequence[torch.Tensor],
    left: Sequence[torch.Tensor],
    right: Sequence[torch.Tensor],
    scale: Sequence[float],
    out_dtype: torch.dtype,
) -> Optional[list[torch.Tensor]]:
    """`lora_addmm_group(a, b, left, right, scale)` where `lora_addmm_group_pays_off`, else None
    (`lora_addmm_group_of_weights_where_it_pays_off` with each b_i's transpose)."""
    weights = [b_i.t() for b_i in b]
    return lora_addmm_group_of_weights_where_it_pays_off(a, weights, left, right, scale, out_dtype)


def lora_addmm_group_of_weights_where_it_pays_off(
    a: torch.Tensor,
    weights: Sequence[torch.Tensor],
    left: Sequence[torch.Tensor],
    right: Sequence[torch.Tensor],
    scale: Sequence[float],
    out_dtype: torch.dtype,
) -> Optional[list[torch.Tensor]]:
    """`lora_addmm_group(a, b, left, right, scale)` with b_i each member's weight transposed (`weights`
    `[N_i, K]`, as a caller holds them), where `lora_addmm_group_pays_off`, else None.

    An eager call that launch plans serve looks its plan up first, and a hit needs no fit check: a
    plan is made only by the TMA launch, which only inputs that fit reach, and its key holds all that
    `group_fits_tma` reads (as lora_terms' `_PLANS_SKIP_CHECKS`). The check and the key each cost
    about 5 us on the CPU machine; a fused q/k/v forward made both. A hit launches the weights as they
    are (the kernel reads each through a descriptor of that layout): a caller that made their
    transposes for b, and a launch that transposed them back, made six view ops a q/k/v forward, about
    1.5 us each on the H200 machine's host.
    """
    if not lora_addmm_group_may_take(a, out_dtype):
        return None
    if _GROUP_PLANS.serve(a) and skips_op_dispatch(a, *weights, *left, *right):
        plan = _GROUP_PLANS.get(_group_plan_key(a, weights, left, right))
        if plan is not None:
            return _run_group_plan(plan, a, weights, left, right, scale)
    b = [weight.t() for weight in weights]
    if not lora_addmm_group_pays_off(a, b, left, out_dtype):  # a miss: the whole rule, fit included
        return None
    return lora_addmm_group(a, b, left, right, scale)


def _lora_addmm_group_tma_triton(
    *,
    a: torch.Tensor,
    b: Sequence[torch.Tensor],
    left: Sequence[torch.Tensor],
    right: Sequence[torch.Tensor],
    scale: Sequence[float],
    config: tuple[int, int, int, int, int] | None = None,
) -> list[torch.Tensor]:
    plan_key = None
    if config is None and _GROUP_PLANS.enabled:
        weights = [b_i.t() for b_i in b]
        plan_key = _group_plan_key(a, weights, left, right)
        plan = _GROUP_PLANS.get(plan_key)
        if plan is not None:
            return _run_group_plan(plan, a, weights, left, right, scale)
    M, K = a.shape
    members = len(b)
    widths = [b_i.shape[1] for b_i in b]
    outs = [torch.empty((M, n), dtype=a.dtype, device=a.device) for n in widths]
    copied = tuple(right_i.stride(1) != 1 for right_i in right)
    right = [r.contiguous() if copy else r for r, copy in zip(right, copied)]
    most_ranks = max(left_i.shape[1] for left_i in left)  # the term's tiling and copy follow the widest
    left_copied = copies_left(most_ranks, left[0])
    left = _row_major(left) if left_copied else left
    block_m, block_n, block_k, warps, stages = config or tma_config(M, sum(widths), a.device)
    slot = [min(i, members - 1) for i in range(MAX_MEMBERS)]  # slots past the group repeat the last
    tiles = sum(cdiv(M, block_m) * cdiv(n, block_n) for n in widths)
    programs = tma_programs(tiles, a.device)
    rank_tile, rank_stages = term_tiling(most_ranks)
    sizes = (M, *(widths[i] for i in slot), K, *(left[i].shape[1] for i in slot))
    right_strides = tuple(stride for i in slot for stride in right[i].stride())
    bound = _lora_addmm_group_tma_kernel[(programs,)](
        TensorDescriptor.from_tensor(a, [block_m, block_k]),
        *(TensorDescriptor.from_tensor(b[i].t(), [block_n, block_k]) for i in slot),
        *(TensorDescriptor.from_tensor(outs[i], [block_m, block_n]) for i in slot),
        *(left[i] for i in slot), *(right[i] for i in slot),
        *sizes, *(float(scale[i]) for i in slot), *left[0].stride(), *right_strides,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_R=rank_tile, GROUP_M=8, MEMBERS=members,
        PROGRAMS=programs, DOT_PRECISION=expand_dot_precision(a.dtype, *(r.dtype for r in right)),
        FP32_DOT=not a.is_cuda,
        RANK_STAGES=rank_stages, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if plan_key is not None and bound is not None:
        plan = _GroupPlan(
            bound, copied, left_copied, tuple(widths), sizes, (*left[0].stride(), *right_strides)
        )
        _GROUP_PLANS.add(plan_key, plan)
    return outs


def _row_major(left: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The lefts as the columns of one row-major copy (one launch; they keep one set of strides)."""
    return list(torch.cat(left, dim=1).split([left_i.shape[1] for left_i in left], dim=1))


class _GroupPlan(NamedTuple):
    """What `_lora_addmm_group_tma_triton` derived from its inputs' metadata, to launch the same again
    (the tensors go where the kernel reads descriptors: `BoundLaunch` encodes them)."""

    launch: BoundLaunch
    copy_right: tuple[bool, ...]  # each right copied to a contiguous one first (strides: the copies')
    copy_left: bool  # the lefts copied row-major first (`lora_addmm.copies_left`; strides: the copy's)
    widths: tuple[int, ...]  # N_i of each member's output
    sizes: tuple[int, ...]  # M, N0, N1, N2, K, R0, R1, R2
    strides: tuple[int, ...]  # the lefts' (shared), then each slot's right's


_GROUP_PLANS = LaunchPlans("lora_addmm_group_tma")


def _group_plan_key(a, weights, left, right) -> tuple:
    """The one key of a plan: the launcher's and the op body's lookups must agree. weights: each
    b_i's transpose (`[N_i, K]`), the layout the kernel's descriptors read."""
    return _GROUP_PLANS.key(a, *weights, *left, *right)


@trace_unit
def _run_group_plan(plan: _GroupPlan, a, weights, left, right, scale) -> list[torch.Tensor]:
    """weights: each b_i's transpose (`[N_i, K]`), as `_group_plan_key` took them."""
    members = len(weights)
    right = [r.contiguous() if copy else r for r, copy in zip(right, plan.copy_right)]
    left = _row_major(left) if plan.copy_left else left
    rows = a.shape[0]
    outs = [empty_2d(rows, n, a.dtype, a.device) for n in plan.widths]
    slot = [min(i, members - 1) for i in range(MAX_MEMBERS)]
    plan.launch(
        a, *(weights[i] for i in slot), *(outs[i] for i in slot), *(left[i] for i in slot),
        *(right[i] for i in slot), *plan.sizes, *(float(scale[i]) for i in slot), *plan.strides,
    )  # fmt: skip
    return outs


def _check_lora_addmm_group(a, b, left, right, scale) -> None:
    op = "lora_addmm_group"
    if not 0 < len(b) == len(left) == len(right) == len(scale):
        raise ValueError(f"{op}: b, left, right and scale must be lists of one length > 0")
    if a.dim() != 2 or a.dtype not in (*_SIXTEEN_BIT, torch.float64):
        raise ValueError(f"{op}: a must be 2-D [M, K] of a 16-bit dtype, got {list(a.shape)} {a.dtype}")
    M, K = a.shape
    for index, (b_i, left_i, right_i) in enumerate(zip(b, left, right)):
        if b_i.dim() != 2 or left_i.dim() != 2 or right_i.dim() != 2:
            raise ValueError(f"{op}: member {index}: b [K, N], left [M, R] and right [N, R] must be 2-D")
        if b_i.dtype != a.dtype:
            raise ValueError(
                f"{op}: member {index}: a and b must share one 16-bit dtype, got {a.dtype}, {b_i.dtype}"
            )
        if left_i.dtype not in (torch.float32, torch.float64):
            raise ValueError(
                f"{op}: member {index}: left must be float32 (lora_shrink's), got {left_i.dtype}"
            )
        N, R = b_i.shape[1], left_i.shape[1]
        if b_i.shape[0] != K or left_i.shape[0] != M or tuple(right_i.shape) != (N, R):
            raise ValueError(
                f"{op}: member {index}: shapes must be a [M, K], b [K, N], left [M, R], right [N, R], got "
                f"{list(a.shape)}, {list(b_i.shape)}, {list(left_i.shape)}, {list(right_i.shape)}"
            )
        if not (a.device == b_i.device == left_i.device == right_i.device):
            raise ValueError(f"{op}: all inputs must be on one device")


def lora_addmm_group(
    a: torch.Tensor,
    b: Sequence[torch.Tensor],
    left: Sequence[torch.Tensor],
    right: Sequence[torch.Tensor],
    scale: Sequence[float],
) -> list[torch.Tensor]:
    """``[a @ b[i] + scale[i] * left[i] @ right[i].T for each i]``: `fastlora::lora_addmm_group`."""
    b, left, right, scale = list(b), list(left), list(right), [float(s) for s in scale]
    if skips_op_dispatch(a, *b, *left, *right):
        return _lora_addmm_group_body(a, b, left, right, scale)
    return lora_addmm_group_op(a, b, left, right, scale)


def _lora_addmm_group_body(
    a: torch.Tensor,
    b: list[torch.Tensor],
    left: list[torch.Tensor],
    right: list[torch.Tensor],
    scale: list[float],
) -> list[torch.Tensor]:
    """Each member's ``a @ b[i] + scale[i] * left[i] @ right[i].T``, summed in fp32 and rounded once
    to a's dtype: one TMA launch where it reads every member (`group_fits_tma`), else `lora_addmm`
    per member.

    a: [M, K] 16-bit (x); b[i]: [K, N_i] of a's dtype (a weight's transpose); left[i]: [M, R_i]
    float32 (columns of xa); right[i]: [N_i, R_i], any float dtype and strides (lora_B). Returns
    [M, N_i] contiguous tensors of a's dtype.
    """
    if _GROUP_PLANS.serve(a):  # a hit skips the checks: see lora_terms' `_PLANS_SKIP_CHECKS`
        weights = [b_i.t() for b_i in b]
        plan = _GROUP_PLANS.get(_group_plan_key(a, weights, left, right))
        if plan is not None:
            return _run_group_plan(plan, a, weights, left, right, scale)
    _check_lora_addmm_group(a, b, left, right, scale)
    if not runs_triton(a):
        return [reference.lora_addmm(a, *member).contiguous() for member in zip(b, left, right, scale)]
    if group_fits_tma(a, b, left):
        return _lora_addmm_group_tma_triton(a=a, b=b, left=left, right=right, scale=scale)
    return [lora_addmm(a, *member) for member in zip(b, left, right, scale)]


lora_addmm_group_op = torch.library.custom_op(
    f"{OP_NAMESPACE}::lora_addmm_group", _lora_addmm_group_body, mutates_args=()
)


@lora_addmm_group_op.register_fake
def _(
    a: torch.Tensor,
    b: list[torch.Tensor],
    left: list[torch.Tensor],
    right: list[torch.Tensor],
    scale: list[float],
) -> list[torch.Tensor]:
    _check_lora_addmm_group(a, b, left, right, scale)
    return [a.new_empty((a.shape[0], b_i.shape[1])) for b_i in b]
