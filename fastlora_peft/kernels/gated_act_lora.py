"""The gated activation's backward fused with the down projection's dA: one pass over dh, gate and up.

For ``h = act(gate) * up`` feeding ``y = h Wd^T + s (h Ad^T) Bd^T``, the backward of a chunk of token
rows needs, besides dh:

* ``grad_gate = dh * up * act'(gate)`` and ``grad_up = dh * act(gate)``, written into gate and up
  themselves (the MLP owns those buffers and needs them no more);
* ``grad_weight = scale * left^T @ h``, dA_down's share (``left = dY @ Bd``, fp32 ``[M, R]``), with h
  recomputed in fp32 and rounded to gate's dtype, as the forward stored it and as the unfused path
  (``gated_act_forward``, then ``lora_weight_grad``) reads it.

Unfused that is three launches and nine passes over ``[M, I]`` tensors (recompute h: 3, read h: 1,
activation backward: 5); here one kernel reads dh, gate and up once and writes the two gradients:
five passes, plus an fp32 ``[split, R, I]`` partial sum. At Llama-8B shapes (8192 tokens, I = 14336,
bf16) that is 4 x 224 MiB less traffic per MLP backward, ~0.2 ms at the H200's 4.3 TB/s.

Shapes and dtypes: ``grad_h, gate, up: [M, I]`` as for :mod:`.gated_act` (gate and up float32,
bfloat16 or float16, any row stride: the two halves of one ``[M, 2I]`` gate_up output are fine), plus
a unit column stride for gate and up, which are written in place; ``left: [M, R]`` float32 (float64
with a float64 gate), any strides. Returns ``[R, I]`` in left's dtype.

The op is ``fastlora::gated_act_backward_weight_grad_`` (mutates gate and up) with a fake
implementation; it runs the Triton kernel when ``runs_triton(gate)`` says so and the pure-torch
reference (:func:`.gated_act_reference.gated_act_backward_weight_grad`) otherwise.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from fastlora_peft.call_traces import VersionedSettings, trace_unit

from . import gated_act_reference as _reference
from ._backend import OP_NAMESPACE, runs_triton, skips_op_dispatch
from ._launch import BoundLaunch, CachedKernel, LaunchPlans, cdiv, empty_2d
from ._lora_common import _num_sms, _rank_block
from .dots import activation_dot, dot_precision, weight_grad_dot_mode
from .gated_act import (
    _activation_and_derivative,
    _check_inputs,
    _gated_act_backward_triton,
    _unit_column_stride,
)
from .split_sum import split_scratch, split_total

_OP = "gated_act_backward_weight_grad_"

# Fewest token rows one split covers. Each split writes and the sum re-reads an [R, I] fp32 partial
# (8 * R * I bytes) against the 10 * rows * I bytes of 16-bit dh, gate, up, grad_gate and grad_up it
# streams: at rank 64 and 512 rows the partials add 10% to the traffic, so splits stop there.
_MIN_ROWS_PER_SPLIT = 512

# The most ranks (dA_down's) this kernel takes in the gated MLP's backward; past them the MLP runs
# `gated_act_backward_keeping_hidden_` (h left in dh's buffer) and `lora_weight_grad` on it. The
# kernel makes h^T in registers as tl.dot's first operand, and past 16 ranks that dot costs more than
# the second launch's pass over h saves. H200, one 2048-row chunk of I = 14336, bf16, token-major
# fp32 left, do_bench (forty-seventh session, `docs/benchmarks/session47/gated_bwd_paths_probe.log`),
# this kernel against the two launches, us: rank 16 112.4 / 115.7, 24 211.0 / 119.7, 32 210.5 / 119.2,
# 64 233.4 / 129.8, 128 336.7 / 152.0 (the three launches before this kernel, h recomputed into a
# buffer of its own: 141.7 at rank 16, 178.2 at 128, `gated_bwd_rank_probe.log`).
FUSED_WEIGHT_GRAD_MAX_RANK = 16


def fuses_weight_grad(rank: int) -> bool:
    """Whether the gated MLP's backward makes dA_down's share of a chunk in this kernel (rank: dA_down's)."""
    return rank <= FUSED_WEIGHT_GRAD_MAX_RANK


# ---------------------------------------------------------------------------------------------------
# Kernel. Row offsets are widened to int64 before they meet a stride (M * stride passes 2**31 at 16k
# tokens of a [M, 2 * 65536] gate_up); column and rank offsets stay int32.
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _rank_block_pass(
    Grad_h_ptr, Gate_ptr, Up_ptr, Left_ptr, Out_ptr, Partial_ptr, Counter_ptr,
    offs_i, mask_i, r0, R, m_start, m_end, scale, split, n_splits, n_cols,
    stride_grad_h_m, stride_gate_m, stride_up_m, stride_lm, stride_lr, stride_or, stride_oi,
    ACTIVATION: tl.constexpr, STORE_GRADS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr,
    BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_MODE: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """Out[r0 : r0 + BLOCK_R, offs_i] = scale * Left[rows, r0 : ...]^T @ h[rows, offs_i] over the rows
    [m_start, m_end) of this split, the splits summed through `split_total`; with STORE_GRADS, also
    gate, up <- grad_gate, grad_up on those rows and columns."""
    offs_r = r0 + tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    offs_m = tl.arange(0, BLOCK_M)
    # Computed as Out^T[I, R] = h^T @ Left, as lora_weight_grad's kernel does (91 against 189us
    # there on an H200): h^T, made in registers, is tl.dot's first operand in any layout, and the fp32
    # second operand wants its token dim contiguous, which the launcher arranges for Left.
    acc = tl.zeros((BLOCK_I, BLOCK_R), dtype=tl.float32)
    for m0 in range(m_start, m_end, BLOCK_M):
        rows = m0 + offs_m
        mask_m = rows < m_end
        rows = rows.to(tl.int64)
        mask = mask_i[:, None] & mask_m[None, :]
        # [BLOCK_I, BLOCK_M] tiles through transposed pointers; masked elements give h = 0.
        gate_ptrs = Gate_ptr + rows[None, :] * stride_gate_m + offs_i[:, None]
        up_ptrs = Up_ptr + rows[None, :] * stride_up_m + offs_i[:, None]
        gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(up_ptrs, mask=mask, other=0.0).to(tl.float32)
        act, dact = _activation_and_derivative(gate, ACTIVATION)
        if STORE_GRADS:  # this program loaded these gate/up elements just now, and no other reads them
            grad_h_ptrs = Grad_h_ptr + rows[None, :] * stride_grad_h_m + offs_i[:, None]
            grad_h = tl.load(grad_h_ptrs, mask=mask, other=0.0).to(tl.float32)
            tl.store(gate_ptrs, (grad_h * up * dact).to(Gate_ptr.dtype.element_ty), mask=mask)
            tl.store(up_ptrs, (grad_h * act).to(Up_ptr.dtype.element_ty), mask=mask)
        # h as the forward stored it: rounded once to gate's dtype (a no-op for fp32).
        h_t = (act * up).to(Gate_ptr.dtype.element_ty)
        left_ptrs = Left_ptr + rows[:, None] * stride_lm + offs_r[None, :] * stride_lr
        left = tl.load(left_ptrs, mask=mask_m[:, None] & mask_r[None, :], other=0.0)
        acc = activation_dot(h_t, left, acc, DOT_MODE=DOT_MODE, DOT_PRECISION=DOT_PRECISION)
    offsets = offs_i[:, None] * stride_oi + offs_r[None, :] * stride_or
    mask = mask_i[:, None] & mask_r[None, :]
    if SPLIT:
        rank_blocks = (R + BLOCK_R - 1) // BLOCK_R
        counter_ptr = Counter_ptr + tl.program_id(0) * rank_blocks + r0 // BLOCK_R
        slab = R * n_cols
        is_last, total = split_total(acc, Partial_ptr, offsets, mask, split, n_splits, slab, counter_ptr)
        if is_last:
            tl.store(Out_ptr + offsets, scale * total, mask=mask)
    else:
        tl.store(Out_ptr + offsets, scale * acc, mask=mask)


@CachedKernel
@triton.jit
def _gated_act_backward_weight_grad_kernel(
    Grad_h_ptr, Gate_ptr, Up_ptr, Left_ptr, Out_ptr, Partial_ptr, Counter_ptr,
    M, n_cols, R, scale, rows_per_split, n_splits,
    stride_grad_h_m, stride_gate_m, stride_up_m, stride_lm, stride_lr, stride_or, stride_oi,
    ACTIVATION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_MODE: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """gate, up <- grad_gate, grad_up and Out[R, I] = scale * Left[M, R]^T @ h[M, I] (fp32). One program
    per (BLOCK_I columns, split), split s over rows [s * rows_per_split, ...); with SPLIT the splits
    meet in `split_total` (fp32 partials laid out like Out, split stride R * I, a counter per tile)."""
    pid_i = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_i = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    mask_i = offs_i < n_cols
    m_start = pid_s * rows_per_split
    m_end = tl.minimum(m_start + rows_per_split, M)
    # Ranks above BLOCK_R take one pass over the program's rows per rank block, and only the last pass
    # writes the gradients: a third grid axis of rank blocks (as lora_terms has) would let one program
    # overwrite gate/up that another has yet to read. Up to rank 64, the only pass is the last.
    last_r0 = (R - 1) // BLOCK_R * BLOCK_R
    for r0 in range(0, last_r0, BLOCK_R):
        _rank_block_pass(
            Grad_h_ptr, Gate_ptr, Up_ptr, Left_ptr, Out_ptr, Partial_ptr, Counter_ptr,
            offs_i, mask_i, r0, R, m_start, m_end, scale, pid_s, n_splits, n_cols,
            stride_grad_h_m, stride_gate_m, stride_up_m, stride_lm, stride_lr, stride_or, stride_oi,
            ACTIVATION=ACTIVATION, STORE_GRADS=False, BLOCK_M=BLOCK_M, BLOCK_I=BLOCK_I, BLOCK_R=BLOCK_R,
            DOT_PRECISION=DOT_PRECISION, DOT_MODE=DOT_MODE, SPLIT=SPLIT,
        )  # fmt: skip
    _rank_block_pass(
        Grad_h_ptr, Gate_ptr, Up_ptr, Left_ptr, Out_ptr, Partial_ptr, Counter_ptr,
        offs_i, mask_i, last_r0, R, m_start, m_end, scale, pid_s, n_splits, n_cols,
        stride_grad_h_m, stride_gate_m, stride_up_m, stride_lm, stride_lr, stride_or, stride_oi,
        ACTIVATION=ACTIVATION, STORE_GRADS=True, BLOCK_M=BLOCK_M, BLOCK_I=BLOCK_I, BLOCK_R=BLOCK_R,
        DOT_PRECISION=DOT_PRECISION, DOT_MODE=DOT_MODE, SPLIT=SPLIT,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# Launcher. Keyword-only block sizes default to `default_launch`'s (the GPU choice); tests pass small
# ones to cover several tiles, splits and rank passes on tiny shapes.
# ---------------------------------------------------------------------------------------------------


class GatedBackwardSettings(metaclass=VersionedSettings):
    """The kernel's default launches, (BLOCK_M, BLOCK_I, warps, stages, programs per SM), read at every
    default launch (`benchmarks.plans_ab --switch gated` and `kernel_ab --switch gated` set them).

    H200, bf16, rank 16, one 2048-row chunk of I = 14336 (the 8192-token MLP's four, the 2048-token
    one's only chunk). The kernel's first tune (`c6096eb`, `python -m benchmarks.tune_lora_terms
    --gated`, 72 configs of 1 or 2 stages) chose 32 x 64 tiles, 4 warps, 2 stages, 2 programs per SM:
    136us (2.2 TB/s) against 157us for the three launches it replaces. Thirty-seventh session, with
    3 stages (36 configs, three interleaved rounds, `docs/benchmarks/session37/d/gated_plain_tune.log`):
    16 x 128 tiles, 3 stages took 113.1us against 124.4 (0.909x in each round). At other shapes
    (`e/gated_shapes_ab.log`, the same two launches): 0.91x at 1792 rows, 0.79x at I = 11008, 0.96x
    at rank 32, 1.00x at rank 64, 0.57x with fp16 (2048 rows); but 1.11x at 1024 rows and 1.19x at
    512 (bf16), where the 128-column tiles leave the SMs fewer than two programs each (224 and 112
    programs on 132 SMs, against 448 and 224): there `few_programs_launch` stays, also for fp32
    gate/up (0.71x at 1024 rows, given up with it).
    """

    launch = (16, 128, 4, 3, 2)
    few_programs_launch = (32, 64, 4, 2, 2)


def _row_splits(M: int, col_tiles: int, split_per_sm: int, device: torch.device) -> int:
    """Splits of the tokens only as far as needed to give every SM `split_per_sm` programs (a 2048-row
    chunk at I = 14336 in 128-column tiles: 3 splits on an H200's 132 SMs), none under
    `_MIN_ROWS_PER_SPLIT` rows."""
    return min(cdiv(split_per_sm * _num_sms(device), col_tiles), cdiv(M, _MIN_ROWS_PER_SPLIT))


def default_launch(M: int, n_cols: int, device: torch.device) -> tuple[int, int, int, int, int]:
    """`GatedBackwardSettings.launch`, or its `few_programs_launch` where the first would give the SMs
    fewer than two programs each."""
    launch = GatedBackwardSettings.launch
    col_tiles = cdiv(n_cols, launch[1])
    programs = col_tiles * _row_splits(M, col_tiles, launch[4], device)
    return launch if programs >= 2 * _num_sms(device) else GatedBackwardSettings.few_programs_launch


def _gated_act_backward_weight_grad_triton(
    *,
    grad_h: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    left: torch.Tensor,
    scale: float,
    rounded_to: torch.dtype | None = None,
    split: int | None = None,
    block_m: int | None = None,
    block_i: int | None = None,
    block_r: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    split_per_sm: int | None = None,
) -> torch.Tensor:
    """block_m, block_i, num_warps, num_stages, split_per_sm: `default_launch`'s where None."""
    launch = (block_m, block_i, num_warps, num_stages, split_per_sm)
    plan_key = None
    if launch == (None,) * 5 and split is None and block_r is None and _WEIGHT_GRAD_PLANS.enabled:
        # The default launch of these inputs' shapes, strides, dtypes and alignment again: its plan.
        plan_key = _weight_grad_plan_key(grad_h, gate, up, activation, left, rounded_to)
        plan = _WEIGHT_GRAD_PLANS.get(plan_key)
        if plan is not None:
            return _run_weight_grad_plan(plan, grad_h, gate, up, left, scale)
    default = default_launch(*gate.shape, gate.device)
    block_m, block_i, num_warps, num_stages, split_per_sm = (
        given if given is not None else chosen for given, chosen in zip(launch, default)
    )
    M, n_cols = gate.shape
    R = left.shape[1]
    if M == 0 or n_cols == 0 or R == 0:
        if R == 0:  # no weight gradient, but gate/up still become their gradients
            _gated_act_backward_triton(grad_h, gate, up, activation, in_place=True)
        return torch.zeros((R, n_cols), dtype=torch.float32, device=gate.device)
    grad_h = _unit_column_stride(grad_h)
    # Left's token dim contiguous, as lora_weight_grad's kernel wants it: M * R * 4 bytes, 0.5 MB for
    # a 2048-row chunk at rank 64.
    copy_left = left.stride(0) != 1
    left = left.T.contiguous().T if copy_left else left
    block_r = block_r or _rank_block(R, cap=64)
    col_tiles = cdiv(n_cols, block_i)
    if split is None:
        split = _row_splits(M, col_tiles, split_per_sm, gate.device)
    rows_per_split = cdiv(cdiv(M, max(split, 1)), block_m) * block_m
    split = cdiv(M, rows_per_split)  # no empty splits
    # Deterministic: the splits' fp32 partials are summed in split order inside the kernel (split_sum).
    out = torch.empty((R, n_cols), dtype=torch.float32, device=gate.device)
    tiles = col_tiles * cdiv(R, block_r)
    partial, counters = split_scratch(gate.device, split * R * n_cols, tiles) if split > 1 else (out, out)
    grid = (col_tiles, split)
    strides = (grad_h.stride(0), gate.stride(0), up.stride(0), left.stride(0), left.stride(1), n_cols, 1)
    bound = _gated_act_backward_weight_grad_kernel[grid](
        grad_h, gate, up, left, out, partial, counters,
        M, n_cols, R, float(scale), rows_per_split, split, *strides,
        ACTIVATION=activation, BLOCK_M=block_m, BLOCK_I=block_i, BLOCK_R=block_r,
        # left is fp32: for a bf16 h the split dot, or what the caller's final rounding of dA asks for
        # (`dots.weight_grad_dot_mode`), else 3xTF32 (see dots).
        DOT_PRECISION=dot_precision(left.dtype),
        DOT_MODE=weight_grad_dot_mode(gate, left, rounded_to or torch.float32), SPLIT=split > 1,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if plan_key is not None and bound is not None:
        _WEIGHT_GRAD_PLANS.add(plan_key, _WeightGradPlan(
            bound, copy_left, gate.device, (R, n_cols), (split * R * n_cols, tiles) if split > 1 else None,
            (M, n_cols, R), (rows_per_split, split), strides,
        ))  # fmt: skip
    return out


class _WeightGradPlan(NamedTuple):
    """What `_gated_act_backward_weight_grad_triton` derived from its inputs' metadata, to launch the
    same again (see `_launch.LaunchPlans`: the MLP launches this once per chunk, every step)."""

    launch: BoundLaunch
    copy_left: bool  # left was copied token-major first (its strides below are the copy's)
    device: torch.device
    out_shape: tuple[int, int]  # R, n_cols
    scratch: Optional[tuple[int, int]]  # split_scratch's sizes when the rows are split
    sizes: tuple[int, int, int]  # M, n_cols, R
    splits: tuple[int, int]  # rows_per_split, n_splits
    strides: tuple[int, ...]


_WEIGHT_GRAD_PLANS = LaunchPlans("gated_act_backward_weight_grad_")


def _weight_grad_plan_key(grad_h, gate, up, activation, left, rounded_to) -> tuple:
    """The one key of a plan here: the launcher's and the op body's lookups must agree. It holds the
    settings' launches, so a plan made under others (a benchmark's switch) is not served."""
    settings = (GatedBackwardSettings.launch, GatedBackwardSettings.few_programs_launch)
    return _WEIGHT_GRAD_PLANS.key(grad_h, gate, up, activation, left, rounded_to, settings)


@trace_unit
def _run_weight_grad_plan(plan: _WeightGradPlan, grad_h, gate, up, left, scale) -> torch.Tensor:
    grad_h = _unit_column_stride(grad_h)  # as the launcher does: the key holds grad_h's strides
    left = left.T.contiguous().T if plan.copy_left else left
    out = empty_2d(*plan.out_shape, torch.float32, plan.device)
    partial, counters = split_scratch(plan.device, *plan.scratch) if plan.scratch else (out, out)
    M, n_cols, R = plan.sizes
    plan.launch(
        grad_h, gate, up, left, out, partial, counters,
        M, n_cols, R, float(scale), *plan.splits, *plan.strides,
    )  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------------
# Public op: checks, dispatch, fake implementation.
# ---------------------------------------------------------------------------------------------------


def _check_weight_grad_inputs(
    grad_h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str, left: torch.Tensor
) -> None:
    _check_inputs(gate, up, activation, grad_h)
    if gate.stride(-1) != 1 or up.stride(-1) != 1:
        raise ValueError(f"{_OP}: gate and up need a unit column stride to be written in place")
    if left.dim() != 2 or left.shape[0] != gate.shape[0]:
        raise ValueError(
            f"left: expected a 2-D tensor [M, R] with M={gate.shape[0]} (gate's rows), "
            f"got shape {tuple(left.shape)}"
        )
    # fp32 (a lora_shrink output); float64 only beside a float64 gate, where the reference runs.
    expected = torch.float64 if gate.dtype == torch.float64 else torch.float32
    if left.dtype != expected:
        raise ValueError(f"left: expected dtype {expected} (with a {gate.dtype} gate), got {left.dtype}")
    if left.device != gate.device:
        raise ValueError(f"left: expected device {gate.device} (gate's), got {left.device}")


def gated_act_backward_weight_grad_(
    grad_h: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    left: torch.Tensor,
    scale: float,
    rounded_to: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """In place: gate <- grad_gate, up <- grad_up (as ``gated_act_backward_``); returns
    ``scale * left.T @ h`` [R, I] (fp32) with ``h = act(gate) * up`` rounded to gate's dtype.

    rounded_to: the dtype the caller rounds the result to in the end (after summing the chunks'),
    None for fp32. A 16-bit one lets a bf16 h's dot keep fewer bits of left
    (`dots.weight_grad_dot_mode`: fp16 the pair, 16 significant bits; bf16 left rounded to bf16).

    `fastlora::gated_act_backward_weight_grad_` (see the module docstring for shapes and dtypes).
    """
    if skips_op_dispatch(grad_h, gate, up, left):
        return _gated_act_backward_weight_grad_body(grad_h, gate, up, activation, left, scale, rounded_to)
    return gated_act_backward_weight_grad_op(grad_h, gate, up, activation, left, scale, rounded_to)


def _gated_act_backward_weight_grad_body(
    grad_h: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    left: torch.Tensor,
    scale: float,
    rounded_to: Optional[torch.dtype] = None,
) -> torch.Tensor:
    if _WEIGHT_GRAD_PLANS.serve(gate):  # a hit skips the checks: see lora_terms' `_PLANS_SKIP_CHECKS`
        plan = _WEIGHT_GRAD_PLANS.get(_weight_grad_plan_key(grad_h, gate, up, activation, left, rounded_to))
        if plan is not None:
            return _run_weight_grad_plan(plan, grad_h, gate, up, left, scale)
    _check_weight_grad_inputs(grad_h, gate, up, activation, left)
    if runs_triton(gate):
        return _gated_act_backward_weight_grad_triton(
            grad_h=grad_h, gate=gate, up=up, activation=activation, left=left, scale=scale,
            rounded_to=rounded_to,
        )  # fmt: skip
    grad_gate, grad_up, grad_weight = _reference.gated_act_backward_weight_grad(
        grad_h, gate, up, activation, left, scale
    )
    gate.copy_(grad_gate)
    up.copy_(grad_up)
    return grad_weight


gated_act_backward_weight_grad_op = torch.library.custom_op(
    f"{OP_NAMESPACE}::{_OP}", _gated_act_backward_weight_grad_body, mutates_args=("gate", "up")
)


@gated_act_backward_weight_grad_op.register_fake
def _(
    grad_h: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    left: torch.Tensor,
    scale: float,
    rounded_to: Optional[torch.dtype] = None,
) -> torch.Tensor:
    _check_weight_grad_inputs(grad_h, gate, up, activation, left)
    return left.new_empty((left.shape[1], gate.shape[1]))
