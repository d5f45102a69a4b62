"""`lora_addmm_sum` (a group's dX in one GEMM: every member's K loop into one accumulator that starts
with the LoRA term) and the group dX path that takes it.

The kernel against float64 under the interpreter (1, 2 and 3 members, ragged tiles); the composite it
runs where TMA cannot read an operand; its reference and checks; the predicate; and, with
`LoraAddmmSettings.mode = "always"`, q/k/v and gate/up groups in every 16-bit layout against float64
with the launches and ops counted, and a tiny Llama against the same model without the sum.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import (
    FUNCTION_LAYOUTS,
    TRITON_INTERPRET,
    OpCounter,
    lora_grads,
    randomize_lora,
    rel_err,
    tiny_llama,
)
from peft import get_peft_model

from fastlora_peft import FastLoraConfig
from fastlora_peft.dtypes import plan_projection_dtypes
from fastlora_peft.functions import group_gemms
from fastlora_peft.functions.frozen_base import FrozenBase, LoraWeights, materialize_weight
from fastlora_peft.functions.shared_input import fused_lora_projections
from fastlora_peft.kernels import lora_addmm_reference as reference
from fastlora_peft.kernels.lora_addmm import LoraAddmmSettings
from fastlora_peft.kernels.lora_addmm_sum import (
    MAX_MEMBERS,
    SUM_MAX_MEMBER_K,
    lora_addmm_sum,
    lora_addmm_sum_may_take,
    lora_addmm_sum_op,
    lora_addmm_sum_pays_off,
    sum_fits_tma,
)

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
# One rounding of a 16-bit result against float64 (the interpreter truncates to bf16: ~3.4e-3).
TOLERANCE = {BF16: 1e-2, FP16: 1e-3}
SCALE = 0.37
needs_triton = pytest.mark.skipif(
    not (TRITON_INTERPRET or torch.cuda.is_available()), reason="Triton needs CUDA or TRITON_INTERPRET=1"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _operands(m, ks, n, r, dtype, right_dtype, right_layout="transposed", left_layout="token", seed=0):
    """a[i] [m, k_i] and b[i] [k_i, n] (row-major: a dX's weight) of `dtype`; left [m, r] fp32; right
    [n, r]. The LoRA term as large as the GEMMs', so a lost or mis-scaled term cannot hide."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    a = [randn(m, k).to(dtype) for k in ks]
    b = [(randn(k, n) / sum(ks) ** 0.5).to(dtype) for k in ks]
    left = randn(m, r) if left_layout == "row" else randn(r, m).T  # token-major: lora_shrink's layout
    right = (randn(n, r) if right_layout == "dense" else randn(r, n).T) / r**0.5
    move = lambda tensors: [t.to(DEVICE) for t in tensors]  # noqa: E731
    return move(a), move(b), left.to(DEVICE), right.to(DEVICE, right_dtype)


def _truth(a, b, left, right, scale=SCALE, members=None):
    members = len(a) if members is None else members
    total = scale * left.double() @ right.double().T
    for a_i, b_i in list(zip(a, b))[:members]:
        total = total + a_i.double() @ b_i.double()
    return total


KERNEL_CASES = [
    pytest.param(dtype, right_dtype, ks, layout, id="-".join([name, "k" + "_".join(map(str, ks)), layout]))
    for (name, dtype, right_dtype), ks, layout in itertools.product(
        [("bf16", BF16, BF16), ("bf16-fp32a", BF16, FP32), ("fp16", FP16, FP16), ("fp16-fp32a", FP16, FP32)],
        # ragged K tiles in every member (the interpreter's are 16 x 32 x 16), one member of a single tile
        [(40,), (24, 40), (72, 8, 24)],
        ["transposed", "dense"],
    )
]  # fmt: skip


@needs_triton
@pytest.mark.parametrize("dtype, right_dtype, ks, right_layout", KERNEL_CASES)
def test_kernel_matches_float64(dtype, right_dtype, ks, right_layout, triton_launches):
    # 37 rows and 40 columns: ragged row and column tiles; rank 20: two rank tiles of the term.
    a, b, left, right = _operands(37, ks, 40, 20, dtype, right_dtype, right_layout)
    assert sum_fits_tma(a, b)
    out = lora_addmm_sum(a, b, left, right, SCALE)
    assert triton_launches == {"_lora_addmm_sum_tma_kernel": 1}, triton_launches
    assert out.dtype == dtype and out.is_contiguous() and out.shape == (37, 40)
    assert rel_err(out, _truth(a, b, left, right).to(out.device)) <= TOLERANCE[dtype]
    # Each member and the term's scale count: without either the error is far larger.
    assert rel_err(out, _truth(a, b, left, right, scale=1.0).to(out.device)) > 10 * TOLERANCE[dtype]
    if len(ks) > 1:
        assert (
            rel_err(out, _truth(a, b, left, right, members=len(ks) - 1).to(out.device))
            > 10 * TOLERANCE[dtype]
        )


@needs_triton
def test_operands_tma_cannot_read_take_lora_addmm_and_addmm(triton_launches):
    """K = 19 (38-byte rows): `lora_addmm`'s pointer kernel for the first member, then `addmm_`."""
    a, b, left, right = _operands(37, (19, 24), 40, 5, BF16, FP32)
    assert not sum_fits_tma(a, b)
    out = lora_addmm_sum(a, b, left, right, SCALE)
    assert triton_launches == {"_lora_addmm_kernel": 1}, triton_launches
    # Rounded twice (once per GEMM call): twice the single rounding's bound.
    assert rel_err(out, _truth(a, b, left, right).to(out.device)) <= 2 * TOLERANCE[BF16]


def test_reference_matches_float64():
    a, b, left, right = _operands(9, (8, 16, 24), 12, 3, BF16, FP32)
    a, b = [t.cpu() for t in a], [t.cpu() for t in b]
    out = reference.lora_addmm_sum(a, b, left.cpu(), right.cpu(), SCALE)
    assert out.dtype == BF16
    assert rel_err(out, _truth(a, b, left.cpu(), right.cpu())) <= TOLERANCE[BF16]


def test_float64_runs_the_reference_for_gradcheck():
    a, b, left, right = _operands(5, (8, 4), 6, 2, torch.float64, torch.float64)
    a, b, left, right = [t.cpu() for t in a], [t.cpu() for t in b], left.cpu().double(), right.cpu()
    out = lora_addmm_sum(a, b, left, right, SCALE)
    assert out.dtype == torch.float64
    assert rel_err(out, _truth(a, b, left, right)) <= 1e-12


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(b=lambda b: [b[0][:-1], b[1]]), "shapes"),
        (dict(a=lambda a: [a[0], a[1].half()]), "16-bit"),
        (dict(b=lambda b: b[:1]), "one length"),
        (dict(left=lambda left: left.to(BF16)), "left must be float32"),
    ],
    ids=["k-mismatch", "mixed-dtypes", "lengths", "16bit-left"],
)
def test_checks_name_the_problem(bad, match):
    a, b, left, right = _operands(7, (8, 16), 8, 2, BF16, FP32)
    args = dict(a=[t.cpu() for t in a], b=[t.cpu() for t in b], left=left.cpu(), right=right.cpu())
    for name, change in bad.items():
        args[name] = change(args[name])
    with pytest.raises(ValueError, match=match):
        lora_addmm_sum(**args, scale=SCALE)


