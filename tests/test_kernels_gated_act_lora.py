"""The fused activation backward + dA_down op against the unfused Triton path, its reference and float64.

`gated_act_backward_weight_grad_` writes grad_gate/grad_up into gate/up and returns
``scale * left.T @ h``. Run the kernel on CPU with ``TRITON_INTERPRET=1``; without it the kernel
cases skip and the op runs the pure-torch reference. Tiny odd shapes with small blocks, so several
column tiles, row tiles, splits (the last one partial) and rank passes run under the interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    TRITON_INTERPRET,
    LaunchSpy,
    assert_rel_close,
    observed_launches,
    rel_err,
    requires_interpreter,
)

from fastlora_peft.kernels import gated_act, gated_act_lora, gated_act_reference
from fastlora_peft.kernels.dots import FP32_DOT, ROUNDED_DOT, SPLIT_DOT, SPLIT_DOT_PAIR
from fastlora_peft.kernels.gated_act_lora import (
    gated_act_backward_weight_grad_,
    gated_act_backward_weight_grad_op,
)

# exp(-x) overflows to inf for x << 0 under the interpreter's numpy, as meant: sigmoid(x) -> 0.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

FP32, BF16, FP16, FP64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
DTYPE_NAMES = {FP32: "fp32", BF16: "bf16", FP16: "fp16", FP64: "fp64"}
ACTIVATIONS = ("silu", "gelu_tanh")
SCALE = 0.37
TOKENS, FEATURES = 37, 45  # tokens, intermediate features: neither a multiple of any block

# Relative errors allowed, against float64 on the same (rounded) inputs.
# * Gradients and dA on exact h: one final rounding of the 16-bit outputs (bf16 3.5e-3 under the
#   interpreter, whose fp32 -> bf16 cast truncates; fp16 2e-4); dA there also sees h's rounding.
TOLERANCE = {FP32: 1e-6, BF16: 8e-3, FP16: 1e-3}
# * dA on the h the unfused path reads (rounded to gate's dtype by the same cast): fp32 sums only,
#   1.4e-7 measured. A skipped rounding of h is off by 1e-4 (fp16) to 1e-3 (bf16).
ROUNDED_H_TOLERANCE = 1e-6
# * dA against the reference, whose h torch makes and rounds: fp32 as above; fp16 h differs in the
#   odd element whose fp32 act (numpy's exp against torch's) rounds the other way (1.3e-5 measured);
#   bf16 by the interpreter's truncation (4e-3 measured; GPUs round to nearest).
REFERENCE_TOLERANCE = {FP32: 1e-6, BF16: 1e-2 if TRITON_INTERPRET else 1e-6, FP16: 1e-4}


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype
    activation: str
    rank: int
    split: int | None = None  # None: the launcher's choice
    block_m: int = 16
    block_i: int = 16
    block_r: int | None = None
    left_layout: str = "rows"  # "rows": a row-major slice (the launcher copies it); "cols": token-major

    @property
    def id(self) -> str:
        blocks = f"bm{self.block_m}-bi{self.block_i}" + (f"-br{self.block_r}" if self.block_r else "")
        return (
            f"{DTYPE_NAMES[self.dtype]}-{self.activation}-r{self.rank}-split{self.split}-{blocks}"
            f"-left{self.left_layout}"
        )


# split=3 with 16-row blocks: rows 16 + 16 + 5; split=2: 32 (two row tiles) + 5. Rank 70: two passes
# with 64-rank blocks (the default), five with 16.
CASES = [
    Case(dtype, activation, rank, split, left_layout=layout)
    for dtype in (FP32, BF16, FP16)
    for activation in ACTIVATIONS
    for rank, split, layout in ((5, 3, "rows"), (70, 2, "cols"))
]
CASES += [
    Case(FP32, "gelu_tanh", 70, 1, block_m=32, block_r=16, left_layout="cols"),
    Case(BF16, "silu", 5, None, block_m=16, block_i=128),  # the default launch's tiles: one tile, one split
]


def make_inputs(dtype, rank, left_layout="rows", tokens=TOKENS, features=FEATURES, seed=0):
    """(grad_h, gate_up, left): gate, up are the halves of gate_up [M, 2I]; grad_h and left are slices
    of wider tensors (four different row strides). gate spans the activations' curved range."""
    generator = torch.Generator().manual_seed(seed)
    scales = torch.cat([torch.full((features,), 3.0), torch.ones(features)])
    gate_up = (torch.randn(tokens, 2 * features, generator=generator) * scales).to(dtype)
    grad_h = torch.randn(tokens, features + 7, generator=generator).to(dtype)[:, :features]
    left_dtype = FP64 if dtype == FP64 else FP32
    if left_layout == "rows":
        left = torch.randn(tokens, rank + 3, generator=generator, dtype=left_dtype)[:, 1 : rank + 1]
    else:  # stride (1, tokens + 3): already token-major, the kernel reads it in place
        left = torch.randn(rank + 2, tokens + 3, generator=generator, dtype=left_dtype).T[
            :tokens, 1 : rank + 1
        ]
    return grad_h, gate_up, left


