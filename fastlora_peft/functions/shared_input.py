"""`LoraSharedInputFunction`: one or more LoRA projections of the same input in one autograd call.

A single `nn.Linear` is a group of one; q/k/v reading the same hidden state are a group of three.

    out_i = x @ W_i.T + bias_i + scale_i * (x @ A_i.T) @ B_i.T

Forward reads x once for every A_i (their rows side by side) and saves x and the small
`xa = x @ [A_1; ...; A_P].T` (fp32, [tokens, sum r]); the base weights are re-materialized in
backward (4-bit: dequantized again) instead of saved. Backward hoists `g_i @ B_i` once per
projection, reads x once for every dA_i, and accumulates dX of all projections in one buffer.

`shared_input_forward` / `shared_input_backward` hold the math on 2-D tensors so the gated-MLP
Function can compose them; the Function itself only flattens, saves and unflattens.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F

from ..call_traces import call_traces
from ..dtypes import DtypePlan, autocast_off
from ..kernels.lora_addmm import LoraAddmmSettings, lora_addmm_auto_takes, lora_addmm_where_it_pays_off
from ..kernels.lora_addmm_sum import MAX_MEMBERS
from ..kernels.lora_shrink_stack import lora_shrink_stacking_weights
from ..kernels.lora_terms import (
    lora_expand_add,
    lora_expand_add_,
    lora_shrink,
    lora_shrink_keeping_weight_t,
    lora_shrink_stacked_of_transposed,
    lora_weight_grad,
)
from ..kernels.lora_weight_grad_group import lora_weight_grads
from .augmented_k import augmented_grad_x, augmented_member, augmented_weight, padded_width
from .frozen_base import FrozenBase, LoraWeights, base_out_features, materialize_weight
from .function_apply import apply_function, direct_apply
from .group_gemms import grouped_4bit_weights, grouped_forward, summed_grad_x
from .tensor_groups import flatten_tensors, unflatten_tensors, values_in_tensor_slots

# apply(x, x_lora, plan, layout, *tensors): the flattened tensors start here.
_FIRST_TENSOR_ARG = 4


class SharedInputGrads(NamedTuple):
    grad_x: Optional[torch.Tensor]  # [tokens, in_features], x's dtype
    grad_x_lora: Optional[torch.Tensor]  # the LoRA terms' share when they read a dropped-out x_lora
    loras: list[LoraWeights]  # grad_a / grad_b (or None) in each slot
    bases: list[FrozenBase]  # grad of a trainable bias (or None); the weight is frozen
    extra: list[torch.Tensor]  # the caller's `extra_weight_grads`, in order


class WeightGradProblem(NamedTuple):
    """One `scale * left.T @ x` for `lora_weight_grads`: left [tokens, r] fp32, x [tokens, K]; the
    result K-major where `k_major` (a dB, whose transpose is then dense), rounded to `out_dtype`."""

    left: torch.Tensor
    x: torch.Tensor
    scale: float
    k_major: bool
    out_dtype: Optional[torch.dtype]


def rank_blocks(stacked: torch.Tensor, loras: Sequence[LoraWeights], dim: int) -> Sequence[torch.Tensor]:
    """Each projection's block of a tensor stacked along `dim` by rank (`xa`'s columns, dA's rows):
    views from one `split_with_sizes` call, where a slicing view per projection was one op each (on
    the H200 machine's host `xa[:, 0:16]` took 4.3 us, `docs/benchmarks/session39/a/op_costs.log`;
    on the CPU machine three slices took 4.2 us and the split 1.7, `session39/cpu/`). One
    projection's block is the tensor itself."""
    if len(loras) == 1:
        return (stacked,)
    return stacked.split_with_sizes([lora.lora_a.shape[0] for lora in loras], dim)


