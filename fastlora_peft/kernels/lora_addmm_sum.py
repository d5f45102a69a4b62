"""A group's dX in one GEMM: ``sum_i a_i @ b_i + scale * left @ right.T``, one launch, one rounding.

The members of a shared-input group (q/k/v, gate/up) each give dX a product `g_i @ W_i` over their
own K (out_i features). `lora_addmm` makes the first with the LoRA term, and cuBLAS adds the others
in place (`addmm_`), each of which reads and writes all of dX again and rounds it again. Here one
persistent TMA kernel starts each output tile with the LoRA term (as `lora_addmm`'s), runs the K
loop of every member in turn into the same fp32 accumulator, and stores the tile once.

For q/k/v at 8192 tokens (Llama-3.1-8B, bf16) the two `addmm_` calls it replaces read and write a
64 MiB dX each; at 2048 tokens, where the step is bound by host time, it is two launches fewer.
Taken where `lora_addmm` would be (`LoraAddmmSettings`; see `lora_addmm_sum_pays_off`), for groups
of up to `MAX_MEMBERS`.

Where TMA cannot read an operand the op computes the same sum as `lora_addmm` of the first member
followed by `addmm_` of the others (what the fused Functions did before), so every caller gets the
same contract; the fused Functions only call it where the TMA kernel runs (`lora_addmm_sum_pays_off`).
A `torch.library` custom op with a fake; the reference (``lora_addmm_reference.lora_addmm_sum``) runs
on the CPU outside the Triton interpreter, as for every op here.
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
    copies_left,
    lora_addmm,
    term_tiling,
    tma_config,
    tma_programs,
)

# The kernel's descriptor slots: q/k/v is the largest group the fused Functions make.
MAX_MEMBERS = 3


@triton.jit
def _member_k_loop(acc, a_desc, b_desc, K, off_m, off_n, BLOCK_K: tl.constexpr, FP32_DOT: tl.constexpr):
    """acc += A[off_m rows, :K] @ B[:K, off_n columns], B row-major; TMA zero-fills a ragged K tile."""
    for k0 in range(0, K, BLOCK_K):
        a = a_desc.load([off_m, k0])
        b = b_desc.load([k0, off_n])
        if FP32_DOT:  # the interpreter computes 16-bit dots wrongly; 16-bit products are exact in fp32
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="tf32")
        else:
            acc = tl.dot(a, b, acc)
    return acc


@CachedKernel
@triton.jit
def _lora_addmm_sum_tma_kernel(
    a0_desc, b0_desc, a1_desc, b1_desc, a2_desc, b2_desc, out_desc, Left_ptr, Right_ptr,
    M, N, K0, K1, K2, R, scale, stride_lm, stride_lr, stride_rn, stride_rr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr, MEMBERS: tl.constexpr, PROGRAMS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FP32_DOT: tl.constexpr, RANK_STAGES: tl.constexpr,
):  # fmt: skip
    """Out = sum_{i < MEMBERS} A_i @ B_i + scale * Left @ Right^T: `_lora_addmm_tma_kernel`'s tiles and
    order, with one K loop per member (slots past MEMBERS are not read)."""
    blocks_m = tl.cdiv(M, BLOCK_M)
    blocks_n = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), blocks_m * blocks_n, PROGRAMS):
        off_m, off_n, acc = _tile_with_term(
            Left_ptr, Right_ptr, tile, blocks_m, blocks_n, M, N, R, scale,
            stride_lm, stride_lr, stride_rn, stride_rr,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=BLOCK_R, GROUP_M=GROUP_M, DOT_PRECISION=DOT_PRECISION,
            RANK_STAGES=RANK_STAGES,
        )  # fmt: skip
        acc = _member_k_loop(acc, a0_desc, b0_desc, K0, off_m, off_n, BLOCK_K=BLOCK_K, FP32_DOT=FP32_DOT)
        if MEMBERS > 1:
            acc = _member_k_loop(acc, a1_desc, b1_desc, K1, off_m, off_n, BLOCK_K=BLOCK_K, FP32_DOT=FP32_DOT)
        if MEMBERS > 2:
            acc = _member_k_loop(acc, a2_desc, b2_desc, K2, off_m, off_n, BLOCK_K=BLOCK_K, FP32_DOT=FP32_DOT)
        out_desc.store([off_m, off_n], acc.to(out_desc.dtype))


def sum_fits_tma(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    """Whether the TMA kernel reads every member: 1 to MAX_MEMBERS of them, one 16-bit dtype, each a_i
    row-major [M, K_i] and b_i row-major [K_i, N] (a dX's weight as it is stored), rows 16-byte aligned."""
    if not 0 < len(a) <= MAX_MEMBERS or len(a) != len(b):
        return False
    dtype = a[0].dtype
    if dtype not in _SIXTEEN_BIT or a[0].shape[0] == 0 or b[0].shape[1] == 0:
        return False  # a descriptor needs every dimension > 0
    for a_i, b_i in zip(a, b):
        if a_i.dtype != dtype or b_i.dtype != dtype or a_i.shape[1] == 0 or _k_major(b_i):
            return False
        if not (_rows_fit_tma(a_i) and _rows_fit_tma(b_i)):
            return False
    return True


# "auto" sums members of at most this many K (out features) each. The sum saves a read and a write of
# dX per member past the first (`addmm_`'s), while its TMA GEMM runs about 2% behind cuBLAS at these
# shapes (docs/benchmarks/session19/tma_gemm_probe*, session22/tma_ws_probe.log): a cost per member that
# grows with K, against a saving that does not; at gate/up's K of 14336 the cost was the larger. H200,
# 8192 tokens, bf16, kernel
# time per step (`python -m benchmarks.kernel_ab --switch sum`, docs/benchmarks/session22/kab_sum_*):
# q/k/v (K 4096, 1024, 1024) 562 us summed against 594 for lora_addmm + two addmm_; gate/up (K 14336
# each) 2480 against 2460.
SUM_MAX_MEMBER_K = 8192


def lora_addmm_sum_may_take(
    grads: Sequence[torch.Tensor], compute_dtype: torch.dtype, out_dtype: torch.dtype
) -> bool:
    """What `lora_addmm_sum_pays_off` checks before the weights are materialized, given the members'
    upstream gradients (`[M, K_i]`): where `lora_addmm` would take their dX ("always": wherever the
    dtypes allow; "auto": a Hopper GPU, at least `min_tokens` rows, and no member past
    `SUM_MAX_MEMBER_K`), computed and handed out in one 16-bit dtype, at most `MAX_MEMBERS` of them,
    with `LoraAddmmSettings.sum_members` on."""
    mode = LoraAddmmSettings.mode
    if mode == "never" or not LoraAddmmSettings.sum_members or len(grads) > MAX_MEMBERS:
        return False
    if compute_dtype != out_dtype or compute_dtype not in _SIXTEEN_BIT:
        return False
    if mode == "always":
        return True
    return _auto_device_and_rows(grads[0]) and all(grad.shape[1] <= SUM_MAX_MEMBER_K for grad in grads)


def lora_addmm_sum_pays_off(
    a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], out_dtype: torch.dtype
) -> bool:
    """Whether a group's `sum_i a_i @ b_i` plus its LoRA term into `out_dtype` should run as one
    `lora_addmm_sum` call: `lora_addmm_sum_may_take`, and the TMA kernel reads every member."""
    return lora_addmm_sum_may_take(a, a[0].dtype, out_dtype) and sum_fits_tma(a, b)


