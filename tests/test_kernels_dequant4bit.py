"""The 4-bit dequantization op against bitsandbytes, bit for bit, on the Triton path and the reference.

Run under ``TRITON_INTERPRET=1`` to test the Triton kernel on the CPU; without it the Triton cases
skip and the reference runs. On a CUDA machine both run on the GPU against bitsandbytes' CUDA kernels.
Shapes are multiples of 64 where bitsandbytes quantizes them (its CPU kernels need that); the mask
tests use odd shapes against the reference.
"""

from __future__ import annotations

import itertools
import zlib
from typing import NamedTuple

import pytest
import torch
from conftest import LaunchSpy

from fastlora_peft.kernels import dequant4bit, dequant4bit_reference
from fastlora_peft.kernels._backend import runs_triton
from fastlora_peft.kernels._launch import LaunchPlans
from fastlora_peft.kernels.dequant4bit import Quant4bitState, dequantize, dequantize_4bit

bnb = pytest.importorskip("bitsandbytes")
bnb_functional = pytest.importorskip("bitsandbytes.functional")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TRITON_RUNS = runs_triton(torch.empty(0, device=DEVICE))
needs_triton = pytest.mark.skipif(not TRITON_RUNS, reason="Triton runs on CUDA or under TRITON_INTERPRET=1")
needs_reference_path = pytest.mark.skipif(TRITON_RUNS, reason="this device runs the Triton kernel")

_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.uint8: "u8"}
_BITS_DTYPE = {4: torch.int32, 2: torch.int16}


class Case(NamedTuple):
    quant_type: str
    nested: bool
    blocksize: int
    dtype: torch.dtype  # the weight's dtype: bitsandbytes dequantizes back to it
    storage: torch.dtype
    shape: tuple[int, int]

    @property
    def id(self) -> str:
        nested = "nested" if self.nested else "plain"
        rows, cols = self.shape
        dtype, storage = _DTYPE_NAMES[self.dtype], _DTYPE_NAMES[self.storage]
        return f"{self.quant_type}-{nested}-b{self.blocksize}-{dtype}-{storage}store-{rows}x{cols}"


_SHAPES = ((64, 128), (192, 64), (128, 320))
# The full product of the quantization settings; the shape cycles so each setting meets one of them.
CASES = [
    Case(quant_type, nested, blocksize, dtype, storage, _SHAPES[index % len(_SHAPES)])
    for index, (quant_type, nested, blocksize, dtype, storage) in enumerate(
        itertools.product(
            ("nf4", "fp4"),
            (False, True),
            (64, 128, 256),
            (torch.float32, torch.bfloat16, torch.float16),
            (torch.uint8, torch.bfloat16),
        )
    )
] + [
    Case("nf4", True, 32, torch.bfloat16, torch.uint8, (64, 128)),
    Case("fp4", True, 512, torch.float16, torch.float32, (192, 64)),
    Case("nf4", False, 4096, torch.bfloat16, torch.float32, (128, 320)),
]


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Same dtype, shape and bits (so also the sign of zero, which torch.equal ignores)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    bits = _BITS_DTYPE[actual.element_size()]
    differ = actual.view(bits) != expected.view(bits)
    assert not differ.any(), f"{int(differ.sum())} of {actual.numel()} values differ from bitsandbytes"


_quantized: dict[Case, tuple] = {}

# bitsandbytes 0.50 dequantizes on a CPU of torch's "AVX512" capability with a native AVX-512 kernel
# that gets blocks of 128 and 256 wrong (most values differ; seen on an AMD EPYC with AVX-512, where
# blocks of 64 agree with its generic code). Its own generic implementation, which it takes there for
# blocks of 2048 and up and for odd shapes, stands in on such CPUs; elsewhere its kernels decide.
_BNB_AVX512_KERNEL = DEVICE.type == "cpu" and torch.backends.cpu.get_cpu_capability() == "AVX512"


