"""`LoraGatedMlpFunction`: a whole gated MLP block with LoRA on every projection, in one autograd call.

    gate = x @ Wg.T + sg (x Ag.T) Bg.T        up = x @ Wu.T + su (x Au.T) Bu.T     (one pass over x)
    h    = act(gate) * up                     act: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    y    = h @ Wd.T + sd (h Ad.T) Bd.T

Gate and up are either two projections (Llama, Gemma, ...) or the two halves of one fused
`gate_up_proj` (Phi-3). Saves x, the gate/up pre-activations and the small fp32 `x @ A.T` and
`h @ Ad.T`; h is not kept ([tokens, I] per block is the largest activation of a transformer layer):
backward recomputes it in registers, inside the kernel that makes the gate/up gradients and dA_down.
Backward overwrites the saved gate/up with their gradients, so a second backward through the same
graph (`retain_graph=True`) stops with a clear error instead of computing garbage.

Gate and up come out of the base GEMMs without their LoRA terms; the activation's kernel adds them
(`gated_act_lora_forward_`: it reads gate and up once, writes them back with their terms, for
backward, and writes h), where two expand-adds would each read and write a `[tokens, I]` tensor.

The down projection runs in chunks of token rows, so h (forward) and dh (backward) exist for one
chunk at a time. At Llama-3.1-8B shapes (8192 tokens, I = 14336, bf16) a whole h is 224 MiB and
the peak was gate + up + h + out = 224 + 224 + 224 + 64 = 742 MiB (852 with an NF4 down weight
dequantized; measured on an H200); in chunks of at most 64 MiB (four there), each written straight
into its rows of the output, it is about 224 + 224 + 56 + 64 = 568 MiB, 680 for NF4 (measured: 586
and 692, `benchmarks.run --cases blocks`). 2048 tokens (56 MiB of h) stay one chunk, i.e. the same
launches as unchunked (see `_CHUNK_BYTES`).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence

import torch

from ..call_traces import VersionedSettings, call_traces
from ..dtypes import DtypePlan, autocast_off
from ..kernels._backend import runs_triton
from ..kernels.gated_act import gated_act_backward_, gated_act_backward_keeping_hidden_
from ..kernels.gated_act_lora import fuses_weight_grad, gated_act_backward_weight_grad_
from ..kernels.gated_act_lora_forward import bf16_left_suffices, gated_act_lora_forward_
from ..kernels.lora_terms import lora_weight_grad
from .augmented_k import augmented_grad_x, augmented_member, augmented_weight, padded_width
from .frozen_base import (
    FrozenBase,
    LoraWeights,
    base_out_features,
    materialize_weight,
    weight_is_materialized_fresh,
)
from .function_apply import apply_function, direct_apply
from .shared_input import (
    WeightGradProblem,
    base_outputs,
    bias_grads,
    hoisted_grad_xa,
    rank_blocks,
    shared_input_backward,
    shared_input_forward,
    shared_input_grad_x,
    shrink_stacking_lora_a,
)
from .tensor_groups import flatten_tensors, unflatten_tensors, values_in_tensor_slots

# apply(x, plan, activation, settings, layout, *tensors)
_FIRST_TENSOR_ARG = 5


# The most bytes of h per chunk. 2048 x 14336 bf16 (56 MiB) stays one chunk: the launches of the
# unchunked block, which matter where launches dominate. At 8192 tokens, four chunks of 2048 rows:
# an NF4 block's forward peaks near gate + up + dequantized down weight + h chunk + out = 224 + 224
# + 112 + 56 + 64 = 680 MiB, the chunks' outputs written straight into `out` (a copy of each would
# add 16). Smaller chunks cost time: a chunk's matmuls and LoRA terms are launched once per chunk.
_CHUNK_BYTES = 64 * 2**20
# Row alignment of the backward's chunks where dh takes the augmented K (see `_down_backward_`).
_AUGMENTED_ROW_ALIGN = 256


def token_chunks(
    tokens: int, intermediate: int, element_size: int, chunk_bytes: int = _CHUNK_BYTES, align: int = 1
) -> list[slice]:
    """Row ranges covering `[0, tokens)` once, in order, so each `[rows, intermediate]` chunk of h
    holds at most about `chunk_bytes`: ceil(bytes of all h / chunk_bytes) ranges (at least one, at
    most one per row) whose sizes differ by at most one row. With `align`, where every range can hold
    that many rows, every bound but the last is a multiple of it (each bound the even one rounded to
    the nearest multiple: a range may then hold up to `align` rows more than the even split)."""
    count = math.ceil(tokens * intermediate * element_size / chunk_bytes)
    count = min(max(count, 1), max(tokens, 1))
    if align > 1 and tokens // count >= align:
        # Each even bound rounded to the nearest multiple of align: bounds at least align apart.
        bounds = [
            (2 * index * tokens + count * align) // (2 * count * align) * align for index in range(count)
        ]
        bounds.append(tokens)
    else:
        bounds = [index * tokens // count for index in range(count + 1)]
    return [slice(start, end) for start, end in zip(bounds, bounds[1:])]


def _gate_and_up(pre_activations: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up): two projections' outputs, or the halves of one `[tokens, 2I]` gate_up output (views)."""
    if len(pre_activations) == 2:
        return pre_activations[0], pre_activations[1]
    (gate_up,) = pre_activations
    half = gate_up.shape[1] // 2
    return gate_up[:, :half], gate_up[:, half:]


