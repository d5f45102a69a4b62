"""A shared-input group's GEMMs as one launch each way where the TMA kernels take them: the forward's
(`lora_addmm_group`) and dX's (`lora_addmm_sum`), and how many materialized weights that may hold.

Both hold every member's weight at once where the per-member paths of `shared_input` hold one at a
time. Each returns None and the weights it made where its predicate says no, so the caller's
per-member path reuses them instead of materializing (dequantizing) them again.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from ..dtypes import DtypePlan
from ..kernels.lora_addmm_group import (
    lora_addmm_group_may_take,
    lora_addmm_group_of_weights_where_it_pays_off,
)
from ..kernels.lora_addmm_sum import lora_addmm_sum_may_take, lora_addmm_sum_where_it_pays_off
from .frozen_base import (
    FrozenBase,
    LoraWeights,
    dequantizes_as_group,
    materialize_weights,
    weight_is_materialized_fresh,
)

# The most bytes of weights a group's GEMM materializes at once (dequantized or cast). Llama-3.1-8B's
# q/k/v dequantized take 48 MiB together; gate/up take 224 MiB, whose extra 112 MiB would lift the
# 4-bit MLP's peak (692 MiB at 8192 tokens) past its 700 MiB budget.
GROUP_FRESH_WEIGHT_BYTES = 64 * 2**20


def group_weights_fit(bases: Sequence[FrozenBase], plan: DtypePlan) -> bool:
    """Whether every member's weight may be materialized at once."""
    fresh_bytes = 0
    for base in bases:
        if weight_is_materialized_fresh(base, plan.compute_dtype):
            out_features, in_features = base.quant.shape if base.quant is not None else base.weight.shape
            fresh_bytes += out_features * in_features * plan.compute_dtype.itemsize
    return fresh_bytes <= GROUP_FRESH_WEIGHT_BYTES


def grouped_4bit_weights(bases: Sequence[FrozenBase], plan: DtypePlan) -> Optional[list[torch.Tensor]]:
    """Every member's weight from one launch, for the per-member paths, where the members are 4-bit
    weights that dequantize as a group and fit at once (a q/k/v group off the TMA GEMMs: on the CPU,
    or with a bias); else None, and those paths materialize one weight at a time."""
    if not dequantizes_as_group(bases) or not group_weights_fit(bases, plan):
        return None
    return materialize_weights(bases, plan.compute_dtype)


def grouped_forward(
    x_compute: torch.Tensor,
    lefts: Sequence[torch.Tensor],
    bases: Sequence[FrozenBase],
    loras: Sequence[LoraWeights],
    plan: DtypePlan,
) -> tuple[Optional[list[torch.Tensor]], Optional[list[torch.Tensor]]]:
    """(every member's output `x @ W_i.T + scale_i * xa_i @ B_i.T` from one `lora_addmm_group`
    launch, None), or (None, the weights made or None). lefts: each member's columns of xa
    (`rank_blocks`)."""
    if any(base.bias is not None for base in bases):
        return None, None
    if not lora_addmm_group_may_take(x_compute, plan.out_dtype) or not group_weights_fit(bases, plan):
        return None, None
    weights = materialize_weights(bases, plan.compute_dtype)
    rights = [lora.lora_b for lora in loras]
    scales = [lora.scale for lora in loras]
    outputs = lora_addmm_group_of_weights_where_it_pays_off(
        x_compute, weights, lefts, rights, scales, plan.out_dtype
    )
    return (None, weights) if outputs is None else (outputs, None)


def summed_grad_x(
    grads_2d: Sequence[torch.Tensor],
    grad_xa: torch.Tensor,
    lora_scale: float,
    bases: Sequence[FrozenBase],
    plan: DtypePlan,
    x_dtype: torch.dtype,
    right_operand: Callable[[], torch.Tensor],
) -> tuple[Optional[torch.Tensor], Optional[list[torch.Tensor]]]:
    """(dX = sum_i g_i W_i plus the LoRA terms from one `lora_addmm_sum` GEMM, None), or (None, the
    weights made or None): no `addmm_` rereading and rewriting dX per member past the first.
    right_operand: makes the term's right operand (the stacked A^T), called once the sum may run (its
    plan's key holds it)."""
    if not lora_addmm_sum_may_take(grads_2d, plan.compute_dtype, x_dtype) or not group_weights_fit(
        bases, plan
    ):
        return None, None
    compute = plan.compute_dtype
    grads_compute = [grad if grad.dtype == compute else grad.to(compute) for grad in grads_2d]
    weights = materialize_weights(bases, plan.compute_dtype)
    grad_x = lora_addmm_sum_where_it_pays_off(
        grads_compute, weights, grad_xa, right_operand(), lora_scale, x_dtype
    )
    return (None, weights) if grad_x is None else (grad_x, None)