def test_opcheck():
    a, b, left, right = _operands(8, (16, 8), 8, 2, BF16, FP32)
    cpu = [[t.cpu() for t in a], [t.cpu() for t in b], left.cpu(), right.cpu(), SCALE]
    torch.library.opcheck(lora_addmm_sum_op, cpu)


def test_pays_off_only_where_lora_addmm_would(monkeypatch):
    """ "auto" never takes it off a Hopper GPU; "never" and `sum_members = False` nowhere; "always"
    wherever the dtypes allow and TMA reads every member, up to MAX_MEMBERS."""
    a = [torch.zeros(4096, 8, dtype=BF16)] * 2
    b = [torch.zeros(8, 16, dtype=BF16)] * 2
    assert LoraAddmmSettings.mode == "auto" and LoraAddmmSettings.sum_members
    assert not lora_addmm_sum_pays_off(a, b, BF16)  # CPU tensors
    monkeypatch.setattr(LoraAddmmSettings, "mode", "never")
    assert not lora_addmm_sum_pays_off(a, b, BF16)
    monkeypatch.setattr(LoraAddmmSettings, "mode", "always")
    assert lora_addmm_sum_pays_off(a, b, BF16)
    assert lora_addmm_sum_pays_off(a + a[:1], b + b[:1], BF16)  # MAX_MEMBERS == 3
    assert MAX_MEMBERS == 3 and not lora_addmm_sum_pays_off(a * 2, b * 2, BF16)
    assert not lora_addmm_sum_pays_off(a, b, FP32)  # dX wanted in fp32
    assert not lora_addmm_sum_pays_off(a, [b[0], b[1].half()], BF16)
    assert not lora_addmm_sum_pays_off(a, [b[0], torch.zeros(16, 8, dtype=BF16).T], BF16)  # K-major b
    monkeypatch.setattr(LoraAddmmSettings, "sum_members", False)
    assert not lora_addmm_sum_pays_off(a, b, BF16)


