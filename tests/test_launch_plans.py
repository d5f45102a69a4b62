"""Launch plans (`_launch.LaunchPlans`): a launcher that meets inputs of the same metadata again
launches from its plan, and must pass the compiled kernel exactly what its own arithmetic would.

On the CPU there is no compiled kernel, so these tests stand one in: every `CachedKernel` of the
package "has compiled" each key, and its C launch records the arguments it gets instead of running.
The oracle for a planned launch is the same launcher with plans switched off, on the same inputs.
A GPU test at the end runs the real kernels from their plans against the reference.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from conftest import _kernel_objects

from fastlora_peft.kernels import (
    _launch,
    dequant4bit,
    dequant4bit_group,
    dequant4bit_reference,
    gated_act_lora,
    gated_act_reference,
    lora_addmm,
    lora_addmm_group,
    lora_addmm_sum,
    lora_augment,
    lora_terms,
    lora_weight_grad_group,
)
from fastlora_peft.kernels import gated_act_lora_forward as gated_forward
from fastlora_peft.kernels import lora_expand_add as expand_add_module
from fastlora_peft.kernels import lora_terms_reference as reference
from fastlora_peft.kernels import lora_weight_grad as weight_grad_module

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class _AlwaysCompiled(dict):
    """A kernel's cache that holds every key: the value given."""

    def __init__(self, value: Any) -> None:
        super().__init__()
        self.value = value

    def get(self, key, default=None):
        return self.value


_THROUGH_CACHE: list[str] = []


@pytest.fixture
def recorded_launches(monkeypatch) -> list[tuple]:
    """Every launch's C-launch arguments (grid, stream, function, ..., the kernel's parameters)."""
    calls: list[tuple] = []
    direct = _launch._DirectLaunch(lambda *args: calls.append(args), 1234, False, False, "metadata")
    monkeypatch.setattr(_launch, "TRITON_INTERPRET", False)
    monkeypatch.setattr(_launch.LaunchPlans, "enabled", True)
    # Op bodies serve plans to CUDA tensors only; here the CPU tensors stand in for them.
    monkeypatch.setattr(_launch.LaunchPlans, "serve", lambda self, tensor: self.enabled)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 77, raising=False)
    for kernel in _kernel_objects().values():
        monkeypatch.setattr(kernel, "compiled", _AlwaysCompiled(object()))
        monkeypatch.setattr(kernel, "direct", _AlwaysCompiled(direct))
    # The TMA kernel's three descriptors: encoders with a stand-in for Triton's fill_tma_descriptor.
    tma_direct = direct._replace(encoders=tuple(_fake_encoder() for _ in range(3)))
    monkeypatch.setattr(lora_addmm._lora_addmm_tma_kernel, "direct", _AlwaysCompiled(tma_direct))
    # lora_addmm_sum's seven: three members' a and b, and the output.
    sum_direct = direct._replace(encoders=tuple(_fake_encoder() for _ in range(7)))
    monkeypatch.setattr(lora_addmm_sum._lora_addmm_sum_tma_kernel, "direct", _AlwaysCompiled(sum_direct))
    # lora_addmm_group's seven: a, three members' weights and outputs.
    group_kernel = lora_addmm_group._lora_addmm_group_tma_kernel
    monkeypatch.setattr(group_kernel, "direct", _AlwaysCompiled(sum_direct))
    # Launches that went through `CachedKernel.launch` (the launcher's own path), not a plan.
    through_cache = _THROUGH_CACHE
    through_cache.clear()
    cached_launch = _launch.CachedKernel.launch

    def counting_launch(self, grid, args, meta):
        through_cache.append(self.name)
        return cached_launch(self, grid, args, meta)

    monkeypatch.setattr(_launch.CachedKernel, "launch", counting_launch)
    all_plans = (
        lora_terms._SHRINK_PLANS,
        expand_add_module._EXPAND_ADD_PLANS,
        weight_grad_module._WEIGHT_GRAD_PLANS,
    )
    gated_plans = (gated_forward._FORWARD_PLANS, gated_act_lora._WEIGHT_GRAD_PLANS)
    other_plans = (
        dequant4bit._DEQUANTIZE_PLANS,
        dequant4bit_group._GROUP_PLANS,
        lora_augment._AUGMENTED_LEFT_PLANS,
        lora_addmm._TMA_PLANS,
        lora_addmm_sum._SUM_PLANS,
        lora_addmm_group._GROUP_PLANS,
        lora_weight_grad_group._GROUP_PLANS,
        lora_terms._STACKED_PLANS,
    )
    for plans in (*all_plans, *gated_plans, *other_plans, *_every_launch_plans()):
        monkeypatch.setattr(plans, "plans", {})
    return calls


def _every_launch_plans() -> list[_launch.LaunchPlans]:
    """Every launcher's plans in the kernels package (a new launcher's too: no test may see another's)."""
    import importlib
    import pkgutil

    import fastlora_peft.kernels as package

    found = []
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        found += [value for value in vars(module).values() if isinstance(value, _launch.LaunchPlans)]
    return found


def counted_fit_checks(monkeypatch, module, fits_name: str) -> list:
    """Calls of `module`'s TMA fit check `fits_name`, with `module`'s CPU tensors reaching its
    launcher and `LoraAddmmSettings.mode` "always" (for the `*_where_it_pays_off` tests)."""
    monkeypatch.setattr(module, "runs_triton", lambda tensor: True)
    monkeypatch.setattr(lora_addmm.LoraAddmmSettings, "mode", "always")
    checks: list = []
    fits = getattr(module, fits_name)
    monkeypatch.setattr(module, fits_name, lambda *args: checks.append(args) or fits(*args))
    return checks


