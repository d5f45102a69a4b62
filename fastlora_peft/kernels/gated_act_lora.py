"""The gated activation's backward fused with the LoRA weight gradients that read its tensors: one
pass over dh, gate and up.

For ``h = act(gate) * up`` feeding ``y = h Wd^T + sd (h Ad^T) Bd^T``, with ``gate = ... + sg (x Ag^T)
Bg^T`` and ``up`` likewise, the backward of a chunk of token rows needs, besides dh:

* ``grad_gate = dh * up * act'(gate)`` and ``grad_up = dh * act(gate)``, written into gate and up
  themselves (the MLP owns those buffers and needs them no more);
* ``grad_weight = scale * left^T @ h``, dA_down's share (``left = dY @ Bd``, fp32 ``[M, R]``), with h
  recomputed in fp32 and rounded to gate's dtype, as the forward stored it and as the unfused path
  (``gated_act_forward``, then ``lora_weight_grad``) reads it;
* ``grad_gate_b = gate_scale * grad_gate^T @ gate_left`` and ``grad_up_b = up_scale * grad_up^T @
  up_left``, dB_gate's and dB_up's shares (``gate_left = x @ Ag^T``, the forward's fp32 ``[M, Rg]``),
  from the gradients as rounded to gate's dtype, as the unfused path (``lora_weight_grad`` on the
  stored gradients) reads them.

Unfused that is five launches and eleven passes over ``[M, I]`` tensors (recompute h: 3, read h: 1,
activation backward: 5, read grad_gate and grad_up for their dB: 2); here one kernel reads dh, gate
and up once and writes the two gradients: five passes, plus fp32 ``[split, R + Rg + Ru, I]`` partial
sums. For a 2048-row chunk at Llama-8B sizes (I = 14336, bf16) that is 6 x 56 MiB less traffic, 2 x
56 of it from the dB shares. Their two dots cost about what those two passes cost on an H200, so the
MLP asks for the dB shares only when its backward runs in one chunk (`gated_mlp._fused_b_lefts`).

Any of the three weight gradients may be left out (its left None): the kernel is compiled without it.
With none, use :func:`.gated_act.gated_act_backward_`.

Shapes and dtypes: ``grad_h, gate, up: [M, I]`` as for :mod:`.gated_act` (gate and up float32,
bfloat16 or float16, any row stride: the two halves of one ``[M, 2I]`` gate_up output are fine), plus
a unit column stride for gate and up, which are written in place; ``left: [M, R]``, ``gate_left:
[M, Rg]``, ``up_left: [M, Ru]`` float32 (float64 with a float64 gate), any strides (token-major ones,
as ``lora_shrink`` makes them, are read in place). Returns ``(grad_weight [R, I], grad_gate_b [I, Rg],
grad_up_b [I, Ru])`` in the lefts' dtype, contiguous; a left that is None gives an empty ``[0, I]``
(``[I, 0]``).

The op is ``fastlora::gated_act_backward_weight_grads_`` (mutates gate and up) with a fake
implementation; it runs the Triton kernel when ``runs_triton(gate)`` says so and the pure-torch
reference (:func:`.gated_act_reference.gated_act_backward_weight_grads`) otherwise.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from . import gated_act_reference as _reference
from ._backend import OP_NAMESPACE, runs_triton, skips_op_dispatch
from ._launch import BoundLaunch, CachedKernel, LaunchPlans, cdiv
from .dots import activation_dot, dot_mode, dot_precision
from .gated_act import (
    _activation_and_derivative,
    _check_inputs,
    _gated_act_backward_triton,
    _unit_column_stride,
)
from .lora_terms import _num_sms, _rank_block
from .split_sum import split_scratch, split_total

_OP = "gated_act_backward_weight_grads_"

# Fewest token rows one split covers. Each split writes and the sum re-reads an [R + Rg + Ru, I] fp32
# partial (8 * (R + Rg + Ru) * I bytes) against the 10 * rows * I bytes of 16-bit dh, gate, up,
# grad_gate and grad_up it streams: at rank 16 (three weight gradients) and 512 rows the partials add
# 8% to the traffic, so splits stop there.
_MIN_ROWS_PER_SPLIT = 512


# ---------------------------------------------------------------------------------------------------
# Kernel. Row offsets are widened to int64 before they meet a stride (M * stride passes 2**31 at 16k
# tokens of a [M, 2 * 65536] gate_up); column and rank offsets stay int32.
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _store_weight_grad(
    acc, Out_ptr, Partial_ptr, Counter_ptr, offs_i, mask_i, offs_r, rank, scale, stride_oi, stride_or,
    partial_base, split, n_splits, n_cols, slab, SPLIT: tl.constexpr,
):  # fmt: skip
    """Out[offs_i, offs_r] (through its strides) = scale * acc, summed over the splits in
    `split_total` when SPLIT (this gradient's partials laid out [rank, n_cols] from partial_base in
    each split's slab; Counter_ptr is this tile's counter)."""
    mask = mask_i[:, None] & (offs_r < rank)[None, :]
    out_offsets = offs_i[:, None] * stride_oi + offs_r[None, :] * stride_or
    if SPLIT:
        partial_offsets = partial_base + offs_r[None, :] * n_cols + offs_i[:, None]
        is_last, total = split_total(
            acc, Partial_ptr, partial_offsets, mask, split, n_splits, slab, Counter_ptr
        )
        if is_last:
            tl.store(Out_ptr + out_offsets, scale * total, mask=mask)
    else:
        tl.store(Out_ptr + out_offsets, scale * acc, mask=mask)


@triton.jit
def _left_tile(Left_ptr, rows, mask_m, offs_r, rank, stride_lm, stride_lr):
    """Left[rows, offs_r] ([BLOCK_M, BLOCK_R], zero outside the rows and the rank)."""
    ptrs = Left_ptr + rows[:, None] * stride_lm + offs_r[None, :] * stride_lr
    return tl.load(ptrs, mask=mask_m[:, None] & (offs_r < rank)[None, :], other=0.0)


@triton.jit
def _rank_block_pass(
    Grad_h_ptr, Gate_ptr, Up_ptr, Left_ptr, GateLeft_ptr, UpLeft_ptr, Out_ptr, GateOut_ptr, UpOut_ptr,
    Partial_ptr, Counter_ptr,
    offs_i, mask_i, r0, R, Rg, Ru, m_start, m_end, scale, gate_scale, up_scale, split, n_splits, n_cols,
    n_rank_blocks, stride_grad_h_m, stride_gate_m, stride_up_m, stride_lm, stride_lr, stride_glm, stride_glr,
    stride_ulm, stride_ulr,
    ACTIVATION: tl.constexpr, STORE_GRADS: tl.constexpr, MAKE_GRADS: tl.constexpr,
    HAS_DOWN: tl.constexpr, HAS_GATE: tl.constexpr, HAS_UP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_MODE: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """Rank block [r0, r0 + BLOCK_R) of each weight gradient, over the rows [m_start, m_end) of this
    split: Out^T = scale * h^T @ Left, GateOut = gate_scale * grad_gate^T @ GateLeft, UpOut likewise
    (the splits summed through `split_total`). MAKE_GRADS computes grad_gate/grad_up (needed by the
    dB shares, and by STORE_GRADS, which also writes them over gate and up on these rows and columns)."""
    offs_r = r0 + tl.arange(0, BLOCK_R)
    offs_m = tl.arange(0, BLOCK_M)
    # Computed transposed ([I, R] = [I, M] @ [M, R]), as lora_terms' weight-grad kernel does (91
    # against 189us there on an H200): the tiles made in registers are tl.dot's first operand in any
    # layout, and the fp32 second operand wants its token dim contiguous, which the launcher arranges.
    acc_down = tl.zeros((BLOCK_I, BLOCK_R), dtype=tl.float32)
    acc_gate = tl.zeros((BLOCK_I, BLOCK_R), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_I, BLOCK_R), dtype=tl.float32)
    for m0 in range(m_start, m_end, BLOCK_M):
        rows = m0 + offs_m
        mask_m = rows < m_end
        rows = rows.to(tl.int64)
        mask = mask_i[:, None] & mask_m[None, :]
        # [BLOCK_I, BLOCK_M] tiles through transposed pointers; masked elements give zeros throughout.
        gate_ptrs = Gate_ptr + rows[None, :] * stride_gate_m + offs_i[:, None]
        up_ptrs = Up_ptr + rows[None, :] * stride_up_m + offs_i[:, None]
        gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(up_ptrs, mask=mask, other=0.0).to(tl.float32)
        act, dact = _activation_and_derivative(gate, ACTIVATION)
        if MAKE_GRADS:
            grad_h_ptrs = Grad_h_ptr + rows[None, :] * stride_grad_h_m + offs_i[:, None]
            grad_h = tl.load(grad_h_ptrs, mask=mask, other=0.0).to(tl.float32)
            # Rounded as stored: the dB shares read what the unfused path reads back from memory.
            grad_gate = (grad_h * up * dact).to(Gate_ptr.dtype.element_ty)
            grad_up = (grad_h * act).to(Up_ptr.dtype.element_ty)
            if STORE_GRADS:  # this program loaded these gate/up elements just now, and no other reads them
                tl.store(gate_ptrs, grad_gate, mask=mask)
                tl.store(up_ptrs, grad_up, mask=mask)
            if HAS_GATE:
                gate_left = _left_tile(GateLeft_ptr, rows, mask_m, offs_r, Rg, stride_glm, stride_glr)
                acc_gate = activation_dot(
                    grad_gate, gate_left, acc_gate, DOT_MODE=DOT_MODE, DOT_PRECISION=DOT_PRECISION
                )
            if HAS_UP:
                up_left = _left_tile(UpLeft_ptr, rows, mask_m, offs_r, Ru, stride_ulm, stride_ulr)
                acc_up = activation_dot(
                    grad_up, up_left, acc_up, DOT_MODE=DOT_MODE, DOT_PRECISION=DOT_PRECISION
                )
        if HAS_DOWN:
            # h as the forward stored it: rounded once to gate's dtype (a no-op for fp32).
            h_t = (act * up).to(Gate_ptr.dtype.element_ty)
            left = _left_tile(Left_ptr, rows, mask_m, offs_r, R, stride_lm, stride_lr)
            acc_down = activation_dot(h_t, left, acc_down, DOT_MODE=DOT_MODE, DOT_PRECISION=DOT_PRECISION)
    # Each gradient's tile has its counter (column tile, rank block, gradient) and its partials in the
    # split's slab of [R + Rg + Ru, n_cols]: down's rows first, then gate's, then up's.
    counter = Counter_ptr + ((tl.program_id(0) * n_rank_blocks + r0 // BLOCK_R) * 3)
    slab = (R + Rg + Ru) * n_cols
    if HAS_DOWN:
        _store_weight_grad(
            acc_down, Out_ptr, Partial_ptr, counter, offs_i, mask_i, offs_r, R, scale, 1, n_cols,
            0, split, n_splits, n_cols, slab, SPLIT=SPLIT,
        )  # fmt: skip
    if HAS_GATE:
        _store_weight_grad(
            acc_gate, GateOut_ptr, Partial_ptr, counter + 1, offs_i, mask_i, offs_r, Rg, gate_scale, Rg, 1,
            R * n_cols, split, n_splits, n_cols, slab, SPLIT=SPLIT,
        )  # fmt: skip
    if HAS_UP:
        _store_weight_grad(
            acc_up, UpOut_ptr, Partial_ptr, counter + 2, offs_i, mask_i, offs_r, Ru, up_scale, Ru, 1,
            (R + Rg) * n_cols, split, n_splits, n_cols, slab, SPLIT=SPLIT,
        )  # fmt: skip


@CachedKernel
@triton.jit
def _gated_act_backward_weight_grads_kernel(
    Grad_h_ptr, Gate_ptr, Up_ptr, Left_ptr, GateLeft_ptr, UpLeft_ptr, Out_ptr, GateOut_ptr, UpOut_ptr,
    Partial_ptr, Counter_ptr,
    M, n_cols, R, Rg, Ru, scale, gate_scale, up_scale, rows_per_split, n_splits, n_rank_blocks,
    stride_grad_h_m, stride_gate_m, stride_up_m, stride_lm, stride_lr, stride_glm, stride_glr,
    stride_ulm, stride_ulr,
    ACTIVATION: tl.constexpr, HAS_DOWN: tl.constexpr, HAS_GATE: tl.constexpr, HAS_UP: tl.constexpr,
    HAS_B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_MODE: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """gate, up <- grad_gate, grad_up; Out[R, I] = scale * Left^T @ h, GateOut[I, Rg] = gate_scale *
    grad_gate^T @ GateLeft, UpOut[I, Ru] likewise (fp32; HAS_B: HAS_GATE or HAS_UP). One program per
    (BLOCK_I columns, split), split s over rows [s * rows_per_split, ...); with SPLIT the splits meet
    in `split_total` (fp32 partials, a slab of [R + Rg + Ru, n_cols] per split, a counter per tile)."""
    pid_i = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_i = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    mask_i = offs_i < n_cols
    m_start = pid_s * rows_per_split
    m_end = tl.minimum(m_start + rows_per_split, M)
    # Ranks above BLOCK_R take one pass over the program's rows per rank block (of every gradient at
    # once), and only the last pass writes the gradients: a third grid axis of rank blocks (as
    # lora_terms has) would let one program overwrite gate/up that another has yet to read. Up to
    # rank 64, the only pass is the last.
    last_r0 = (n_rank_blocks - 1) * BLOCK_R
    for r0 in range(0, last_r0, BLOCK_R):
        _rank_block_pass(
            Grad_h_ptr, Gate_ptr, Up_ptr, Left_ptr, GateLeft_ptr, UpLeft_ptr, Out_ptr, GateOut_ptr, UpOut_ptr,
            Partial_ptr, Counter_ptr,
            offs_i, mask_i, r0, R, Rg, Ru, m_start, m_end, scale, gate_scale, up_scale, pid_s, n_splits,
            n_cols, n_rank_blocks, stride_grad_h_m, stride_gate_m, stride_up_m, stride_lm, stride_lr,
            stride_glm, stride_glr, stride_ulm, stride_ulr,
            ACTIVATION=ACTIVATION, STORE_GRADS=False, MAKE_GRADS=HAS_B,
            HAS_DOWN=HAS_DOWN, HAS_GATE=HAS_GATE, HAS_UP=HAS_UP, BLOCK_M=BLOCK_M, BLOCK_I=BLOCK_I,
            BLOCK_R=BLOCK_R, DOT_PRECISION=DOT_PRECISION, DOT_MODE=DOT_MODE, SPLIT=SPLIT,
        )  # fmt: skip
    _rank_block_pass(
        Grad_h_ptr, Gate_ptr, Up_ptr, Left_ptr, GateLeft_ptr, UpLeft_ptr, Out_ptr, GateOut_ptr, UpOut_ptr,
        Partial_ptr, Counter_ptr,
        offs_i, mask_i, last_r0, R, Rg, Ru, m_start, m_end, scale, gate_scale, up_scale, pid_s, n_splits,
        n_cols, n_rank_blocks, stride_grad_h_m, stride_gate_m, stride_up_m, stride_lm, stride_lr,
        stride_glm, stride_glr, stride_ulm, stride_ulr,
        ACTIVATION=ACTIVATION, STORE_GRADS=True, MAKE_GRADS=True,
        HAS_DOWN=HAS_DOWN, HAS_GATE=HAS_GATE, HAS_UP=HAS_UP, BLOCK_M=BLOCK_M, BLOCK_I=BLOCK_I,
        BLOCK_R=BLOCK_R, DOT_PRECISION=DOT_PRECISION, DOT_MODE=DOT_MODE, SPLIT=SPLIT,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# Launcher. Keyword-only block sizes default to the GPU choice; tests pass small ones to cover
# several tiles, splits and rank passes on tiny shapes. H200, I = 14336, bf16, rank 16, dA_down and
# both dB shares (`python -m benchmarks.tune_lora_terms --gated`, 72 configs,
# docs/benchmarks/session14/tune_gated.log): 32 x 64 tiles, 4 warps, 1 stage, 2 programs per SM took
# 174us on 2048 rows and 667 on 8192 (the fastest, 32 x 128 with 8 warps, 174 and 665), against 193
# and 692us for dA_down fused and the dB shares as two lora_weight_grad launches, and 280 and 1056us
# with the 2 stages that were best for dA_down alone (136us, 2.2 TB/s, on 2048 rows).
# ---------------------------------------------------------------------------------------------------


def _rank(left: Optional[torch.Tensor]) -> int:
    return 0 if left is None else left.shape[1]


def _token_major(left: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], bool]:
    """(left with its token dim contiguous, whether that took a copy): M * R * 4 bytes, 0.5 MB for a
    2048-row chunk at rank 64; lora_shrink's outputs (every left the MLP passes) need none."""
    if left is None or left.stride(0) == 1:
        return left, False
    return left.T.contiguous().T, True


