"""The gate/up LoRA terms fused into the gated activation's forward, against float64, the reference
and the unfused ops (two `lora_expand_add_`, then `gated_act_forward`).

`gated_act_lora_forward_` adds ``scale * left @ right.T`` to gate and to up in place and returns
``act(gate) * up`` of the rounded results. On CPU the kernel runs under ``TRITON_INTERPRET=1`` (the
op runs the pure-torch reference otherwise); the cuda cases run on a GPU. Tiny odd shapes with small
blocks, so several row and column tiles and rank blocks run under the interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from conftest import TRITON_INTERPRET, LaunchSpy, assert_rel_close, requires_interpreter

from fastlora_peft.kernels import gated_act_lora_forward, gated_act_reference
from fastlora_peft.kernels._lora_common import _rank_block
from fastlora_peft.kernels.gated_act import gated_act_forward
from fastlora_peft.kernels.gated_act_lora_forward import gated_act_lora_forward_, gated_act_lora_forward_op
from fastlora_peft.kernels.lora_terms import lora_expand_add_

# exp(-x) overflows to inf for x << 0 under the interpreter's numpy, as meant: sigmoid(x) -> 0.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

FP32, BF16, FP16, FP64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
DTYPE_NAMES = {FP32: "fp32", BF16: "bf16", FP16: "fp16", FP64: "fp64"}
GATE_SCALE, UP_SCALE = 0.37, 1.9
TOKENS, FEATURES = 37, 45  # neither a multiple of any block
DEVICES = (
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
    ),
)

# Relative errors against float64 on the same inputs: one final rounding of each output (bf16
# 3.5e-3 under the interpreter, whose fp32 -> bf16 cast truncates, 2e-3 on GPUs; fp16 2.5e-4); fp32
# is bounded by the fp32 sums (3xTF32 on a GPU).
TOLERANCE = {FP32: 1e-6, BF16: 8e-3, FP16: 1e-3}
# Against the reference, whose casts round to nearest where the interpreter's truncate: h there
# carries gate's and up's differing roundings too (bf16 9.5e-3 measured).
REFERENCE_TOLERANCE = {**TOLERANCE, BF16: 2e-2 if TRITON_INTERPRET else 8e-3}


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype  # gate/up (the base outputs) and h
    right_dtype: torch.dtype  # lora_B: the adapters' dtype
    activation: str
    gate_rank: int
    up_rank: int
    gate_up: bool = False  # one gate_up projection: a shared left, the two halves of one lora_B
    block_m: int | None = 16  # None: the launcher's default
    block_i: int | None = 16
    block_r: int | None = None

    @property
    def id(self) -> str:
        layout = "gate_up" if self.gate_up else "gate-up"
        blocks = f"bm{self.block_m}-bi{self.block_i}-br{self.block_r}"
        return (
            f"{DTYPE_NAMES[self.dtype]}-B{DTYPE_NAMES[self.right_dtype]}-{self.activation}-{layout}"
            f"-r{self.gate_rank}.{self.up_rank}-{blocks}"
        )


CASES = [
    Case(dtype, right, activation, 5, 19)
    for dtype, right in ((FP32, FP32), (BF16, BF16), (FP16, FP16), (BF16, FP32), (FP16, FP32))
    for activation in ("silu", "gelu_tanh")
]
CASES += [
    Case(BF16, FP32, "silu", 70, 70, gate_up=True),  # rank over one 64-block: two rank steps
    Case(BF16, BF16, "silu", 70, 66),  # bf16 adapters past 64 ranks: the bf16 term (dots.term_dot)
    Case(FP32, FP32, "gelu_tanh", 33, 9, block_r=16),  # three rank steps for gate, one for up
    Case(BF16, BF16, "silu", 16, 16, gate_up=True, block_m=None, block_i=None),  # the GPU tiles
    Case(FP32, FP32, "silu", 16, 16, block_m=None, block_i=None),
]


def make_inputs(case: Case, device: str, tokens: int = TOKENS, features: int = FEATURES, seed: int = 0):
    """(gate_up [M, 2I] base outputs, terms): gate and up are its halves (row stride 2I); each left is
    columns of one wider fp32 xa (row stride over the ranks), each right a lora_B or half of one."""
    generator = torch.Generator().manual_seed(seed)

    def tensor(*shape, dtype=FP32, scale=1.0):
        return (scale * torch.randn(*shape, generator=generator)).to(device=device, dtype=dtype)

    scales = torch.cat([torch.full((features,), 3.0), torch.ones(features)]).to(device)
    gate_up = (tensor(tokens, 2 * features) * scales).to(case.dtype)  # gate spans the curved range
    if case.gate_up:
        xa = tensor(tokens, case.gate_rank + 3)
        left = xa[:, 1 : case.gate_rank + 1]
        right = tensor(2 * features, case.gate_rank, dtype=case.right_dtype, scale=0.5)
        terms = (left, right[:features], GATE_SCALE, left, right[features:], UP_SCALE)
    else:
        xa = tensor(tokens, case.gate_rank + case.up_rank + 3)
        gate_left, up_left = xa[:, 1 : case.gate_rank + 1], xa[:, case.gate_rank + 1 : -2]
        gate_right = tensor(features, case.gate_rank, dtype=case.right_dtype, scale=0.5)
        up_right = tensor(features, case.up_rank, dtype=case.right_dtype, scale=0.5)
        terms = (gate_left, gate_right, GATE_SCALE, up_left, up_right, UP_SCALE)
    return gate_up, terms


def halves(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    half = gate_up.shape[1] // 2
    return gate_up[:, :half], gate_up[:, half:]


def launch_blocks(case: Case) -> dict[str, int]:
    """The case's block sizes; None leaves the launcher's default."""
    blocks = dict(block_m=case.block_m, block_i=case.block_i, block_r=case.block_r)
    return {name: size for name, size in blocks.items() if size is not None}


def run_fused(case: Case, gate_up: torch.Tensor, terms, launcher: bool = True):
    """The op on a copy of gate_up: (gate', up', h). launcher: the Triton launcher with the case's
    blocks; else the public op."""
    gate, up = halves(gate_up.clone())
    if launcher:
        gate_left, gate_right, gate_scale, up_left, up_right, up_scale = terms
        hidden = gated_act_lora_forward._gated_act_lora_forward_triton(
            gate=gate, up=up, activation=case.activation, gate_left=gate_left, gate_right=gate_right,
            gate_scale=gate_scale, up_left=up_left, up_right=up_right, up_scale=up_scale,
            **launch_blocks(case),
        )  # fmt: skip
    else:
        hidden = gated_act_lora_forward_(gate, up, case.activation, *terms)
    return gate, up, hidden


def float64_sums(gate_up, terms):
    """gate and up plus their LoRA terms, exact in float64."""
    gate, up = halves(gate_up)
    gate_left, gate_right, gate_scale, up_left, up_right, up_scale = terms
    exact_gate = gate.double() + gate_scale * gate_left.double() @ gate_right.double().T
    exact_up = up.double() + up_scale * up_left.double() @ up_right.double().T
    return exact_gate, exact_up


def float64_activation(gate, up, activation):
    gate64 = gate.double()
    act = F.silu(gate64) if activation == "silu" else F.gelu(gate64, approximate="tanh")
    return act * up.double()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_matches_float64_reference_and_unfused_ops(case: Case, device: str):
    if device == "cpu" and not TRITON_INTERPRET:
        pytest.skip("the Triton kernel runs on CPU only under TRITON_INTERPRET=1")
    gate_up, terms = make_inputs(case, device)
    terms_before = [term.clone() if isinstance(term, torch.Tensor) else term for term in terms]
    gate, up, hidden = run_fused(case, gate_up, terms)
    tol = TOLERANCE[case.dtype]
    for name, actual, exact in zip(("gate", "up"), (gate, up), float64_sums(gate_up, terms)):
        assert actual.dtype == case.dtype
        assert_rel_close(actual, exact, tol, f"{name} + its LoRA term vs float64")
    # h from the stored (rounded) gate and up, which backward reads: one rounding of h against
    # float64 on them, and the activation kernel's own h on them bit for bit under the interpreter.
    assert hidden.dtype == case.dtype and hidden.is_contiguous()
    assert_rel_close(hidden, float64_activation(gate, up, case.activation), tol, "h vs float64")
    own_activation = gated_act_forward(gate, up, case.activation)
    if TRITON_INTERPRET and device == "cpu":
        assert torch.equal(hidden, own_activation), "h is not act(stored gate) * stored up"
    else:
        assert_rel_close(hidden, own_activation, 1e-6 if case.dtype == FP32 else 1e-3, "h vs gated_act")
    # The reference, and the unfused ops this kernel replaces.
    reference = gated_act_reference.gated_act_lora_forward(
        halves(gate_up)[0], halves(gate_up)[1], case.activation, *terms
    )
    unfused_gate, unfused_up = (t.clone() for t in halves(gate_up))
    lora_expand_add_(unfused_gate, terms[0], terms[1], terms[2])
    lora_expand_add_(unfused_up, terms[3], terms[4], terms[5])
    unfused = (unfused_gate, unfused_up, gated_act_forward(unfused_gate, unfused_up, case.activation))
    for name, actual, wanted, unfused_value in zip(
        ("gate", "up", "h"), (gate, up, hidden), reference, unfused
    ):
        assert_rel_close(actual, wanted, REFERENCE_TOLERANCE[case.dtype], f"{name} vs reference")
        assert_rel_close(actual, unfused_value, tol, f"{name} vs unfused ops")
    for term, before in zip(terms, terms_before):
        if isinstance(term, torch.Tensor):
            assert torch.equal(term, before), "a LoRA operand was written"


def test_float64_reference_matches_float64_math():
    # The reference (what CI's plain CPU run and gradcheck use) on float64 inputs is the math itself.
    case = Case(FP64, FP64, "gelu_tanh", 5, 19)
    gate_up, terms = make_inputs(Case(FP32, FP32, "gelu_tanh", 5, 19), "cpu")
    gate_up = gate_up.double()
    terms = tuple(term.double() if isinstance(term, torch.Tensor) else term for term in terms)
    gate, up, hidden = run_fused(case, gate_up, terms, launcher=False)
    exact_gate, exact_up = float64_sums(gate_up, terms)
    torch.testing.assert_close(gate, exact_gate, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(up, exact_up, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(hidden, float64_activation(exact_gate, exact_up, "gelu_tanh"))


# --- which path runs -----------------------------------------------------------------------------


def spy_on_paths(monkeypatch, dtype):
    """Runs the public op (eager, then through torch.library) on `dtype`: (kernel grids, reference calls)."""
    spy = LaunchSpy(gated_act_lora_forward._gated_act_lora_forward_kernel)
    monkeypatch.setattr(gated_act_lora_forward, "_gated_act_lora_forward_kernel", spy)
    reference_calls = []
    original = gated_act_reference.gated_act_lora_forward
    monkeypatch.setattr(
        gated_act_reference,
        "gated_act_lora_forward",
        lambda *args: reference_calls.append(args[0].dtype) or original(*args),
    )
    gate_up, terms = make_inputs(Case(FP32, FP32, "silu", 5, 19), "cpu")
    gate_up, terms = (
        gate_up.to(dtype),
        tuple(t.to(dtype) if isinstance(t, torch.Tensor) else t for t in terms),
    )
    gated_act_lora_forward_(*halves(gate_up.clone()), "silu", *terms)
    gated_act_lora_forward_op(*halves(gate_up.clone()), "silu", *terms)
    return spy.grids, reference_calls


@requires_interpreter
def test_pin_triton_kernel_ran_under_interpreter(monkeypatch):
    grids, reference_calls = spy_on_paths(monkeypatch, FP32)
    assert grids == [(1, 1)] * 2 and reference_calls == []  # 45 columns, 37 rows: one 64 x 64 tile


@pytest.mark.skipif(TRITON_INTERPRET, reason="under TRITON_INTERPRET=1 CPU tensors run the Triton kernel")
def test_pin_reference_ran_without_interpreter(monkeypatch):
    assert spy_on_paths(monkeypatch, FP32) == ([], [FP32, FP32])


def test_float64_runs_the_reference(monkeypatch):
    assert spy_on_paths(monkeypatch, FP64) == ([], [FP64, FP64])


def test_fake_matches_and_op_is_registered():
    gate_up, terms = make_inputs(Case(BF16, FP32, "silu", 5, 19), "cpu")
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake_gate_up = mode.from_tensor(gate_up)
        fake_terms = tuple(mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in terms)
        hidden = gated_act_lora_forward_op(*halves(fake_gate_up), "silu", *fake_terms)
    assert hidden.shape == (TOKENS, FEATURES) and hidden.dtype == BF16
    assert torch.ops.fastlora.gated_act_lora_forward_.default is not None


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda terms: (terms[0][:-1],) + terms[1:], "gate_left must be \\[M, R\\]"),
        (lambda terms: terms[:4] + (terms[4][:, :-1],) + terms[5:], "up_right must be \\[I, R\\]"),
        (lambda terms: (terms[0].to(FP16),) + terms[1:], "gate_left must be torch.float32 or torch.bfloat16"),
    ],
    ids=["gate-left-rows", "up-right-rank", "left-dtype"],
)
def test_bad_operands_are_refused(change, message):
    gate_up, terms = make_inputs(Case(BF16, FP32, "silu", 5, 19), "cpu")
    with pytest.raises(ValueError, match=message):
        gated_act_lora_forward_(*halves(gate_up), "silu", *change(terms))


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_opcheck(dtype):
    # Schema (gate and up declared mutated), fake tensor and dispatch checks of the registered op.
    gate_up, terms = make_inputs(Case(dtype, FP32, "gelu_tanh", 5, 19), "cpu", tokens=9, features=7)
    torch.library.opcheck(gated_act_lora_forward_op, (*halves(gate_up), "gelu_tanh", *terms))


class _StagesSpy:
    """Stands in for the kernel and records each launch's (num_stages, BLOCK_RG, BLOCK_RU) and its
    term's DOT_PRECISION."""

    def __init__(self, kernel):
        self.kernel, self.launches, self.precisions = kernel, [], []

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.launches.append((meta["num_stages"], meta["BLOCK_RG"], meta["BLOCK_RU"]))
            self.precisions.append(meta["DOT_PRECISION"])
            return self.kernel[grid](*args, **meta)

        return launch