_ENCODED_ADDRESSES: list[int] = []


def _fake_fill(address, swizzle, elem_size, elem_type, block, shape, strides, padding) -> tuple:
    """Triton's fill_tma_descriptor stood in: everything but the address, which is recorded."""
    _ENCODED_ADDRESSES.append(address)
    return ("tma", swizzle, elem_size, elem_type, tuple(block), tuple(shape), tuple(strides), padding)


def _fake_encoder() -> _launch.TmaEncoder:
    meta = dict(swizzle=3, elem_size=2, elem_type=10, block_size=[16, 32], fp4_padded=False)
    return _launch.TmaEncoder(meta, _fake_fill, {10: 9})


def _same_launch(planned: tuple, unplanned: tuple, inputs: list[torch.Tensor]) -> None:
    """Argument by argument: equal values, the caller's own tensors themselves, and tensors the
    launcher made (outputs, copies, scratch) alike in shape, strides and dtype."""
    assert len(planned) == len(unplanned)
    for index, (got, expected) in enumerate(zip(planned, unplanned)):
        if isinstance(expected, torch.Tensor):
            assert isinstance(got, torch.Tensor), index
            if any(expected is tensor for tensor in inputs):
                assert got is expected, index
            else:
                assert (got.shape, got.stride(), got.dtype) == (
                    expected.shape,
                    expected.stride(),
                    expected.dtype,
                )
        else:
            assert type(got) is type(expected) and got == expected, (index, got, expected)


def _planned_and_unplanned(
    calls: list[tuple], launcher: Callable[..., torch.Tensor], make_inputs: Callable[[int], dict[str, Any]]
) -> tuple:
    """Call 1 makes the plan; call 2 (other values, same metadata) launches from it; call 3 is call 2's
    inputs with plans off. Calls 2 and 3 must hand the kernel the same arguments; returns call 2's."""
    plans = _launch.LaunchPlans
    launcher(**make_inputs(0))
    assert len(calls) == 1 and len(_THROUGH_CACHE) == 1
    second = make_inputs(1)
    launcher(**second)
    assert len(_THROUGH_CACHE) == 1, "call 2 did not launch from the plan"
    plans.enabled = False
    launcher(**second)
    plans.enabled = True
    assert len(calls) == 3
    inputs = [value for value in second.values() if isinstance(value, torch.Tensor)]
    _same_launch(calls[1], calls[2], inputs)
    return calls[1]


def _floats(launch: tuple) -> list[float]:
    return [value for value in launch if type(value) is float]


def _randn(generator, *shape, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=generator).to(dtype)


def _matrix(generator, rows: int, cols: int, dtype, transposed: bool) -> torch.Tensor:
    """[rows, cols], row-major or (transposed) a view of a [cols, rows] one."""
    if transposed:
        return _randn(generator, cols, rows, dtype=dtype).t()
    return _randn(generator, rows, cols, dtype=dtype)


@pytest.mark.parametrize("shape", [(16, 8192), (1, 7), (0, 5), (5, 0), (0, 0)])
def test_empty_2d_has_the_strides_of_torch_empty_and_its_transpose(shape):
    """The plans' one-call allocation: a plan's output must be laid out as the launcher's was."""
    rows, columns = shape
    row_major = _launch.empty_2d(rows, columns, torch.bfloat16, torch.device("cpu"))
    column_major = _launch.empty_2d(rows, columns, torch.float32, torch.device("cpu"), column_major=True)
    assert (row_major.shape, row_major.stride(), row_major.dtype) == (
        torch.Size(shape),
        torch.empty(shape).stride(),
        torch.bfloat16,
    )
    transposed = torch.empty((columns, rows)).T
    assert (column_major.shape, column_major.stride()) == (transposed.shape, transposed.stride())


# (M, K, R, x dtype, weight dtype, weight transposed): one split and K split (this CPU counts one
# SM, so few row blocks split K), fp32 on fp32 (the weight copied contiguous), a rank above one tile.
SHRINK_CASES = [
    (33, 70, 16, torch.bfloat16, torch.bfloat16, False),
    (7, 300, 8, torch.bfloat16, torch.float32, True),
    (9, 200, 8, torch.float32, torch.float32, True),
    (64, 96, 5, torch.float16, torch.float32, False),
    (130, 64, 24, torch.bfloat16, torch.bfloat16, True),
]


@pytest.mark.parametrize("keeps_weight_t", [False, True], ids=["", "keeping-weight-t"])
@pytest.mark.parametrize("case", SHRINK_CASES, ids=str)
def test_shrink_plan_launches_what_the_launcher_would(recorded_launches, case, keeps_weight_t):
    M, K, R, x_dtype, weight_dtype, transposed = case

    def make_inputs(seed):
        generator = torch.Generator().manual_seed(seed)
        weight = _matrix(generator, R, K, weight_dtype, transposed)
        inputs = dict(x=_randn(generator, M, K, dtype=x_dtype), weight=weight, scale=0.5 + seed)
        return {**inputs, "weight_t": torch.empty(K, R, dtype=weight_dtype)} if keeps_weight_t else inputs

    launch = _planned_and_unplanned(recorded_launches, lora_terms._lora_shrink_triton, make_inputs)
    assert launch[3] == 77 and launch[4] == 1234  # the current stream, the compiled function
    assert 1.5 in _floats(launch)  # call 2's own scale, not the plan's first
    # A plan with weight_t and one without are two: each launch is compiled for its own.
    lora_terms._lora_shrink_triton(
        **{**make_inputs(2), "weight_t": None if keeps_weight_t else torch.empty(K, R, dtype=weight_dtype)}
    )
    assert len(lora_terms._SHRINK_PLANS.plans) == 2