def _gated_act_backward_weight_grads_triton(
    *,
    grad_h: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    left: Optional[torch.Tensor],
    scale: float,
    gate_left: Optional[torch.Tensor] = None,
    gate_scale: float = 1.0,
    up_left: Optional[torch.Tensor] = None,
    up_scale: float = 1.0,
    split: int | None = None,
    block_m: int = 32,
    block_i: int = 64,
    block_r: int | None = None,
    num_warps: int = 4,
    num_stages: int = 1,
    split_per_sm: int = 2,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lefts = (left, gate_left, up_left)
    scales = (float(scale), float(gate_scale), float(up_scale))
    # The default launch of these inputs' shapes, strides, dtypes and alignment again: its plan.
    plan_key = None
    defaults = split is None and block_m == 32 and block_i == 64 and block_r is None
    if defaults and (num_warps, num_stages, split_per_sm) == (4, 1, 2) and _WEIGHT_GRAD_PLANS.enabled:
        plan_key = _weight_grad_plan_key(grad_h, gate, up, activation, *lefts)
        plan = _WEIGHT_GRAD_PLANS.get(plan_key)
        if plan is not None:
            return _run_weight_grad_plan(plan, grad_h, gate, up, lefts, scales)
    M, n_cols = gate.shape
    ranks = tuple(map(_rank, lefts))
    outs = _weight_grad_outputs(gate.device, n_cols, ranks)
    if M == 0 or n_cols == 0 or max(ranks) == 0:
        if M and n_cols:  # no weight gradient, but gate/up still become their gradients
            _gated_act_backward_triton(grad_h, gate, up, activation, in_place=True)
        return tuple(out.zero_() for out in outs)
    grad_h = _unit_column_stride(grad_h)
    copied = [_token_major(one) for one in lefts]
    lefts = tuple(one for one, _ in copied)
    block_r = block_r or _rank_block(max(ranks), cap=64)
    rank_blocks = cdiv(max(ranks), block_r)
    col_tiles = cdiv(n_cols, block_i)
    if split is None:
        # Split the tokens only as far as needed to give every SM two programs: a 2048-row chunk at
        # I = 14336 has 224 column tiles, 2 splits on an H200's 132 SMs.
        split = min(cdiv(split_per_sm * _num_sms(gate.device), col_tiles), cdiv(M, _MIN_ROWS_PER_SPLIT))
    rows_per_split = cdiv(cdiv(M, max(split, 1)), block_m) * block_m
    split = cdiv(M, rows_per_split)  # no empty splits
    # Deterministic: the splits' fp32 partials are summed in split order inside the kernel (split_sum).
    scratch = (split * sum(ranks) * n_cols, col_tiles * rank_blocks * 3) if split > 1 else None
    partial, counters = split_scratch(gate.device, *scratch) if scratch else (gate, gate)
    # An absent left (its gradient compiled out) is never read: gate stands in for its pointers.
    pointers = [gate if one is None else one for one in lefts] + [
        gate if rank == 0 else out for rank, out in zip(ranks, outs)
    ]
    strides = (grad_h.stride(0), gate.stride(0), up.stride(0)) + tuple(
        stride for one in lefts for stride in ((0, 0) if one is None else one.stride())
    )
    grid = (col_tiles, split)
    has = tuple(rank > 0 for rank in ranks)
    any_left = next(one for one in lefts if one is not None)
    bound = _gated_act_backward_weight_grads_kernel[grid](
        grad_h, gate, up, *pointers, partial, counters,
        M, n_cols, *ranks, *scales, rows_per_split, split, rank_blocks, *strides,
        ACTIVATION=activation, HAS_DOWN=has[0], HAS_GATE=has[1], HAS_UP=has[2], HAS_B=has[1] or has[2],
        BLOCK_M=block_m, BLOCK_I=block_i, BLOCK_R=block_r,
        # The lefts are fp32: the split dot for a bf16 gate, else 3xTF32 (see dots).
        DOT_PRECISION=dot_precision(torch.float32), DOT_MODE=dot_mode(gate, any_left),
        SPLIT=split > 1, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if plan_key is not None and bound is not None:
        _WEIGHT_GRAD_PLANS.add(plan_key, _WeightGradPlan(
            bound, tuple(copy for _, copy in copied), gate.device, ranks, scratch, (M, n_cols),
            (rows_per_split, split, rank_blocks), strides,
        ))  # fmt: skip
    return outs


def _weight_grad_outputs(device, n_cols: int, ranks: tuple[int, int, int]) -> tuple[torch.Tensor, ...]:
    """Empty fp32 (grad_weight [R, I], grad_gate_b [I, Rg], grad_up_b [I, Ru])."""
    down_rank, gate_rank, up_rank = ranks
    return (
        torch.empty((down_rank, n_cols), dtype=torch.float32, device=device),
        torch.empty((n_cols, gate_rank), dtype=torch.float32, device=device),
        torch.empty((n_cols, up_rank), dtype=torch.float32, device=device),
    )


class _WeightGradPlan(NamedTuple):
    """What `_gated_act_backward_weight_grads_triton` derived from its inputs' metadata, to launch the
    same again (see `_launch.LaunchPlans`: the MLP launches this once per chunk, every step)."""

    launch: BoundLaunch
    copied: tuple[bool, bool, bool]  # each left was copied token-major first (strides are the copy's)
    device: torch.device
    ranks: tuple[int, int, int]  # R, Rg, Ru (0: that gradient left out)
    scratch: Optional[tuple[int, int]]  # split_scratch's sizes when the rows are split
    sizes: tuple[int, int]  # M, n_cols
    splits: tuple[int, int, int]  # rows_per_split, n_splits, rank blocks
    strides: tuple[int, ...]


_WEIGHT_GRAD_PLANS = LaunchPlans("gated_act_backward_weight_grads_")


def _weight_grad_plan_key(grad_h, gate, up, activation, left, gate_left, up_left) -> tuple:
    """The one key of a plan here: the launcher's and the op body's lookups must agree."""
    return _WEIGHT_GRAD_PLANS.key(grad_h, gate, up, activation, left, gate_left, up_left)


def _run_weight_grad_plan(plan: _WeightGradPlan, grad_h, gate, up, lefts, scales) -> tuple[torch.Tensor, ...]:
    grad_h = _unit_column_stride(grad_h)  # as the launcher does: the key holds grad_h's strides
    lefts = [one.T.contiguous().T if copy else one for one, copy in zip(lefts, plan.copied)]
    M, n_cols = plan.sizes
    outs = _weight_grad_outputs(plan.device, n_cols, plan.ranks)
    partial, counters = split_scratch(plan.device, *plan.scratch) if plan.scratch else (gate, gate)
    pointers = [gate if one is None else one for one in lefts] + [
        gate if rank == 0 else out for rank, out in zip(plan.ranks, outs)
    ]
    plan.launch(
        grad_h, gate, up, *pointers, partial, counters,
        M, n_cols, *plan.ranks, *scales, *plan.splits, *plan.strides,
    )  # fmt: skip
    return outs


# ---------------------------------------------------------------------------------------------------
# Public op: checks, dispatch, fake implementation.
# ---------------------------------------------------------------------------------------------------


def _check_left(name: str, left: Optional[torch.Tensor], gate: torch.Tensor) -> None:
    if left is None:
        return
    if left.dim() != 2 or left.shape[0] != gate.shape[0]:
        raise ValueError(
            f"{name}: expected a 2-D tensor [M, R] with M={gate.shape[0]} (gate's rows), "
            f"got shape {tuple(left.shape)}"
        )
    # fp32 (a lora_shrink output); float64 only beside a float64 gate, where the reference runs.
    expected = torch.float64 if gate.dtype == torch.float64 else torch.float32
    if left.dtype != expected:
        raise ValueError(f"{name}: expected dtype {expected} (with a {gate.dtype} gate), got {left.dtype}")
    if left.device != gate.device:
        raise ValueError(f"{name}: expected device {gate.device} (gate's), got {left.device}")


def _check_weight_grad_inputs(
    grad_h: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    left: Optional[torch.Tensor],
    gate_left: Optional[torch.Tensor],
    up_left: Optional[torch.Tensor],
) -> None:
    _check_inputs(gate, up, activation, grad_h)
    if gate.stride(-1) != 1 or up.stride(-1) != 1:
        raise ValueError(f"{_OP}: gate and up need a unit column stride to be written in place")
    if left is None and gate_left is None and up_left is None:
        raise ValueError(f"{_OP}: no weight gradient asked for (every left is None): use gated_act_backward_")
    for name, one in (("left", left), ("gate_left", gate_left), ("up_left", up_left)):
        _check_left(name, one, gate)


def gated_act_backward_weight_grads_(
    grad_h: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    left: Optional[torch.Tensor],
    scale: float,
    gate_left: Optional[torch.Tensor] = None,
    gate_scale: float = 1.0,
    up_left: Optional[torch.Tensor] = None,
    up_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """In place: gate <- grad_gate, up <- grad_up (as ``gated_act_backward_``); returns
    ``(scale * left.T @ h [R, I], gate_scale * grad_gate.T @ gate_left [I, Rg], up_scale * grad_up.T
    @ up_left [I, Ru])`` with h and the gradients rounded to gate's dtype; a None left gives an empty
    result.

    `fastlora::gated_act_backward_weight_grads_` (see the module docstring for shapes and dtypes).
    """
    args = (grad_h, gate, up, activation, left, scale, gate_left, gate_scale, up_left, up_scale)
    if skips_op_dispatch(grad_h, gate, up, *(one for one in (left, gate_left, up_left) if one is not None)):
        return _gated_act_backward_weight_grads_body(*args)
    return gated_act_backward_weight_grads_op(*args)


def _gated_act_backward_weight_grads_body(
    grad_h: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    left: Optional[torch.Tensor],
    scale: float,
    gate_left: Optional[torch.Tensor] = None,
    gate_scale: float = 1.0,
    up_left: Optional[torch.Tensor] = None,
    up_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lefts, scales = (left, gate_left, up_left), (scale, gate_scale, up_scale)
    if _WEIGHT_GRAD_PLANS.serve(gate):  # a hit skips the checks: see lora_terms' `_PLANS_SKIP_CHECKS`
        plan = _WEIGHT_GRAD_PLANS.get(_weight_grad_plan_key(grad_h, gate, up, activation, *lefts))
        if plan is not None:
            return _run_weight_grad_plan(plan, grad_h, gate, up, lefts, scales)
    _check_weight_grad_inputs(grad_h, gate, up, activation, *lefts)
    if runs_triton(gate):
        return _gated_act_backward_weight_grads_triton(
            grad_h=grad_h, gate=gate, up=up, activation=activation, left=left, scale=scale,
            gate_left=gate_left, gate_scale=gate_scale, up_left=up_left, up_scale=up_scale,
        )  # fmt: skip
    grad_gate, grad_up, *grad_weights = _reference.gated_act_backward_weight_grads(
        grad_h, gate, up, activation, left, scale, gate_left, gate_scale, up_left, up_scale
    )
    gate.copy_(grad_gate)
    up.copy_(grad_up)
    return tuple(grad_weights)


gated_act_backward_weight_grads_op = torch.library.custom_op(
    f"{OP_NAMESPACE}::{_OP}", _gated_act_backward_weight_grads_body, mutates_args=("gate", "up")
)


@gated_act_backward_weight_grads_op.register_fake
def _(
    grad_h: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    left: Optional[torch.Tensor],
    scale: float,
    gate_left: Optional[torch.Tensor] = None,
    gate_scale: float = 1.0,
    up_left: Optional[torch.Tensor] = None,
    up_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_weight_grad_inputs(grad_h, gate, up, activation, left, gate_left, up_left)
    dtype = torch.float64 if gate.dtype == torch.float64 else torch.float32
    n_cols = gate.shape[1]
    return (
        gate.new_empty((_rank(left), n_cols), dtype=dtype),
        gate.new_empty((n_cols, _rank(gate_left)), dtype=dtype),
        gate.new_empty((n_cols, _rank(up_left)), dtype=dtype),
    )