class GateUpLoraTerms(NamedTuple):
    """What `gated_act_lora_forward_` adds to gate and up: `scale * left @ right.T` for each."""

    gate_left: torch.Tensor  # [tokens, r_gate] fp32 (or bf16): gate's columns of the forward's xa
    gate_right: torch.Tensor  # [I, r_gate]: gate's lora_B, or the first half of gate_up's
    gate_scale: float
    up_left: torch.Tensor
    up_right: torch.Tensor
    up_scale: float

    def rows(self, rows: slice) -> "GateUpLoraTerms":
        return self._replace(gate_left=self.gate_left[rows], up_left=self.up_left[rows])


def _gate_up_lora_terms(
    xa: torch.Tensor, loras: Sequence[LoraWeights], gate: torch.Tensor
) -> GateUpLoraTerms:
    """The terms of (gate, up) or of the two halves of one gate_up (whose xa columns they share), on
    a row-major copy of xa: the activation kernel's term wants its left operand's rank dim
    contiguous (tl.dot's first operand; see gated_act_lora_forward), and the shrink writes xa token-
    major for dB's weight gradient, which the backward reads from the saved xa. The copy is bf16
    where the kernel's term rounds xa to bf16 anyway (`bf16_left_suffices`: bf16 adapters into a
    bf16 output, at every rank): the same numbers, from half the bytes that every column tile of a
    chunk re-reads."""
    if len(loras) == 2:
        gate_lora, up_lora = loras
        gate_right, up_right = gate_lora.lora_b, up_lora.lora_b
        gate_scale, up_scale = gate_lora.scale, up_lora.scale
    else:
        (gate_up,) = loras
        half = gate_up.lora_b.shape[0] // 2
        gate_right, up_right = gate_up.lora_b[:half], gate_up.lora_b[half:]
        gate_scale = up_scale = gate_up.scale
    if runs_triton(gate) and bf16_left_suffices(gate.dtype, gate_right.dtype, up_right.dtype):
        # One op (`_to_copy`), rounded and row-major, as the fp32 path's one `clone`.
        xa = xa.to(torch.bfloat16, memory_format=torch.contiguous_format)
    else:
        xa = xa.contiguous()
    if len(loras) == 2:
        gate_left, up_left = rank_blocks(xa, loras, 1)
        return GateUpLoraTerms(gate_left, gate_right, gate_scale, up_left, up_right, up_scale)
    return GateUpLoraTerms(xa, gate_right, gate_scale, xa, up_right, up_scale)


def _dense_base(base: FrozenBase, plan: DtypePlan) -> FrozenBase:
    """The base with its weight materialized once in the compute dtype: every chunk reads it, and a
    4-bit weight (or one cast under autocast) would otherwise be dequantized (cast) once per chunk."""
    return FrozenBase(materialize_weight(base, plan.compute_dtype), base.bias, None)