def halves(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    half = gate_up.shape[1] // 2
    return gate_up[:, :half], gate_up[:, half:]


def float64_truth(grad_h, gate, up, activation, left):
    """(grad_gate, grad_up, dA on exact h) through float64 autograd."""
    gate64, up64 = gate.double().requires_grad_(), up.double().requires_grad_()
    act = F.silu(gate64) if activation == "silu" else F.gelu(gate64, approximate="tanh")
    h = act * up64
    h.backward(grad_h.double())
    return gate64.grad, up64.grad, SCALE * left.double().T @ h.detach()


def run_fused(grad_h, gate_up, activation, left, **launch):
    """The fused op on a copy of gate_up: (grad_gate, grad_up, grad_weight). With `launch`, the
    Triton launcher with those block sizes and split; without, the public op."""
    buffer = gate_up.clone()
    gate, up = halves(buffer)
    if launch:
        grad_weight = gated_act_lora._gated_act_backward_weight_grad_triton(
            grad_h=grad_h, gate=gate, up=up, activation=activation, left=left, scale=SCALE, **launch
        )
    else:
        grad_weight = gated_act_backward_weight_grad_(grad_h, gate, up, activation, left, SCALE)
    return gate, up, grad_weight


def check_against_unfused_reference_and_float64(
    case, grad_h, gate_up, left, grad_gate, grad_up, grad_weight, unfused=True
):
    gate, up = halves(gate_up)
    exact = float64_truth(grad_h, gate, up, case.activation, left)
    reference = gated_act_reference.gated_act_backward_weight_grad(
        grad_h, gate, up, case.activation, left, SCALE
    )
    if unfused:  # the unfused ops launch a program per row: slow under the interpreter for many rows
        # The same activation code, so the same gradients bit for bit, and the same rounded h.
        unfused_grads = gated_act.gated_act_backward(grad_h, gate, up, case.activation)
        assert torch.equal(grad_gate, unfused_grads[0]), "grad_gate differs from gated_act_backward's"
        assert torch.equal(grad_up, unfused_grads[1]), "grad_up differs from gated_act_backward's"
        rounded_h = gated_act.gated_act_forward(gate, up, case.activation)
        assert_rel_close(grad_weight, SCALE * left.double().T @ rounded_h.double(), ROUNDED_H_TOLERANCE, "dA")
    tol = TOLERANCE[case.dtype]
    for name, actual, wanted, truth in zip(("grad_gate", "grad_up"), (grad_gate, grad_up), reference, exact):
        assert actual.dtype == case.dtype
        assert_rel_close(actual, truth, tol, f"{name} vs float64")
        assert_rel_close(actual, wanted, tol, f"{name} vs reference")
    assert grad_weight.dtype == FP32 and grad_weight.shape == (left.shape[1], gate.shape[1])
    assert_rel_close(grad_weight, exact[2], tol, "dA vs float64 on exact h")
    assert_rel_close(grad_weight, reference[2], REFERENCE_TOLERANCE[case.dtype], "dA vs reference")


@requires_interpreter
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_kernel_matches_unfused_reference_and_float64(case: Case):
    grad_h, gate_up, left = make_inputs(case.dtype, case.rank, case.left_layout)
    grad_h_before, left_before = grad_h.clone(), left.clone()
    launch = dict(split=case.split, block_m=case.block_m, block_i=case.block_i, block_r=case.block_r)
    results = run_fused(grad_h, gate_up, case.activation, left, **launch)
    check_against_unfused_reference_and_float64(case, grad_h, gate_up, left, *results)
    assert torch.equal(grad_h, grad_h_before) and torch.equal(left, left_before), "an input was written"


@requires_interpreter
def test_default_geometry_splits_tokens_with_a_partial_last_split(monkeypatch):
    # As on a GPU of 132 SMs: 1100 rows become 3 splits of 368, 368 and 364 (at least 512 rows each
    # before rounding up to the default launch's 16-row blocks), one column tile.
    monkeypatch.setattr(gated_act_lora, "_num_sms", lambda device: 132)
    spy = LaunchSpy(gated_act_lora._gated_act_backward_weight_grad_kernel)
    monkeypatch.setattr(gated_act_lora, "_gated_act_backward_weight_grad_kernel", spy)
    case = Case(FP32, "silu", 5)
    grad_h, gate_up, left = make_inputs(case.dtype, case.rank, tokens=1100, features=23, seed=1)
    results = run_fused(grad_h, gate_up, case.activation, left)
    assert spy.grids == [(1, 3)]
    check_against_unfused_reference_and_float64(case, grad_h, gate_up, left, *results, unfused=False)


@requires_interpreter
@pytest.mark.parametrize(
    "dtype, rounded_to, mode",
    [
        (BF16, None, SPLIT_DOT),
        (BF16, FP32, SPLIT_DOT),
        (BF16, BF16, ROUNDED_DOT),
        (BF16, FP16, SPLIT_DOT_PAIR),
        (FP16, BF16, FP32_DOT),  # the split is for a bf16 h only
    ],
)
def test_a_dA_rounded_to_16_bits_in_the_end_keeps_16_bits_of_left(dtype, rounded_to, mode):
    """rounded_to names the caller's final rounding of dA: fp16 lets a bf16 h's dot take left's two
    high bf16 parts (~1e-5 relative error against float64 on the rounded h here, 100x under a 16-bit
    rounding; the interpreter's cast truncates), bf16 left rounded to bf16 to nearest (2.1e-3 here;
    truncated, 3.8e-3), anything else all three (fp32 sums only, ~1e-7)."""
    grad_h, gate_up, left = make_inputs(dtype, 5)
    gate, up = halves(gate_up)
    truth = SCALE * left.double().T @ gated_act.gated_act_forward(gate, up, "silu").double()
    modes = []
    kernel = gated_act_lora._gated_act_backward_weight_grad_kernel
    with observed_launches([kernel], lambda grid, args, meta: modes.append(meta["DOT_MODE"])):
        buffer = gate_up.clone()
        gate, up = halves(buffer)
        grad_weight = gated_act_backward_weight_grad_(grad_h, gate, up, "silu", left, SCALE, rounded_to)
    assert modes == [mode] and grad_weight.dtype == FP32
    error = rel_err(grad_weight, truth)
    if mode == SPLIT_DOT_PAIR:
        assert 1e-7 < error < 3e-5
    elif mode == ROUNDED_DOT:  # left rounded to bf16 to nearest (`dots.bf16_rounded` here)
        assert 3e-4 < error < 3e-3
    else:
        assert error < ROUNDED_H_TOLERANCE
    # The gradients of gate and up do not depend on it.
    wanted_gate, wanted_up, _ = run_fused(grad_h, gate_up, "silu", left)
    assert torch.equal(gate, wanted_gate) and torch.equal(up, wanted_up)


# --- which path runs -----------------------------------------------------------------------------


def spy_on_paths(monkeypatch, dtype):
    """Runs the public op (eager, then through torch.library) on `dtype`: (kernel grids, reference calls)."""
    spy = LaunchSpy(gated_act_lora._gated_act_backward_weight_grad_kernel)
    monkeypatch.setattr(gated_act_lora, "_gated_act_backward_weight_grad_kernel", spy)
    reference_calls = []
    original = gated_act_reference.gated_act_backward_weight_grad
    monkeypatch.setattr(
        gated_act_reference,
        "gated_act_backward_weight_grad",
        lambda *args: reference_calls.append(args[0].dtype) or original(*args),
    )
    grad_h, gate_up, left = make_inputs(dtype, 5)
    gate, up = halves(gate_up.clone())
    gated_act_backward_weight_grad_(grad_h, gate, up, "silu", left, SCALE)
    gate, up = halves(gate_up.clone())
    gated_act_backward_weight_grad_op(grad_h, gate, up, "silu", left, SCALE)
    return spy.grids, reference_calls


@requires_interpreter
def test_pin_triton_kernel_ran_under_interpreter(monkeypatch):
    grids, reference_calls = spy_on_paths(monkeypatch, FP32)
    assert grids == [(1, 1)] * 2 and reference_calls == []  # 45 columns: one 128-wide tile, one split


@pytest.mark.skipif(TRITON_INTERPRET, reason="under TRITON_INTERPRET=1 CPU tensors run the Triton kernel")
def test_pin_reference_ran_without_interpreter(monkeypatch):
    assert spy_on_paths(monkeypatch, FP32) == ([], [FP32, FP32])


def test_float64_runs_the_reference(monkeypatch):
    assert spy_on_paths(monkeypatch, FP64) == ([], [FP64, FP64])
    grad_h, gate_up, left = make_inputs(FP64, 5, "cols")
    gate, up, grad_weight = run_fused(grad_h, gate_up, "gelu_tanh", left)
    exact = float64_truth(grad_h, *halves(gate_up), "gelu_tanh", left)
    for name, actual, truth in zip(("grad_gate", "grad_up", "dA"), (gate, up, grad_weight), exact):
        assert actual.dtype == FP64
        assert_rel_close(actual, truth, 1e-12, name)


@pytest.mark.parametrize("dtype", (FP32, BF16), ids=DTYPE_NAMES.get)
def test_public_op_matches_reference(dtype):
    # Whichever path runs (the kernel under the interpreter, else the reference), the op's results.
    grad_h, gate_up, left = make_inputs(dtype, 70, "rows", seed=2)
    case = Case(dtype, "silu", 70)
    check_against_unfused_reference_and_float64(
        case, grad_h, gate_up, left, *run_fused(grad_h, gate_up, "silu", left)
    )


@pytest.mark.parametrize("tokens, rank", [(0, 5), (9, 0)], ids=["no-tokens", "rank-0"])
def test_empty(tokens, rank):
    grad_h, gate_up, left = make_inputs(FP32, rank, tokens=tokens, features=23)
    gate, up, grad_weight = run_fused(grad_h, gate_up, "silu", left)
    expected = gated_act_reference.gated_act_backward_weight_grad(
        grad_h, *halves(gate_up), "silu", left, SCALE
    )
    for actual, wanted in zip((gate, up, grad_weight), expected):
        assert_rel_close(actual, wanted, 1e-6, "empty")
    assert grad_weight.shape == (rank, 23) and grad_weight.dtype == FP32


# --- registration and input checks -------------------------------------------------------------


@pytest.mark.parametrize("dtype", (FP32, BF16), ids=DTYPE_NAMES.get)
def test_opcheck(dtype):
    grad_h, gate_up, left = make_inputs(dtype, 3, "rows", tokens=5, features=23, seed=3)
    gate, up = halves(gate_up)
    torch.library.opcheck(gated_act_backward_weight_grad_op, (grad_h, gate, up, "gelu_tanh", left, SCALE))


def bad_inputs():
    gate, left = torch.randn(3, 5), torch.randn(3, 2)
    return {
        "activation": ((gate, gate.clone(), gate.clone(), "relu", left), "activation: expected one of"),
        "up-shape": ((gate, gate.clone(), gate[:, :4].clone(), "silu", left), r"up: expected shape \(3, 5\)"),
        "gate-transposed": (
            (gate, torch.randn(5, 3).T, gate.clone(), "silu", left),
            "gate and up need a unit column stride",
        ),
        "left-1d": (
            (gate, gate.clone(), gate.clone(), "silu", left[:, 0]),
            r"left: expected a 2-D .* got shape \(3,\)",
        ),
        "left-rows": (
            (gate, gate.clone(), gate.clone(), "silu", torch.randn(4, 2)),
            r"left: expected a 2-D tensor \[M, R\] with M=3 \(gate's rows\), got shape \(4, 2\)",
        ),
        "left-bf16": (
            (gate, gate.clone(), gate.clone(), "silu", left.bfloat16()),
            "left: expected dtype torch.float32 .* got torch.bfloat16",
        ),
        "left-fp64-on-fp32": (
            (gate, gate.clone(), gate.clone(), "silu", left.double()),
            "left: expected dtype torch.float32",
        ),
        "left-device": (
            (gate, gate.clone(), gate.clone(), "silu", torch.empty(3, 2, device="meta")),
            "left: expected device cpu",
        ),
    }


@pytest.mark.parametrize("name", list(bad_inputs()))
def test_rejects_bad_inputs(name: str):
    args, message = bad_inputs()[name]
    with pytest.raises(ValueError, match=message):
        gated_act_backward_weight_grad_(*args, SCALE)


# --- the default launch ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rows, columns, wide",
    [
        (2048, 14336, True),
        (1792, 14336, True),
        (2048, 11008, True),
        (1024, 14336, False),
        (512, 14336, False),
    ],
)
def test_default_launch_keeps_two_programs_per_sm(monkeypatch, rows, columns, wide):
    # On 132 SMs the 16 x 128 launch (the H200's fastest at 2048-row chunks) makes 336 programs of a
    # 2048 x 14336 chunk, but 224 of 1024 rows and 112 of 512 (splits stop at 512 rows), where the
    # 32 x 64 launch was faster (docs/benchmarks/session37/e/gated_shapes_ab.log).
    monkeypatch.setattr(gated_act_lora, "_num_sms", lambda device: 132)
    launch = gated_act_lora.default_launch(rows, columns, torch.device("cuda"))
    settings = gated_act_lora.GatedBackwardSettings
    assert launch == (settings.launch if wide else settings.few_programs_launch)