def bnb_dequantize(packed: torch.Tensor, quant_state) -> torch.Tensor:
    """bitsandbytes' dequantization of `packed` (its CUDA or CPU kernel, or on an AVX-512 CPU its
    generic implementation, see `_BNB_AVX512_KERNEL`)."""
    if not _BNB_AVX512_KERNEL:
        return bnb_functional.dequantize_4bit(packed, quant_state)
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
    from bitsandbytes.backends.utils import _get_4bit_code

    # bitsandbytes wraps it in torch.compile (functools.wraps keeps the plain function): eager, the
    # same arithmetic without a compile per shape (dynamo hit its recompile limit here).
    dequantize_compute = getattr(_dequantize_4bit_compute, "__wrapped__", _dequantize_4bit_compute)

    absmax = quant_state.absmax
    if quant_state.nested:  # as bnb_functional.dequantize_4bit unpacks the nested statistics
        absmax = (
            bnb_functional.dequantize_blockwise(quant_state.absmax, quant_state.state2) + quant_state.offset
        )
    code = _get_4bit_code(quant_state.quant_type, packed.device).clone()
    if quant_state.quant_type == "fp4":  # -0.0, as its native kernels give (test_fp4_code_eight_...)
        code[8] = -0.0
    shape, dtype = quant_state.shape, quant_state.dtype
    return dequantize_compute(
        packed.view(torch.uint8).reshape(-1), absmax.float(), code, quant_state.blocksize, shape, dtype
    )


def quantized(case: Case) -> tuple[torch.Tensor, object, torch.Tensor]:
    """(packed, bitsandbytes QuantState, bitsandbytes' dequantization) for a case, made once."""
    if case not in _quantized:
        generator = torch.Generator().manual_seed(zlib.crc32(case.id.encode()))
        weight = torch.randn(case.shape, generator=generator) * 0.02
        weight[0, :8] = torch.tensor([0.0, -0.0, 1e-9, -1e-9, 0.5, -0.5, 1e-3, -1e-3])  # zeros, outliers
        packed, quant_state = bnb_functional.quantize_4bit(
            weight.to(DEVICE, case.dtype),
            blocksize=case.blocksize,
            compress_statistics=case.nested,
            quant_type=case.quant_type,
            quant_storage=case.storage,
        )
        _quantized[case] = (packed, quant_state, bnb_dequantize(packed, quant_state))
    return _quantized[case]


def _reference_from_state(state: Quant4bitState, packed: torch.Tensor) -> torch.Tensor:
    return dequant4bit_reference.dequantize_4bit(
        packed, state.absmax, state.code, state.nested_absmax, state.nested_code, state.nested_offset,
        state.blocksize, state.nested_blocksize, state.rows, state.cols, state.dtype,
    )  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_reference_matches_bitsandbytes(case: Case) -> None:
    packed, quant_state, expected = quantized(case)
    state = Quant4bitState.from_bnb(quant_state, packed)
    assert_bitwise_equal(_reference_from_state(state, packed), expected)


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_triton_matches_bitsandbytes(case: Case) -> None:
    packed, quant_state, expected = quantized(case)
    state = Quant4bitState.from_bnb(quant_state, packed)
    assert state.nested == case.nested and state.shape == case.shape and state.dtype == case.dtype
    assert_bitwise_equal(dequantize(state, packed), expected)


@pytest.mark.parametrize(
    "quant_type, nested, storage",
    [("nf4", True, torch.uint8), ("fp4", False, torch.bfloat16), ("nf4", False, torch.float32)],
    ids=["nf4-nested-u8store", "fp4-plain-bf16store", "nf4-plain-fp32store"],
)
def test_params4bit_of_a_linear4bit(quant_type: str, nested: bool, storage: torch.dtype) -> None:
    """A real Linear4bit's weight: from_bnb(param) and dequantize(state, param) on whichever path runs."""
    torch.manual_seed(0)
    layer = bnb.nn.Linear4bit(
        192, 64, bias=False, compute_dtype=torch.bfloat16,
        compress_statistics=nested, quant_type=quant_type, quant_storage=storage,
    )  # fmt: skip
    layer.weight.data = (torch.randn(64, 192) * 0.02).to(torch.bfloat16)
    layer = layer.to(DEVICE)  # quantizes
    param = layer.weight
    assert param.dtype == storage and param.bnb_quantized
    expected = bnb_dequantize(param.data, param.quant_state)
    state = Quant4bitState.from_bnb(param)
    assert_bitwise_equal(dequantize(state, param), expected)
    # The state as a checkpoint stores it: offset and code rebuilt from the state dict.
    reloaded = bnb_functional.QuantState.from_dict(param.quant_state.as_dict(packed=True), device=DEVICE)
    assert_bitwise_equal(dequantize(Quant4bitState.from_bnb(reloaded, param), param), expected)