def stacked_lora_a_t(loras: Sequence[LoraWeights]) -> torch.Tensor:
    """Every A transposed, side by side ([in, sum r]) with the rank dim contiguous: the layout the dX
    term's kernels want their right operand in, made here for a backward whose forward kept none (a
    group's forward writes it in its shrink's launch, `shrink_stacking_lora_a`). For a group one cat
    of the transposed views makes it, where the cat and then the launcher's contiguous copy would be
    two ops."""
    if len(loras) == 1:
        return loras[0].lora_a.t()  # the launcher copies it
    dtypes = [lora.lora_a.dtype for lora in loras]
    dtype = dtypes[0]
    if dtypes.count(dtype) != len(dtypes):
        dtype = functools.reduce(torch.promote_types, dtypes)
    # (`.to` only where it changes something: a no-op `.to` is still a call into torch.)
    return torch.cat(
        [lora.lora_a.t() if d == dtype else lora.lora_a.t().to(dtype) for lora, d in zip(loras, dtypes)],
        dim=1,
    )


def shrink_stacking_lora_a(
    x_2d: torch.Tensor, loras: Sequence[LoraWeights]
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(xa = x @ [A_1; ...].T, fp32 `[tokens, sum r]`; the As transposed side by side, `[in, sum r]`,
    which backward's dX term takes as it is), made once per step: for a group both from one
    `lora_shrink_stacking_weights` launch, which reads each lora_A where it is (no cat of the As on
    the path to the forward's GEMM). One projection makes no stacked As: its lora_a serves as it is."""
    if len(loras) == 1:
        return lora_shrink(x_2d, loras[0].lora_a), None
    return lora_shrink_stacking_weights(x_2d, [lora.lora_a for lora in loras])


def _right_operand_of_dx_term(loras: Sequence[LoraWeights], lora_a_t: Optional[torch.Tensor]) -> torch.Tensor:
    return lora_a_t if lora_a_t is not None else stacked_lora_a_t(loras)


def shared_input_forward(
    x_2d: torch.Tensor,
    bases: Sequence[FrozenBase],
    loras: Sequence[LoraWeights],
    plan: DtypePlan,
    x_lora_2d: Optional[torch.Tensor] = None,
    out: Optional[Sequence[torch.Tensor]] = None,
    keep_lora_a_t: bool = False,
) -> tuple[list[torch.Tensor], torch.Tensor, Optional[torch.Tensor]]:
    """Outputs `[tokens, out_i]` of `plan.out_dtype`, `xa` (fp32 `[tokens, sum r]`) for backward, and
    the As transposed with the rank dim contiguous (`[in, sum r]`, backward's dX term reads it), or None.

    x_lora_2d: what the LoRA terms read instead of x (x after lora_dropout), or None for x itself.
    out: contiguous `[tokens, out_i]` tensors of `plan.out_dtype` to write the outputs into (e.g. rows
    of a larger output), or None for new ones.
    The As transposed come from a group's shrink (`shrink_stacking_lora_a`); one projection makes
    none unless `keep_lora_a_t`.
    keep_lora_a_t: one projection's shrink also writes A.T out, for a caller whose backward makes dX:
    the shrink loads A.T tile by tile anyway, where dX's term would copy lora_a.T (one op more).
    """
    x_compute = x_2d if x_2d.dtype == plan.compute_dtype else x_2d.to(plan.compute_dtype)
    x_shrunk = x_2d if x_lora_2d is None else x_lora_2d
    if len(loras) == 1 and keep_lora_a_t:
        xa, lora_a_t = lora_shrink_keeping_weight_t(x_shrunk, loras[0].lora_a)
    else:
        xa, lora_a_t = shrink_stacking_lora_a(x_shrunk, loras)
    lefts = rank_blocks(xa, loras, 1)
    weights = None  # every member's weight, where the grouped forward made them and then did not run
    if out is None and 1 < len(bases) <= MAX_MEMBERS:
        grouped, weights = grouped_forward(x_compute, lefts, bases, loras, plan)
        if grouped is not None:
            return grouped, xa, lora_a_t
    if weights is None and len(bases) > 1:
        weights = grouped_4bit_weights(bases, plan)
    outputs = []
    for index, (base, lora, left) in enumerate(zip(bases, loras, lefts)):
        weight, weights = _next_weight(base, plan, weights, index)
        bias = None if base.bias is None else base.bias.to(plan.compute_dtype)
        destination = None if out is None else out[index]
        if destination is None and bias is None and LoraAddmmSettings.mode != "never":
            # The term inside the GEMM (`lora_addmm`, x @ W.T as a K-major b) where it pays off: one
            # launch and no second pass over the output. (The mode is read first, so "never" pays no
            # host time here.)
            weight_t = weight.t()
            result = lora_addmm_where_it_pays_off(
                x_compute, weight_t, left, lora.lora_b, lora.scale, plan.out_dtype
            )
            if result is not None:
                outputs.append(result)
                del weight, weight_t
                continue
        if destination is not None and destination.dtype == plan.compute_dtype:
            # The base matmul writes its result where the output goes; the LoRA term is added there.
            base_out = _linear_into(destination, x_compute, weight, bias)
        else:
            base_out = F.linear(x_compute, weight, bias)
        del weight  # a dequantized 4-bit weight goes before the next one is made (one at the peak)
        result = _add_lora_term(base_out, left, lora.lora_b, lora.scale, plan.out_dtype)
        if destination is not None and result is not destination:
            destination.copy_(result)
            result = destination
        outputs.append(result)
    return outputs, xa, lora_a_t


def _next_weight(
    base: FrozenBase, plan: DtypePlan, weights: Optional[list], index: int
) -> tuple[torch.Tensor, Optional[list]]:
    """(member `index`'s weight, the rest): made now, or taken out of the group's `weights`, made
    before, so that it is freed once the caller drops it, as a weight made now is."""
    if weights is None:
        return materialize_weight(base, plan.compute_dtype), None
    weight, weights[index] = weights[index], None
    return weight, weights


def base_outputs(x_2d: torch.Tensor, bases: Sequence[FrozenBase], plan: DtypePlan) -> list[torch.Tensor]:
    """`x @ W_i.T + b_i` of every base, `[tokens, out_i]` of `plan.out_dtype`, without LoRA terms: for
    a caller that adds `scale_i * xa_i @ B_i.T` in a kernel of its own (the gated MLP's activation)."""
    x_compute = x_2d if x_2d.dtype == plan.compute_dtype else x_2d.to(plan.compute_dtype)
    weights = grouped_4bit_weights(bases, plan) if len(bases) > 1 else None
    outputs = []
    for index, base in enumerate(bases):
        weight, weights = _next_weight(base, plan, weights, index)
        bias = None if base.bias is None else base.bias.to(plan.compute_dtype)
        outputs.append(F.linear(x_compute, weight, bias).to(plan.out_dtype))
        del weight  # a dequantized 4-bit weight goes before the next one is made (one at the peak)
    return outputs


def _linear_into(destination, x, weight, bias) -> torch.Tensor:
    """`F.linear(x, weight, bias)` written into `destination` (the same cuBLAS call: mm, or addmm)."""
    if bias is None:
        return torch.mm(x, weight.t(), out=destination)
    return torch.addmm(bias, x, weight.t(), out=destination)


def _add_lora_term(base_out, left, right, scale, out_dtype) -> torch.Tensor:
    """base_out + scale * left @ right.T, in base_out's own buffer when the dtypes allow it."""
    if base_out.dtype == out_dtype and base_out.is_contiguous():
        return lora_expand_add_(base_out, left, right, scale)
    return lora_expand_add(base_out, left, right, scale, out_dtype)


def _grads_or_zeros(x_2d, bases, plan, grads_2d) -> list[torch.Tensor]:
    tokens = x_2d.shape[0]
    return [
        x_2d.new_zeros(tokens, base_out_features(base), dtype=plan.out_dtype) if grad is None else grad
        for base, grad in zip(bases, grads_2d)
    ]


def hoisted_grad_xa(
    grads_2d: Sequence[torch.Tensor], loras: Sequence[LoraWeights]
) -> tuple[torch.Tensor, float]:
    """`g_i @ B_i` for every projection, side by side: it feeds both dX and dA_i, so it is made once.

    Returns (grad_xa `[tokens, sum r]` fp32, the scale still to apply): for one projection the
    kernels apply its scale; for a group each block of columns already carries its own.
    """
    if len(loras) == 1:
        return lora_shrink(grads_2d[0], loras[0].lora_b.t()), loras[0].scale
    # Each shrink applies its own scale to its fp32 sum (no separate scaling pass per projection) and
    # writes its columns of one token-major buffer ([tokens, sum r], strides (1, tokens)), the layout
    # dA's lora_weight_grad wants (it copies any other): no cat of separate results.
    grad_xa = lora_shrink_stacked_of_transposed(
        grads_2d, [lora.lora_b for lora in loras], [lora.scale for lora in loras]
    )
    return grad_xa, 1.0


def shared_input_grad_x(
    grads_2d: Sequence[torch.Tensor],
    grad_xa: torch.Tensor,
    lora_scale: float,
    bases: Sequence[FrozenBase],
    loras: Sequence[LoraWeights],
    plan: DtypePlan,
    x_dtype: torch.dtype,
    with_lora_term: bool = True,
    allow_augmented: bool = True,
    lora_a_t: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """dX of every projection accumulated in one buffer: sum_i g_i W_i, plus the LoRA terms (unless
    they read another tensor, a dropped-out x: then `lora_input_grad` gives their share).

    One member's GEMM carries all the LoRA terms in its K dimension where `augmented_member` picks
    one (see `augmented_k`; not with `allow_augmented=False`, for a caller that decided already);
    else a group of up to three makes all of dX in one GEMM (`lora_addmm_sum`) where
    `lora_addmm_sum_pays_off` says so, or the first GEMM carries them (`lora_addmm`) where
    `lora_addmm_pays_off` does; otherwise
    cuBLAS makes sum_i g_i W_i and `lora_expand_add_` adds them. lora_a_t: the As transposed that
    `shared_input_forward` returned, or None to stack (for one projection: transpose) them here.
    """
    grad_x_base = None
    term_right = None  # the term's right operand: made where the first GEMM runs with the term pending
    term_pending = with_lora_term  # until one GEMM (augmented, lora_addmm) or the expand-add adds it
    tokens = grads_2d[0].shape[0]
    # lora_addmm forced ("always", its tests and probes) keeps the term it was asked to carry, and
    # where "auto" gives it the first GEMM it carries the term at no extra pass over dX or g: the
    # augmented K's left operand (a copy of g_j) and its launch cost more host time. H200, q/k/v at
    # 8192 tokens, fp32 adapters, augmented / not in one process under "auto" (`python -m
    # benchmarks.plans_ab --switch augmented --blocks qkv --bases nf4,bf16`): 1.64x / 1.53x the floor
    # on NF4 and 1.62x / 1.58x on bf16 (docs/benchmarks/session21/plans_ab_aug_qkv_8192_real.log;
    # 2.16x / 1.93x on bf16 in the twentieth session); at 2048 tokens even (2.96 / 2.99, 1.41 / 1.39).
    # In kernel time the augmented K was 1.6% ahead (1324 against 1345 us per step on bf16,
    # `kernel_ab --switch augmented --block qkv --base bf16`): the host decides.
    augment = with_lora_term and allow_augmented and LoraAddmmSettings.mode != "always"
    augment = augment and not lora_addmm_auto_takes(grads_2d[0], plan.compute_dtype, x_dtype)
    member = augmented_member(bases, loras, plan, tokens, grads_2d[0].device, x_dtype) if augment else None
    weights = None  # every member's weight, where a summed dX materialized them and then did not run
    if member is None and term_pending and 1 < len(bases) <= MAX_MEMBERS:
        right = functools.partial(_right_operand_of_dx_term, loras, lora_a_t)
        grad_x, weights = summed_grad_x(grads_2d, grad_xa, lora_scale, bases, plan, x_dtype, right)
        if grad_x is not None:
            return grad_x
    if weights is None and member is None and len(bases) > 1:
        weights = grouped_4bit_weights(bases, plan)
    order = range(len(bases)) if member is None else [member, *(i for i in range(len(bases)) if i != member)]
    for index in order:
        base, grad = bases[index], grads_2d[index]
        grad_compute = grad if grad.dtype == plan.compute_dtype else grad.to(plan.compute_dtype)
        if index == member:
            weight = augmented_weight(
                base, loras, plan, padded_width(base_out_features(base), grad_xa.shape[1], grad.device)
            )
            grad_x_base = augmented_grad_x(grad_compute, grad_xa, lora_scale, weight)
            term_pending = False
            del weight, grad_compute
            continue
        weight, weights = _next_weight(base, plan, weights, index)
        if grad_x_base is not None:
            grad_x_base.addmm_(grad_compute, weight)
        elif term_pending:  # the term's right operand is read either way: by lora_addmm or below
            term_right = _right_operand_of_dx_term(loras, lora_a_t)
            grad_x_base = lora_addmm_where_it_pays_off(
                grad_compute, weight, grad_xa, term_right, lora_scale, x_dtype
            )
            term_pending = grad_x_base is None
            if term_pending:
                grad_x_base = grad_compute @ weight
        else:
            grad_x_base = grad_compute @ weight
        del weight, grad_compute  # as in the forward: one materialized weight at a time
    if not term_pending:
        return grad_x_base if grad_x_base.dtype == x_dtype else grad_x_base.to(x_dtype)
    return _add_lora_term(grad_x_base, grad_xa, term_right, lora_scale, x_dtype)


def lora_input_grad(
    grad_xa: torch.Tensor,
    lora_scale: float,
    loras: Sequence[LoraWeights],
    x_lora_2d: torch.Tensor,
    lora_a_t: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The gradient of the tensor the LoRA terms read, `scale * (g B) A`, when it is not x itself."""
    zeros = torch.zeros_like(x_lora_2d, memory_format=torch.contiguous_format)
    right = _right_operand_of_dx_term(loras, lora_a_t)
    return _add_lora_term(zeros, grad_xa, right, lora_scale, x_lora_2d.dtype)


def shared_input_weight_grads(
    x_2d: torch.Tensor,
    xa: torch.Tensor,
    grads_2d: Sequence[torch.Tensor],
    grad_xa: Optional[torch.Tensor],
    lora_scale: float,
    bases: Sequence[FrozenBase],
    loras: Sequence[LoraWeights],
    needs_loras: Sequence[LoraWeights],
    needs_bases: Sequence[FrozenBase],
    extra_weight_grads: Sequence[WeightGradProblem] = (),
) -> tuple[list[LoraWeights], list[FrozenBase], list[torch.Tensor]]:
    """dA_i (one pass over x for all of them), dB_i from the saved xa, trainable biases' grads, and
    the caller's `extra_weight_grads` (the gated MLP's down dB), in that order.

    The weight gradients go to one `lora_weight_grads` call, which launches together those it can
    (o_proj's dA and dB, a group's dB_i), where all have one dtype (each gradient is then rounded to it
    by its kernel). A group of mixed adapter dtypes makes each with `lora_weight_grad`.
    """
    needs_a = any(need.lora_a for need in needs_loras)
    a_dtypes = {lora.lora_a.dtype for lora in loras}
    # The kernel rounds to the adapters' dtype itself when the group has one (no separate cast); the
    # blocks of dA below are then views, and a mixed group casts each block.
    a_dtype = next(iter(a_dtypes)) if len(a_dtypes) == 1 else None
    # (left, x, scale, k_major, out dtype) of each gradient: dA of the group first, then each dB_i,
    # made K-major so its transpose (lora_B's layout) is dense and autograd keeps it as it is.
    # (Plain tuples, laid out as WeightGradProblem: this runs in every backward.)
    problems = [(grad_xa, x_2d, lora_scale, False, a_dtype)] if needs_a else []
    unused = [None] * len(loras)
    xa_blocks = rank_blocks(xa, loras, 1) if any(need.lora_b for need in needs_loras) else unused
    for lora, need, grad, xa_block in zip(loras, needs_loras, grads_2d, xa_blocks):
        if need.lora_b:
            problems.append((xa_block, grad, lora.scale, True, lora.lora_b.dtype))
    problems += extra_weight_grads
    out_dtypes = {problem[4] for problem in problems}
    if len(problems) > 1 and len(out_dtypes) == 1 and None not in out_dtypes:
        lefts, xs, scales, k_major, out_dtype = zip(*problems)
        weight_grads = lora_weight_grads(lefts, xs, scales, k_major, out_dtype[0])
    else:
        weight_grads = [
            lora_weight_grad(left, x, scale, k_major=k_major, out_dtype=out_dtype)
            for left, x, scale, k_major, out_dtype in problems
        ]
    extra = weight_grads[len(weight_grads) - len(extra_weight_grads) :]
    grad_a_all = weight_grads[0] if needs_a else None
    grad_bs = iter(weight_grads[1:] if needs_a else weight_grads)
    grad_loras = []
    grad_a_blocks = rank_blocks(grad_a_all, loras, 0) if needs_a else unused
    for lora, need, grad_a in zip(loras, needs_loras, grad_a_blocks):
        if need.lora_a:
            grad_a = grad_a if grad_a.dtype == lora.lora_a.dtype else grad_a.to(lora.lora_a.dtype)
        else:
            grad_a = None
        grad_b = next(grad_bs).t() if need.lora_b else None
        grad_loras.append(LoraWeights(grad_a, grad_b, lora.scale))
    return grad_loras, bias_grads(bases, needs_bases, grads_2d), extra


def bias_grads(
    bases: Sequence[FrozenBase], needs_bases: Sequence[FrozenBase], grads_2d: Sequence[torch.Tensor]
) -> list[FrozenBase]:
    """Each trainable bias's gradient (summed over the tokens in fp32), in a FrozenBase slot."""
    grad_bases = []
    for base, need, grad in zip(bases, needs_bases, grads_2d):
        grad_bias = grad.sum(0, dtype=torch.float32).to(base.bias.dtype) if need.bias else None
        grad_bases.append(FrozenBase(None, grad_bias, None))  # the weight stays frozen
    return grad_bases


def shared_input_backward(
    x_2d: torch.Tensor,
    xa: torch.Tensor,
    bases: Sequence[FrozenBase],
    loras: Sequence[LoraWeights],
    plan: DtypePlan,
    grads_2d: Sequence[Optional[torch.Tensor]],
    needs_x: bool,
    needs_loras: Sequence[LoraWeights],
    needs_bases: Sequence[FrozenBase],
    x_lora_2d: Optional[torch.Tensor] = None,
    needs_x_lora: bool = False,
    lora_a_t: Optional[torch.Tensor] = None,
    extra_weight_grads: Sequence[WeightGradProblem] = (),
) -> SharedInputGrads:
    """Gradients of `shared_input_forward` given the upstream `grads_2d` (None: that output was unused);
    lora_a_t: the As transposed that the forward returned, or None; extra_weight_grads: weight
    gradients of the caller's to make with the group's (`shared_input_weight_grads`)."""
    grads_2d = _grads_or_zeros(x_2d, bases, plan, grads_2d)
    lora_reads_x = x_lora_2d is None
    grad_xa, lora_scale = None, 1.0
    if (needs_x and lora_reads_x) or needs_x_lora or any(need.lora_a for need in needs_loras):
        grad_xa, lora_scale = hoisted_grad_xa(grads_2d, loras)
    grad_x = grad_x_lora = None
    if needs_x:
        grad_x = shared_input_grad_x(
            grads_2d, grad_xa, lora_scale, bases, loras, plan, x_2d.dtype, with_lora_term=lora_reads_x,
            lora_a_t=lora_a_t,
        )  # fmt: skip
    if needs_x_lora and not lora_reads_x:
        grad_x_lora = lora_input_grad(grad_xa, lora_scale, loras, x_lora_2d, lora_a_t)
    grad_loras, grad_bases, extra = shared_input_weight_grads(
        x_2d if lora_reads_x else x_lora_2d,
        xa,
        grads_2d,
        grad_xa,
        lora_scale,
        bases,
        loras,
        needs_loras,
        needs_bases,
        extra_weight_grads,
    )
    return SharedInputGrads(grad_x, grad_x_lora, grad_loras, grad_bases, extra)


class LoraSharedInputFunction(torch.autograd.Function):
    """Forward and backward of `P` LoRA projections sharing the input x.

    Inputs: x `[..., in_features]` (fp32, bf16 or fp16); x_lora, what the LoRA terms read instead
    of x (x after lora_dropout, same shape), or None; `plan` from `plan_projection_dtypes`;
    `layout` from `flatten_tensors((bases, loras))`; then the flattened tensors.
    Outputs: P tensors `[..., out_features_i]` of `plan.out_dtype`.
    Dtypes: the base matmuls run in `plan.compute_dtype` (fp32 accumulation by the BLAS); the LoRA
    terms read x, A, B, dY in their own dtypes and accumulate in fp32; each output is rounded once.
    dX has x's dtype, dA/dB the adapters' dtypes (computed in fp32), dbias the bias's dtype.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, x_lora: Optional[torch.Tensor], plan: DtypePlan, layout, *tensors):
        # dX's LoRA term (of x, or of x_lora) reads the As transposed: kept from the forward.
        needs_term_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]

        def body():
            bases, loras = unflatten_tensors(layout, tensors)
            x_lora_2d = None if x_lora is None else x_lora.reshape(-1, x.shape[-1])
            outputs, xa, lora_a_t = shared_input_forward(
                x.reshape(-1, x.shape[-1]), bases, loras, plan, x_lora_2d, keep_lora_a_t=needs_term_grad
            )
            return tuple(out.view(*x.shape[:-1], out.shape[-1]) for out in outputs), xa, lora_a_t

        # Replayed without its decisions where the same metadata was seen before (`call_traces`).
        inputs = (x, x_lora, *tensors)
        key = _FORWARD_TRACES.key((plan, layout, needs_term_grad), inputs)
        (outputs, xa, lora_a_t), ctx.trace_entry = _FORWARD_TRACES.call(key, inputs, body)
        ctx.plan, ctx.layout = plan, layout
        ctx.save_for_backward(x, x_lora, xa, lora_a_t, *tensors)
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs: Optional[torch.Tensor]):
        saved = ctx.saved_tensors
        needs_input_grad = ctx.needs_input_grad
        plan, layout = ctx.plan, ctx.layout

        def body():
            x, x_lora, xa, lora_a_t, *tensors = saved
            bases, loras = unflatten_tensors(layout, tensors)
            needs_bases, needs_loras = unflatten_tensors(layout, needs_input_grad[_FIRST_TENSOR_ARG:])
            x_2d = x.reshape(-1, x.shape[-1])
            grads_2d = [
                None if grad is None else grad.reshape(x_2d.shape[0], grad.shape[-1]) for grad in grad_outputs
            ]
            x_lora_2d = None if x_lora is None else x_lora.reshape(x_2d.shape)
            grads = shared_input_backward(
                x_2d, xa, bases, loras, plan, grads_2d, needs_input_grad[0], needs_loras, needs_bases,
                x_lora_2d, needs_input_grad[1], lora_a_t,
            )  # fmt: skip
            grad_x = None if grads.grad_x is None else grads.grad_x.view(x.shape)
            grad_x_lora = None if grads.grad_x_lora is None else grads.grad_x_lora.view(x.shape)
            # One gradient per flattened tensor, in the same order as the inputs.
            grad_tensors = values_in_tensor_slots(layout, (grads.bases, grads.loras))
            return (grad_x, grad_x_lora, None, None, *grad_tensors)

        # The saved tensors are the forward's inputs and what its trace (or body) made of them: its
        # entry stands for their metadata. Without one (no trace served it) the body runs.
        forward = ctx.trace_entry
        parts = (forward, needs_input_grad, torch.is_grad_enabled())
        key = None if forward is None else _BACKWARD_TRACES.key(parts, grad_outputs)
        with autocast_off(saved[0].device.type):
            return _BACKWARD_TRACES.call(key, (*saved, *grad_outputs), body)[0]


# The Function's bodies by call metadata, replayed without their decisions (`call_traces`).
_FORWARD_TRACES = call_traces("shared_input_forward")
_BACKWARD_TRACES = call_traces("shared_input_backward")
# The Function's C apply, called without `Function.apply`'s wrapper where it does nothing.
_APPLY = direct_apply(LoraSharedInputFunction)


def fused_lora_projections(
    x: torch.Tensor,
    bases: Sequence[FrozenBase],
    loras: Sequence[LoraWeights],
    plan: DtypePlan,
    x_lora: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, ...]:
    """Runs `LoraSharedInputFunction` with autocast off inside (the plan already holds its dtypes).

    x_lora: x after lora_dropout, read by the LoRA terms instead of x; None when there is no dropout.
    """
    tensors, layout = flatten_tensors((tuple(bases), tuple(loras)))
    with autocast_off(x.device.type):
        return apply_function(LoraSharedInputFunction, _APPLY, x, x_lora, plan, layout, *tensors)
