"""The fused gated activation (SwiGLU, GeGLU): the public ops, their reference, float64 autograd.

Run the Triton kernels on CPU with ``TRITON_INTERPRET=1 python -m pytest tests/test_kernels_gated_act.py``;
without the variable the CPU cases run the pure-torch reference (and CUDA cases, where a GPU is
present, the kernels).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from conftest import LaunchSpy

from fastlora_peft.kernels import gated_act, gated_act_reference
from fastlora_peft.kernels._backend import TRITON_INTERPRET, runs_triton
from fastlora_peft.kernels.gated_act import gated_act_backward, gated_act_forward

# exp(-x) overflows to inf for x << 0 under the interpreter's numpy, as meant: sigmoid(x) -> 0.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
DTYPES = tuple(DTYPE_NAMES)
ACTIVATIONS = ("silu", "gelu_tanh")
DEVICES = (
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
    ),
)

# ||actual - exact|| / ||exact|| against float64 autograd on the same (rounded) inputs. Low-precision
# outputs are bounded by their one final rounding: bf16 ~1.7e-3 measured with round-to-nearest, 3.5e-3
# under the Triton interpreter, whose float32 -> bf16 cast truncates; fp16 ~2.1e-4; fp32 ~3e-7.
TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype
    activation: str
    n_rows: int
    n_cols: int
    # "contiguous"; "halves": gate, up = out[:, :I], out[:, I:] of one [M, 2I] tensor and grad_h a
    # slice of a wider one (three different row strides); "transposed": column stride != 1.
    layout: str = "contiguous"
    grad_dtype: torch.dtype | None = None  # grad_h's dtype when it differs from gate's

    @property
    def id(self) -> str:
        grad = f"-grad{DTYPE_NAMES[self.grad_dtype]}" if self.grad_dtype else ""
        return (
            f"{DTYPE_NAMES[self.dtype]}{grad}-{self.activation}-m{self.n_rows}-i{self.n_cols}-{self.layout}"
        )


CASES = [Case(dtype, act, 37, 130, "halves") for dtype in DTYPES for act in ACTIVATIONS]
CASES += [
    Case(dtype, act, n_rows, n_cols)
    for dtype in DTYPES
    for act in ACTIVATIONS
    for n_rows, n_cols in ((1, 130), (37, 23))
]
CASES += [Case(torch.bfloat16, act, 37, 130, "halves", grad_dtype=torch.float32) for act in ACTIVATIONS]
CASES += [
    Case(torch.float16, "gelu_tanh", 37, 23, "transposed", grad_dtype=torch.bfloat16),
    Case(torch.bfloat16, "silu", 0, 23, "halves"),
    Case(torch.float32, "gelu_tanh", 0, 130),
]


def _make_inputs(case: Case, device: str, seed: int = 0):
    """(grad_h, gate, up) with the layout of ``case``; gate spans the activations' curved range."""
    generator = torch.Generator().manual_seed(seed)
    m, i = case.n_rows, case.n_cols
    grad_dtype = case.grad_dtype or case.dtype

    def randn(*shape, dtype=case.dtype, scale=1.0):
        return (scale * torch.randn(*shape, generator=generator)).to(device=device, dtype=dtype)

    if case.layout == "halves":
        out = randn(m, 2 * i, scale=torch.cat([torch.full((i,), 3.0), torch.ones(i)]))
        gate, up = out[:, :i], out[:, i:]
        grad_h = randn(m, i + 7, dtype=grad_dtype)[:, :i]
    elif case.layout == "transposed":
        gate, up, grad_h = randn(i, m, scale=3.0).t(), randn(i, m).t(), randn(i, m, dtype=grad_dtype).t()
    else:
        gate, up, grad_h = randn(m, i, scale=3.0), randn(m, i), randn(m, i, dtype=grad_dtype)
    return grad_h, gate, up