def test_fp4_code_eight_is_negative_zero() -> None:
    """bitsandbytes' kernels give -0.0 for FP4 code 8 (get_4bit_type's table says +0.0). On an AVX-512
    CPU the stand-in for them (`bnb_dequantize`) is given that -0.0, so the check bites elsewhere."""
    packed = torch.tensor([0x80, 0x08], dtype=torch.uint8, device=DEVICE)
    absmax = torch.ones(1, device=DEVICE)
    code = dequant4bit_reference.code_for("fp4", DEVICE)
    out = dequantize_4bit(packed, absmax, code, None, None, None, 64, 0, 1, 4, torch.float32)
    assert torch.equal(torch.signbit(out), torch.tensor([[True, False, False, True]], device=DEVICE))
    quant_state = bnb_functional.QuantState(
        absmax=absmax, shape=torch.Size((1, 4)), dtype=torch.float32, blocksize=64, quant_type="fp4"
    )
    assert_bitwise_equal(out, bnb_dequantize(packed, quant_state))


def _random_inputs(rows: int, cols: int, blocksize: int, nested: bool, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    numel = rows * cols
    blocks = -(-numel // blocksize)
    args = dict(
        packed=torch.randint(0, 256, ((numel + 1) // 2,), dtype=torch.uint8, generator=generator),
        code=dequant4bit_reference.code_for("nf4"),
        blocksize=blocksize, rows=rows, cols=cols,
    )  # fmt: skip
    if nested:
        nested_blocksize = 3  # not a power of two, not a divisor of the block count
        args.update(
            absmax=torch.randint(0, 256, (blocks,), dtype=torch.uint8, generator=generator),
            nested_absmax=torch.rand(-(-blocks // nested_blocksize), generator=generator) + 0.1,
            nested_code=torch.linspace(-1, 1, 256),
            nested_offset=torch.tensor([0.0371]),
            nested_blocksize=nested_blocksize,
        )
    else:
        args.update(
            absmax=torch.rand(blocks, generator=generator) + 0.1,
            nested_absmax=None, nested_code=None, nested_offset=None, nested_blocksize=0,
        )  # fmt: skip
    return {
        name: value.to(DEVICE) if isinstance(value, torch.Tensor) else value for name, value in args.items()
    }


@needs_triton
@pytest.mark.parametrize(
    "rows, cols, blocksize, nested, elements_per_program",
    [(7, 50, 64, False, 128), (3, 5, 32, True, 64), (33, 70, 128, True, 512), (5, 100, 32, False, 4096)],
    ids=[
        "7x50-b64-plain-tile128",
        "3x5-b32-nested-tile64",
        "33x70-b128-nested-tile512",
        "5x100-b32-one-tile",
    ],
)
@pytest.mark.parametrize("out_dtype", (torch.float32, torch.bfloat16, torch.float16), ids=_DTYPE_NAMES.get)
def test_triton_masks_match_reference(rows, cols, blocksize, nested, elements_per_program, out_dtype) -> None:
    """Odd element counts, a partial last block and a partial last program, several programs."""
    args = _random_inputs(rows, cols, blocksize, nested, seed=rows * cols)
    expected = dequant4bit_reference.dequantize_4bit(**args, out_dtype=out_dtype)
    actual = dequant4bit._dequantize_4bit_triton(
        **args, out_dtype=out_dtype, elements_per_program=elements_per_program
    )
    assert_bitwise_equal(actual, expected)


def _both_paths(case: Case) -> tuple[list[torch.Tensor], torch.Tensor]:
    """dequantize()'s eager call and the library op on one case, and bitsandbytes' result."""
    packed, quant_state, expected = quantized(case)
    state = Quant4bitState.from_bnb(quant_state, packed)
    args = (
        packed, state.absmax, state.code, state.nested_absmax, state.nested_code, state.nested_offset,
        state.blocksize, state.nested_blocksize, state.rows, state.cols, state.dtype,
    )  # fmt: skip
    return [dequantize(state, packed), torch.ops.fastlora.dequantize_4bit(*args)], expected


@needs_triton
def test_triton_kernel_runs_where_triton_runs(monkeypatch) -> None:
    spy = LaunchSpy(dequant4bit._dequantize_4bit_kernel)
    monkeypatch.setattr(dequant4bit, "_dequantize_4bit_kernel", spy)
    monkeypatch.setattr(LaunchPlans, "enabled", False)  # through the spied kernel, not an earlier plan

    def reference_must_not_run(*args, **kwargs):
        raise AssertionError("the reference ran where the Triton kernel should have")

    monkeypatch.setattr(dequant4bit.reference, "dequantize_4bit", reference_must_not_run)
    outputs, expected = _both_paths(CASES[-3])
    for out in outputs:
        assert_bitwise_equal(out, expected)
    assert spy.grids == [(2,), (2,)]  # 64 x 128 = 8192 elements, 4096 a program; eager call, then op


@needs_reference_path
def test_reference_runs_without_triton(monkeypatch) -> None:
    calls = []
    original = dequant4bit.reference.dequantize_4bit

    def reference_spy(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    def triton_must_not_run(**kwargs):
        raise AssertionError("the Triton launcher ran on a plain CPU call")

    monkeypatch.setattr(dequant4bit.reference, "dequantize_4bit", reference_spy)
    monkeypatch.setattr(dequant4bit, "_dequantize_4bit_triton", triton_must_not_run)
    outputs, expected = _both_paths(CASES[0])
    for out in outputs:
        assert_bitwise_equal(out, expected)
    assert len(calls) == 2


@pytest.mark.parametrize("nested", (False, True), ids=("plain", "nested"))
def test_opcheck(nested: bool) -> None:
    args = _random_inputs(64, 64, 64, nested, seed=1)
    ordered = tuple(
        args[name]
        for name in (
            "packed", "absmax", "code", "nested_absmax", "nested_code", "nested_offset",
            "blocksize", "nested_blocksize", "rows", "cols",
        )
    ) + (torch.bfloat16,)  # fmt: skip
    torch.library.opcheck(dequantize_4bit, ordered)


def test_compiled_call_matches_bitsandbytes() -> None:
    """Under torch.compile dequantize() goes through the library op, with no graph break."""
    packed, quant_state, expected = quantized(CASES[9])
    compiled = torch.compile(dequantize, fullgraph=True, backend="eager")
    assert_bitwise_equal(compiled(Quant4bitState.from_bnb(quant_state, packed), packed), expected)


def test_cpu_repacked_layout_is_refused() -> None:
    packed, quant_state, _ = quantized(CASES[0])
    names = ("absmax", "shape", "code", "blocksize", "quant_type", "dtype", "offset", "state2")
    copy = bnb_functional.QuantState(**{name: getattr(quant_state, name) for name in names})
    convert = getattr(bnb_functional, "_convert_weight_packed_for_cpu", None)
    if convert is not None and DEVICE.type == "cpu":
        packed, copy = convert(packed.clone(), copy)  # what Linear4bit.forward does on AVX512-BF16 CPUs
    else:
        copy.packing_format_for_cpu = True
    with pytest.raises(ValueError, match="packing_format_for_cpu"):
        Quant4bitState.from_bnb(copy, packed)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(blocksize=48), "blocksize"),
        (dict(absmax=torch.ones(3)), "one value per block"),
        (dict(code=torch.ones(8)), "code"),
        (dict(out_dtype=torch.int8), "out_dtype"),
        (dict(rows=128), "bytes"),
        (dict(nested_code=torch.ones(256)), "together"),
    ],
    ids=["blocksize", "absmax-count", "code-size", "out-dtype", "too-few-bytes", "half-nested"],
)
def test_bad_inputs_raise(change: dict, message: str) -> None:
    args = {**_random_inputs(64, 64, 64, False, seed=2), "out_dtype": torch.float32}
    args.update({k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in change.items()})
    with pytest.raises(ValueError, match=message):
        dequantize_4bit(**args)


def _linear4bit(nested: bool, seed: int) -> "bnb.nn.Linear4bit":
    torch.manual_seed(seed)
    layer = bnb.nn.Linear4bit(
        192, 64, bias=False, compute_dtype=torch.bfloat16, compress_statistics=nested, quant_type="nf4"
    )
    layer.weight.data = (torch.randn(64, 192) * 0.02).to(torch.bfloat16)
    return layer.to(DEVICE)  # quantizes


def _same_state(actual: Quant4bitState, expected: Quant4bitState) -> bool:
    return all(torch.equal(a, e) if isinstance(a, torch.Tensor) else a == e for a, e in zip(actual, expected))


@pytest.mark.parametrize("nested", (False, True), ids=("plain", "nested"))
def test_state_reader_reads_once_and_again_on_any_change(nested: bool) -> None:
    """BnbStateReader hands out one state while nothing from_bnb reads has changed, and reads again
    when anything has: a replaced tensor, an in-place change, a replaced parameter, a changed field."""
    layer = _linear4bit(nested, seed=0)
    reader = dequant4bit.BnbStateReader()
    param = layer.weight
    first = reader(param)
    assert _same_state(first, Quant4bitState.from_bnb(param))
    assert reader(param) is first, "read again with nothing changed"

    quant_state = param.quant_state
    # What QuantState.to does: new tensors. A plain fp16 absmax is converted by from_bnb (a copy).
    quant_state.absmax = quant_state.absmax.clone() if nested else quant_state.absmax.half()
    if nested:  # an fp16 nested code, converted by from_bnb too
        quant_state.state2.code = quant_state.state2.code.half()
    after_replace = reader(param)
    assert after_replace is not first and _same_state(after_replace, Quant4bitState.from_bnb(param))
    # In place, on a tensor from_bnb converts (the fp16 absmax; the nested code) or reads as it is.
    for in_place in (quant_state.state2.code, quant_state.state2.absmax) if nested else (quant_state.absmax,):
        in_place.mul_(2.0)
        changed = reader(param)
        assert _same_state(changed, Quant4bitState.from_bnb(param)), "an in-place change was not seen"
    current = reader(param)
    quant_state.quant_type = "fp4"
    assert reader(param).quant_type == "fp4" and reader(param).code is not current.code
    quant_state.quant_type = "nf4"

    other = _linear4bit(nested, seed=1)
    assert _same_state(reader(other.weight), Quant4bitState.from_bnb(other.weight))
    assert not torch.equal(dequantize(reader(other.weight), other.weight), dequantize(first, param))


def test_state_reader_keeps_no_replaced_weight_alive_and_copies_empty() -> None:
    import copy
    import gc
    import pickle
    import weakref

    layer = _linear4bit(nested=True, seed=0)
    reader = dequant4bit.BnbStateReader()
    reader(layer.weight)
    gone = weakref.ref(layer.weight)
    layer.weight = _linear4bit(nested=True, seed=1).weight
    gc.collect()
    assert gone() is None, "the reader kept the replaced packed weight alive"
    for duplicate in (copy.deepcopy(reader), pickle.loads(pickle.dumps(reader))):
        assert duplicate._state is None
        assert _same_state(duplicate(layer.weight), Quant4bitState.from_bnb(layer.weight))


def test_a_fused_4bit_layer_follows_a_replaced_weight() -> None:
    """The layer's state reader must not serve the old weight's state after the weight is replaced:
    the fused forward then computes with the new weight (lora_B nonzero, fused_only on)."""
    from peft import get_peft_model

    from fastlora_peft import FastLoraConfig

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = _linear4bit(nested=True, seed=0)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(x)

    model = get_peft_model(Net(), FastLoraConfig(r=4, target_modules=["proj"], fused_only=True))
    layer = model.base_model.model.proj
    torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.1)
    x = torch.randn(5, 192, dtype=torch.bfloat16, device=DEVICE)
    before = model(x)
    replacement = _linear4bit(nested=True, seed=1)
    layer.get_base_layer().weight = replacement.weight
    after = model(x)
    lora_term = (
        layer.scaling["default"]
        * (x.float() @ layer.lora_A["default"].weight.float().T)
        @ (layer.lora_B["default"].weight.float().T)
    )
    dense = bnb_dequantize(replacement.weight.data, replacement.weight.quant_state).float()
    torch.testing.assert_close(after.float(), x.float() @ dense.T + lora_term, rtol=2e-2, atol=2e-2)
    assert not torch.allclose(before, after)
