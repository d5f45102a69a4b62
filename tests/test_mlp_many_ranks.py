"""The gated MLP past `FUSED_WEIGHT_GRAD_MAX_RANK` ranks of down's adapter: its backward takes
`gated_act_backward_keeping_hidden_` (h into dh's buffer) and `lora_weight_grad` per chunk instead of
the fused `gated_act_backward_weight_grad_`; and, at every rank, the activation's forward reads gate's
and up's xa row-major (the shrink's token-major xa made so once per forward).

Output and every gradient against float64 autograd on the same rounded inputs, in each dtype layout
(fp32, bf16, fp16, fp32 adapters on bf16/fp16, NF4 with bf16 or fp32 adapters), through 3 chunks;
pins that the path taken is the one the rank asks for; a float64 gradcheck on that path. Tiny odd
shapes: under TRITON_INTERPRET=1 the kernels run in the interpreter.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import TRITON_INTERPRET, assert_rel_close, observed_launches
from test_mlp_chunks import (
    MLP_LAYOUTS,
    bytes_for_chunks,
    gradcheck_mlp,
    nf4_base,
    random_mlp,
    trainable_tensors,
)

from fastlora_peft.dtypes import DtypePlan
from fastlora_peft.functions import gated_mlp
from fastlora_peft.functions.frozen_base import FrozenBase, LoraWeights, materialize_weight
from fastlora_peft.functions.gated_mlp import GatedMlpSettings, fused_gated_mlp
from fastlora_peft.kernels import _launch, gated_act_lora
from fastlora_peft.kernels import lora_weight_grad as lora_weight_grad_module
from fastlora_peft.kernels.dots import FP32_DOT, ROUNDED_DOT, SPLIT_DOT
from fastlora_peft.kernels.gated_act_lora import FUSED_WEIGHT_GRAD_MAX_RANK

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
TOKENS = 37
MANY_RANKS = FUSED_WEIGHT_GRAD_MAX_RANK + 7  # odd, and past a 16-rank tile
# id: (x dtype, base weight dtype, adapter dtype, NF4 base?, plan, tolerance against float64). The
# tolerances hold the 16-bit roundings of gate, up, h and the output; largest relative errors of any
# tensor measured here: 2.6e-7 (fp32), 1.3e-2 (bf16, NF4), 5.3e-4 (fp16). A dropped down scale (1.25)
# is off by 0.2.
LAYOUTS = {
    "fp32": (F32, F32, F32, False, DtypePlan(F32, F32), 2e-6),
    "bf16": (BF16, BF16, BF16, False, DtypePlan(BF16, BF16), 3e-2),
    "fp16": (F16, F16, F16, False, DtypePlan(F16, F16), 2e-3),
    "bf16-fp32adapters": (BF16, BF16, F32, False, DtypePlan(BF16, BF16), 3e-2),
    "fp16-fp32adapters": (F16, F16, F32, False, DtypePlan(F16, F16), 2e-3),
    "nf4-bf16adapters": (BF16, BF16, BF16, True, DtypePlan(BF16, BF16), 3e-2),
    "nf4-fp32adapters": (BF16, BF16, F32, True, DtypePlan(BF16, BF16), 3e-2),
}
# bitsandbytes quantizes on the CPU only feature sizes that are multiples of 64.
NF4_SIZES = dict(hidden=64, intermediate=128)
SIZES = dict(hidden=24, intermediate=40)


DEVICES = (
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
    ),
)


def mlp_in_layout(
    layout_id: str, mlp_layout: str, down_rank: int, device: str = "cpu", gate_up_rank: int | None = None
):
    """(x, bases, loras, plan) on `device` (a 4-bit layout on the CPU only: bitsandbytes quantizes
    there); gate_up_rank: see `random_mlp`."""
    x_dtype, base_dtype, adapter_dtype, quantized, plan, _ = LAYOUTS[layout_id]
    sizes = NF4_SIZES if quantized else SIZES
    x, bases, loras = random_mlp(
        mlp_layout, F32, tokens=TOKENS, down_rank=down_rank, gate_up_rank=gate_up_rank, **sizes
    )

    def leaf(tensor, dtype):
        return tensor.detach().to(device, dtype).requires_grad_()

    x = leaf(x, x_dtype)
    bases = [
        FrozenBase(
            base.weight.detach().to(device, base_dtype),
            None if base.bias is None else leaf(base.bias, base_dtype),
            None,
        )
        for base in bases
    ]
    if quantized:
        bases = [nf4_base(base) for base in bases]
    loras = [
        LoraWeights(leaf(lora.lora_a, adapter_dtype), leaf(lora.lora_b, adapter_dtype), lora.scale)
        for lora in loras
    ]
    return x, bases, loras, plan


def float64_mlp(x, bases, loras, activation: str, plan: DtypePlan) -> torch.Tensor:
    """The MLP in float64 autograd on the same values (a 4-bit weight as our dequantize gives it)."""

    def linear(inputs, base, lora):
        weight = materialize_weight(base, plan.compute_dtype).double()
        out = inputs @ weight.T + (lora.lora_a.double() @ inputs.T).T @ lora.lora_b.double().T * lora.scale
        return out if base.bias is None else out + base.bias.double()

    x64 = x.double()
    if len(bases) == 3:
        gate, up = linear(x64, bases[0], loras[0]), linear(x64, bases[1], loras[1])
    else:
        gate, up = linear(x64, bases[0], loras[0]).chunk(2, dim=1)
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    return linear(act * up, bases[-1], loras[-1])


def float64_out_and_grads(x, bases, loras, tensors, grad_out, plan: DtypePlan):
    """The float64 MLP's output and the gradients of `tensors` (the trainable ones `run` returned), on
    the same values."""
    tensors64 = [t.detach().double().requires_grad_() for t in tensors]
    swap = dict(zip(map(id, tensors), tensors64))

    def in64(t):
        return None if t is None else swap.get(id(t), t)

    bases64 = [FrozenBase(b.weight, in64(b.bias), b.quant) for b in bases]
    loras64 = [LoraWeights(in64(lora.lora_a), in64(lora.lora_b), lora.scale) for lora in loras]
    out64 = float64_mlp(in64(x), bases64, loras64, "silu", plan)
    return out64, torch.autograd.grad(out64, tensors64, grad_out.double())


@pytest.fixture
def mlp_calls(monkeypatch) -> dict[str, list[tuple]]:
    """The arguments of every call the gated MLP makes to its activation ops, by name."""
    names = (
        "gated_act_lora_forward_",
        "gated_act_backward_weight_grad_",
        "gated_act_backward_keeping_hidden_",
        "lora_weight_grad",
    )
    calls: dict[str, list[tuple]] = {name: [] for name in names}
    for name in names:
        original = getattr(gated_mlp, name)

        def recording(*args, _name=name, _original=original, **kwargs):
            calls[_name].append(args)
            return _original(*args, **kwargs)

        monkeypatch.setattr(gated_mlp, name, recording)
    return calls


def run(monkeypatch, x, bases, loras, plan, activation, chunks: int):
    intermediate = loras[-1].lora_a.shape[1]  # down's in-features (a 4-bit weight is packed)
    monkeypatch.setattr(
        GatedMlpSettings, "chunk_bytes", bytes_for_chunks(chunks, plan.out_dtype, TOKENS, intermediate)
    )
    out = fused_gated_mlp(x, bases, loras, plan, activation)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.device, out.dtype)
    tensors = trainable_tensors(x, bases, loras)
    return out.detach(), torch.autograd.grad(out, tensors, grad_out), grad_out, tensors


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mlp_layout", MLP_LAYOUTS)
@pytest.mark.parametrize("layout_id", list(LAYOUTS))
def test_many_ranks_match_float64_through_the_two_launch_path(
    monkeypatch, mlp_calls, layout_id, mlp_layout, device
):
    if device == "cuda" and LAYOUTS[layout_id][3]:
        pytest.skip("a 4-bit base is quantized on the CPU here (test_gpu.py runs NF4 on CUDA)")
    x, bases, loras, plan = mlp_in_layout(layout_id, mlp_layout, MANY_RANKS, device)
    out, grads, grad_out, tensors = run(monkeypatch, x, bases, loras, plan, "silu", chunks=3)

    # The path: three chunks, each through the two launches; the fused kernel never ran.
    assert [args[1].shape[0] for args in mlp_calls["gated_act_backward_keeping_hidden_"]] == [12, 12, 13]
    assert mlp_calls["gated_act_backward_weight_grad_"] == []
    down_lefts = [args[0] for args in mlp_calls["lora_weight_grad"]]
    assert [left.shape for left in down_lefts] == [(rows, MANY_RANKS) for rows in (12, 12, 13)]
    # The forward's activation read row-major lefts (rank dim contiguous) in every chunk.
    forward_lefts = [(args[3], args[6]) for args in mlp_calls["gated_act_lora_forward_"]]
    assert len(forward_lefts) == 3 and all(left.stride(1) == 1 for pair in forward_lefts for left in pair)

    # Against float64: the output and every gradient, dA_down (fed by h in dh's buffer) included.
    out64, grads64 = float64_out_and_grads(x, bases, loras, tensors, grad_out, plan)
    tol = LAYOUTS[layout_id][-1]
    assert_rel_close(out, out64, tol, "out")
    names = ["x"] + [f"{p}.lora_{ab}" for p in range(len(loras)) for ab in "ab"] + ["biases"] * 2
    for name, grad, grad64, tensor in zip(names, grads, grads64, tensors, strict=True):
        assert grad.dtype == tensor.dtype, f"{name}: gradient dtype {grad.dtype} != {tensor.dtype}"
        assert grad64.abs().max() > 0, f"{name}: a zero gradient tests nothing"
        assert_rel_close(grad, grad64, tol, name)


@pytest.mark.parametrize("down_rank", [FUSED_WEIGHT_GRAD_MAX_RANK, FUSED_WEIGHT_GRAD_MAX_RANK + 1])
def test_the_rank_of_down_picks_the_backward_path(monkeypatch, mlp_calls, down_rank):
    x, bases, loras, plan = mlp_in_layout("bf16-fp32adapters", "gate-up-down", down_rank)
    run(monkeypatch, x, bases, loras, plan, "silu", chunks=2)
    fused = len(mlp_calls["gated_act_backward_weight_grad_"])
    two_launches = len(mlp_calls["gated_act_backward_keeping_hidden_"])
    assert (fused, two_launches) == ((2, 0) if down_rank <= FUSED_WEIGHT_GRAD_MAX_RANK else (0, 2))
    assert len(mlp_calls["lora_weight_grad"]) == two_launches


def test_many_ranks_without_down_lora_a_grad_keep_no_h(monkeypatch, mlp_calls):
    x, bases, loras, plan = mlp_in_layout("fp32", "gate-up-down", MANY_RANKS)
    loras[-1] = loras[-1]._replace(lora_a=loras[-1].lora_a.detach())  # dA_down is h's only reader
    run(monkeypatch, x, bases, loras, plan, "silu", chunks=2)
    assert mlp_calls["gated_act_backward_keeping_hidden_"] == []
    assert mlp_calls["gated_act_backward_weight_grad_"] == [] and mlp_calls["lora_weight_grad"] == []


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_many_ranks_gradcheck(monkeypatch, mlp_calls, activation):
    # gradcheck runs backward many times through one graph: keep the saved gate/up intact.
    monkeypatch.setattr(GatedMlpSettings, "overwrite_saved_preactivations", False)
    tokens, intermediate = 7, 9
    chunk_bytes = bytes_for_chunks(2, torch.float64, tokens, intermediate)
    monkeypatch.setattr(GatedMlpSettings, "chunk_bytes", chunk_bytes)
    x, bases, loras = random_mlp(
        "gate-up-down", torch.float64, tokens=tokens, seed=3, hidden=6, intermediate=intermediate,
        down_rank=MANY_RANKS,
    )  # fmt: skip
    assert gradcheck_mlp(x, bases, loras, activation)
    assert len(mlp_calls["gated_act_backward_keeping_hidden_"]) >= 2, "gradcheck ran the two-launch path"


@pytest.mark.parametrize("layout_id", ["nf4-fp32adapters", "nf4-bf16adapters"])
def test_many_ranks_behind_the_augmented_dh(monkeypatch, mlp_calls, layout_id):
    # A 4-bit down's dh may take its LoRA term inside its GEMM's K (`augmented_k`; the rule is forced
    # here): that dh, too, has gate's dtype and a unit column stride, and becomes h's buffer.
    augmented_dh = []
    real_augmented_grad_x = gated_mlp.augmented_grad_x

    def spy(*args):
        augmented_dh.append(real_augmented_grad_x(*args))
        return augmented_dh[-1]

    monkeypatch.setattr(gated_mlp, "augmented_member", lambda *args: 0)
    monkeypatch.setattr(gated_mlp, "augmented_grad_x", spy)
    x, bases, loras, plan = mlp_in_layout(layout_id, "gate-up-down", MANY_RANKS)
    out, grads, grad_out, tensors = run(monkeypatch, x, bases, loras, plan, "silu", chunks=1)
    # The augmented path chunks dh's rows again (dh and its left operand share the chunk budget).
    kept = [args[0] for args in mlp_calls["gated_act_backward_keeping_hidden_"]]
    assert augmented_dh and len(kept) == len(augmented_dh)
    assert all(h is dh for h, dh in zip(kept, augmented_dh))
    read = [args[1] for args in mlp_calls["lora_weight_grad"]]
    assert all(h is dh for h, dh in zip(read, augmented_dh, strict=True)), "dA_down reads dh's buffer"
    _, grads64 = float64_out_and_grads(x, bases, loras, tensors, grad_out, plan)
    for grad, grad64 in zip(grads, grads64, strict=True):
        assert_rel_close(grad, grad64, LAYOUTS[layout_id][-1], "a gradient")


# What dA_down's dot multiplies, by layout (every layout of LAYOUTS): a bf16 h against the fp32
# dY @ Bd takes the split dot, or dY @ Bd rounded to bf16 where the adapter is bf16 (the chunks' fp32
# sum is rounded once to it in the end); an fp16 or fp32 h takes the fp32 dot either way.
DOWN_DOT_MODES = {
    "fp32": FP32_DOT,
    "bf16": ROUNDED_DOT,
    "nf4-bf16adapters": ROUNDED_DOT,
    "bf16-fp32adapters": SPLIT_DOT,
    "nf4-fp32adapters": SPLIT_DOT,
    "fp16": FP32_DOT,
    "fp16-fp32adapters": FP32_DOT,
}


@pytest.mark.skipif(not TRITON_INTERPRET, reason="the kernels' launches run under TRITON_INTERPRET=1")
@pytest.mark.parametrize("down_rank", [FUSED_WEIGHT_GRAD_MAX_RANK - 3, MANY_RANKS])
@pytest.mark.parametrize("layout_id", list(LAYOUTS))  # a layout missing from DOWN_DOT_MODES fails
def test_dA_down_dot_follows_the_adapter_dtype(monkeypatch, layout_id, down_rank):
    """Both backward paths (the fused kernel to 16 ranks, `lora_weight_grad` past them) multiply
    dA_down's operands as its final dtype needs (`dots.weight_grad_dot_mode`): each chunk's launch,
    and only those, seen inside the call that makes its share."""
    monkeypatch.setattr(_launch.LaunchPlans, "enabled", False)  # a planned launch is not observed
    inside, modes = [], []
    for name in ("gated_act_backward_weight_grad_", "lora_weight_grad"):
        original = getattr(gated_mlp, name)

        def flagged(*args, _original=original, **kwargs):
            inside.append(True)
            try:
                return _original(*args, **kwargs)
            finally:
                inside.pop()

        monkeypatch.setattr(gated_mlp, name, flagged)
    kernels = (
        gated_act_lora._gated_act_backward_weight_grad_kernel,
        lora_weight_grad_module._lora_weight_grad_kernel,
    )
    x, bases, loras, plan = mlp_in_layout(layout_id, "gate-up-down", down_rank)
    with observed_launches(kernels, lambda grid, args, meta: inside and modes.append(meta["DOT_MODE"])):
        _, grads, _, tensors = run(monkeypatch, x, bases, loras, plan, "silu", chunks=3)
    assert modes == [DOWN_DOT_MODES[layout_id]] * 3
    grad_a_down = grads[[id(t) for t in tensors].index(id(loras[-1].lora_a))]
    assert grad_a_down.dtype == LAYOUTS[layout_id][2]


@pytest.mark.parametrize("layout_id", ["bf16-fp32adapters", "fp16-fp32adapters", "nf4-fp32adapters"])
def test_many_ranks_keep_fp32_dA_down_to_fp32_accuracy(monkeypatch, layout_id):
    # The whole-MLP comparison above cannot see dA_down rounded to 16 bits (its 16-bit activations
    # swamp that); against float64 on the path's own operands (each chunk's dY @ B_down and the h it
    # left in dh's buffer, exact 16-bit values) an fp32 dA_down is good to ~1e-7: measured 6.0-6.6e-8
    # here, and 3.3e-3 with lora_weight_grad's result rounded to bf16.
    shares = []
    real_weight_grad = gated_mlp.lora_weight_grad

    def recording(left, hidden, scale, **kwargs):
        shares.append(scale * left.double().T @ hidden.double())
        return real_weight_grad(left, hidden, scale, **kwargs)

    monkeypatch.setattr(gated_mlp, "lora_weight_grad", recording)
    x, bases, loras, plan = mlp_in_layout(layout_id, "gate-up-down", MANY_RANKS)
    _, grads, _, tensors = run(monkeypatch, x, bases, loras, plan, "silu", chunks=3)
    assert len(shares) == 3
    grad_a_down = grads[[id(t) for t in tensors].index(id(loras[-1].lora_a))]
    assert grad_a_down.dtype == F32
    assert_rel_close(grad_a_down, sum(shares), 1e-5, "dA_down")


# The activation's forward reads gate's and up's xa as a bf16 copy where its term rounds xa to bf16
# in registers anyway (bf16 adapters at every rank, `bf16_left_suffices`), else as an fp32 copy.
BF16_LEFT_CASES = [
    ("bf16", "gate-up-down", 67, True),
    ("bf16", "gate_up-down", 64, True),  # the first rank that takes the bf16 term
    ("bf16", "gate-up-down", 63, True),  # below 64 ranks too (fifty-fifth session)
    ("bf16", "gate_up-down", 16, True),
    ("bf16-fp32adapters", "gate-up-down", 67, False),  # fp32 adapters' terms stay tf32
    ("nf4-bf16adapters", "gate-up-down", 67, True),
    # Every other layout keeps the fp32 xa past 64 ranks too: its term is not the bf16 dot.
    ("fp32", "gate-up-down", 67, False),
    ("fp16", "gate_up-down", 67, False),
    ("fp16-fp32adapters", "gate-up-down", 67, False),
    ("nf4-fp32adapters", "gate-up-down", 67, False),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "layout_id, mlp_layout, gate_up_rank, bf16_left", BF16_LEFT_CASES, ids=lambda v: str(v)
)
def test_activation_reads_xa_in_the_dtype_its_term_rounds_to(
    monkeypatch, mlp_calls, layout_id, mlp_layout, gate_up_rank, bf16_left, device
):
    if device == "cuda" and LAYOUTS[layout_id][3]:
        pytest.skip("a 4-bit base is quantized on the CPU here (test_gpu.py runs NF4 on CUDA)")
    x, bases, loras, plan = mlp_in_layout(layout_id, mlp_layout, 5, device, gate_up_rank=gate_up_rank)
    out, grads, grad_out, tensors = run(monkeypatch, x, bases, loras, plan, "silu", chunks=2)
    # Only the kernel takes the copy rounded to bf16; the reference (plain CPU) reads the fp32 xa.
    wanted = torch.bfloat16 if bf16_left and (TRITON_INTERPRET or device == "cuda") else F32
    lefts = [(args[3], args[6]) for args in mlp_calls["gated_act_lora_forward_"]]
    assert len(lefts) == 2 and {left.dtype for pair in lefts for left in pair} == {wanted}
    assert all(left.stride(1) == 1 for pair in lefts for left in pair)  # row-major, as before

    # The same numbers as the fp32 xa gives, bit for bit: the term rounded it to bf16 in registers.
    monkeypatch.setattr(gated_mlp, "bf16_left_suffices", lambda *args: False)
    x2 = x.detach().requires_grad_()
    out_fp32_left, grads_fp32_left, _, _ = run(monkeypatch, x2, bases, loras, plan, "silu", chunks=2)
    assert {args[3].dtype for args in mlp_calls["gated_act_lora_forward_"][2:]} == {F32}
    assert torch.equal(out, out_fp32_left)
    for grad, grad_fp32_left in zip(grads, grads_fp32_left, strict=True):
        assert torch.equal(grad, grad_fp32_left)

    # And against float64, gate's and up's LoRA terms past 64 ranks included.
    out64, grads64 = float64_out_and_grads(x, bases, loras, tensors, grad_out, plan)
    tol = LAYOUTS[layout_id][-1]
    assert_rel_close(out, out64, tol, "out")
    for grad, grad64 in zip(grads, grads64, strict=True):
        assert grad64.abs().max() > 0
        assert_rel_close(grad, grad64, tol, "gradient")
