"""The gate/up LoRA terms fused into the gated activation's forward: one pass over gate and up.

For ``gate = base_gate + sg (x Ag^T) Bg^T`` and ``up = base_up + su (x Au^T) Bu^T`` feeding
``h = act(gate) * up``, a chunk of token rows needs gate and up with their LoRA terms (backward
recomputes h from them) and h. Unfused that is two ``lora_expand_add_`` launches, each reading and
writing a ``[M, I]`` tensor, then the activation kernel reading both and writing h: seven passes.
Here one kernel reads base_gate and base_up, adds the terms in registers, writes gate and up back in
place and writes h: five. At Llama-8B shapes (8192 tokens, I = 14336, bf16) that is 2 x 224 MiB less
traffic and two launches fewer per MLP forward.

Shapes and dtypes: ``gate, up: [M, I]``, float32, bfloat16 or float16, the same; any row stride (the
two halves of one ``[M, 2I]`` gate_up output are fine) and a unit column stride (they are written in
place). ``gate_left: [M, Rg]`` and ``up_left: [M, Ru]`` float32 (the ``x @ A^T`` of
``lora_shrink``; float64 beside a float64 gate) or that rounded to bfloat16 (where the term rounds it
so anyway: `bf16_left_suffices`), any strides, fastest with the rank dim contiguous:
the term's dot takes left as its first operand, and a token-major left (the shrinks' own layout) took
102.5 / 283 / 428 us against 94 / 125 / 163 row-major on an H200 (one 2048-row chunk of I = 14336,
fp32 adapters, rank 16 / 64 / 128; `docs/benchmarks/session47/gated_fwd_layout_probe.log`), so the
gated MLP hands it a row-major copy of xa; ``gate_right: [I, Rg]`` and
``up_right: [I, Ru]`` (lora_B, or a half of a gate_up lora_B) float32, bfloat16 or float16.
gate and up are rounded once to their dtype, as ``lora_expand_add_`` rounds them, and h is computed
from the rounded values, as ``gated_act_forward`` computes it from the stored ones: the result is the
unfused path's, up to the order of fp32 sums.

The op is ``fastlora::gated_act_lora_forward_`` (mutates gate and up, returns h) with a fake
implementation; it runs the Triton kernel when ``runs_triton(gate)`` says so and the pure-torch
reference (:func:`.gated_act_reference.gated_act_lora_forward`) otherwise.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fastlora_peft.call_traces import trace_unit

from . import gated_act_reference as _reference
from ._backend import OP_NAMESPACE, runs_triton, skips_op_dispatch
from ._launch import BoundLaunch, CachedKernel, LaunchPlans, cdiv, empty_2d
from ._lora_common import _rank_block
from .dots import FP32_DOT_PRECISION, TERM_IN_BF16, expand_dot_precision
from .gated_act import _activation_and_derivative, _check_inputs
from .lora_expand_add import expand_term

_OP = "gated_act_lora_forward_"
# From this many ranks (gate's or up's) on, the default launch takes at least 2 stages whatever the
# precision (3 past it with the bf16 term).
GATED_FORWARD_STAGED_RANKS = 64


# ---------------------------------------------------------------------------------------------------
# Kernel. Row offsets are widened to int64 before they meet a stride; column and rank offsets stay
# int32.
# ---------------------------------------------------------------------------------------------------


@CachedKernel
@triton.jit
def _gated_act_lora_forward_kernel(
    Gate_ptr, Up_ptr, H_ptr, GateLeft_ptr, GateRight_ptr, UpLeft_ptr, UpRight_ptr,
    M, n_cols, gate_rank, up_rank, gate_scale, up_scale,
    stride_gate_m, stride_up_m, stride_h_m,
    stride_glm, stride_glr, stride_gri, stride_grr, stride_ulm, stride_ulr, stride_uri, stride_urr,
    ACTIVATION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr,
    BLOCK_RG: tl.constexpr, BLOCK_RU: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """gate += gate_scale * GateLeft @ GateRight^T, up likewise (each rounded once, in place), and
    H = act(gate) * up from the rounded values; one program per (BLOCK_M rows, BLOCK_I columns)."""
    # Axis 0 walks along the columns, so neighbouring programs share the rows' left tiles.
    pid_i = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_i = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    mask_m = offs_m < M
    mask_i = offs_i < n_cols
    rows = offs_m.to(tl.int64)
    mask = mask_m[:, None] & mask_i[None, :]
    # Loaded before the dots, so their latency overlaps the LoRA terms (as lora_expand_add does).
    gate_ptrs = Gate_ptr + rows[:, None] * stride_gate_m + offs_i[None, :]
    up_ptrs = Up_ptr + rows[:, None] * stride_up_m + offs_i[None, :]
    gate = tl.load(gate_ptrs, mask=mask, other=0.0)
    up = tl.load(up_ptrs, mask=mask, other=0.0)
    gate_term = expand_term(
        GateLeft_ptr, GateRight_ptr, rows, mask_m, offs_i, mask_i, gate_rank,
        stride_glm, stride_glr, stride_gri, stride_grr,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_I, BLOCK_R=BLOCK_RG, DOT_PRECISION=DOT_PRECISION,
    )  # fmt: skip
    # Rounded to the stored dtype first: backward reads the stored gate and up, and h must be the h
    # they give (a no-op for fp32).
    gate = (gate.to(tl.float32) + gate_scale * gate_term).to(Gate_ptr.dtype.element_ty)
    tl.store(gate_ptrs, gate, mask=mask)
    up_term = expand_term(
        UpLeft_ptr, UpRight_ptr, rows, mask_m, offs_i, mask_i, up_rank,
        stride_ulm, stride_ulr, stride_uri, stride_urr,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_I, BLOCK_R=BLOCK_RU, DOT_PRECISION=DOT_PRECISION,
    )  # fmt: skip
    up = (up.to(tl.float32) + up_scale * up_term).to(Up_ptr.dtype.element_ty)
    tl.store(up_ptrs, up, mask=mask)
    act, _ = _activation_and_derivative(gate.to(tl.float32), ACTIVATION)
    h = act * up.to(tl.float32)
    tl.store(H_ptr + rows[:, None] * stride_h_m + offs_i[None, :], h.to(H_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------------
# Launcher. Keyword-only block sizes default to the GPU choice; tests pass small ones to cover
# several tiles and rank blocks on tiny shapes.
# ---------------------------------------------------------------------------------------------------


def bf16_left_suffices(
    out_dtype: torch.dtype, gate_right_dtype: torch.dtype, up_right_dtype: torch.dtype
) -> bool:
    """Whether the default launch's terms round their left (xa) to bf16 in registers (`TERM_IN_BF16`,
    the launcher's `expand_dot_precision`): then a caller may hand it over as a bf16 copy, the same
    numbers from half the bytes (a chunk's 224 column tiles each re-read its 64-row tiles of the left
    from L2). Elsewhere the left stays fp32: tf32 keeps 10 bits of it, not bf16's 7.

    bf16 adapters into a bf16 output take the one bf16 dot at every rank, on the bf16 left the gated
    MLP then hands over. H200, one 2048-row chunk of I = 14336, plain tf32 against the bf16 dot on an
    fp32 left, two rounds (docs/benchmarks/session51/a/bf16_term_probe.log): rank 16 92.4 / 92.5
    against 99.4 / 99.5 us, rank 64 152.6 / 152.1 against 132.2 / 132.2, rank 128 219.1 / 211.4
    against 169.1 / 168.2; so from the fifty-first session only 64+ ranks took it. With a bf16 left
    the bf16 dot wins at rank 16 too: 93.5 (plain tf32, fp32 left) against 84.2 us
    (session54/b/gated_fwd_bf16_left_probe.log), and in the MLP step's profile (8192 tokens, bf16
    adapters, `python3 -m benchmarks.profile_block --block mlp --provider fastlora --adapters bf16
    --rank 16`, two rounds against the tree before, fifty-fifth session, docs/benchmarks/session55/a/)
    91.5 / 93.5 -> 84.5 / 86.8 us a chunk; since then no rank keeps plain tf32 for bf16 adapters. It
    also rounds xa as PEFT's bf16-adapter path does (lora_A's bf16 output is lora_B's input)."""
    return expand_dot_precision(out_dtype, gate_right_dtype, up_right_dtype) == TERM_IN_BF16