@pytest.mark.parametrize("first_rank", [0, 5], ids=["aligned", "unaligned"])
def test_shrink_into_a_given_out_is_planned_by_that_out(recorded_launches, first_rank):
    """`lora_shrink_stacked` writes each member into its columns of one [sum r, M] buffer: the launch
    passes that out itself, and a plan serves only an out of the same strides and alignment (at 37
    rows, columns from rank 5 on start 740 bytes in: a kernel compiled for an aligned pointer must not
    get it)."""
    M, K, R = 37, 64, 5

    def make_inputs(seed):
        generator = torch.Generator().manual_seed(seed)
        out = torch.empty(2 * R, M)[first_rank : first_rank + R].T
        return dict(x=_randn(generator, M, K), weight=_randn(generator, R, K), scale=0.5 + seed, out=out)

    launch = _planned_and_unplanned(recorded_launches, lora_terms._lora_shrink_triton, make_inputs)
    assert 1.5 in _floats(launch)
    other_alignment = torch.empty(2 * R, M)[R - first_rank : 2 * R - first_rank].T
    for out in (other_alignment, None):  # None: a new result
        lora_terms._lora_shrink_triton(**{**make_inputs(2), "out": out})
    assert len(lora_terms._SHRINK_PLANS.plans) == 3


EXPAND_CASES = [
    # (M, N, R, right transposed, in place)
    (33, 70, 16, True, True),
    (9, 40, 3, False, False),
    (65, 129, 40, True, False),
]


@pytest.mark.parametrize("case", EXPAND_CASES, ids=str)
def test_expand_add_plan_launches_what_the_launcher_would(recorded_launches, case):
    M, N, R, transposed, in_place = case

    def make_inputs(seed):
        generator = torch.Generator().manual_seed(seed)
        base = _randn(generator, M, N)
        right = _matrix(generator, N, R, torch.bfloat16, transposed)
        inputs = dict(base=base, left=_randn(generator, M, R, dtype=torch.float32), right=right)
        return dict(inputs, scale=2.0 + seed, out_dtype=torch.bfloat16, out=base if in_place else None)

    launch = _planned_and_unplanned(recorded_launches, expand_add_module._lora_expand_add_triton, make_inputs)
    assert 3.0 in _floats(launch)


WEIGHT_GRAD_CASES = [
    # (M, K, R, k_major, left token-major, out dtype)
    (600, 70, 16, False, True, torch.float32),
    (33, 96, 8, True, False, torch.bfloat16),
    (1100, 64, 24, True, True, torch.float32),
]


@pytest.mark.parametrize("case", WEIGHT_GRAD_CASES, ids=str)
def test_weight_grad_plan_launches_what_the_launcher_would(recorded_launches, case):
    M, K, R, k_major, token_major, out_dtype = case

    def make_inputs(seed):
        generator = torch.Generator().manual_seed(seed)
        left = _matrix(generator, M, R, torch.float32, token_major)
        return dict(
            left=left, x=_randn(generator, M, K), scale=0.25 + seed, k_major=k_major, out_dtype=out_dtype
        )

    launch = _planned_and_unplanned(
        recorded_launches, weight_grad_module._lora_weight_grad_triton, make_inputs
    )
    assert 1.25 in _floats(launch)


# (M, I, gate rank, up rank, rights transposed, gate and up the halves of one [M, 2I] tensor, activation)
GATED_FORWARD_CASES = [
    (33, 70, 16, 16, False, True, "silu"),
    (9, 40, 3, 8, True, False, "gelu_tanh"),
]


def _gated_forward_inputs(M, cols, gate_rank, up_rank, transposed, halves, activation, seed) -> dict:
    generator = torch.Generator().manual_seed(seed)
    if halves:
        gate_up = _randn(generator, M, 2 * cols)
        gate, up = gate_up[:, :cols], gate_up[:, cols:]
    else:
        gate, up = _randn(generator, M, cols), _randn(generator, M, cols)
    return dict(
        gate=gate, up=up, activation=activation,
        gate_left=_randn(generator, M, gate_rank, dtype=torch.float32),
        gate_right=_matrix(generator, cols, gate_rank, torch.float32, transposed), gate_scale=2.0 + seed,
        up_left=_randn(generator, M, up_rank, dtype=torch.float32),
        up_right=_matrix(generator, cols, up_rank, torch.bfloat16, transposed), up_scale=0.5 + seed,
    )  # fmt: skip


@pytest.mark.parametrize("case", GATED_FORWARD_CASES, ids=str)
def test_gated_forward_plan_launches_what_the_launcher_would(recorded_launches, case):
    launch = _planned_and_unplanned(
        recorded_launches,
        gated_forward._gated_act_lora_forward_triton,
        lambda seed: _gated_forward_inputs(*case, seed),
    )
    assert 3.0 in _floats(launch) and 1.5 in _floats(launch)  # call 2's own scales


# (M, cols, R, left token-major, grad_h transposed): rows split (this CPU counts one SM) or not, copies.
GATED_WEIGHT_GRAD_CASES = [
    (1100, 40, 16, True, False, "silu"),  # one column tile: the rows split in two
    (33, 70, 5, False, True, "gelu_tanh"),
]