def _float64_autograd(grad_h, gate, up, activation):
    """(h, grad_gate, grad_up) in float64 through torch's own activations and autograd."""
    gate64 = gate.double().requires_grad_()
    up64 = up.double().requires_grad_()
    act = F.silu(gate64) if activation == "silu" else F.gelu(gate64, approximate="tanh")
    h = act * up64
    h.backward(grad_h.double())
    return h.detach(), gate64.grad, up64.grad


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, name: str):
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if expected.numel() == 0:
        return
    assert torch.isfinite(actual).all(), f"{name}: non-finite values"
    err = ((actual.double() - expected.double()).norm() / expected.double().norm()).item()
    assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_matches_reference_and_float64(case: Case, device: str):
    grad_h, gate, up = _make_inputs(case, device)
    if case.layout == "halves":
        assert gate.stride(0) == up.stride(0) == 2 * case.n_cols and grad_h.stride(0) == case.n_cols + 7
    exact = _float64_autograd(grad_h, gate, up, case.activation)
    h = gated_act_forward(gate, up, case.activation)
    grad_gate, grad_up = gated_act_backward(grad_h, gate, up, case.activation)
    h_ref = gated_act_reference.gated_act_forward(gate, up, case.activation)
    grads_ref = gated_act_reference.gated_act_backward(grad_h, gate, up, case.activation)

    tol = TOLERANCE[case.dtype]
    for name, actual, reference, expected in zip(
        ("h", "grad_gate", "grad_up"), (h, grad_gate, grad_up), (h_ref, *grads_ref), exact
    ):
        assert actual.dtype == reference.dtype == case.dtype, f"{name}: dtype {actual.dtype}"
        assert actual.is_contiguous(), f"{name}: not contiguous"
        assert_rel_close(actual, expected, tol, f"op {name} vs float64")
        assert_rel_close(reference, expected, tol, f"reference {name} vs float64")
        assert_rel_close(actual, reference, tol, f"op {name} vs reference")


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_forward_is_differentiable_through_backward_op(activation: str):
    grad_h, gate, up = _make_inputs(Case(torch.bfloat16, activation, 5, 23, "halves"), "cpu", seed=1)
    gate, up = gate.clone().requires_grad_(), up.clone().requires_grad_()
    grads = torch.autograd.grad(gated_act_forward(gate, up, activation), (gate, up), grad_h.to(gate.dtype))
    expected = gated_act_backward(grad_h.to(gate.dtype), gate.detach(), up.detach(), activation)
    for actual, wanted in zip(grads, expected):
        torch.testing.assert_close(actual, wanted, rtol=0, atol=0)


def _spy_on_paths(monkeypatch):
    launches = {}
    for name in ("_gated_act_forward_kernel", "_gated_act_backward_kernel"):
        launches[name] = LaunchSpy(getattr(gated_act, name))
        monkeypatch.setattr(gated_act, name, launches[name])
    reference_calls = []
    for name in ("gated_act_forward", "gated_act_backward"):
        function = getattr(gated_act_reference, name)

        def counted(*args, _function=function, _name=name):
            reference_calls.append(_name)
            return _function(*args)

        monkeypatch.setattr(gated_act_reference, name, counted)
    grad_h, gate, up = _make_inputs(Case(torch.float32, "silu", 37, 130, "halves"), "cpu")
    gated_act_forward(gate, up, "silu")
    gated_act_backward(grad_h, gate, up, "silu")
    return {name: spy.grids for name, spy in launches.items()}, reference_calls


@pytest.mark.skipif(
    not TRITON_INTERPRET, reason="the Triton kernels run on CPU only under TRITON_INTERPRET=1"
)
def test_pin_triton_kernels_ran_under_interpreter(monkeypatch):
    assert runs_triton(torch.empty(0))
    launches, reference_calls = _spy_on_paths(monkeypatch)
    # 37 rows x one 256-column block.
    assert launches == {"_gated_act_forward_kernel": [(37,)], "_gated_act_backward_kernel": [(37,)]}
    assert reference_calls == []


