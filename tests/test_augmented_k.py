"""dX's LoRA term inside one base GEMM's K dimension (`functions/augmented_k.py`, `kernels/lora_augment.py`).

The kernel against its definition; the rule at Llama-3.1-8B shapes; and, for a q/k/v group and a
gated MLP on 4-bit bases (and a dense q/k/v group with enough tokens), pins that the augmented GEMM
made dX (its left operand built once, no expand-add in backward) with gradients as close to float64
as the expand-add path's, which a dropped scale, a missing term or a wrong member breaks.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import FUNCTION_LAYOUTS, TRITON_INTERPRET, OpCounter, rel_err

from fastlora_peft.dtypes import DtypePlan
from fastlora_peft.functions import augmented_k, gated_mlp, shared_input
from fastlora_peft.functions.frozen_base import FrozenBase, LoraWeights, materialize_weight
from fastlora_peft.functions.gated_mlp import GatedMlpSettings, fused_gated_mlp
from fastlora_peft.functions.shared_input import fused_lora_projections
from fastlora_peft.kernels.lora_augment import lora_augmented_left

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
AUGMENTED_OP, EXPAND_OP = "fastlora.lora_augmented_left", "fastlora.lora_expand_add_"


@pytest.fixture(autouse=True)
def tiny_shapes_pay_no_host_cost(request, monkeypatch):
    """The rule asks the augmented path to save more than its extra host time, which these tests'
    tiny shapes never do: without that term the rule takes it where its bytes say, and the tests
    that pin where it is NOT taken (fp16, forced lora_addmm) pin the other reasons."""
    if request.node.get_closest_marker("real_host_cost") is None:
        monkeypatch.setattr(augmented_k, "_HOST_COST_ELEMENTS", 0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
def test_augmented_left_is_grad_then_scaled_grad_xa_then_zeros(dtype, device, triton_launches):
    generator = torch.Generator().manual_seed(0)
    grad = torch.randn(37, 50, generator=generator).to(device, dtype)[:, 3:43]  # a column slice
    grad_xa = torch.randn(9, 37, generator=generator).to(device).T  # token-major fp32, as the shrink's
    out = lora_augmented_left(grad, grad_xa, 1.7, 56)
    if TRITON_INTERPRET or device == "cuda":
        assert triton_launches.get("_lora_augmented_left_kernel") == 1, triton_launches
    assert out.shape == (37, 56) and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out[:, :40], grad)
    # Rounded once from fp32 (the interpreter truncates to bf16 where torch rounds to nearest).
    expected = 1.7 * grad_xa
    assert rel_err(out[:, 40:49].float(), expected) < 2 * torch.finfo(dtype).eps
    assert torch.equal(out[:, 49:], torch.zeros_like(out[:, 49:]))


def _meta_base(out_features, in_features, dtype=BF16, quantized=False) -> FrozenBase:
    if quantized:
        quant = SimpleNamespace(shape=torch.Size((out_features, in_features)), dtype=dtype)
        return FrozenBase(torch.empty(0, dtype=torch.uint8, device="meta"), None, quant)
    return FrozenBase(torch.empty(out_features, in_features, dtype=dtype, device="meta"), None, None)


def _meta_lora(out_features, in_features, rank=16, dtype=FP32) -> LoraWeights:
    a = torch.empty(rank, in_features, dtype=dtype, device="meta")
    return LoraWeights(a, torch.empty(out_features, rank, dtype=dtype, device="meta"), 2.0)


@pytest.mark.real_host_cost
def test_rule_at_llama_shapes(monkeypatch):
    cuda, bf16_plan = torch.device("cuda"), DtypePlan(BF16, BF16)
    assert augmented_k.padded_width(4096, 16, cuda) == 4160
    assert augmented_k.padded_width(1024, 48, cuda) == 1088
    for quantized in (False, True):
        qkv = [_meta_base(n, 4096, quantized=quantized) for n in (4096, 1024, 1024)]
        qkv_loras = [_meta_lora(n, 4096) for n in (4096, 1024, 1024)]
        # k, the first of the two narrowest, once the saving beats the extra host time (about 5k tokens).
        for tokens, expected in ((2048, None), (4096, None), (6144, 1), (8192, 1)):
            assert augmented_k.augmented_member(qkv, qkv_loras, bf16_plan, tokens, cuda, BF16) == expected
        o = ([_meta_base(4096, 4096, quantized=quantized)], [_meta_lora(4096, 4096)])
        # o_proj: rank 16's expand-add is cheap; a 4-bit weight pays from about 21k tokens, a dense
        # one (copied) from about 29k.
        for tokens, expected in ((8192, None), (24576, 0 if quantized else None), (32768, 0)):
            assert augmented_k.augmented_member(*o, bf16_plan, tokens, cuda, BF16) == expected
        gate_up = [_meta_base(14336, 4096, quantized=quantized) for _ in range(2)]
        gate_up_loras = [_meta_lora(14336, 4096) for _ in range(2)]
        assert augmented_k.augmented_member(gate_up, gate_up_loras, bf16_plan, 8192, cuda, BF16) is None
        assert augmented_k.augmented_member(qkv, qkv_loras, DtypePlan(FP16, FP16), 8192, cuda, FP16) is None
    # dh: a 4-bit down weight is written anyway; a 2048-row chunk (the MLP's one-chunk case at
    # 2048 tokens) saves less than the host time, 4096 rows more.
    down_lora = [_meta_lora(4096, 14336)]
    nf4_down = [_meta_base(4096, 14336, quantized=True)]
    assert augmented_k.augmented_member(nf4_down, down_lora, bf16_plan, 2048, cuda, BF16) is None
    assert augmented_k.augmented_member(nf4_down, down_lora, bf16_plan, 4096, cuda, BF16) == 0
    # fp32 activations on a bf16 base: dX is fp32, the expand-add keeps the term at that precision.
    assert augmented_k.augmented_member(nf4_down, down_lora, bf16_plan, 4096, cuda, FP32) is None
    # Without the host term the bytes alone decide: a 4-bit o_proj at 8192 tokens pays.
    o = ([_meta_base(4096, 4096, quantized=True)], [_meta_lora(4096, 4096)])
    monkeypatch.setattr(augmented_k, "_HOST_COST_ELEMENTS", 0)
    assert augmented_k.augmented_member(*o, bf16_plan, 8192, cuda, BF16) == 0


def _projection(in_features, out_features, rank, scale, dtype, adapter_dtype, quantized, generator, device):
    weight = (torch.randn(out_features, in_features, generator=generator) / in_features**0.5).to(
        device, dtype
    )
    base = FrozenBase(weight, None, None)
    if quantized:
        import bitsandbytes.functional as bnb_functional

        from fastlora_peft.kernels.dequant4bit import Quant4bitState

        packed, state = bnb_functional.quantize_4bit(
            weight, blocksize=64, compress_statistics=True, quant_type="nf4"
        )
        base = FrozenBase(packed, None, Quant4bitState.from_bnb(state, packed))
    # lora_B random and of the same size as the base's contribution: a wrong term cannot hide.
    lora_a = (torch.randn(rank, in_features, generator=generator) / in_features**0.5).to(
        device, adapter_dtype
    )
    lora_b = torch.randn(out_features, rank, generator=generator).to(device, adapter_dtype)
    return base, LoraWeights(lora_a.requires_grad_(), lora_b.requires_grad_(), scale)


def _linear64(x, weight, lora):
    return x @ weight.T + lora.scale * (x @ lora.lora_a.T) @ lora.lora_b.T


def _float64_grads(x, bases, loras, run64, grad_outs):
    """Gradients of x and every adapter through `run64` in float64, on the weights the Function sees."""
    x64 = x.detach().double().requires_grad_()
    weights = [materialize_weight(base, FP32).double() for base in bases]
    loras64 = [
        LoraWeights(
            lora.lora_a.detach().double().requires_grad_(),
            lora.lora_b.detach().double().requires_grad_(),
            lora.scale,
        )
        for lora in loras
    ]
    outputs = run64(x64, weights, loras64)
    torch.autograd.backward(outputs, [g.double() for g in grad_outs])
    return [x64.grad] + [t.grad for lora in loras64 for t in (lora.lora_a, lora.lora_b)]


def _fused_grads(x, loras, outputs, grad_outs):
    tensors = [x] + [t for lora in loras for t in (lora.lora_a, lora.lora_b)]
    return torch.autograd.grad(outputs, tensors, grad_outs)


def _qkv(x, bases, loras, plan):
    return fused_lora_projections(x, bases, loras, plan)


def _qkv64(x, weights, loras):
    return [_linear64(x, w, lora) for w, lora in zip(weights, loras)]


def _mlp(x, bases, loras, plan):
    return (fused_gated_mlp(x, bases, loras, plan, "silu"),)


def _mlp64(x, weights, loras):
    gate, up = (_linear64(x, w, lora) for w, lora in zip(weights[:2], loras[:2]))
    return [_linear64(F.silu(gate) * up, weights[2], loras[2])]


# (run, run64, [(in, out, rank, scale)], tokens, the member whose GEMM should carry the term)
CASES = {
    "qkv": (_qkv, _qkv64, [(128, 128, 4, 0.5), (128, 64, 3, 1.5), (128, 64, 5, 0.75)], 21, 1),
    # dh: the down projection's (64 out, 128 in); gate/up's dX is not augmented (out > in).
    "mlp": (_mlp, _mlp64, [(64, 128, 3, 0.5), (64, 128, 2, 1.5), (128, 64, 5, 1.25)], 21, 0),
    # A dense group with enough tokens that copying k's weight is cheaper than a pass over dX.
    "qkv-dense": (_qkv, _qkv64, [(64, 64, 4, 0.5), (64, 16, 3, 1.5), (64, 16, 5, 0.75)], 200, 1),
}
LAYOUTS = FUNCTION_LAYOUTS  # id -> (x and base dtype, adapter dtype, 4-bit base), conftest
CASE_LAYOUTS = [
    ("qkv", "nf4-bf16-adapters"),
    ("qkv", "nf4-fp32-adapters"),
    ("mlp", "nf4-bf16-adapters"),
    ("mlp", "nf4-fp32-adapters"),
    ("qkv-dense", "fp32-adapters-on-bf16"),
    ("qkv-dense", "bf16"),
    ("qkv-dense", "fp32"),
]


def _run_case(case, layout_id, augmented: bool, monkeypatch, device="cpu"):
    run, run64, shapes, tokens, _ = CASES[case]
    dtype, adapter_dtype, quantized = LAYOUTS[layout_id]
    generator = torch.Generator().manual_seed(3)
    pairs = [_projection(*shape, dtype, adapter_dtype, quantized, generator, device) for shape in shapes]
    bases, loras = [p[0] for p in pairs], [p[1] for p in pairs]
    x = torch.randn(tokens, shapes[0][0], generator=generator).to(device, dtype).requires_grad_()
    plan = DtypePlan(dtype, dtype)
    with monkeypatch.context() as patch:
        if not augmented:  # the expand-add path, for comparison
            for module in (shared_input, gated_mlp):
                patch.setattr(module, "augmented_member", lambda *args: None)
        outputs = run(x, bases, loras, plan)
        grad_outs = [torch.randn(out.shape, generator=generator).to(device, out.dtype) for out in outputs]
        with OpCounter() as counter:
            grads = _fused_grads(x, loras, outputs, grad_outs)
    expected = _float64_grads(x, bases, loras, run64, grad_outs)
    return grads, expected, counter.ops


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case,layout_id", CASE_LAYOUTS)
def test_augmented_dx_is_taken_and_as_exact_as_the_expand_add(
    case, layout_id, device, monkeypatch, triton_launches
):
    monkeypatch.setattr(GatedMlpSettings, "chunk_bytes", 2**30)  # one chunk
    grads, expected, ops = _run_case(case, layout_id, True, monkeypatch, device)
    plain_grads, _, plain_ops = _run_case(case, layout_id, False, monkeypatch, device)
    # The pin: one augmented left operand, and no expand-add left in the backward for the term
    # the augmented GEMM carries (the MLP's gate/up dX still takes one).
    assert ops[AUGMENTED_OP] == 1, ops
    assert ops[EXPAND_OP] == plain_ops[EXPAND_OP] - 1, (ops, plain_ops)
    assert plain_ops[AUGMENTED_OP] == 0
    if TRITON_INTERPRET or device == "cuda":
        assert triton_launches.get("_lora_augmented_left_kernel", 0) == 1, triton_launches
    names = ["x"] + [f"{kind}{i}" for i in range(len(grads) // 2) for kind in ("A", "B")]
    for name, grad, plain, reference in zip(names, grads, plain_grads, expected):
        error, plain_error = rel_err(grad, reference), rel_err(plain, reference)
        # Only dX's term is rounded differently (its operands to the compute dtype). With lora_B as
        # large as here (the term about the size of the base's part) that measured 3.0-3.3e-3 from
        # float64 for a 16-bit dX against 2.1e-3 by the expand-add, and 4.6e-3 against 3.0e-3 for
        # gate's dA behind dh; fp32 adapters' dA/dB of q/k/v unchanged (~2e-7). The project's rule
        # for the fused path against PEFT, at most twice the error, bounds it against the old path.
        assert error <= 2 * plain_error + 1e-6, f"{name}: {error:.2e} against {plain_error:.2e}"


@pytest.mark.parametrize("augmented", [True, False], ids=["augmented", "expand-add"])
@pytest.mark.parametrize("layout_id", ["nf4-fp32-adapters", "nf4-bf16-adapters"])
def test_mlp_forward_keeps_down_a_t_only_where_dh_reads_it(layout_id, augmented, monkeypatch):
    # dh's term reads the forward's Ad.T where it takes the expand-add (or lora_addmm); through the
    # augmented K it reads lora_a itself. The forward decides which (`_dh_takes_augmented_k`), keeps
    # Ad.T only for the first, and the backward takes the path the forward decided.
    kept = []

    def spy(*args):
        out, ha_down, down_a_t = down_forward(*args)
        kept.append(down_a_t is not None)
        return out, ha_down, down_a_t

    down_forward = gated_mlp._down_forward
    monkeypatch.setattr(gated_mlp, "_down_forward", spy)
    _, _, ops = _run_case("mlp", layout_id, augmented, monkeypatch)
    assert kept == [not augmented]
    assert ops[AUGMENTED_OP] == (1 if augmented else 0), ops


@pytest.mark.parametrize("layout_id", ["fp16", "fp32-adapters-on-fp16"])
def test_fp16_keeps_the_expand_add(layout_id, monkeypatch):
    # s gB rounded to fp16 could overflow where the expand-add's fp32 term does not.
    _, _, ops = _run_case("qkv-dense", layout_id, True, monkeypatch)
    assert ops[AUGMENTED_OP] == 0 and ops[EXPAND_OP] == 1, ops


@pytest.mark.parametrize("align, expected_rows", [(1, [4, 4, 4, 4, 5]), (3, [3, 6, 3, 6, 3])])
@pytest.mark.parametrize("layout_id", ["nf4-fp32-adapters", "nf4-bf16-adapters"])
def test_several_mlp_chunks_take_it_in_chunks_within_the_budget(layout_id, align, expected_rows, monkeypatch):
    # Forward: three chunks of 7 rows of h (I = 128). Backward: dh's rows chunked again so dh and
    # the left operand (width 72) fit the same budget together: five chunks, each with its own left
    # operand, one augmented weight for all, and no expand-add for dh's term. Their bounds at
    # multiples of the row alignment (256 at real sizes; 3 here, 1 for the even split).
    chunk_bytes = 7 * 128 * 2
    monkeypatch.setattr(GatedMlpSettings, "chunk_bytes", chunk_bytes)
    monkeypatch.setattr(gated_mlp, "_AUGMENTED_ROW_ALIGN", align)
    # The rule weighs all 21 rows against the host term (paid once): they save 21 x (128 x (1 + 5/32)
    # - 72) = 1596 elements, one 7-row chunk 532; a term between the two keeps only a per-chunk
    # rule from taking the path.
    monkeypatch.setattr(augmented_k, "_HOST_COST_ELEMENTS", 1000)
    left_rows = []
    real_left = augmented_k.lora_augmented_left

    def spy(grad, grad_xa, scale, width):
        left_rows.append(grad.shape[0])
        row_bytes = (128 + width) * grad.element_size()  # token_chunks' "about": align rows over at most
        assert (grad.shape[0] - align) * row_bytes < chunk_bytes, (grad.shape, width)
        return real_left(grad, grad_xa, scale, width)

    monkeypatch.setattr(augmented_k, "lora_augmented_left", spy)
    grads, expected, ops = _run_case("mlp", layout_id, True, monkeypatch)
    assert left_rows == expected_rows, left_rows
    plain_grads, _, plain_ops = _run_case("mlp", layout_id, False, monkeypatch)
    assert ops[AUGMENTED_OP] == 5 and ops[EXPAND_OP] == 1, ops  # the one left: gate/up's dX
    assert plain_ops[EXPAND_OP] == 3 + 1, plain_ops  # one per forward chunk, and gate/up's dX
    names = ["x"] + [f"{kind}{i}" for i in range(len(grads) // 2) for kind in ("A", "B")]
    for name, grad, plain, reference in zip(names, grads, plain_grads, expected):
        error, plain_error = rel_err(grad, reference), rel_err(plain, reference)
        assert error <= 2 * plain_error + 1e-6, f"{name}: {error:.2e} against {plain_error:.2e}"


def test_forced_lora_addmm_keeps_the_term(monkeypatch):
    from fastlora_peft.kernels.lora_addmm import LoraAddmmSettings

    monkeypatch.setattr(LoraAddmmSettings, "mode", "always")
    _, _, ops = _run_case("qkv", "nf4-bf16-adapters", True, monkeypatch)
    assert ops[AUGMENTED_OP] == 0 and ops["fastlora.lora_addmm_sum"] == 1, ops  # the group's dX in one
    monkeypatch.setattr(LoraAddmmSettings, "sum_members", False)
    _, _, ops = _run_case("qkv", "nf4-bf16-adapters", True, monkeypatch)
    assert ops[AUGMENTED_OP] == 0 and ops["fastlora.lora_addmm"] == 1, ops


def test_auto_lora_addmm_takes_the_dx_term_from_the_augmented_gemm(monkeypatch):
    """Where "auto" gives a shared-input dX's first GEMM to lora_addmm, that GEMM carries the term and
    no member's K is augmented (on the CPU lora_addmm itself stays off, so the expand-add adds it)."""
    monkeypatch.setattr(shared_input, "lora_addmm_auto_takes", lambda grad, compute, out: True)
    _, _, ops = _run_case("qkv", "nf4-bf16-adapters", True, monkeypatch)
    assert ops[AUGMENTED_OP] == 0 and ops[EXPAND_OP] == 1, ops