@pytest.mark.parametrize("case", GATED_WEIGHT_GRAD_CASES, ids=str)
def test_gated_weight_grad_plan_launches_what_the_launcher_would(recorded_launches, case):
    M, cols, R, token_major, grad_transposed, activation = case

    def make_inputs(seed):
        generator = torch.Generator().manual_seed(seed)
        return dict(
            grad_h=_matrix(generator, M, cols, torch.bfloat16, grad_transposed),
            gate=_randn(generator, M, cols), up=_randn(generator, M, cols), activation=activation,
            left=_matrix(generator, M, R, torch.float32, token_major), scale=0.25 + seed,
        )  # fmt: skip

    launcher = gated_act_lora._gated_act_backward_weight_grad_triton
    launch = _planned_and_unplanned(recorded_launches, launcher, make_inputs)
    assert 1.25 in _floats(launch)


# (M, K, N, R, dtype, b K-major (a weight's transpose, the forward), right transposed (lora_a.T, dX),
# left token-major (lora_shrink's layout: copied row-major from 64 ranks on, `copies_left`))
TMA_ADDMM_CASES = [
    (33, 72, 40, 16, torch.bfloat16, True, False, False),
    (9, 40, 64, 5, torch.float16, False, True, True),
    (33, 72, 40, 70, torch.bfloat16, True, False, True),
]


def _tma_addmm_inputs(M, K, N, R, dtype, k_major, transposed, token_major, seed) -> dict:
    generator = torch.Generator().manual_seed(seed)
    b = _randn(generator, N, K, dtype=dtype).t() if k_major else _randn(generator, K, N, dtype=dtype)
    left = _matrix(generator, M, R, torch.float32, token_major)
    right = _matrix(generator, N, R, torch.float32, transposed)
    return dict(a=_randn(generator, M, K, dtype=dtype), b=b, left=left, right=right, scale=2.0 + seed)


@pytest.mark.parametrize("case", TMA_ADDMM_CASES, ids=str)
def test_tma_addmm_plan_launches_what_the_launcher_would(recorded_launches, case):
    """The TMA kernel's plan passes the tensors where the kernel takes descriptors: the launch encodes
    them as it encodes the launcher's own TensorDescriptors (the same C-launch arguments), a and b
    (b's [N, K] transpose when K-major) from their own addresses."""
    M, K, N, R, dtype, k_major, transposed, token_major = case
    _ENCODED_ADDRESSES.clear()
    make_inputs = lambda seed: _tma_addmm_inputs(M, K, N, R, dtype, k_major, transposed, token_major, seed)  # noqa: E731
    launch = _planned_and_unplanned(recorded_launches, lora_addmm._lora_addmm_tma_triton, make_inputs)
    assert 3.0 in _floats(launch)
    b_rows = (N, K) if k_major else (K, N)
    descriptors = [value for value in launch if type(value) is tuple and value[0] == "tma"]
    assert [value[5] for value in descriptors] == [(M, K), b_rows, (M, N)]  # a, b, the output
    inputs = make_inputs(2)
    for encoder in lora_addmm._lora_addmm_tma_kernel.direct.get(None).encoders:
        encoder.encoded.clear()  # freed inputs' addresses come back: start from nothing encoded
    _ENCODED_ADDRESSES.clear()
    out = lora_addmm._lora_addmm_tma_triton(**inputs)
    assert _ENCODED_ADDRESSES == [inputs["a"].data_ptr(), inputs["b"].data_ptr(), out.data_ptr()]
    # The same a and b again: their encoded descriptors are reused (only a new output's is encoded).
    lora_addmm._lora_addmm_tma_triton(**inputs)
    assert _ENCODED_ADDRESSES[:3] == [inputs["a"].data_ptr(), inputs["b"].data_ptr(), out.data_ptr()]
    assert len(_ENCODED_ADDRESSES) <= 4


def _shrink_op_inputs(seed):
    generator = torch.Generator().manual_seed(seed)
    return dict(
        x=_randn(generator, 33, 70), weight=_randn(generator, 16, 70, dtype=torch.float32), scale=0.5 + seed
    )


def _expand_op_inputs(seed):
    generator = torch.Generator().manual_seed(seed)
    base, left = _randn(generator, 33, 70), _randn(generator, 33, 16, dtype=torch.float32)
    return dict(
        base=base, left=left, right=_matrix(generator, 70, 16, torch.bfloat16, True), scale=2.0 + seed
    )


def _weight_grad_op_inputs(seed):
    generator = torch.Generator().manual_seed(seed)
    left, x = _randn(generator, 600, 8, dtype=torch.float32), _randn(generator, 600, 70)
    return dict(left=left, x=x, scale=0.25 + seed, k_major=True, out_dtype=torch.bfloat16)


def _gated_weight_grad_op_inputs(seed):
    generator = torch.Generator().manual_seed(seed)
    return dict(
        grad_h=_randn(generator, 33, 70), gate=_randn(generator, 33, 70), up=_randn(generator, 33, 70),
        activation="gelu_tanh", left=_randn(generator, 33, 5, dtype=torch.float32), scale=0.25 + seed,
    )  # fmt: skip


def _augmented_left_op_inputs(seed):
    generator = torch.Generator().manual_seed(seed)
    grad, grad_xa = _randn(generator, 33, 70), _matrix(generator, 33, 5, torch.float32, True)
    return dict(grad=grad, grad_xa=grad_xa, scale=0.25 + seed, width=80)