@requires_interpreter
@pytest.mark.parametrize(
    "dtype, right, ranks, stages, precision",
    [
        (BF16, FP32, (16, 16), 1, "tf32"),  # plain tf32 at rank 16: one stage (twentieth session)
        (BF16, FP32, (63, 5), 1, "tf32"),
        (BF16, FP32, (5, 64), 2, "tf32"),  # from 64 ranks of either term on: two (forty-sixth session)
        (BF16, FP32, (70, 70), 2, "tf32"),
        (FP16, FP32, (16, 16), 2, "tf32x3"),  # 3xTF32 into fp16: two at every rank
        (FP16, BF16, (16, 16), 2, "tf32x3"),  # bf16 adapters into fp16 too: no bf16 term, fp32 left
        # bf16 adapters: the bf16 term at every rank (from 64 ranks on since the fifty-first session,
        # below since the fifty-fifth, with the bf16 left the gated MLP hands it there too).
        (BF16, BF16, (16, 16), 1, "bf16"),
        (BF16, BF16, (63, 5), 1, "bf16"),
        (BF16, BF16, (5, 64), 2, "bf16"),
        # Past 64 ranks (two rank blocks) the bf16 term takes three (fifty-fourth session).
        (BF16, BF16, (70, 70), 3, "bf16"),
        (BF16, BF16, (65, 5), 3, "bf16"),
    ],
)
def test_default_launch_takes_two_stages_from_64_ranks(monkeypatch, dtype, right, ranks, stages, precision):
    spy = _StagesSpy(gated_act_lora_forward._gated_act_lora_forward_kernel)
    monkeypatch.setattr(gated_act_lora_forward, "_gated_act_lora_forward_kernel", spy)
    gate_up, terms = make_inputs(Case(dtype, right, "silu", *ranks, block_m=None, block_i=None), "cpu")
    gate, up = halves(gate_up.clone())
    hidden = gated_act_lora_forward_(gate, up, "silu", *terms)
    assert spy.launches == [(stages, *(_rank_block(rank, cap=64) for rank in ranks))]
    assert spy.precisions == [precision]
    # A caller may hand the left over in bf16 exactly where the term rounds it so (the gated MLP does).
    assert gated_act_lora_forward.bf16_left_suffices(dtype, right, right) == (precision == "bf16")
    assert_rel_close(hidden, float64_activation(gate, up, "silu"), TOLERANCE[dtype], "h vs float64")


