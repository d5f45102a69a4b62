"""dX with the LoRA term inside one base GEMM's reduction (K) dimension, where that moves fewer bytes.

    dX = sum_i g_i @ W_i + s * (g B) @ A          (g B: every member's side by side, scales applied)
       = [g_j | s g B | 0] @ [W_j ; A ; 0] + sum_{i != j} g_i @ W_i

For one member j the GEMM's K grows from out_j to out_j + r, padded to a multiple of 64 on CUDA
(on an H200 a 2048-row GEMM of dh took 10-17% longer at K = 4112 than at 4160). In place of the
expand-add's read and write of dX (`[tokens, in]`), it costs a read of g_j and a write of the
`[tokens, K_pad]` left operand (`lora_augmented_left`), and A's rows under W_j: free where W_j is
written anyway (a 4-bit weight dequantized for this GEMM straight into the buffer, or a weight cast
to the compute dtype), a copy of W_j otherwise; and two host ops more. `augmented_member` decides
by those costs (see there): at Llama-3.1-8B shapes, from about 5k tokens on, a q/k/v group's k
projection; o_proj and a 4-bit down projection's dh (the MLP's, all its chunks) from larger sizes;
never gate/up (out > in). `python -m benchmarks.augmented_k_probe` (H200, bf16 base, fp32 adapters,
GEMM and term together): q/k/v through k at 8192 tokens 180 -> 117 us, o_proj 446 -> 395, one
2048-row chunk of dh 353 -> 327; inside a q/k/v step at 8192 tokens 58-64 us less kernel time,
while o_proj's was 10 us less on a 4-bit base and none less on a dense one (its left operand and
weight copy, 50 us, against the expand-add's 53; `docs/benchmarks/session16/aug_diag_8192.log`).

Numerics: the term's operands, s gB and A, are rounded to the compute dtype before cuBLAS multiplies
them (fp32 accumulation); the expand-add read them in fp32 and rounded the sum once. That adds the
compute dtype's rounding of the term: where the term is as large as the base's part (the tests'
random lora_B), a bf16 dX measured 3.0-3.3e-3 from float64 against 2.1e-3 by the expand-add
(`tests/test_augmented_k.py`, which holds it within 2x); fp32 adapters' dA and dB do not change.
fp16 is left out (s gB may overflow in fp16 where the fp32 path does not); float64 takes it exactly.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..dtypes import DtypePlan
from ..kernels.lora_augment import lora_augmented_left
from .frozen_base import (
    FrozenBase,
    LoraWeights,
    base_out_features,
    materialize_weight,
    weight_is_materialized_fresh,
)

_AUGMENTED_DTYPES = (torch.bfloat16, torch.float32, torch.float64)
# K padded to a multiple of this many elements: 128 bytes of bf16 rows on CUDA. Elsewhere (the CPU
# tests) a smaller multiple, so the padding is still there and exercised at tiny shapes.
_K_ALIGN_CUDA, _K_ALIGN_OTHER = 64, 8

# What an expand-add over dX costs, in copies of dX: 1 + rank / 32 for the (summed) rank of its dot.
# H200, [8192, 4096] bf16: 49-53 us at rank 16, 78 us at a q/k/v group's rank 48, against 32-34 us
# for the [8192, 4160] left operand (`docs/benchmarks/session16/aug_diag_8192.log`).
_EXPAND_ADD_RANK_PER_COPY = 32
# The augmented path's extra host time, in elements of a copy of the same time (about 1 ns each on
# the H200): it makes two host ops more than the expand-add (the weight buffer, the left operand's
# allocation). Host alone read 38-58 us more per o_proj or q/k/v step in three of four rows (same
# log), a measurement whose identical arms also read up to 15% apart; 40 us it is. A host-bound step
# (o_proj, q/k/v, anything at 2048 tokens) pays it in full, so the GEMM carries the term only where
# it saves more GPU time than that.
_HOST_COST_ELEMENTS = 40 * 2**20

# Zero rows under A in the augmented weight, by (rows, in_features, dtype, device): never written.
_ZERO_ROWS: dict[tuple, torch.Tensor] = {}


def padded_width(out_features: int, rank: int, device: torch.device) -> int:
    """K of the augmented GEMM: out + r rounded up to the alignment."""
    align = _K_ALIGN_CUDA if device.type == "cuda" else _K_ALIGN_OTHER
    return -(-(out_features + rank) // align) * align


def augmented_member(
    bases: Sequence[FrozenBase],
    loras: Sequence[LoraWeights],
    plan: DtypePlan,
    tokens: int,
    device: torch.device,
    grad_dtype: torch.dtype,
) -> Optional[int]:
    """The member whose dX GEMM should carry the LoRA terms in its K dimension, or None (expand-add).

    grad_dtype: the dtype dX is handed out in (x's). Only where it is the compute dtype: the GEMM
    rounds dX, term included, to the compute dtype, where the expand-add writes a wider dX (fp32
    activations on a bf16 base) with the term at that precision; an NF4 model with fp32 x measured
    its first q_proj's dA 4.0e-3 from float64 that way, against 3e-3 allowed (`test_model_parity`).
    Cost in elements copied: member j's left operand, tokens * K_pad (a copy of g_j; the kernel ran
    at copy speed), plus out_j * in to copy W_j when it is not written anyway; the expand-add,
    tokens * in * (1 + rank / `_EXPAND_ADD_RANK_PER_COPY`). The augmented path must save more than
    `_HOST_COST_ELEMENTS` (its extra host time). At Llama-3.1-8B shapes, rank 16, that leaves a q/k/v
    group (rank 48, through k) from about 5k tokens on, o_proj from about 21k (4-bit) or 29k (dense)
    and a 4-bit down projection's dh from about 2.4k rows (`tokens`: all of the MLP's chunks, whose left
    operands each take the place of an expand-add launch, so the host term is paid once); at 8192
    tokens a dense o_proj saved nothing on the GPU (its weight copy) and a 4-bit one 10 us.
    """
    if plan.compute_dtype not in _AUGMENTED_DTYPES or grad_dtype != plan.compute_dtype:
        return None
    rank = sum(lora.lora_a.shape[0] for lora in loras)
    in_features = loras[0].lora_a.shape[1]
    expand_add_cost = tokens * in_features * (1 + rank / _EXPAND_ADD_RANK_PER_COPY)
    best, best_cost = None, expand_add_cost - _HOST_COST_ELEMENTS
    for index, base in enumerate(bases):
        out_features = base_out_features(base)
        cost = tokens * padded_width(out_features, rank, device)
        if not weight_is_materialized_fresh(base, plan.compute_dtype):
            cost += out_features * in_features
        if cost < best_cost:
            best, best_cost = index, cost
    return best


def augmented_weight(
    base: FrozenBase, loras: Sequence[LoraWeights], plan: DtypePlan, width: int
) -> torch.Tensor:
    """`[W ; A_1 ; ... ; A_P ; 0]`, `[width, in]` of the compute dtype: W written (dequantized) into its
    first rows, the adapters' A rounded to the compute dtype under it, zeros to `width`."""
    out_features = base_out_features(base)
    lora_a = loras[0].lora_a
    rank = sum(lora.lora_a.shape[0] for lora in loras)
    weight = torch.empty((width, lora_a.shape[1]), dtype=plan.compute_dtype, device=lora_a.device)
    tail = [lora.lora_a for lora in loras]
    if width > out_features + rank:
        tail.append(
            _zero_rows(width - out_features - rank, lora_a.shape[1], plan.compute_dtype, lora_a.device)
        )
    if base.quant is None:
        # A dense weight is copied: with A's rows and the zeros in the same cat, one op (this is host
        # time on every backward that takes the augmented path, and o_proj's and q/k/v's are host-bound).
        return torch.cat([base.weight, *tail], dim=0, out=weight)
    materialize_weight(base, plan.compute_dtype, out=weight[:out_features])
    torch.cat(tail, dim=0, out=weight[out_features:])
    return weight


def augmented_grad_x(
    grad: torch.Tensor, grad_xa: torch.Tensor, scale: float, weight: torch.Tensor
) -> torch.Tensor:
    """`[grad | scale * grad_xa | 0] @ weight` (`weight` from `augmented_weight`), in grad's dtype."""
    return lora_augmented_left(grad, grad_xa, scale, weight.shape[0]) @ weight


def _zero_rows(rows: int, columns: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if torch.compiler.is_compiling():  # a cached tensor would become a graph constant and a guard
        return torch.zeros((rows, columns), dtype=dtype, device=device)
    key = (rows, columns, dtype, device)
    zeros = _ZERO_ROWS.get(key)
    if zeros is None:
        if len(_ZERO_ROWS) >= 64:  # a handful of shapes per model
            _ZERO_ROWS.clear()
        zeros = _ZERO_ROWS[key] = torch.zeros((rows, columns), dtype=dtype, device=device)
    return zeros