# (op, the module holding its checks and `runs_triton`, the check function, inputs by seed)
OP_CASES = {
    "lora_shrink": (lora_terms.lora_shrink, lora_terms, "_check_shrink", _shrink_op_inputs),
    "lora_shrink_keeping_weight_t": (
        lora_terms.lora_shrink_keeping_weight_t, lora_terms, "_check_shrink", _shrink_op_inputs,
    ),
    "lora_expand_add": (
        lambda **inputs: lora_terms.lora_expand_add(**inputs, out_dtype=torch.float16),
        expand_add_module, "_check_expand_add", _expand_op_inputs,
    ),
    "lora_expand_add_": (
        lora_terms.lora_expand_add_, expand_add_module, "_check_expand_add", _expand_op_inputs,
    ),
    "lora_weight_grad": (
        lora_terms.lora_weight_grad, weight_grad_module, "_check_weight_grad", _weight_grad_op_inputs,
    ),
    "gated_act_lora_forward_": (
        gated_forward.gated_act_lora_forward_, gated_forward, "_check_lora_forward_inputs",
        lambda seed: _gated_forward_inputs(33, 70, 16, 8, False, True, "silu", seed),
    ),
    "gated_act_backward_weight_grad_": (
        gated_act_lora.gated_act_backward_weight_grad_, gated_act_lora, "_check_weight_grad_inputs",
        _gated_weight_grad_op_inputs,
    ),
    "lora_augmented_left": (
        lora_augment.lora_augmented_left, lora_augment, "_check_augmented_left", _augmented_left_op_inputs,
    ),
    "lora_addmm (TMA)": (
        lora_addmm.lora_addmm, lora_addmm, "_check_lora_addmm",
        lambda seed: _tma_addmm_inputs(33, 72, 40, 16, torch.bfloat16, True, True, False, seed),
    ),
    "dequantize_4bit": (
        dequant4bit.dequantize_4bit, dequant4bit, "_check_dequantize",
        lambda seed: _dequantize_inputs(33, 70, 128, True, torch.uint8, seed),
    ),
    "dequantize_4bit (not nested)": (
        dequant4bit.dequantize_4bit, dequant4bit, "_check_dequantize",
        lambda seed: _dequantize_inputs(7, 64, 64, False, torch.float32, seed),
    ),
    "dequantize_4bit_group": (
        dequant4bit_group.dequantize_4bit_group, dequant4bit_group, "_check_group",
        lambda seed: _dequantize_group_op_inputs(True, seed),
    ),
    "dequantize_4bit_group (not nested)": (
        dequant4bit_group.dequantize_4bit_group, dequant4bit_group, "_check_group",
        lambda seed: _dequantize_group_op_inputs(False, seed),
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(OP_CASES))
def test_ops_launch_from_their_plans_without_rechecking(recorded_launches, monkeypatch, name):
    """An op's second call with inputs of the first's metadata launches from the plan before its input
    checks (they read only what the key holds), and passes the kernel what the unplanned op passes."""
    op, module, check_name, make_inputs = OP_CASES[name]
    monkeypatch.setattr(module, "runs_triton", lambda tensor: True)  # CPU tensors reach the launcher
    checks: list[str] = []
    check = getattr(module, check_name)

    def counting_check(*args, **kwargs):
        checks.append(check_name)
        return check(*args, **kwargs)

    monkeypatch.setattr(module, check_name, counting_check)
    _planned_and_unplanned(recorded_launches, lambda **inputs: op(**inputs), make_inputs)
    assert len(checks) == 2, "call 2 (from the plan) checked its inputs again, or call 1 or 3 did not"


def test_a_plan_never_serves_inputs_that_fail_the_checks(recorded_launches, monkeypatch):
    monkeypatch.setattr(lora_terms, "runs_triton", lambda tensor: True)
    inputs = _shrink_op_inputs(0)
    lora_terms.lora_shrink(**inputs)
    with pytest.raises(ValueError, match="K"):
        lora_terms.lora_shrink(inputs["x"][:, :69], inputs["weight"])
    with pytest.raises(ValueError, match="must be float32, bfloat16 or float16"):
        lora_terms.lora_shrink(inputs["x"].to(torch.int32), inputs["weight"])


@pytest.mark.parametrize("name", sorted(OP_CASES))
def test_ops_on_cpu_tensors_never_look_plans_up(monkeypatch, name):
    """With plans on and no interpreter, CPU tensors run the reference: their op must not build a plan
    key, which asks for the current CUDA device (a CPU-only torch raises there)."""
    op, module, _, make_inputs = OP_CASES[name]
    monkeypatch.setattr(_launch.LaunchPlans, "enabled", True)
    monkeypatch.setattr(module, "runs_triton", lambda tensor: False)

    def no_cuda():
        raise AssertionError("a CPU op asked for the current CUDA device")

    monkeypatch.setattr(torch.cuda, "current_device", no_cuda)
    op(**make_inputs(0))


def _dequantize_inputs(rows: int, cols: int, blocksize: int, nested: bool, absmax_dtype, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    blocks = -(-rows * cols // blocksize)
    inputs = dict(
        packed=torch.randint(0, 256, ((rows * cols + 1) // 2,), dtype=torch.uint8, generator=generator),
        code=dequant4bit_reference.code_for("nf4"),
        blocksize=blocksize, rows=rows, cols=cols, out_dtype=torch.bfloat16,
    )  # fmt: skip
    if nested:
        inputs.update(
            absmax=torch.randint(0, 256, (blocks,), dtype=torch.uint8, generator=generator),
            nested_absmax=torch.rand(-(-blocks // 4), generator=generator) + 0.1,
            nested_code=torch.linspace(-1, 1, 256),
            nested_offset=torch.tensor([0.01 * seed]),
            nested_blocksize=4,
        )  # fmt: skip
    else:
        absmax = (torch.rand(blocks, generator=generator) + 0.1).to(absmax_dtype)
        inputs.update(absmax=absmax, nested_absmax=None, nested_code=None, nested_offset=None)
        inputs.update(nested_blocksize=0)
    return inputs


# (rows, cols, blocksize, nested, absmax dtype): fp16 absmax is converted by the launcher, so never planned.
DEQUANTIZE_CASES = [(7, 64, 64, False, torch.float32), (33, 70, 128, True, torch.uint8)]


@pytest.mark.parametrize("case", DEQUANTIZE_CASES, ids=str)
def test_dequantize_plan_launches_what_the_launcher_would(recorded_launches, case):
    launch = _planned_and_unplanned(
        recorded_launches, dequant4bit._dequantize_4bit_triton, lambda seed: _dequantize_inputs(*case, seed)
    )
    assert launch[3] == 77


def test_dequantize_into_a_given_out_checks_the_out_on_a_plan_hit(recorded_launches, monkeypatch):
    """The out of `dequantize_4bit_` is not in the plan's key: a hit still checks it."""
    monkeypatch.setattr(dequant4bit, "runs_triton", lambda tensor: True)
    inputs = _dequantize_inputs(33, 70, 128, True, torch.uint8, seed=0)
    out_dtype = inputs.pop("out_dtype")
    dequant4bit.dequantize_4bit(**inputs, out_dtype=out_dtype)  # makes the plan
    good = torch.empty(33, 70, dtype=out_dtype)
    dequant4bit.dequantize_4bit_(good, **inputs)
    assert len(_THROUGH_CACHE) == 1, "the out variant did not launch from the plan"
    with pytest.raises(ValueError, match="out must be a contiguous"):
        dequant4bit.dequantize_4bit_(torch.empty(70, 33, dtype=out_dtype).t(), **inputs)
    with pytest.raises(ValueError, match="storage starts"):
        dequant4bit.dequantize_4bit_(torch.empty(34, 70, dtype=out_dtype)[1:], **inputs)


def test_dequantize_is_not_planned_when_the_launcher_converts_an_input(recorded_launches):
    inputs = _dequantize_inputs(7, 64, 64, False, torch.float16, seed=0)
    dequant4bit._dequantize_4bit_triton(**inputs)
    assert dequant4bit._DEQUANTIZE_PLANS.plans == {}


# A q/k/v-like group: three members of other shapes, nested or not (a member's shape is (rows, cols)).
_GROUP_SHAPES = ((33, 70), (7, 64), (12, 64))


def _dequantize_group_members(nested: bool, seed: int) -> list[dequant4bit_group.Member]:
    members = []
    for index, (rows, cols) in enumerate(_GROUP_SHAPES):
        inputs = _dequantize_inputs(rows, cols, 64, nested, torch.float32, seed * 7 + index)
        members.append(dequant4bit_group.Member(*(inputs[name] for name in dequant4bit_group.Member._fields)))
    return members


def _dequantize_group_op_inputs(nested: bool, seed: int) -> dict:
    members = _dequantize_group_members(nested, seed)
    inputs = {
        name: [getattr(member, name) for member in members] for name in dequant4bit_group.Member._fields
    }
    return dict(inputs, blocksize=64, nested_blocksize=4 if nested else 0, out_dtype=torch.bfloat16)


@pytest.mark.parametrize("count", [1, 2, 3])
def test_dequantize_group_plan_passes_each_member_its_own_tensors(recorded_launches, count):
    """A plan made where two members shared a tensor (the cached NF4 code, here every input alike)
    must still pass each member of a later call its own tensors, and outputs made for that call."""
    first = _dequantize_group_members(True, seed=0)[:count]
    shared = [member._replace(code=first[0].code, nested_code=first[0].nested_code) for member in first]
    dequant4bit_group._dequantize_4bit_group_triton(shared, 64, 4, torch.bfloat16)
    assert len(_THROUGH_CACHE) == 1
    second = _dequantize_group_members(True, seed=1)[:count]
    second = [
        member._replace(code=member.code.clone(), nested_code=member.nested_code.clone()) for member in second
    ]
    outs = dequant4bit_group._dequantize_4bit_group_triton(second, 64, 4, torch.bfloat16)
    assert len(_THROUGH_CACHE) == 1, "call 2 did not launch from the plan"
    _launch.LaunchPlans.enabled = False
    dequant4bit_group._dequantize_4bit_group_triton(second, 64, 4, torch.bfloat16)
    _launch.LaunchPlans.enabled = True
    planned, unplanned = recorded_launches[1], recorded_launches[2]
    inputs = [tensor for member in second for tensor in member[:6] if tensor is not None]
    _same_launch(planned, unplanned, inputs)
    tensors = [value for value in planned if isinstance(value, torch.Tensor)]
    for slot in range(dequant4bit_group.MAX_MEMBERS):
        member = min(slot, count - 1)
        assert tensors[slot * 7 + 2] is second[member].code
        assert tensors[slot * 7 + 6] is outs[member]


@pytest.mark.parametrize("member", [0, 1, 2])
def test_dequantize_group_plans_are_keyed_by_every_member(recorded_launches, member):
    """A member of other rows, or with an absmax of another dtype, is another plan, wherever it sits."""
    members = _dequantize_group_members(False, seed=0)
    dequant4bit_group._dequantize_4bit_group_triton(members, 64, 0, torch.bfloat16)
    rows, cols = _GROUP_SHAPES[member]
    taller = _dequantize_inputs(rows + 5, cols, 64, False, torch.float32, seed=9)
    changes = [
        dequant4bit_group.Member(*(taller[name] for name in dequant4bit_group.Member._fields)),
        members[member]._replace(absmax=members[member].absmax.to(torch.bfloat16)),
    ]
    for launches, change in enumerate(changes, start=2):
        other = list(members)
        other[member] = change
        outs = dequant4bit_group._dequantize_4bit_group_triton(other, 64, 0, torch.bfloat16)
        assert len(_THROUGH_CACHE) == launches, "a call with another member was served the first plan"
        assert outs[member].shape == (change.rows, cols)
    sizes = [value for value in recorded_launches[1] if type(value) is int]
    assert (rows + 5) * cols in sizes  # the taller member's element count reached the kernel


def test_dequantize_group_is_not_planned_when_the_launcher_converts_an_input(recorded_launches):
    members = _dequantize_group_members(False, seed=0)
    members[1] = members[1]._replace(absmax=members[1].absmax.half())
    dequant4bit_group._dequantize_4bit_group_triton(members, 64, 0, torch.bfloat16)
    assert dequant4bit_group._GROUP_PLANS.plans == {}


def test_plans_are_keyed_by_strides_alignment_dtype_and_device(recorded_launches, monkeypatch):
    """Inputs that differ in anything a launch depends on get their own plan."""
    storage = torch.randn(70 * 40 + 8).to(torch.bfloat16)
    weight = torch.randn(16, 40).to(torch.bfloat16)
    variants = [
        storage[: 70 * 40].view(70, 40),
        storage[8 : 8 + 70 * 40].view(70, 40),  # 16 bytes further: aligned, the same plan
        storage[1 : 1 + 70 * 40].view(70, 40),  # 2 bytes further: not aligned
        storage[: 70 * 40].view(40, 70).t(),  # column-major
        storage[: 70 * 40].view(70, 40).float(),  # another dtype
        storage[: 69 * 40].view(69, 40),  # another shape
    ]
    for x in variants:
        lora_terms._lora_shrink_triton(x=x, weight=weight)
    assert len(lora_terms._SHRINK_PLANS.plans) == 5
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    lora_terms._lora_shrink_triton(x=variants[0], weight=weight)
    assert len(lora_terms._SHRINK_PLANS.plans) == 6
    # A Parameter subclass (bitsandbytes' are) is keyed by its metadata too: a key holding the
    # tensor itself would keep it alive, and match nothing else.
    lora_terms._lora_shrink_triton(x=variants[0], weight=_Weight(weight))
    assert len(lora_terms._SHRINK_PLANS.plans) == 6
    for key in lora_terms._SHRINK_PLANS.plans:
        assert not any(isinstance(part, torch.Tensor) for part in key), key


class _Weight(torch.nn.Parameter):
    """A Parameter subclass, as quantization libraries make."""


def test_explicit_tiles_never_use_a_plan(recorded_launches):
    """Tests and tuners pass tiles of their own: those launches are neither planned nor served by a plan."""
    x, weight = torch.randn(40, 64).to(torch.bfloat16), torch.randn(16, 64).to(torch.bfloat16)
    lora_terms._lora_shrink_triton(x=x, weight=weight, block_m=16)
    assert lora_terms._SHRINK_PLANS.plans == {}
    lora_terms._lora_shrink_triton(x=x, weight=weight)  # the default tiles: planned
    lora_terms._lora_shrink_triton(x=x, weight=weight, block_m=16, block_k=32)
    _launch.LaunchPlans.enabled = False
    lora_terms._lora_shrink_triton(x=x, weight=weight, block_m=16, block_k=32)
    _launch.LaunchPlans.enabled = True
    _same_launch(recorded_launches[2], recorded_launches[3], [x, weight])
    assert recorded_launches[2][-6:] != recorded_launches[1][-6:]  # other constexprs than the plan's


def test_a_full_plan_cache_starts_over(recorded_launches, monkeypatch):
    monkeypatch.setattr(_launch.LaunchPlans, "MAX_PLANS", 2)
    weight = torch.randn(16, 32).to(torch.bfloat16)
    for rows in (3, 4, 5):
        lora_terms._lora_shrink_triton(x=torch.randn(rows, 32).to(torch.bfloat16), weight=weight)
    assert len(lora_terms._SHRINK_PLANS.plans) == 1


def test_plans_switch_only_on_the_class():
    # An instance attribute would shadow the class's switch, which the launch recorders set: with
    # pytest 9.1 (pytest-dev/pytest#10644), patching `enabled` on one instance left one behind.
    plans = lora_terms._SHRINK_PLANS
    with pytest.raises(AttributeError):
        plans.enabled = False
    with pytest.MonkeyPatch.context() as patch, pytest.raises(AttributeError):
        patch.setattr(plans, "enabled", False)


@needs_cuda
def test_planned_launches_compute_the_reference(triton_launches):
    """On the GPU: the second call of each op with new values of the same metadata runs from its plan
    (counted at `BoundLaunch.__call__`) and still computes the reference. Relative errors the H200
    showed (printed with -s; `docs/benchmarks/session13/gpu_tests_gated_plans.log`), and the bounds:
    shrink 9.2e-8, weight grad 9.3e-8 and the gated dA 1.5e-7, bound 1e-6 (fp32-accurate dots against
    float64, the gated dA against an fp32 sum over the same bf16 h); expand-add 1.0e-3 and the gated
    forward up to 1.4e-3, bound 5e-3 (tf32 terms rounded into bf16 outputs, against a reference that
    rounds an fp32 sum once); the gated gate/up gradients 8.7e-8 and 0, bound 1e-5 (bf16 results of
    elementwise math, against the reference's own bf16 rounding)."""
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    errors: dict[str, float] = {}

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=generator, device=device).to(dtype)

    def assert_near(name, got, expected, tolerance):
        error = ((got.double() - expected.double()).norm() / expected.double().norm()).item()
        errors[name] = max(errors.get(name, 0.0), error)
        assert error < tolerance, (name, error)

    for _ in range(2):
        x, weight = randn(333, 520), randn(16, 520, dtype=torch.float32)
        shrink = lora_terms.lora_shrink(x, weight, 0.5)
        assert_near("shrink", shrink, reference.lora_shrink(x.double(), weight.double(), 0.5), 1e-6)
        base, left, right = randn(333, 260), 0.1 * randn(333, 16, dtype=torch.float32), randn(16, 260).t()
        expected = reference.lora_expand_add(base, left, right, 2.0, torch.bfloat16)
        assert_near("expand_add", lora_terms.lora_expand_add_(base, left, right, 2.0), expected, 5e-3)
        grad = lora_terms.lora_weight_grad(left, x, 0.25, k_major=True, out_dtype=torch.float32)
        expected = reference.lora_weight_grad(left.double(), x.double(), 0.25)
        assert_near("weight_grad", grad, expected, 1e-6)
        gate_up, gate_right, up_right = (
            randn(333, 2 * 260),
            randn(260, 16),
            randn(260, 16, dtype=torch.float32),
        )
        gate, up = gate_up[:, :260], gate_up[:, 260:]
        terms = (left, gate_right, 2.0, 0.5 * left, up_right, 0.5)
        expected = gated_act_reference.gated_act_lora_forward(gate, up, "silu", *terms)
        hidden = gated_forward.gated_act_lora_forward_(gate, up, "silu", *terms)
        for name, got, want in zip(("forward gate", "forward up", "forward h"), (gate, up, hidden), expected):
            assert_near(name, got, want, 5e-3)
        grad_h, gate, up = randn(333, 260), randn(333, 260), randn(333, 260)
        # h rounded to bf16 as the kernel rounds it: the reference's fp32 sum over the same h.
        expected = gated_act_reference.gated_act_backward_weight_grad(grad_h, gate, up, "silu", left, 0.25)
        grad_weight = gated_act_lora.gated_act_backward_weight_grad_(grad_h, gate, up, "silu", left, 0.25)
        names = ("backward gate", "backward up", "backward dA")
        for name, got, want, tolerance in zip(names, (gate, up, grad_weight), expected, (1e-5, 1e-5, 1e-6)):
            assert_near(name, got, want, tolerance)
    print("relative errors against the references:", {name: f"{error:.2e}" for name, error in errors.items()})
    assert lora_terms._SHRINK_PLANS.get(lora_terms._shrink_plan_key(x, weight)) is not None
    for kernel in (
        "_lora_shrink_kernel", "_lora_expand_add_kernel", "_lora_weight_grad_kernel",
        "_gated_act_lora_forward_kernel", "_gated_act_backward_weight_grad_kernel",
    ):  # fmt: skip
        assert triton_launches[kernel] == 2, kernel


@needs_cuda
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs a Hopper GPU"
)
@pytest.mark.parametrize("k_major", [True, False], ids=["forward", "dx"])
def test_tma_plan_launches_directly_and_computes_the_reference(triton_launches, monkeypatch, k_major):
    """On Hopper: lora_addmm's TMA kernel launches through its C launch with our descriptor encoders
    (no Triton wrapper), from its plan on the second call, and each call still computes the reference
    (new values at the same addresses, so the reused encodings read the new values)."""
    device = torch.device("cuda")
    monkeypatch.setattr(lora_addmm._TMA_PLANS, "plans", {})
    generator = torch.Generator(device=device).manual_seed(0)
    M, K, N, R = 1000, 512, 384, 16
    a = torch.empty(M, K, device=device, dtype=torch.bfloat16)
    b_rows = torch.empty((N, K) if k_major else (K, N), device=device, dtype=torch.bfloat16)
    b = b_rows.t() if k_major else b_rows
    left = torch.empty(M, R, device=device)
    right = torch.empty(R, N, device=device).t()  # lora_a.T-like: copied by the launcher
    for call in range(3):
        for tensor in (a, b_rows, left, right):
            tensor.copy_(torch.randn(tensor.shape, generator=generator, device=device))
        out = lora_addmm.lora_addmm(a, b, left, right, 0.5 + call)
        expected = lora_addmm.reference.lora_addmm(
            a.double(), b.double(), left.double(), right.double(), 0.5 + call
        )
        error = ((out.double() - expected).norm() / expected.norm()).item()
        assert error < 5e-3, (call, error)  # one bf16 rounding of an fp32 sum
    assert triton_launches["_lora_addmm_tma_kernel"] == 3
    plan = lora_addmm._TMA_PLANS.get(lora_addmm._tma_plan_key(a, b, left, right))
    assert plan is not None and plan.launch.direct is not None
    assert len(plan.launch.direct.encoders) == 3
    assert all(encoder.encoded for encoder in plan.launch.direct.encoders)