@requires_interpreter
def test_default_launch_is_the_one_launched(monkeypatch):
    # 600 x 100: on 132 SMs one 128-column tile in 2 splits is too few programs, so 32 x 64 tiles
    # (2 column tiles, 2 splits of 320 rows); on one "SM" the 16 x 128 launch (1 tile, 2 splits).
    spy = LaunchSpy(gated_act_lora._gated_act_backward_weight_grad_kernel)
    monkeypatch.setattr(gated_act_lora, "_gated_act_backward_weight_grad_kernel", spy)
    grad_h, gate_up, left = make_inputs(FP32, 5, tokens=600, features=100, seed=8)
    for sms, grid in ((132, (2, 2)), (1, (1, 2))):
        monkeypatch.setattr(gated_act_lora, "_num_sms", lambda device, sms=sms: sms)
        results = run_fused(grad_h, gate_up, "silu", left)
        assert spy.grids[-1] == grid
        check_against_unfused_reference_and_float64(
            Case(FP32, "silu", 5), grad_h, gate_up, left, *results, unfused=False
        )


def test_plan_key_holds_the_settings(monkeypatch):
    # A plan made under other launches (a benchmark's switch between its arms) is never served.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # the key's device (CPU here)
    grad_h, gate_up, left = make_inputs(BF16, 5)
    gate, up = halves(gate_up)
    key = gated_act_lora._weight_grad_plan_key(grad_h, gate, up, "silu", left, None)
    # ... nor one made for another final rounding (another dot).
    assert gated_act_lora._weight_grad_plan_key(grad_h, gate, up, "silu", left, BF16) != key
    monkeypatch.setattr(gated_act_lora.GatedBackwardSettings, "launch", (32, 64, 4, 2, 2))
    assert gated_act_lora._weight_grad_plan_key(grad_h, gate, up, "silu", left, None) != key