def test_auto_sums_members_of_moderate_k_on_hopper(monkeypatch):
    """ "auto": lora_addmm's device and rows rule, and no member's K past SUM_MAX_MEMBER_K (q/k/v's
    4096/1024/1024 summed; gate/up's 14336 not: measured slower there). "always" ignores the K rule."""
    from types import SimpleNamespace

    from fastlora_peft.kernels import lora_addmm as addmm_module

    monkeypatch.setattr(addmm_module, "_is_hopper", lambda device: device == "hopper")

    def grads(*ks, rows=LoraAddmmSettings.min_tokens, device="hopper"):
        return [SimpleNamespace(is_cuda=True, shape=(rows, k), device=device) for k in ks]

    assert SUM_MAX_MEMBER_K == 8192
    assert lora_addmm_sum_may_take(grads(4096, 1024, 1024), BF16, BF16)
    assert lora_addmm_sum_may_take(grads(8192, 8192), FP16, FP16)
    assert not lora_addmm_sum_may_take(grads(14336, 14336), BF16, BF16)
    assert not lora_addmm_sum_may_take(grads(1024, 8193), BF16, BF16)
    assert not lora_addmm_sum_may_take(grads(4096, 1024, 1024, 1024), BF16, BF16)  # past MAX_MEMBERS
    assert not lora_addmm_sum_may_take(grads(4096, 1024, rows=LoraAddmmSettings.min_tokens - 1), BF16, BF16)
    assert not lora_addmm_sum_may_take(grads(4096, 1024, device="ampere"), BF16, BF16)
    assert not lora_addmm_sum_may_take(grads(4096, 1024), FP32, FP32)
    assert not lora_addmm_sum_may_take(grads(4096, 1024), BF16, FP32)  # dX handed out wider
    monkeypatch.setattr(LoraAddmmSettings, "mode", "always")
    assert lora_addmm_sum_may_take(grads(14336, 14336, rows=1, device="ampere"), BF16, BF16)


# ---------------------------------------------------------------------------------------------------
# The fused group's dX. Feature sizes are multiples of 64: bitsandbytes quantizes only those on the CPU.
# ---------------------------------------------------------------------------------------------------
SIXTEEN_BIT_LAYOUTS = {name: layout for name, layout in FUNCTION_LAYOUTS.items() if layout[0] != FP32}
QKV_SHAPES = [(64, 128), (64, 64), (64, 64)]
GATE_UP_SHAPES = [(64, 192), (64, 192)]