# Where the term rounds its left to bf16 (bf16 adapters), a left handed over already
# rounded to bf16 (half the bytes, as the gated MLP now hands it) gives the same numbers bit for bit.
BF16_LEFT_CASES = [
    Case(BF16, BF16, "silu", 70, 66),
    Case(BF16, BF16, "silu", 16, 5),  # below 64 ranks too (fifty-fifth session)
    Case(BF16, BF16, "gelu_tanh", 64, 5),
    Case(BF16, BF16, "silu", 70, 70, gate_up=True),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", BF16_LEFT_CASES, ids=lambda case: case.id)
def test_a_bf16_left_gives_the_fp32_lefts_numbers_where_the_term_rounds_to_bf16(case: Case, device: str):
    if device == "cpu" and not TRITON_INTERPRET:
        pytest.skip("the reference keeps the fp32 left it is given; the kernel runs under TRITON_INTERPRET=1")
    assert gated_act_lora_forward.bf16_left_suffices(case.dtype, case.right_dtype, case.right_dtype)
    gate_up, terms = make_inputs(case, device)
    rounded = (terms[0].to(BF16), *terms[1:3], terms[3].to(BF16), *terms[4:])
    for name, fp32_left, bf16_left in zip(
        ("gate", "up", "h"), run_fused(case, gate_up, terms), run_fused(case, gate_up, rounded)
    ):
        assert torch.equal(fp32_left, bf16_left), f"{name}: a bf16 left changed the numbers"
    # And the op takes it (checks, dispatch): the launcher's default blocks.
    op_outputs = run_fused(case, gate_up, rounded, launcher=False)
    for name, actual, exact in zip(("gate", "up"), op_outputs[:2], float64_sums(gate_up, terms)):
        assert_rel_close(actual, exact, TOLERANCE[case.dtype], f"{name} + its LoRA term vs float64")


@pytest.mark.parametrize("case", BF16_LEFT_CASES, ids=lambda case: case.id)
def test_the_reference_takes_a_bf16_left_as_its_values(case: Case):
    """The op's check lets a bf16 left through to the pure-torch reference too (a plain CPU): it must
    give what the fp32 left of the same (bf16-exact) values gives."""
    gate_up, terms = make_inputs(case, "cpu")
    exact_in_bf16 = (terms[0].to(BF16).float(), *terms[1:3], terms[3].to(BF16).float(), *terms[4:])
    rounded = (terms[0].to(BF16), *terms[1:3], terms[3].to(BF16), *terms[4:])
    from_fp32 = gated_act_reference.gated_act_lora_forward(*halves(gate_up.clone()), "silu", *exact_in_bf16)
    from_bf16 = gated_act_reference.gated_act_lora_forward(*halves(gate_up.clone()), "silu", *rounded)
    for name, expected, actual in zip(("gate", "up", "h"), from_fp32, from_bf16, strict=True):
        assert torch.equal(expected, actual), f"{name}: the reference read a bf16 left otherwise"