def test_what_auto_gives_lora_addmm_before_the_weight_is_at_hand(monkeypatch):
    from fastlora_peft.kernels import lora_addmm
    from fastlora_peft.kernels.lora_addmm import LoraAddmmSettings, lora_addmm_auto_takes

    monkeypatch.setattr(lora_addmm, "_is_hopper", lambda device: device == "hopper")
    rows = LoraAddmmSettings.min_tokens
    assert rows == 1024  # measured at 256-1024 tokens (docs/benchmarks.md, "Twenty-first session")
    grad = SimpleNamespace(is_cuda=True, shape=(rows, 4096), device="hopper")
    assert lora_addmm_auto_takes(grad, BF16, BF16) and lora_addmm_auto_takes(grad, FP16, FP16)
    assert not lora_addmm_auto_takes(grad, FP32, FP32)  # fp32 GEMMs stay cuBLAS's
    assert not lora_addmm_auto_takes(grad, BF16, FP32)  # dX handed out wider than it is computed
    assert not lora_addmm_auto_takes(
        SimpleNamespace(is_cuda=True, shape=(rows - 1, 64), device="hopper"), BF16, BF16
    )
    assert not lora_addmm_auto_takes(
        SimpleNamespace(is_cuda=True, shape=(4096, 64), device="ampere"), BF16, BF16
    )
    assert not lora_addmm_auto_takes(
        SimpleNamespace(is_cuda=False, shape=(4096, 64), device="hopper"), BF16, BF16
    )
    for mode in ("never", "always"):  # "always" keeps the augmented GEMM out by itself
        monkeypatch.setattr(LoraAddmmSettings, "mode", mode)
        assert not lora_addmm_auto_takes(grad, BF16, BF16)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs a Hopper GPU"
)
@pytest.mark.real_host_cost
@pytest.mark.parametrize("layout_id", ["bf16", "nf4-fp32-adapters"])
def test_qkv_dx_at_llama_shapes_takes_lora_addmm_under_auto(layout_id, monkeypatch):
    """A q/k/v group at 8192 tokens, where the rule picks k's augmented K: under "auto" (the default)
    the forward's GEMMs take lora_addmm_group, dX lora_addmm_sum, and nothing is augmented; under "never"
    k's GEMM carries the term. The gradients of the two agree within the 16-bit rounding of dX."""
    from fastlora_peft.kernels.lora_addmm import LoraAddmmSettings

    dtype, adapter_dtype, quantized = LAYOUTS[layout_id]
    results = {}
    for mode in ("auto", "never"):
        monkeypatch.setattr(LoraAddmmSettings, "mode", mode)
        generator = torch.Generator().manual_seed(5)
        shapes = [(4096, 4096, 16, 2.0), (4096, 1024, 16, 2.0), (4096, 1024, 16, 2.0)]
        pairs = [_projection(*shape, dtype, adapter_dtype, quantized, generator, "cuda") for shape in shapes]
        bases, loras = [p[0] for p in pairs], [p[1] for p in pairs]
        x = torch.randn(8192, 4096, generator=generator).to("cuda", dtype).requires_grad_()
        with OpCounter() as counter:
            outputs = _qkv(x, bases, loras, DtypePlan(dtype, dtype))
            grad_outs = [torch.randn(out.shape, generator=generator).to("cuda", out.dtype) for out in outputs]
            grads = _fused_grads(x, loras, outputs, grad_outs)
        results[mode] = (counter.ops, grads)
    auto_ops, never_ops = results["auto"][0], results["never"][0]
    # The forward's three GEMMs in one launch (lora_addmm_group), dX as one GEMM over the three
    # members (lora_addmm_sum).
    assert auto_ops["fastlora.lora_addmm_group"] == 1 and auto_ops["fastlora.lora_addmm_sum"] == 1, auto_ops
    assert auto_ops[AUGMENTED_OP] == 0, auto_ops
    assert never_ops["fastlora.lora_addmm"] == 0 and never_ops[AUGMENTED_OP] == 1, never_ops
    for auto_grad, never_grad in zip(*(results[mode][1] for mode in ("auto", "never"))):
        assert rel_err(auto_grad, never_grad) < 1e-2