def lora_addmm_sum_where_it_pays_off(
    a: Sequence[torch.Tensor],
    b: Sequence[torch.Tensor],
    left: torch.Tensor,
    right: torch.Tensor,
    scale: float,
    out_dtype: torch.dtype,
) -> Optional[torch.Tensor]:
    """`lora_addmm_sum(a, b, left, right, scale)` where `lora_addmm_sum_pays_off`, else None.

    An eager call that launch plans serve looks its plan up first, and a hit needs no fit check (see
    `lora_addmm_group_where_it_pays_off`: a plan is made only by the TMA launch, and its key holds all
    that `sum_fits_tma` reads).
    """
    if not lora_addmm_sum_may_take(a, a[0].dtype, out_dtype):
        return None
    if _SUM_PLANS.serve(a[0]) and skips_op_dispatch(*a, *b, left, right):
        plan = _SUM_PLANS.get(_sum_plan_key(a, b, left, right))
        if plan is not None:
            return _run_sum_plan(plan, a, b, left, right, scale)
    if not lora_addmm_sum_pays_off(a, b, out_dtype):  # a miss: the whole rule, fit included
        return None
    return lora_addmm_sum(a, b, left, right, scale)


def _lora_addmm_sum_tma_triton(
    *,
    a: Sequence[torch.Tensor],
    b: Sequence[torch.Tensor],
    left: torch.Tensor,
    right: torch.Tensor,
    scale: float,
    config: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:
    plan_key = None
    if config is None and _SUM_PLANS.enabled:
        plan_key = _sum_plan_key(a, b, left, right)
        plan = _SUM_PLANS.get(plan_key)
        if plan is not None:
            return _run_sum_plan(plan, a, b, left, right, scale)
    M, N, members = a[0].shape[0], b[0].shape[1], len(a)
    out = torch.empty((M, N), dtype=a[0].dtype, device=a[0].device)
    right_copied = right.stride(1) != 1
    right = right.contiguous() if right_copied else right
    left_copied = copies_left(left.shape[1], left)
    left = left.contiguous() if left_copied else left
    block_m, block_n, block_k, warps, stages = config or tma_config(M, N, a[0].device)
    # Slots past the group's members repeat the last member's operands (never read: MEMBERS).
    slots = [(a[min(i, members - 1)], b[min(i, members - 1)]) for i in range(MAX_MEMBERS)]
    descriptors = []
    for a_i, b_i in slots:
        descriptors += [
            TensorDescriptor.from_tensor(a_i, [block_m, block_k]),
            TensorDescriptor.from_tensor(b_i, [block_k, block_n]),
        ]
    tiles = cdiv(M, block_m) * cdiv(N, block_n)
    programs = tma_programs(tiles, a[0].device)
    rank_tile, rank_stages = term_tiling(left.shape[1])
    sizes = (M, N, *(a_i.shape[1] if i < members else 0 for i, (a_i, _) in enumerate(slots)), left.shape[1])
    strides = (left.stride(0), left.stride(1), right.stride(0), right.stride(1))
    bound = _lora_addmm_sum_tma_kernel[(programs,)](
        *descriptors, TensorDescriptor.from_tensor(out, [block_m, block_n]), left, right,
        *sizes, float(scale), *strides,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_R=rank_tile, GROUP_M=8, MEMBERS=members,
        PROGRAMS=programs, DOT_PRECISION=expand_dot_precision(a[0].dtype, right.dtype),
        FP32_DOT=not a[0].is_cuda,
        RANK_STAGES=rank_stages, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if plan_key is not None and bound is not None:
        _SUM_PLANS.add(plan_key, _SumPlan(bound, right_copied, left_copied, (M, N), sizes, strides))
    return out


class _SumPlan(NamedTuple):
    """What `_lora_addmm_sum_tma_triton` derived from its inputs' metadata, to launch the same again
    (the tensors go where the kernel reads descriptors: `BoundLaunch` encodes them)."""

    launch: BoundLaunch
    copy_right: bool  # right was copied to a contiguous one first (its strides below are the copy's)
    copy_left: bool  # left likewise (`lora_addmm.copies_left`)
    out_shape: tuple[int, int]
    sizes: tuple[int, ...]  # M, N, K0, K1, K2, R
    strides: tuple[int, int, int, int]  # left's and right's


_SUM_PLANS = LaunchPlans("lora_addmm_sum_tma")


def _sum_plan_key(a, b, left, right) -> tuple:
    """The one key of a plan: the launcher's and the op body's lookups must agree."""
    return _SUM_PLANS.key(*a, *b, left, right)


@trace_unit
def _run_sum_plan(plan: _SumPlan, a, b, left, right, scale) -> torch.Tensor:
    right = right.contiguous() if plan.copy_right else right
    left = left.contiguous() if plan.copy_left else left
    out = empty_2d(*plan.out_shape, a[0].dtype, a[0].device)
    last = len(a) - 1
    slots = []
    for i in range(MAX_MEMBERS):
        slots += (a[min(i, last)], b[min(i, last)])
    plan.launch(*slots, out, left, right, *plan.sizes, float(scale), *plan.strides)
    return out


def _check_lora_addmm_sum(a, b, left: torch.Tensor, right: torch.Tensor) -> None:
    op = "lora_addmm_sum"
    if not 0 < len(a) == len(b):
        raise ValueError(f"{op}: a and b must be lists of one length > 0, got {len(a)} and {len(b)}")
    if left.dim() != 2 or right.dim() != 2:
        raise ValueError(
            f"{op}: left must be [M, R] and right [N, R], got {list(left.shape)}, {list(right.shape)}"
        )
    if left.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{op}: left must be float32 (the output of lora_shrink), got {left.dtype}")
    M, N, R = left.shape[0], right.shape[0], left.shape[1]
    dtype = a[0].dtype
    for index, (a_i, b_i) in enumerate(zip(a, b)):
        if a_i.dim() != 2 or b_i.dim() != 2:
            raise ValueError(f"{op}: a[{index}] and b[{index}] must be 2-D [M, K_i] and [K_i, N]")
        if a_i.dtype != dtype or b_i.dtype != dtype or dtype not in (*_SIXTEEN_BIT, torch.float64):
            raise ValueError(
                f"{op}: every a and b must share one 16-bit dtype, got {a_i.dtype} and {b_i.dtype}"
            )
        if a_i.shape[0] != M or b_i.shape[0] != a_i.shape[1] or b_i.shape[1] != N or right.shape[1] != R:
            raise ValueError(
                f"{op}: shapes must be a[i] [M, K_i], b[i] [K_i, N], left [M, R], right [N, R], got "
                f"{list(a_i.shape)}, {list(b_i.shape)}, {list(left.shape)}, {list(right.shape)} "
                f"at member {index}"
            )
        if not (a_i.device == b_i.device == left.device == right.device):
            raise ValueError(f"{op}: all inputs must be on one device")


def lora_addmm_sum(
    a: Sequence[torch.Tensor],
    b: Sequence[torch.Tensor],
    left: torch.Tensor,
    right: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``sum_i a[i] @ b[i] + scale * left @ right.T``: `fastlora::lora_addmm_sum` (see its body)."""
    if skips_op_dispatch(*a, *b, left, right):
        return _lora_addmm_sum_body(list(a), list(b), left, right, scale)
    return lora_addmm_sum_op(list(a), list(b), left, right, scale)


def _lora_addmm_sum_body(
    a: list[torch.Tensor], b: list[torch.Tensor], left: torch.Tensor, right: torch.Tensor, scale: float
) -> torch.Tensor:
    """``sum_i a[i] @ b[i] + scale * left @ right.T``, summed in fp32 and rounded once to a's dtype
    where the TMA kernel reads every member (`sum_fits_tma`); elsewhere `lora_addmm` of the first
    member, then `addmm_` of each other one (rounded once per member).

    a[i]: [M, K_i], b[i]: [K_i, N], one 16-bit dtype (dX: the members' upstream gradients and
    weights); left: [M, R] float32; right: [N, R], any float dtype and strides. Returns [M, N]
    contiguous, a's dtype.
    """
    if _SUM_PLANS.serve(a[0]):  # a hit skips the checks: see lora_terms' `_PLANS_SKIP_CHECKS`
        plan = _SUM_PLANS.get(_sum_plan_key(a, b, left, right))
        if plan is not None:
            return _run_sum_plan(plan, a, b, left, right, scale)
    _check_lora_addmm_sum(a, b, left, right)
    if not runs_triton(a[0]):
        return reference.lora_addmm_sum(a, b, left, right, scale).contiguous()
    if sum_fits_tma(a, b):
        return _lora_addmm_sum_tma_triton(a=a, b=b, left=left, right=right, scale=scale)
    out = lora_addmm(a[0], b[0], left, right, scale)
    for a_i, b_i in zip(a[1:], b[1:]):
        out.addmm_(a_i, b_i)
    return out


lora_addmm_sum_op = torch.library.custom_op(
    f"{OP_NAMESPACE}::lora_addmm_sum", _lora_addmm_sum_body, mutates_args=()
)


@lora_addmm_sum_op.register_fake
def _(
    a: list[torch.Tensor], b: list[torch.Tensor], left: torch.Tensor, right: torch.Tensor, scale: float
) -> torch.Tensor:
    _check_lora_addmm_sum(a, b, left, right)
    return a[0].new_empty((a[0].shape[0], b[0].shape[1]))