def _group(shapes, layout, seed=0):
    dtype, adapter_dtype, quantized = layout
    generator = torch.Generator().manual_seed(seed)
    bases, loras = [], []
    for index, (in_features, out_features) in enumerate(shapes):
        weight = (torch.randn(out_features, in_features, generator=generator) / in_features**0.5).to(dtype)
        base = FrozenBase(weight, None, None)
        if quantized:
            import bitsandbytes.functional as bnb_functional

            from fastlora_peft.kernels.dequant4bit import Quant4bitState

            packed, state = bnb_functional.quantize_4bit(weight, blocksize=64, quant_type="nf4")
            base = FrozenBase(packed, None, Quant4bitState.from_bnb(state, packed))
        bases.append(base)
        rank = 4 + index  # unequal ranks: each member's term in its own columns
        lora_a = (torch.randn(rank, in_features, generator=generator) * 0.3).to(adapter_dtype)
        lora_b = (torch.randn(out_features, rank, generator=generator) * 0.3).to(adapter_dtype)
        loras.append(LoraWeights(lora_a.requires_grad_(), lora_b.requires_grad_(), 0.5 + index))
    return bases, loras


def _group_dx(shapes, layout):
    """(dX of one fused step, its float64 truth, the ops its backward dispatched)."""
    dtype, _, quantized = layout
    bases, loras = _group(shapes, layout)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, shapes[0][0], generator=generator).to(dtype).requires_grad_()
    grads = [torch.randn(3, 7, out, generator=generator).to(dtype) for _, out in shapes]
    plan = plan_projection_dtypes(dtype, dtype, quantized=quantized, device_type="cpu")
    outputs = fused_lora_projections(x, bases, loras, plan)
    with OpCounter(frozenset({"view", "t", "slice", "alias", "detach", "transpose", "_unsafe_view"})) as ops:
        torch.autograd.backward(outputs, grads)
    truth = torch.zeros(21, shapes[0][0], dtype=torch.float64)
    for base, lora, grad in zip(bases, loras, grads):
        weight = materialize_weight(base, FP32).double()
        delta = lora.scale * lora.lora_b.detach().double() @ lora.lora_a.detach().double()
        truth += grad.reshape(21, -1).double() @ (weight + delta)
    return x.grad.reshape(21, -1), truth, dict(ops.ops)


@pytest.mark.parametrize("layout_id", list(SIXTEEN_BIT_LAYOUTS))
@pytest.mark.parametrize("shapes", [QKV_SHAPES, GATE_UP_SHAPES], ids=["qkv", "gate_up"])
def test_group_dx_is_one_summed_gemm(layout_id, shapes, monkeypatch, triton_launches):
    """Every 16-bit layout (4-bit ones dequantize all members first): dX within one rounding of
    float64, from one `lora_addmm_sum` and no other GEMM; without the sum the same step runs
    lora_addmm and one `addmm_` per further member."""
    layout = SIXTEEN_BIT_LAYOUTS[layout_id]
    monkeypatch.setattr(LoraAddmmSettings, "mode", "always")
    grad_x, truth, ops = _group_dx(shapes, layout)
    assert ops.get("fastlora.lora_addmm_sum") == 1, ops
    assert not {"mm", "addmm_", "fastlora.lora_addmm", "fastlora.lora_expand_add_"} & set(ops), ops
    if TRITON_INTERPRET:
        assert triton_launches.get("_lora_addmm_sum_tma_kernel") == 1, triton_launches
    assert rel_err(grad_x, truth) <= TOLERANCE[layout[0]]
    monkeypatch.setattr(LoraAddmmSettings, "sum_members", False)
    grad_x_loop, _, ops = _group_dx(shapes, layout)
    assert "fastlora.lora_addmm_sum" not in ops and ops.get("addmm_") == len(shapes) - 1, ops
    # The loop rounds dX once per member; the sum once.
    assert rel_err(grad_x, truth) <= rel_err(grad_x_loop, truth) * 1.5 + 1e-6


def test_four_bit_members_past_the_byte_budget_keep_the_loop(monkeypatch):
    """Dequantized weights beyond `GROUP_FRESH_WEIGHT_BYTES` are not held at once: one at a time."""
    monkeypatch.setattr(LoraAddmmSettings, "mode", "always")
    monkeypatch.setattr(group_gemms, "GROUP_FRESH_WEIGHT_BYTES", 2 * 64 * 192 * 2 - 1)
    _, _, ops = _group_dx(GATE_UP_SHAPES, FUNCTION_LAYOUTS["nf4-bf16-adapters"])
    assert "fastlora.lora_addmm_sum" not in ops and ops.get("addmm_") == 1, ops
    _, _, ops = _group_dx(GATE_UP_SHAPES, FUNCTION_LAYOUTS["bf16"])  # stored weights: nothing made
    assert ops.get("fastlora.lora_addmm_sum") == 1, ops


