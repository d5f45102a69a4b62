"""What one fused step dispatches: the ops that launch work, per Function, pinned.

Short steps are bound by host time, and every dispatched op costs some: a new cast, copy or cat in a
fused Function's forward or backward should be a decision, not a side effect. Each case counts, with
a dispatch mode, the ops one forward and one backward dispatch (a kernel op counts once: the mode
does not see inside it, so the counts are the same on any device), leaves out the ops that only make
views, and compares with the budget below.

The backward budgets also pin that autograd takes the adapter gradients over as they are: a gradient
the Function returns that is still referenced elsewhere, or laid out other than its parameter, is
copied (`new_empty_strided` + `copy_`) before it becomes `.grad`.
"""

from __future__ import annotations

import pytest
import torch
from conftest import FUNCTION_LAYOUTS, TRITON_INTERPRET, OpCounter

from fastlora_peft.dtypes import plan_projection_dtypes
from fastlora_peft.functions.frozen_base import FrozenBase, LoraWeights
from fastlora_peft.functions.gated_mlp import fused_gated_mlp
from fastlora_peft.functions.shared_input import fused_lora_projections

# Ops that make views or answer questions about dtypes: no kernel, no allocation.
_VIEW_OPS = frozenset(
    {
        "view",
        "t",
        "slice",
        "alias",
        "detach",
        "promote_types",
        "transpose",
        "_unsafe_view",
        "as_strided",
        "split_with_sizes",
    }
)

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
# Feature sizes are multiples of 64: bitsandbytes quantizes only those on the CPU.
HIDDEN, INTERMEDIATE, TOKENS, RANK = 64, 128, 10, 4

LAYOUTS = FUNCTION_LAYOUTS  # every layout the fused path takes (conftest)


def _projection(in_features: int, out_features: int, layout):
    dtype, adapter_dtype, quantized = layout
    weight = torch.randn(out_features, in_features, dtype=dtype)
    base = FrozenBase(weight, None, None)
    if quantized:
        import bitsandbytes.functional as bnb_functional

        from fastlora_peft.kernels.dequant4bit import Quant4bitState

        packed, state = bnb_functional.quantize_4bit(
            weight, blocksize=64, compress_statistics=True, quant_type="nf4"
        )
        base = FrozenBase(packed, None, Quant4bitState.from_bnb(state, packed))
    lora_a = torch.randn(RANK, in_features, dtype=adapter_dtype, requires_grad=True)
    lora_b = torch.randn(out_features, RANK, dtype=adapter_dtype, requires_grad=True)
    return base, LoraWeights(lora_a, lora_b, 0.5)