def _gated_act_lora_forward_triton(
    *,
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    gate_left: torch.Tensor,
    gate_right: torch.Tensor,
    gate_scale: float,
    up_left: torch.Tensor,
    up_right: torch.Tensor,
    up_scale: float,
    block_m: int = 64,
    block_i: int = 64,
    block_r: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
) -> torch.Tensor:
    # The default launch of these inputs' shapes, strides, dtypes and alignment again: its plan.
    plan_key = None
    defaults = block_m == 64 and block_i == 64 and block_r is None and num_stages is None
    if defaults and num_warps == 4 and _FORWARD_PLANS.enabled:
        plan_key = _forward_plan_key(gate, up, activation, gate_left, gate_right, up_left, up_right)
        plan = _FORWARD_PLANS.get(plan_key)
        if plan is not None:
            return _run_forward_plan(
                plan, gate, up, gate_left, gate_right, gate_scale, up_left, up_right, up_scale
            )
    M, n_cols = gate.shape
    h = torch.empty((M, n_cols), dtype=gate.dtype, device=gate.device)
    if h.numel() == 0:
        return h
    # tl.dot's second operand wants its rank dim contiguous (see lora_expand_add): lora_B and the
    # halves of a gate_up lora_B already are.
    copy_gate_right, copy_up_right = gate_right.stride(1) != 1, up_right.stride(1) != 1
    gate_right = gate_right.contiguous() if copy_gate_right else gate_right
    up_right = up_right.contiguous() if copy_up_right else up_right
    gate_rank, up_rank = gate_left.shape[1], up_left.shape[1]
    many_ranks = max(gate_rank, up_rank) >= GATED_FORWARD_STAGED_RANKS
    precision = expand_dot_precision(gate.dtype, gate_right.dtype, up_right.dtype)
    block_rg = block_r or _rank_block(gate_rank, cap=64)
    block_ru = block_r or _rank_block(up_rank, cap=64)
    # H200, one 2048-row chunk of I = 14336 from the halves of a bf16 [M, 2I], rank 16
    # (`python -m benchmarks.tune_lora_terms --gated-forward`, 20 configs each): 64 x 64 tiles, 4 warps,
    # took 94us with bf16 adapters (plain tf32, 1 stage) and 111us with fp32 (3xTF32, 2 stages, before
    # fp32 adapters into bf16 took plain tf32 too),
    # against 130 and 138us for the three launches it replaces; lora_expand_add's own tiles (32 x 256
    # and 64 x 128) took 111 and 124us here.
    # From 64 ranks on, 2 stages with plain tf32 too: H200, fp32 adapters, the same chunk (`python -m
    # benchmarks.tune_lora_terms --gated-forward --rank=128 --rank=64`, forty-sixth session,
    # docs/benchmarks/session46/tune_gated_forward.log): rank 128 199.2 -> 162.2us, rank 64 141.8 ->
    # 125.1, the same tiles (no other of the 96 launches timed was faster).
    # Past 64 ranks with the bf16 term, 3 stages: the rank loop then runs two 64-rank blocks and the
    # third stage keeps their copies ahead. H200, bf16 adapters, bf16 left, the same chunk
    # (`session54/b/gated_fwd_bf16_left_probe.log`, one sweep): rank 128 141.4 -> 123.6 us; at rank 64
    # (one block) 109.2 and 110.9, no gain. In the MLP step's profile (8192 tokens, bf16 adapters,
    # fifty-fifth session, docs/benchmarks/session55/a/): rank 128 148.2 -> 124.4 us a chunk, rank 96
    # 142.7 -> 135.6.
    staged_ranks = max(gate_rank, up_rank) > GATED_FORWARD_STAGED_RANKS
    default_stages = 3 if precision == TERM_IN_BF16 and staged_ranks else 2
    num_stages = num_stages or (1 if precision != FP32_DOT_PRECISION and not many_ranks else default_stages)
    grid = (cdiv(n_cols, block_i), cdiv(M, block_m))
    strides = (
        gate.stride(0), up.stride(0), h.stride(0),
        gate_left.stride(0), gate_left.stride(1), gate_right.stride(0), gate_right.stride(1),
        up_left.stride(0), up_left.stride(1), up_right.stride(0), up_right.stride(1),
    )  # fmt: skip
    bound = _gated_act_lora_forward_kernel[grid](
        gate, up, h, gate_left, gate_right, up_left, up_right,
        M, n_cols, gate_rank, up_rank, float(gate_scale), float(up_scale), *strides,
        ACTIVATION=activation, BLOCK_M=block_m, BLOCK_I=block_i, BLOCK_RG=block_rg, BLOCK_RU=block_ru,
        DOT_PRECISION=precision,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if plan_key is not None and bound is not None:
        _FORWARD_PLANS.add(plan_key, _ForwardPlan(
            bound, copy_gate_right, copy_up_right, h.dtype, h.device, (M, n_cols), (gate_rank, up_rank),
            strides,
        ))  # fmt: skip
    return h


class _ForwardPlan(NamedTuple):
    """What `_gated_act_lora_forward_triton` derived from its inputs' metadata, to launch the same again
    (see `_launch.LaunchPlans`: the MLP launches this once per chunk of every block, every step)."""

    launch: BoundLaunch
    copy_gate_right: bool  # gate_right was copied contiguous first (its strides below are the copy's)
    copy_up_right: bool
    dtype: torch.dtype  # h's: gate's
    device: torch.device
    shape: tuple[int, int]  # M, n_cols (gate's, up's and h's)
    ranks: tuple[int, int]  # gate_rank, up_rank
    strides: tuple[int, ...]


_FORWARD_PLANS = LaunchPlans("gated_act_lora_forward_")


def _forward_plan_key(gate, up, activation, gate_left, gate_right, up_left, up_right) -> tuple:
    """The one key of a forward plan: the launcher's and the op body's lookups must agree."""
    return _FORWARD_PLANS.key(gate, up, activation, gate_left, gate_right, up_left, up_right)


@trace_unit
def _run_forward_plan(
    plan: _ForwardPlan, gate, up, gate_left, gate_right, gate_scale, up_left, up_right, up_scale
):
    gate_right = gate_right.contiguous() if plan.copy_gate_right else gate_right
    up_right = up_right.contiguous() if plan.copy_up_right else up_right
    h = empty_2d(*plan.shape, plan.dtype, plan.device)
    plan.launch(
        gate, up, h, gate_left, gate_right, up_left, up_right,
        *plan.shape, *plan.ranks, float(gate_scale), float(up_scale), *plan.strides,
    )  # fmt: skip
    return h


# ---------------------------------------------------------------------------------------------------
# Public op: checks, dispatch, fake implementation.
# ---------------------------------------------------------------------------------------------------


def _check_term(name: str, left: torch.Tensor, right: torch.Tensor, target: torch.Tensor) -> None:
    rows, cols = target.shape
    if left.dim() != 2 or left.shape[0] != rows:
        raise ValueError(f"{_OP}: {name}_left must be [M, R] with M={rows}, got shape {list(left.shape)}")
    if right.dim() != 2 or right.shape != (cols, left.shape[1]):
        raise ValueError(
            f"{_OP}: {name}_right must be [I, R] with I={cols}, R={left.shape[1]} ({name}_left's), "
            f"got shape {list(right.shape)}"
        )
    # A lora_shrink output, or its copy rounded to bf16 (`bf16_left_suffices`).
    expected = (torch.float64,) if target.dtype == torch.float64 else (torch.float32, torch.bfloat16)
    if left.dtype not in expected:
        wanted = " or ".join(map(str, expected))
        raise ValueError(f"{_OP}: {name}_left must be {wanted} (a lora_shrink output), got {left.dtype}")
    if right.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise ValueError(f"{_OP}: {name}_right must be float32, bfloat16 or float16, got {right.dtype}")
    for tensor in (left, right):
        if tensor.device != target.device:
            raise ValueError(f"{_OP}: {name}'s LoRA operands must be on {target.device}, got {tensor.device}")


def _check_lora_forward_inputs(gate, up, activation, gate_left, gate_right, up_left, up_right) -> None:
    _check_inputs(gate, up, activation)
    if gate.stride(-1) != 1 or up.stride(-1) != 1:
        raise ValueError(f"{_OP}: gate and up need a unit column stride to be written in place")
    _check_term("gate", gate_left, gate_right, gate)
    _check_term("up", up_left, up_right, up)


def gated_act_lora_forward_(
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    gate_left: torch.Tensor,
    gate_right: torch.Tensor,
    gate_scale: float,
    up_left: torch.Tensor,
    up_right: torch.Tensor,
    up_scale: float,
) -> torch.Tensor:
    """In place: ``gate += gate_scale * gate_left @ gate_right.T``, up likewise (each rounded once to
    its dtype); returns ``h = act(gate) * up`` [M, I] from the rounded values, in gate's dtype.

    `fastlora::gated_act_lora_forward_` (see the module docstring for shapes and dtypes).
    """
    args = (gate, up, activation, gate_left, gate_right, gate_scale, up_left, up_right, up_scale)
    if skips_op_dispatch(gate, up, gate_left, gate_right, up_left, up_right):
        return _gated_act_lora_forward_body(*args)
    return gated_act_lora_forward_op(*args)


def _gated_act_lora_forward_body(
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    gate_left: torch.Tensor,
    gate_right: torch.Tensor,
    gate_scale: float,
    up_left: torch.Tensor,
    up_right: torch.Tensor,
    up_scale: float,
) -> torch.Tensor:
    if _FORWARD_PLANS.serve(gate):  # a hit skips the checks: see lora_terms' `_PLANS_SKIP_CHECKS`
        plan = _FORWARD_PLANS.get(
            _forward_plan_key(gate, up, activation, gate_left, gate_right, up_left, up_right)
        )
        if plan is not None:
            return _run_forward_plan(
                plan, gate, up, gate_left, gate_right, gate_scale, up_left, up_right, up_scale
            )
    _check_lora_forward_inputs(gate, up, activation, gate_left, gate_right, up_left, up_right)
    if runs_triton(gate):
        return _gated_act_lora_forward_triton(
            gate=gate, up=up, activation=activation, gate_left=gate_left, gate_right=gate_right,
            gate_scale=gate_scale, up_left=up_left, up_right=up_right, up_scale=up_scale,
        )  # fmt: skip
    new_gate, new_up, hidden = _reference.gated_act_lora_forward(
        gate, up, activation, gate_left, gate_right, gate_scale, up_left, up_right, up_scale
    )
    gate.copy_(new_gate)
    up.copy_(new_up)
    return hidden


gated_act_lora_forward_op = torch.library.custom_op(
    f"{OP_NAMESPACE}::{_OP}", _gated_act_lora_forward_body, mutates_args=("gate", "up")
)


@gated_act_lora_forward_op.register_fake
def _(
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    gate_left: torch.Tensor,
    gate_right: torch.Tensor,
    gate_scale: float,
    up_left: torch.Tensor,
    up_right: torch.Tensor,
    up_scale: float,
) -> torch.Tensor:
    _check_lora_forward_inputs(gate, up, activation, gate_left, gate_right, up_left, up_right)
    return gate.new_empty(gate.shape)