@pytest.mark.parametrize("adapter_dtype", [None, FP32], ids=["same", "fp32adapters"])
def test_tiny_llama_groups_take_the_sum(adapter_dtype, monkeypatch):
    """A whole model under "always": q/k/v (rank 18) and gate/up (12) each take one sum per layer, and
    q/k/v's forward one lora_addmm_group; every gradient as without them (lora_addmm per GEMM and
    addmm_), within the 16-bit rounding."""
    model = tiny_llama(BF16)
    config = FastLoraConfig(r=6, lora_alpha=9, target_modules="all-linear")
    fast = get_peft_model(model, config, autocast_adapter_dtype=adapter_dtype == FP32)
    randomize_lora(fast, seed=5, std=0.1)
    generator = torch.Generator().manual_seed(6)
    embeds = torch.randn(2, 5, 48, generator=generator).to(BF16)
    loss_weight = torch.randn(2, 5, 61, generator=generator)
    monkeypatch.setattr(LoraAddmmSettings, "mode", "always")
    calls, group_calls = [], []

    def counted(where, record):  # the calls that launched (a GPU's later layers launch from plans)
        def call(*args):
            out = where(*args)
            if out is not None:
                record.append(args)
            return out

        return call

    wheres = {
        "lora_addmm_sum_where_it_pays_off": calls,
        "lora_addmm_group_of_weights_where_it_pays_off": group_calls,
    }
    for where_name, record in wheres.items():
        monkeypatch.setattr(group_gemms, where_name, counted(getattr(group_gemms, where_name), record))

    def step(grouped):  # q/k/v's forward in one launch too (lora_addmm_group), or neither
        monkeypatch.setattr(LoraAddmmSettings, "sum_members", grouped)
        monkeypatch.setattr(LoraAddmmSettings, "group_forward", grouped)
        fast.zero_grad(set_to_none=True)
        x = embeds.clone().requires_grad_()
        (fast(inputs_embeds=x).logits.float() * loss_weight).sum().backward()
        return x.grad, lora_grads(fast)

    grad_x, grads = step(True)
    layers = fast.config.num_hidden_layers
    assert sorted(left.shape[1] for _, _, left, _, _, _ in calls) == [12] * layers + [18] * layers
    # The forward: q/k/v only (gate/up's terms go through the gated activation's kernel).
    assert [[left.shape[1] for left in lefts] for _, _, lefts, _, _, _ in group_calls] == [[6, 6, 6]] * layers
    calls.clear()
    group_calls.clear()
    grad_x_loop, grads_loop = step(False)
    assert calls == [] and group_calls == []
    assert rel_err(grad_x, grad_x_loop) <= 3e-2
    for name, grad in grads.items():
        assert rel_err(grad, grads_loop[name]) <= 3e-2, name


# ---------------------------------------------------------------------------------------------------
# Its launch plan (the CPU stand-ins of test_launch_plans), and the real kernel from its plan on Hopper.
# ---------------------------------------------------------------------------------------------------
from test_launch_plans import _ENCODED_ADDRESSES, _planned_and_unplanned, recorded_launches  # noqa: E402, F401

from fastlora_peft.kernels import lora_addmm_sum as sum_module  # noqa: E402