@pytest.mark.skipif(TRITON_INTERPRET, reason="under TRITON_INTERPRET=1 CPU tensors run the Triton kernels")
def test_pin_reference_ran_without_interpreter(monkeypatch):
    assert not runs_triton(torch.empty(0))
    launches, reference_calls = _spy_on_paths(monkeypatch)
    assert launches == {"_gated_act_forward_kernel": [], "_gated_act_backward_kernel": []}
    assert reference_calls == ["gated_act_forward", "gated_act_backward"]


OPCHECK_CASES = [
    Case(torch.bfloat16, "silu", 5, 130, "halves", grad_dtype=torch.float32),
    Case(torch.float32, "gelu_tanh", 5, 23),
]


@pytest.mark.parametrize("case", OPCHECK_CASES, ids=lambda case: case.id)
def test_opcheck(case: Case):
    grad_h, gate, up = _make_inputs(case, "cpu", seed=2)
    torch.library.opcheck(gated_act_backward, (grad_h, gate, up, case.activation))
    torch.library.opcheck(gated_act_forward, (gate, up, case.activation))
    gate, up = gate.clone().requires_grad_(), up.clone().requires_grad_()
    torch.library.opcheck(gated_act_forward, (gate, up, case.activation))


def _bad_inputs():
    gate = torch.randn(3, 5)
    return {
        "activation": ((gate, gate, "relu"), "activation: expected one of"),
        "gate-1d": ((gate[0], gate[0], "silu"), r"gate: expected a 2-D tensor \[M, I\], got shape \(5,\)"),
        "up-shape": ((gate, gate[:, :4], "silu"), r"up: expected shape \(3, 5\) \(gate's\), got \(3, 4\)"),
        "up-dtype": (
            (gate, gate.half(), "silu"),
            "up: expected dtype torch.float32 .gate's., got torch.float16",
        ),
        "gate-dtype": ((gate.to(torch.int32), gate.to(torch.int32), "silu"), "gate: expected dtype in"),
    }


@pytest.mark.parametrize("name", list(_bad_inputs()))
def test_rejects_bad_inputs(name: str):
    args, message = _bad_inputs()[name]
    with pytest.raises(ValueError, match=message):
        gated_act_forward(*args)
    with pytest.raises(ValueError, match=message):
        gated_act_backward(args[0], *args)


def test_rejects_grad_h_of_other_shape():
    gate = torch.randn(3, 5)
    with pytest.raises(ValueError, match=r"grad_h: expected shape \(3, 5\) \(gate's\), got \(4, 5\)"):
        gated_act_backward(torch.randn(4, 5), gate, gate, "silu")


# --- gated_act_backward_keeping_hidden_: the gradients into gate/up, h into grad_h ------------------

KEEPING_HIDDEN_CASES = [Case(dtype, act, 37, 130, "halves") for dtype in DTYPES for act in ACTIVATIONS]
KEEPING_HIDDEN_CASES += [Case(torch.bfloat16, "silu", 1, 23), Case(torch.float16, "gelu_tanh", 37, 23)]