def _down_forward(
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    gate_up_terms: GateUpLoraTerms,
    down_base: FrozenBase,
    down_lora: LoraWeights,
    plan: DtypePlan,
    chunks: Sequence[slice],
    keep_down_a_t: bool,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(out `[tokens, hidden]` of `plan.out_dtype`, `h @ Ad.T` fp32 `[tokens, r]`, Ad.T `[I, r]` with
    the rank dim contiguous where `keep_down_a_t`, else None), with h made one chunk of rows at a
    time, each chunk's output written into its rows of `out`. gate and up come in as the base
    outputs; each chunk's activation adds their LoRA terms there, in place. The first chunk's shrink
    writes Ad.T, which every chunk of dh's LoRA term reads in backward (see `shared_input_forward`)."""
    if len(chunks) == 1:
        hidden = gated_act_lora_forward_(gate, up, activation, *gate_up_terms)
        (out,), ha_down, down_a_t = shared_input_forward(
            hidden, [down_base], [down_lora], plan, keep_lora_a_t=keep_down_a_t
        )
        return out, ha_down, down_a_t
    tokens, hidden_features = gate.shape[0], base_out_features(down_base)
    out = gate.new_empty((tokens, hidden_features), dtype=plan.out_dtype)
    ha_down = down_a_t = None
    for rows in chunks:
        hidden = gated_act_lora_forward_(gate[rows], up[rows], activation, *gate_up_terms.rows(rows))
        keep = keep_down_a_t and down_a_t is None
        _, ha_rows, kept = shared_input_forward(
            hidden, [down_base], [down_lora], plan, out=[out[rows]], keep_lora_a_t=keep
        )
        down_a_t = kept if keep else down_a_t
        del hidden
        if ha_down is None:  # fp32, or float64 under gradcheck: the LoRA kernels' accumulation dtype
            ha_down = ha_rows.new_empty((tokens, ha_rows.shape[1]))
        ha_down[rows].copy_(ha_rows)
    return out, ha_down, down_a_t


def _dh_takes_augmented_k(
    down_base: FrozenBase, down_lora: LoraWeights, plan: DtypePlan, gate: torch.Tensor
) -> bool:
    """Whether dh's LoRA term goes inside its GEMM's K dimension (see `_down_backward_`), from the
    stored down base, the plan and gate's rows, device and dtype: asked in the forward, whose down
    projection then keeps no Ad.T (that path reads lora_a itself), and handed to the backward."""
    return weight_is_materialized_fresh(down_base, plan.compute_dtype) and (
        augmented_member([down_base], [down_lora], plan, gate.shape[0], gate.device, gate.dtype) == 0
    )


def _down_backward_(
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    grad_2d: torch.Tensor,
    grad_ha: torch.Tensor,
    down_scale: float,
    down_base: FrozenBase,
    down_lora: LoraWeights,
    down_a_t: Optional[torch.Tensor],
    plan: DtypePlan,
    needs_a: bool,
    chunks: Sequence[slice],
    chunk_bytes: int,
    augmented: bool,
) -> Optional[torch.Tensor]:
    """down_base as stored (its weight is materialized here, once). Per chunk of rows: dh, then one
    fused op that turns it into the gate/up gradients in the saved gate/up buffers themselves and,
    when dA_down is needed, recomputes h from those rows (before it overwrites them) for h's share of
    dA_down. Returns dA_down (fp32 `[r, I]`), or None. down_a_t: the forward's Ad.T (see
    `_down_forward`), which every chunk's dh term reads, or None to transpose lora_a there.
    augmented: `_dh_takes_augmented_k`, as the forward decided it.

    Besides gate and up at most one `[chunk, I]` tensor (dh) is alive; h never is in memory. `chunks`
    are the forward's; where dh's term goes through the augmented K (below) the rows are chunked again.
    """
    grad_a = None
    tokens, intermediate = gate.shape
    # dA_down's chunk shares are summed in fp32 and rounded once to the adapter's dtype (backward's
    # caller): each share's dot is the one that rounding asks for (`dots.weight_grad_dot_mode`: for
    # fp16 the pair, 16 significant bits of dY @ Bd; for bf16 dY @ Bd rounded to bf16, one dot).
    rounded_to = down_lora.lora_a.dtype
    # dh's LoRA term inside the GEMM's K dimension where that costs less (see augmented_k): a 4-bit
    # down weight is dequantized straight into the augmented weight, once for every chunk; the rule
    # weighs all rows against the path's extra host time, which is paid once (the weight's buffer;
    # each chunk's left operand takes the place of its expand-add launch). Beside each chunk's dh
    # the left operand lives until its GEMM returns (16 MiB at 2048 rows, which took the NF4 MLP's
    # peak at 8192 tokens from 692 to 702 MiB), so these chunks hold dh and the left operand
    # together within the forward's budget for h: five at 8192 tokens, of 1536 and 1792 rows (peak
    # 693 MiB). Their bounds are multiples of 256 rows, cuBLAS's tile there: at 1638-1639-row chunks
    # the gated backward kernel took 184 against 101 us per chunk and cuBLAS picked a slower GEMM;
    # 1664 rows would fill 6.5 of its 256-row tiles (H200, `docs/benchmarks/session17/dh_chunks_ab*`).
    if augmented:
        width = padded_width(base_out_features(down_base), grad_ha.shape[1], gate.device)
        down_weight = augmented_weight(down_base, [down_lora], plan, width)
        chunks = token_chunks(
            tokens, intermediate + width, gate.element_size(), chunk_bytes, _AUGMENTED_ROW_ALIGN
        )
    else:
        down_base = _dense_base(down_base, plan)
    for rows in chunks:
        if augmented:  # taken only where out, dh and the compute dtype are one dtype: no casts
            grad_hidden = augmented_grad_x(grad_2d[rows], grad_ha[rows], down_scale, down_weight)
        else:
            grad_hidden = shared_input_grad_x(
                [grad_2d[rows]], grad_ha[rows], down_scale, [down_base], [down_lora], plan, gate.dtype,
                allow_augmented=False,  # the weight is materialized: augmenting would copy it per chunk
                lora_a_t=down_a_t,
            )  # fmt: skip
        # These rows of gate/up hold their gradients afterwards.
        if needs_a and fuses_weight_grad(grad_ha.shape[1]):
            # One pass over dh, gate and up instead of three launches that recompute h, read it for
            # dA and read gate/up again (9 passes over [chunk, I] against 5, see gated_act_lora).
            grad_a_rows = gated_act_backward_weight_grad_(
                grad_hidden, gate[rows], up[rows], activation, grad_ha[rows], down_scale, rounded_to
            )
            grad_a = grad_a_rows if grad_a is None else grad_a.add_(grad_a_rows)
        elif needs_a:
            # More ranks: the activation's backward leaves h in dh's buffer, and dA reads it there
            # (6 passes and one over h; the fused kernel's dot is slower past its ranks, see there).
            gated_act_backward_keeping_hidden_(grad_hidden, gate[rows], up[rows], activation)
            grad_a_rows = lora_weight_grad(grad_ha[rows], grad_hidden, down_scale, rounded_to=rounded_to)
            grad_a = grad_a_rows if grad_a is None else grad_a.add_(grad_a_rows)
        else:
            gated_act_backward_(grad_hidden, gate[rows], up[rows], activation)
        del grad_hidden
    return grad_a


class GatedMlpSettings(metaclass=VersionedSettings):
    """Knobs of the fused gated MLP, read by `fused_gated_mlp` at every call and handed to the Function
    (a plain class: torch.compile traces reads of its attributes, not of an autograd.Function's)."""

    # Backward writes the gate/up gradients into the saved gate/up buffers (two [tokens, I] tensors
    # less at the peak). False keeps them, for a second backward through the same graph.
    overwrite_saved_preactivations = True
    # The most bytes of h per chunk of the down projection, read at forward (backward reuses the
    # forward's chunks). Tests lower it to run several chunks on tiny shapes.
    chunk_bytes = _CHUNK_BYTES
    # The Function's forward and backward replayed from call traces (`call_traces`). A replay drops
    # each intermediate after its last use, so it holds no more than the body (the first traced MLP,
    # forty-second session, kept them all to the end: peak 584 -> 811 MiB at 8192 tokens on the H200).
    call_traces = True


class _MlpSettings(NamedTuple):
    """`GatedMlpSettings` as read for one call."""

    chunk_bytes: int
    overwrite_saved_preactivations: bool
    call_traces: bool


class LoraGatedMlpFunction(torch.autograd.Function):
    """Forward and backward of `down(act(gate(x)) * up(x))` with a LoRA adapter on each projection.

    x: `[..., hidden]` (fp32, bf16 or fp16); returns `[..., hidden]` of `plan.out_dtype`. The layout
    holds `(bases, loras)` of `(gate, up, down)` or `(gate_up, down)`. Gate/up outputs and h have
    `plan.out_dtype`; the down projection takes h in that dtype under the same plan. dX has x's
    dtype; every adapter gradient has its adapter's dtype and is accumulated in fp32.
    """

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, plan: DtypePlan, activation: str, settings: _MlpSettings, layout, *tensors
    ):
        # dh's term reads Ad.T in every backward (dh is always made), unless it goes through the
        # augmented K: kept wherever a backward can run and will read it.
        backward_runs = any(ctx.needs_input_grad)

        def body():
            bases, loras = unflatten_tensors(layout, tensors)
            x_2d = x.reshape(-1, x.shape[-1])
            # Gate and up without their LoRA terms: the activation kernel adds them (see _down_forward).
            # Their GEMMs are launched first, then the LoRA shrink they do not need: where the host is
            # slower than the GPU, the block's largest GEMMs start before the host spends its time on
            # the shrink, instead of after.
            pre_activations = base_outputs(x_2d, bases[:-1], plan)
            xa_in, lora_a_t = shrink_stacking_lora_a(x_2d, loras[:-1])
            gate, up = _gate_and_up(pre_activations)
            gate_up_terms = _gate_up_lora_terms(xa_in, loras[:-1], gate)
            chunks = token_chunks(*gate.shape, gate.element_size(), settings.chunk_bytes)
            down_base = _dense_base(bases[-1], plan)
            augmented_dh = backward_runs and _dh_takes_augmented_k(bases[-1], loras[-1], plan, gate)
            keep_down_a_t = backward_runs and not augmented_dh
            out, ha_down, down_a_t = _down_forward(
                gate, up, activation, gate_up_terms, down_base, loras[-1], plan, chunks, keep_down_a_t
            )
            saved = (x, xa_in, ha_down, lora_a_t, down_a_t, *pre_activations)
            return out.view(*x.shape[:-1], out.shape[-1]), saved, chunks, augmented_dh

        # Replayed without its decisions where the same metadata was seen before (`call_traces`):
        # the chunks and the dh decision come back as the values the recorded body returned.
        inputs = (x, *tensors)
        key = (
            _FORWARD_TRACES.key((plan, activation, settings, layout, backward_runs), inputs)
            if settings.call_traces
            else None
        )
        (out, saved, chunks, augmented_dh), ctx.trace_entry = _FORWARD_TRACES.call(key, inputs, body)
        ctx.plan, ctx.activation, ctx.layout, ctx.chunks = plan, activation, layout, chunks
        ctx.augmented_dh = augmented_dh
        ctx.chunk_bytes = settings.chunk_bytes
        ctx.overwrite = settings.overwrite_saved_preactivations
        ctx.pre_activation_count = len(saved) - _SAVED_BEFORE_PRE_ACTIVATIONS
        ctx.save_for_backward(*saved, *tensors)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        try:
            saved_tensors = ctx.saved_tensors
        except RuntimeError as error:
            if ctx.overwrite and "inplace operation" in str(error):
                raise RuntimeError(
                    "fastlora_peft: a second backward through a fused gated MLP: its first backward "
                    "reused the saved gate/up buffers. Set GatedMlpSettings.overwrite_saved_preactivations "
                    "= False (fastlora_peft.functions.gated_mlp) before "
                    "the forward to keep them."
                ) from error
            raise
        needs_input_grad = ctx.needs_input_grad
        # Everything else the body reads of ctx follows from the forward's key (its entry, below).
        plan: DtypePlan = ctx.plan
        layout, activation, chunks, chunk_bytes = ctx.layout, ctx.activation, ctx.chunks, ctx.chunk_bytes
        overwrite, augmented_dh, count = ctx.overwrite, ctx.augmented_dh, ctx.pre_activation_count

        def body():
            x, xa_in, ha_down, lora_a_t, down_a_t, *saved = saved_tensors
            pre_activations, tensors = saved[:count], saved[count:]
            if not overwrite:
                pre_activations = [t.clone() for t in pre_activations]
            gate, up = _gate_and_up(pre_activations)
            bases, loras = unflatten_tensors(layout, tensors)
            needs_bases, needs_loras = unflatten_tensors(layout, needs_input_grad[_FIRST_TENSOR_ARG:])
            x_2d = x.reshape(-1, x.shape[-1])
            grad_2d = grad_out.reshape(x_2d.shape[0], grad_out.shape[-1])
            # Down projection: dA_down and dh (which becomes the gate/up gradients) are made chunk by
            # chunk, see `_down_backward_`. dB and the bias grad need no h: dB (xa_down against dY)
            # is made with gate's and up's weight gradients, one `lora_weight_grads` call whose
            # grouped launch takes it beside their dB.
            down_lora, need_down = loras[-1], needs_loras[-1]
            grad_ha, down_scale = hoisted_grad_xa([grad_2d], [down_lora])
            down_grad_bases = bias_grads(bases[-1:], needs_bases[-1:], [grad_2d])
            grad_a_down = _down_backward_(
                gate, up, activation, grad_2d, grad_ha, down_scale, bases[-1],
                down_lora, down_a_t, plan, need_down.lora_a, chunks, chunk_bytes, augmented_dh,
            )  # fmt: skip
            down_b = WeightGradProblem(ha_down, grad_2d, down_lora.scale, True, down_lora.lora_b.dtype)
            gate_up = shared_input_backward(
                x_2d, xa_in, bases[:-1], loras[:-1], plan, pre_activations, needs_input_grad[0],
                needs_loras[:-1], needs_bases[:-1], lora_a_t=lora_a_t,
                extra_weight_grads=[down_b] if need_down.lora_b else [],
            )  # fmt: skip
            grad_a_down = None if grad_a_down is None else grad_a_down.to(down_lora.lora_a.dtype)
            grad_b_down = gate_up.extra[0].t() if need_down.lora_b else None
            down_grad_lora = LoraWeights(grad_a_down, grad_b_down, down_lora.scale)
            grad_x = None if gate_up.grad_x is None else gate_up.grad_x.view(x.shape)
            grad_tree = (gate_up.bases + down_grad_bases, gate_up.loras + [down_grad_lora])
            return (grad_x, None, None, None, None, *values_in_tensor_slots(layout, grad_tree))

        forward = ctx.trace_entry
        parts = (forward, needs_input_grad, torch.is_grad_enabled())
        key = None if forward is None else _BACKWARD_TRACES.key(parts, (grad_out,))
        with autocast_off(saved_tensors[0].device.type):
            return _BACKWARD_TRACES.call(key, (*saved_tensors, grad_out), body)[0]