def _counted_step(run, layout, shapes):
    """(forward ops, backward ops) of one step of `run(x, bases, loras, plan)`; checks every
    parameter got its gradient, so a budget cannot pass by skipping work."""
    torch.manual_seed(0)
    dtype, adapter_dtype, quantized = layout
    pairs = [_projection(i, o, layout) for i, o in shapes]
    bases, loras = [p[0] for p in pairs], [p[1] for p in pairs]
    x = torch.randn(2, TOKENS // 2, HIDDEN, dtype=dtype, requires_grad=True)
    plan = plan_projection_dtypes(dtype, dtype, quantized=quantized, device_type="cpu")
    with OpCounter(_VIEW_OPS) as forward:
        outputs = run(x, bases, loras, plan)
    grads = [torch.randn_like(out) for out in outputs]
    with OpCounter(_VIEW_OPS) as backward:
        torch.autograd.backward(outputs, grads)
    for lora in loras:
        for param in (lora.lora_a, lora.lora_b):
            assert param.grad is not None and param.grad.dtype == adapter_dtype
            assert param.grad.is_contiguous()
    assert x.grad is not None
    return dict(forward.ops), dict(backward.ops)


def _o(x, bases, loras, plan):
    return fused_lora_projections(x, bases, loras, plan)


def _mlp(x, bases, loras, plan):
    return (fused_gated_mlp(x, bases, loras, plan, "silu"),)


_O_SHAPES = [(HIDDEN, HIDDEN)]
_QKV_SHAPES = [(HIDDEN, HIDDEN), (HIDDEN, HIDDEN // 2), (HIDDEN, HIDDEN // 2)]
_MLP_SHAPES = [(HIDDEN, INTERMEDIATE), (HIDDEN, INTERMEDIATE), (INTERMEDIATE, HIDDEN)]

SHRINK, EXPAND, WGRAD = "fastlora.lora_shrink", "fastlora.lora_expand_add_", "fastlora.lora_weight_grad"
WGRADS = "fastlora.lora_weight_grads"  # a Function's weight gradients in one op (grouped launches inside)
SHRINK_STACKED = "fastlora.lora_shrink_stacked"
# A group's forward shrink, read from each member's lora_A and writing the A^T side by side for
# backward's dX term (no cat of the As: `lora_shrink_stack`).
SHRINK_STACKING = "fastlora.lora_shrink_stacking_weights"
# One projection's forward shrink, writing A.T (rank dim contiguous) for backward's dX term, where
# the term's launcher would copy lora_a.T inside its op (`test_dx_terms_read_a_contiguous_a_t`).
SHRINK_KEEP = "fastlora.lora_shrink_keeping_weight_t"
GATED_FWD, GATED_BWD = "fastlora.gated_act_lora_forward_", "fastlora.gated_act_backward_weight_grad_"


def _with_casts(budget: dict[str, int], casts: int) -> dict[str, int]:
    """16-bit adapters add the casts of fp32-accumulated gradients the kernels do not round themselves
    (lora_weight_grad writes the adapters' dtype; the MLP's dA_down is summed over chunks in fp32)."""
    return {**budget, "_to_copy": casts} if casts else budget


CASES = {
    # forward: one pass over x for every A (A.T kept), the base matmul, the LoRA term added in place.
    # backward: dY @ B, dX (one matmul, the LoRA term in place), dA and dB (one op, one launch).
    "o": (_o, _O_SHAPES, {SHRINK_KEEP: 1, "mm": 1, EXPAND: 1}, {SHRINK: 1, "mm": 1, EXPAND: 1, WGRADS: 1}, 0),
    # forward: one shrink from every lora_A, writing the A^T side by side (kept for backward's dX
    # term); backward: dY_i @ B_i written side by side (one op, no cat), dX accumulated in one buffer,
    # dA of all three in one pass and the dB_i in one op (two launches: dA's rank is 3r).
    "qkv": (
        _o,
        _QKV_SHAPES,
        {SHRINK_STACKING: 1, "mm": 3, EXPAND: 3},
        {SHRINK_STACKED: 1, "mm": 1, "addmm_": 2, EXPAND: 1, WGRADS: 1},
        0,
    ),
    # gate/up as a group, their LoRA terms added by the gated activation's kernel; h made and
    # consumed inside the gated kernels; down as one projection (its A.T kept by its shrink, its dA
    # inside the gated backward, its dB made with gate's and up's weight gradients: one op for all).
    # The one clone: gate's and up's xa copied row-major for the activation kernel's term (the shrink
    # writes it token-major for backward's dB).
    "mlp": (
        _mlp,
        _MLP_SHAPES,
        {SHRINK_STACKING: 1, SHRINK_KEEP: 1, "mm": 3, EXPAND: 1, GATED_FWD: 1, "clone": 1},
        {SHRINK: 1, SHRINK_STACKED: 1, "mm": 2, "addmm_": 1, EXPAND: 2, WGRADS: 1, GATED_BWD: 1},
        1,
    ),
}


# 4-bit weights, dequantized once in the forward and once for dX: a group's weights that fit at once
# by one group op (q/k/v; gate/up here, where they are small), the others one by one.
PER_MEMBER_DEQUANTIZE_BUDGET = {
    "o": ({"fastlora.dequantize_4bit": 1}, {"fastlora.dequantize_4bit": 1}),
    "qkv": ({"fastlora.dequantize_4bit_group": 1}, {"fastlora.dequantize_4bit_group": 1}),
    "mlp": (
        {"fastlora.dequantize_4bit_group": 1, "fastlora.dequantize_4bit": 1},
        {"fastlora.dequantize_4bit_group": 1, "fastlora.dequantize_4bit": 1},
    ),
}


@pytest.mark.parametrize(
    "layout_id", ["fp32-adapters-on-bf16", "bf16", "nf4-fp32-adapters", "nf4-bf16-adapters"]
)
@pytest.mark.parametrize("case", list(CASES))
def test_fused_step_dispatches_its_budget(case, layout_id):
    run, shapes, forward_budget, backward_budget, casts = CASES[case]
    layout = LAYOUTS[layout_id]
    if layout[2]:
        forward_budget = {**forward_budget, **PER_MEMBER_DEQUANTIZE_BUDGET[case][0]}
        backward_budget = {**backward_budget, **PER_MEMBER_DEQUANTIZE_BUDGET[case][1]}
    if case == "mlp" and layout[1] == BF16 and TRITON_INTERPRET:
        # bf16 adapters: gate's and up's xa copied rounded to bf16 (`bf16_left_suffices`), one op too,
        # for the kernel; these CPU tensors reach it under the interpreter only (else the reference,
        # which reads the fp32 copy).
        forward_budget = {**{k: v for k, v in forward_budget.items() if k != "clone"}, "_to_copy": 1}
    forward_ops, backward_ops = _counted_step(run, layout, shapes)
    assert forward_ops == forward_budget
    assert backward_ops == _with_casts(backward_budget, casts if layout[1] == BF16 else 0)


@pytest.mark.parametrize("layout_id", list(LAYOUTS))
@pytest.mark.parametrize("case", list(CASES))
def test_autograd_takes_the_adapter_gradients_without_a_copy(case, layout_id):
    # A gradient that autograd must copy before it becomes `.grad` (still referenced, or laid out
    # other than its parameter) shows up as new_empty_strided + copy_ (or clone) in the backward.
    run, shapes, *_ = CASES[case]
    _, backward_ops = _counted_step(run, LAYOUTS[layout_id], shapes)
    copies = {op: n for op, n in backward_ops.items() if op in ("new_empty_strided", "copy_", "clone")}
    assert not copies, backward_ops


@pytest.mark.parametrize("layout_id", list(LAYOUTS))
def test_mlp_adds_gate_and_up_lora_terms_inside_the_activation_kernel(layout_id):
    # In every layout, not only the budgets' two: gate's and up's LoRA terms go through the gated
    # activation op; the one expand-add left in the forward is the down projection's.
    run, shapes, *_ = CASES["mlp"]
    forward_ops, _ = _counted_step(run, LAYOUTS[layout_id], shapes)
    assert forward_ops[GATED_FWD] == 1 and forward_ops[EXPAND] == 1, forward_ops
    assert "fastlora.gated_act_forward" not in forward_ops and "fastlora.lora_expand_add" not in forward_ops


@pytest.mark.parametrize("layout_id", list(LAYOUTS))
@pytest.mark.parametrize("case", list(CASES))
def test_weight_grads_get_token_major_left_operands(case, layout_id, monkeypatch):
    # The weight-grad launchers copy a left operand ([tokens, r] fp32: xa or dY @ B) that is not
    # token-major (stride(0) == 1) before their kernels read it; the copy is inside the op, where the
    # budgets above cannot see it. A group's dY_i @ B_i side by side used to come out row-major.
    from fastlora_peft.functions import shared_input

    lefts = []

    def spy(left, x, scale, k_major=False, out_dtype=None):
        lefts.append((tuple(left.shape), left.stride()))
        return weight_grad(left, x, scale, k_major, out_dtype)

    def spy_grouped(group_lefts, xs, scales, k_major, out_dtype=None):
        lefts.extend((tuple(left.shape), left.stride()) for left in group_lefts)
        return weight_grads(group_lefts, xs, scales, k_major, out_dtype)

    weight_grad, weight_grads = shared_input.lora_weight_grad, shared_input.lora_weight_grads
    monkeypatch.setattr(shared_input, "lora_weight_grad", spy)
    monkeypatch.setattr(shared_input, "lora_weight_grads", spy_grouped)
    run, shapes, *_ = CASES[case]
    _counted_step(run, LAYOUTS[layout_id], shapes)
    # o: dA, dB; q/k/v: dA of the three, three dB; MLP: gate/up's dA, their two dB, down's dB.
    assert len(lefts) == {"o": 2, "qkv": 4, "mlp": 4}[case], lefts
    assert all(stride[0] == 1 for _, stride in lefts), lefts


# Where the TMA kernels take a group's GEMMs (`LoraAddmmSettings`: "auto" on Hopper from 1024 rows;
# "always" here), q/k/v's forward is one pass over x (writing the A^T side by side) and one launch
# for all three GEMMs with their terms; dX is one GEMM over the three members with the term;
# o_proj's GEMMs carry their terms (lora_addmm). The MLP's gate/up dX sums only under "always" (its
# K of 14336 stays out under "auto", `lora_addmm_sum.SUM_MAX_MEMBER_K`).
ADDMM, ADDMM_SUM, ADDMM_GROUP = "fastlora.lora_addmm", "fastlora.lora_addmm_sum", "fastlora.lora_addmm_group"
TMA_CASES = {
    "o": ({SHRINK_KEEP: 1, ADDMM: 1}, {SHRINK: 1, ADDMM: 1, WGRADS: 1}),
    "qkv": ({SHRINK_STACKING: 1, ADDMM_GROUP: 1}, {SHRINK_STACKED: 1, ADDMM_SUM: 1, WGRADS: 1}),
}


# 4-bit weights: o_proj's one weight by the single op; q/k/v's three by one group op each way.
_DEQUANTIZE_BUDGET = {"o": {"fastlora.dequantize_4bit": 1}, "qkv": {"fastlora.dequantize_4bit_group": 1}}


@pytest.mark.parametrize("layout_id", ["fp32-adapters-on-bf16", "bf16", "nf4-fp32-adapters"])
@pytest.mark.parametrize("case", list(TMA_CASES))
def test_fused_step_with_the_tma_gemms_dispatches_its_budget(case, layout_id, monkeypatch):
    from fastlora_peft.kernels.lora_addmm import LoraAddmmSettings

    monkeypatch.setattr(LoraAddmmSettings, "mode", "always")
    run, shapes, *_ = CASES[case]
    forward_budget, backward_budget = TMA_CASES[case]
    forward_ops, backward_ops = _counted_step(run, LAYOUTS[layout_id], shapes)
    if LAYOUTS[layout_id][2]:  # 4-bit: the weights dequantized once in the forward and once in dX
        forward_budget = {**forward_budget, **_DEQUANTIZE_BUDGET[case]}
        backward_budget = {**backward_budget, **_DEQUANTIZE_BUDGET[case]}
    assert forward_ops == forward_budget
    assert backward_ops == backward_budget


@pytest.mark.parametrize("layout_id", list(LAYOUTS))
def test_mlp_forward_launches_the_gate_up_gemms_before_the_lora_shrink(layout_id):
    """Where the host is slower than the GPU, the block's largest GEMMs should start before the host
    spends its time on the shrink, which only the activation's kernel needs."""
    torch.manual_seed(0)
    layout = LAYOUTS[layout_id]
    dtype, adapter_dtype, quantized = layout
    pairs = [_projection(i, o, layout) for i, o in _MLP_SHAPES]
    x = torch.randn(TOKENS, HIDDEN, dtype=dtype)
    plan = plan_projection_dtypes(dtype, dtype, quantized=quantized, device_type="cpu")
    with OpCounter(_VIEW_OPS) as forward:
        _mlp(x, [p[0] for p in pairs], [p[1] for p in pairs], plan)
    order = forward.order
    gate_up_gemms = [index for index, name in enumerate(order) if name == "mm"][:2]
    assert len(gate_up_gemms) == 2, order
    assert max(gate_up_gemms) < order.index(SHRINK_STACKING), order


@pytest.mark.parametrize("mode", ["auto", "always"])
@pytest.mark.parametrize("layout_id", list(LAYOUTS))
@pytest.mark.parametrize("case, chunks", [("o", 1), ("mlp", 1), ("mlp", 2)])
def test_dx_terms_read_a_contiguous_a_t(case, chunks, layout_id, mode, monkeypatch):
    # dX's LoRA term reads A.T with the rank dim contiguous; lora_a.T is not, and the term's launcher
    # would copy it inside its op, where the budgets cannot see it. One projection's forward shrink
    # writes A.T for it (`lora_shrink_keeping_weight_t`); the MLP's down projection reads that one A.T
    # in every chunk of dh. Spied on: what every dX term (expand-add, lora_addmm or summed) gets.
    from fastlora_peft.functions import shared_input
    from fastlora_peft.functions.gated_mlp import GatedMlpSettings
    from fastlora_peft.kernels.lora_addmm import LoraAddmmSettings

    monkeypatch.setattr(LoraAddmmSettings, "mode", mode)
    # h: the MLP's TOKENS rows of INTERMEDIATE values of the layout's dtype, in `chunks` chunks.
    h_bytes = TOKENS * INTERMEDIATE * LAYOUTS[layout_id][0].itemsize
    monkeypatch.setattr(GatedMlpSettings, "chunk_bytes", h_bytes // chunks)
    rights = []

    def spy(loras, lora_a_t):
        right = right_operand(loras, lora_a_t)
        rights.append((len(loras), right))
        return right

    right_operand = shared_input._right_operand_of_dx_term
    monkeypatch.setattr(shared_input, "_right_operand_of_dx_term", spy)
    run, shapes, *_ = CASES[case]
    _counted_step(run, LAYOUTS[layout_id], shapes)
    # o: its dX. MLP: dh's term per chunk (down alone), then gate/up's dX (their A.T cat).
    assert [members for members, _ in rights] == {"o": [1], "mlp": [1] * chunks + [2]}[case]
    assert all(right.stride(1) == 1 for _, right in rights), [right.stride() for _, right in rights]
    if case == "mlp":
        assert len({right.data_ptr() for _, right in rights[:chunks]}) == 1, "a chunk of dh made its own A.T"