def _keeping_hidden_inputs(case: Case, device: str):
    """(grad_h, gate, up) as `_make_inputs` gives them, grad_h in a wider buffer of gate's dtype (the
    op writes h into it, so it needs a unit column stride, as the MLP's dh has)."""
    grad_h, gate, up = _make_inputs(case, device)
    if case.layout == "halves":
        assert grad_h.stride(0) == case.n_cols + 7 and gate.stride(0) == 2 * case.n_cols
    return grad_h, gate, up


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", KEEPING_HIDDEN_CASES, ids=lambda case: case.id)
def test_keeping_hidden_matches_reference_and_float64(case: Case, device: str, monkeypatch):
    grad_h, gate, up = _keeping_hidden_inputs(case, device)
    exact_h, exact_grad_gate, exact_grad_up = _float64_autograd(grad_h, gate, up, case.activation)
    h_forward = gated_act_forward(gate, up, case.activation)  # the h the MLP's forward stored
    grad_gate_ref, grad_up_ref = gated_act_reference.gated_act_backward(grad_h, gate, up, case.activation)
    spy = LaunchSpy(gated_act._gated_act_backward_kernel)
    monkeypatch.setattr(gated_act, "_gated_act_backward_kernel", spy)
    buffers = (grad_h.data_ptr(), gate.data_ptr(), up.data_ptr())

    gated_act.gated_act_backward_keeping_hidden_(grad_h, gate, up, case.activation)

    assert (grad_h.data_ptr(), gate.data_ptr(), up.data_ptr()) == buffers, "in place, no new buffers"
    assert len(spy.grids) == (1 if runs_triton(gate) else 0), "the kernel runs where Triton does"
    tol = TOLERANCE[case.dtype]
    for name, actual, expected in (
        ("h (in grad_h)", grad_h, exact_h),
        ("grad_gate (in gate)", gate, exact_grad_gate),
        ("grad_up (in up)", up, exact_grad_up),
    ):
        assert_rel_close(actual, expected, tol, f"{name} vs float64")
    # h is the forward's h to the bit: dA_down reads it as the fused kernel reads its recomputed h.
    torch.testing.assert_close(grad_h, h_forward, rtol=0, atol=0)
    torch.testing.assert_close(gate, grad_gate_ref)
    torch.testing.assert_close(up, grad_up_ref)


@pytest.mark.skipif(
    not TRITON_INTERPRET, reason="the Triton kernels run on CPU only under TRITON_INTERPRET=1"
)
def test_keeping_hidden_launches_once_and_plain_backward_writes_no_h(monkeypatch):
    spy = LaunchSpy(gated_act._gated_act_backward_kernel)
    monkeypatch.setattr(gated_act, "_gated_act_backward_kernel", spy)
    grad_h, gate, up = _keeping_hidden_inputs(Case(torch.float32, "silu", 37, 130, "halves"), "cpu")
    before = grad_h.clone()
    gated_act.gated_act_backward_(grad_h, gate.clone(), up.clone(), "silu")
    assert torch.equal(grad_h, before), "the plain in-place backward leaves grad_h alone"
    gated_act.gated_act_backward_keeping_hidden_(grad_h, gate, up, "silu")
    assert spy.grids == [(37,), (37,)]


def test_keeping_hidden_opcheck():
    grad_h, gate, up = _keeping_hidden_inputs(Case(torch.bfloat16, "silu", 5, 130, "halves"), "cpu")
    torch.library.opcheck(gated_act._keeping_hidden_op, (grad_h, gate, up, "silu"))


@pytest.mark.parametrize(
    "name, message",
    [
        ("grad_h-dtype", r"grad_h must be torch.bfloat16 \(gate's\), got torch.float32"),
        ("grad_h-transposed", "grad_h, gate and up need a unit column stride"),
        ("up-transposed", "grad_h, gate and up need a unit column stride"),
    ],
)
def test_keeping_hidden_rejects_bad_inputs(name: str, message: str):
    gate, up = torch.randn(6, 5, dtype=torch.bfloat16), torch.randn(6, 5, dtype=torch.bfloat16)
    grad_h = torch.randn(6, 5, dtype=torch.bfloat16)
    if name == "grad_h-dtype":
        grad_h = grad_h.float()
    elif name == "grad_h-transposed":
        grad_h = torch.randn(5, 6, dtype=torch.bfloat16).t()
    else:
        up = torch.randn(5, 6, dtype=torch.bfloat16).t()
    with pytest.raises(ValueError, match=message):
        gated_act.gated_act_backward_keeping_hidden_(grad_h, gate, up, "silu")