# x, xa_in, ha_down, lora_a_t, down_a_t: the saved tensors before the gate/up pre-activations.
_SAVED_BEFORE_PRE_ACTIVATIONS = 5
# The Function's bodies by call metadata, replayed without their decisions (`call_traces`).
_FORWARD_TRACES = call_traces("gated_mlp_forward")
_BACKWARD_TRACES = call_traces("gated_mlp_backward")
# The Function's C apply, called without `Function.apply`'s wrapper where it does nothing.
_APPLY = direct_apply(LoraGatedMlpFunction)


def fused_gated_mlp(
    x: torch.Tensor,
    bases: Sequence[FrozenBase],
    loras: Sequence[LoraWeights],
    plan: DtypePlan,
    activation: str,
) -> torch.Tensor:
    """Runs `LoraGatedMlpFunction` on (gate, up, down) or (gate_up, down), autocast off inside."""
    tensors, layout = flatten_tensors((tuple(bases), tuple(loras)))
    with autocast_off(x.device.type):
        settings = _MlpSettings(
            GatedMlpSettings.chunk_bytes, GatedMlpSettings.overwrite_saved_preactivations,
            GatedMlpSettings.call_traces,
        )  # fmt: skip
        return apply_function(LoraGatedMlpFunction, _APPLY, x, plan, activation, settings, layout, *tensors)