@pytest.mark.parametrize(
    "ks, ranks", [((24, 40), 16), ((72, 8, 24), 16), ((72, 8, 24), 72)], ids=["two", "three", "left-copied"]
)
def test_plan_launches_what_the_launcher_would(recorded_launches, ks, ranks):  # noqa: F811
    """The plan passes the members' tensors where the kernel takes descriptors (a slot past the group
    repeats the last member), and launches what the launcher itself would; from 64 ranks on, with
    the token-major left copied row-major as the launcher copies it (`copies_left`)."""

    def make_inputs(seed):
        a, b, left, right = _operands(33, ks, 40, ranks, BF16, FP32, seed=seed)
        return dict(a=a, b=b, left=left, right=right, scale=2.0 + seed)

    _ENCODED_ADDRESSES.clear()
    launch = _planned_and_unplanned(recorded_launches, sum_module._lora_addmm_sum_tma_triton, make_inputs)
    assert 3.0 in [value for value in launch if type(value) is float]
    descriptors = [value[5] for value in launch if type(value) is tuple and value[0] == "tma"]
    members = [shape for k in ks for shape in ((33, k), (k, 40))]
    members += members[-2:] * (MAX_MEMBERS - len(ks))
    assert descriptors == [*members, (33, 40)]  # a_i and b_i of each slot, then the output
    scale_at = next(i for i, value in enumerate(launch) if type(value) is float and value == 3.0)
    # M, N, each slot's K (0 past the group: its loop is not compiled in), R, just before the scale.
    assert list(launch[scale_at - 6 : scale_at]) == [33, 40, *ks, *[0] * (MAX_MEMBERS - len(ks)), ranks]


def test_where_it_pays_off_launches_from_its_plan_without_the_fit_check(recorded_launches, monkeypatch):  # noqa: F811
    """`lora_addmm_sum_where_it_pays_off` is None wherever `lora_addmm_sum_pays_off` says no, and
    elsewhere launches; a call of the first one's metadata launches from its plan without asking
    `sum_fits_tma`, and a mode that rules the sum out still does so with a plan made."""
    from test_launch_plans import _THROUGH_CACHE, counted_fit_checks

    fit_checks = counted_fit_checks(monkeypatch, sum_module, "sum_fits_tma")
    where = sum_module.lora_addmm_sum_where_it_pays_off
    a, b, left, right = _operands(33, (24, 40), 40, 16, BF16, FP32)
    assert where(a, b, left, right, 2.0, BF16) is not None
    assert len(recorded_launches) == 1 and fit_checks
    fit_checks.clear()
    a2, b2, left2, right2 = _operands(33, (24, 40), 40, 16, BF16, FP32, seed=1)
    assert where(a2, b2, left2, right2, 3.0, BF16).shape == (33, 40)
    assert not fit_checks and len(recorded_launches) == 2 and len(_THROUGH_CACHE) == 1  # from the plan
    assert where(a, b, left, right, 2.0, FP32) is None  # dX wanted in fp32
    assert where(a, [b[0], b[1].t().contiguous().t()], left, right, 2.0, BF16) is None  # a K-major b
    monkeypatch.setattr(LoraAddmmSettings, "mode", "never")
    assert where(a2, b2, left2, right2, 3.0, BF16) is None
    assert len(recorded_launches) == 2


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs a Hopper GPU"
)
def test_plan_launches_directly_and_computes_the_reference(triton_launches, monkeypatch):
    """On Hopper: the kernel launches through its C launch with our seven descriptor encoders, from its
    plan from the second call on, and each call computes the reference (new values, same addresses)."""
    monkeypatch.setattr(sum_module._SUM_PLANS, "plans", {})
    generator = torch.Generator(device="cuda").manual_seed(0)
    a, b, left, right = _operands(1000, (512, 128, 128), 384, 48, BF16, FP32)
    for call in range(3):
        for tensor in (*a, *b, left, right):
            tensor.copy_(torch.randn(tensor.shape, generator=generator, device="cuda") * 0.1)
        out = lora_addmm_sum(a, b, left, right, 0.5 + call)
        expected = _truth(a, b, left, right, scale=0.5 + call)
        assert rel_err(out, expected) < 5e-3, call  # one bf16 rounding of an fp32 sum
    assert triton_launches["_lora_addmm_sum_tma_kernel"] == 3
    plan = sum_module._SUM_PLANS.get(sum_module._sum_plan_key(a, b, left, right))
    assert plan is not None and plan.launch.direct is not None
    assert len(plan.launch.direct.encoders) == 7 and all(
        encoder.encoded for encoder in plan.launch.direct.encoders
    )
