"""`lora_addmm` (a GEMM whose accumulator starts with the LoRA term) and the dX path that uses it.

The kernel against float64 under the interpreter; its reference; the predicate that picks it; and,
with `LoraAddmmSettings.mode = "always"`, every fused dX that can take it: the single projection in
each 16-bit layout held to the float64 bound of `test_projection_numerics`, and a tiny Llama's q/k/v
group, o_proj and chunked MLP against the same model on cuBLAS + expand-add, with the calls counted.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from conftest import (
    FUSED_BACKWARD_NODE,
    LAYOUTS,
    TRITON_INTERPRET,
    Layout,
    compiles_for_sm90_on_cpu,
    copy_lora,
    count_lora_sublayer_calls,
    lora_grads,
    randomize_lora,
    rel_err,
    tiny_llama,
)
from peft import get_peft_model
from test_launch_plans import recorded_launches  # noqa: F401
from test_projection_numerics import ERROR_FLOOR, adapt, float64_reference, make_projection, run_projection

from fastlora_peft import FastLoraConfig
from fastlora_peft.functions import gated_mlp, shared_input
from fastlora_peft.kernels import lora_addmm as addmm_module
from fastlora_peft.kernels import lora_addmm_reference as reference
from fastlora_peft.kernels.lora_addmm import LoraAddmmSettings, lora_addmm, lora_addmm_pays_off, tma_fits

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
# Relative error of a result stored in 16 bits against float64: one rounding (the interpreter
# truncates to bf16: ~3.4e-3; fp16 ~2e-4), see test_kernels_lora_terms.
TOLERANCE = {BF16: 1e-2, FP16: 1e-3}
SCALE = 0.37
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    not (TRITON_INTERPRET or torch.cuda.is_available()), reason="Triton needs CUDA or TRITON_INTERPRET=1"
)


def _operands(m, k, n, r, dtype, right_dtype, weight_layout, left_layout, right_layout, seed=0):
    """a [m, k], b [k, n] of `dtype`; left [m, r] fp32; right [n, r]; laid out as dX sees them."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    a = randn(m, k).to(dtype)
    # dX: b is the weight [out, in] itself; "transposed": a [k, n] view of an [n, k] tensor.
    b = (randn(k, n) if weight_layout == "dense" else randn(n, k).T) / k**0.5
    b = b.to(dtype)
    # The LoRA term as large as the GEMM's, so a lost or mis-scaled term cannot hide in the rounding.
    left = randn(m, r) if left_layout == "row" else randn(r, m).T  # token-major: lora_shrink's layout
    right = (randn(n, r) if right_layout == "dense" else randn(r, n).T) / r**0.5  # lora_a.T: [n, r] view
    return a.to(DEVICE), b.to(DEVICE), left.to(DEVICE), right.to(DEVICE, right_dtype)


def _truth(a, b, left, right, scale=SCALE):
    return a.double() @ b.double() + scale * left.double() @ right.double().T


KERNEL_CASES = [
    pytest.param(dtype, right_dtype, shape, wl, ll, rl, id="-".join([name, "x".join(map(str, shape)), wl]))
    for (name, dtype, right_dtype), shape, (wl, ll, rl) in itertools.product(
        [("bf16", BF16, BF16), ("bf16-fp32a", BF16, FP32), ("fp16", FP16, FP16), ("fp16-fp32a", FP16, FP32)],
        [(37, 70, 45, 5), (1, 19, 33, 16), (40, 64, 64, 48)],
        [("dense", "token", "transposed"), ("transposed", "row", "dense")],
    )
]  # fmt: skip


@needs_triton
@pytest.mark.parametrize("dtype, right_dtype, shape, weight_layout, left_layout, right_layout", KERNEL_CASES)
def test_kernel_matches_float64(
    dtype, right_dtype, shape, weight_layout, left_layout, right_layout, triton_launches
):
    a, b, left, right = _operands(*shape, dtype, right_dtype, weight_layout, left_layout, right_layout)
    out = lora_addmm(a, b, left, right, SCALE)
    # (40, 64, 64, 48) has 16-byte rows: the TMA kernel, the others the pointer kernel; once each.
    kernel = "_lora_addmm_tma_kernel" if tma_fits(a, b) else "_lora_addmm_kernel"
    assert triton_launches == {kernel: 1}, triton_launches
    assert out.dtype == dtype and out.is_contiguous()
    truth = _truth(a, b, left, right)
    assert rel_err(out, truth.to(out.device)) <= TOLERANCE[dtype]
    # The term alone carries a scale: against the unscaled term the error is far larger.
    assert rel_err(out, _truth(a, b, left, right, scale=1.0)) > 10 * TOLERANCE[dtype]


@needs_triton
@pytest.mark.parametrize("lora_at", ["prologue", "epilogue", "none"])
def test_every_placement_of_the_term(lora_at):
    """The probe times all three placements with the library's kernel: each computes what it claims."""
    a, b, left, right = _operands(37, 70, 45, 5, BF16, FP32, "dense", "token", "transposed")
    out = addmm_module._lora_addmm_triton(a=a, b=b, left=left, right=right, scale=SCALE, lora_at=lora_at)
    truth = a.double() @ b.double() if lora_at == "none" else _truth(a, b, left, right)
    assert rel_err(out, truth) <= TOLERANCE[BF16]


TMA_CASES = [
    pytest.param(dtype, right_dtype, shape, wl, ll, rl, id="-".join([name, "x".join(map(str, shape)), wl]))
    for (name, dtype, right_dtype), shape, (wl, ll, rl) in itertools.product(
        [("bf16", BF16, BF16), ("bf16-fp32a", BF16, FP32), ("fp16", FP16, FP16), ("fp16-fp32a", FP16, FP32)],
        # odd rows, ragged K and N tiles (the interpreter's tiles are 16 x 32 x 16), rank past 16
        [(37, 72, 40, 5), (3, 24, 56, 20)],
        [("dense", "token", "transposed"), ("transposed", "row", "dense")],
    )
]  # fmt: skip


@pytest.fixture
def tma_calls(monkeypatch) -> list[bool]:
    """Records each call of the TMA kernel's launcher (its kernel is not a CachedKernel) by b's layout."""
    calls: list[bool] = []
    launcher = addmm_module._lora_addmm_tma_triton

    def counting(*, a, b, **kwargs):
        calls.append(b.stride(0) == 1)  # K-major b (x @ W.T)
        return launcher(a=a, b=b, **kwargs)

    monkeypatch.setattr(addmm_module, "_lora_addmm_tma_triton", counting)
    return calls


@needs_triton
@pytest.mark.parametrize("dtype, right_dtype, shape, weight_layout, left_layout, right_layout", TMA_CASES)
def test_tma_kernel_matches_float64(
    dtype, right_dtype, shape, weight_layout, left_layout, right_layout, tma_calls, triton_launches
):
    # Several tiles per program (the interpreter runs 3 programs), b row-major (dX) or K-major (x @ W.T).
    a, b, left, right = _operands(*shape, dtype, right_dtype, weight_layout, left_layout, right_layout)
    out = lora_addmm(a, b, left, right, SCALE)
    assert tma_calls == [weight_layout == "transposed"]
    assert triton_launches == {"_lora_addmm_tma_kernel": 1}, triton_launches
    assert out.dtype == dtype and out.is_contiguous()
    assert rel_err(out, _truth(a, b, left, right).to(out.device)) <= TOLERANCE[dtype]
    assert rel_err(out, _truth(a, b, left, right, scale=1.0)) > 10 * TOLERANCE[dtype]


def test_tma_tiles_narrow_where_wide_ones_would_idle_half_the_sms(monkeypatch):
    """H200 (132 SMs): k/v's forward (1024 columns) at up to 2048 rows gets 128 x 128 tiles; 8192
    rows, or 4096 columns from 1024 rows (128 wide tiles), keep the wide ones."""
    monkeypatch.setattr(addmm_module, "_num_sms", lambda device: 132)
    few, wide = addmm_module.TMA_FEW_TILES_CONFIG, addmm_module.TMA_GPU_CONFIG
    assert few[:2] == (128, 128) and wide[:2] == (128, 256)
    config = addmm_module.tma_gpu_config
    assert config(2048, 1024, "cuda") == config(1024, 1024, "cuda") == config(512, 4096, "cuda") == few
    assert config(8192, 1024, "cuda") == config(1024, 4096, "cuda") == config(2048, 4096, "cuda") == wide


def test_tma_takes_16_byte_rows_only():
    a, b, _, _ = _operands(37, 72, 40, 5, BF16, BF16, "dense", "row", "dense")
    assert tma_fits(a, b) and tma_fits(a, b.t().contiguous().t())  # row-major or K-major b
    assert not tma_fits(a[:, :70], b[:70])  # rows of 140 bytes
    assert not tma_fits(a, b[:, :37])  # an output row of 74 bytes
    assert not tma_fits(a[1:], b) or a[1:].data_ptr() % 16 == 0
    assert not tma_fits(a.float(), b.float())  # 16-bit operands only
    assert not tma_fits(a, torch.zeros(72, 80, dtype=BF16)[:, ::2])  # neither stride of b is 1
    assert not tma_fits(a[:0], b) and not tma_fits(a[:, :0], b[:0])  # no rows, no K: no descriptor


def test_transpose_check_reads_as_the_transposes_rows_check():
    """`_transpose_fits_tma(w)` answers `_rows_fit_tma(w.t())` without the view, for K-major weights
    and every way one can miss: a strided column, an unaligned start, stride or width."""
    from fastlora_peft.kernels.lora_addmm import _rows_fit_tma, _transpose_fits_tma

    storage = torch.zeros(2 * 96 * 80 + 8, dtype=BF16)
    layouts = [
        storage[: 96 * 80].view(96, 80).t(),  # a weight's transpose: fits
        storage[1 : 1 + 96 * 80].view(96, 80).t(),  # start 2 bytes off
        storage[: 96 * 80].view(96, 80)[:, :75].t(),  # rows of 150 bytes: stride fine, width not
        storage[: 96 * 79].view(96, 79).t(),  # a row stride of 158 bytes
        storage[8 : 8 + 96 * 80].view(96, 80).t(),  # start 16 bytes in: fits
        storage[: 2 * 96 * 80].view(192, 80)[::2].t(),  # every other row: stride 320 bytes, fits
        storage[: 96 * 80].view(96, 80),  # row-major: its transpose is not
        storage[: 2 * 96 * 80].view(96, 160)[:, ::2].t(),  # neither stride is 1
    ]
    answers = [_transpose_fits_tma(w) for w in layouts]
    assert answers == [_rows_fit_tma(w.t()) for w in layouts]
    assert answers == [True, False, False, False, True, True, False, False]
    for dtype in (torch.float16, torch.float32):
        w = torch.zeros(64, 40, dtype=dtype).t()
        assert _transpose_fits_tma(w) == _rows_fit_tma(w.t()) == True  # noqa: E712


def test_empty_batch():
    a, b, left, right = _operands(0, 19, 33, 4, BF16, BF16, "dense", "row", "dense")
    assert lora_addmm(a, b, left, right, SCALE).shape == (0, 33)


@pytest.mark.parametrize("dtype, right_dtype", [(BF16, BF16), (FP16, FP32)], ids=["bf16", "fp16-fp32a"])
def test_reference_matches_float64(dtype, right_dtype):
    a, b, left, right = _operands(37, 70, 45, 5, dtype, right_dtype, "dense", "token", "transposed")
    assert (
        rel_err(reference.lora_addmm(a, b, left, right, SCALE), _truth(a, b, left, right)) <= TOLERANCE[dtype]
    )


def test_opcheck():
    a, b, left, right = _operands(9, 19, 13, 3, BF16, BF16, "dense", "row", "dense")
    torch.library.opcheck(addmm_module.lora_addmm_op, (a, b, left, right, SCALE))


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(b=torch.zeros(18, 33, dtype=BF16)), "shapes"),
        (dict(left=torch.zeros(37, 4, dtype=BF16)), "left must be float32"),
        (dict(a=torch.zeros(37, 19)), "16-bit"),
    ],
    ids=["k-mismatch", "16bit-left", "fp32-a"],
)
def test_checks_name_the_problem(bad, match):
    a, b, left, right = _operands(37, 19, 33, 4, BF16, BF16, "dense", "row", "dense")
    args = dict(a=a, b=b, left=left, right=right) | bad
    with pytest.raises(ValueError, match=match):
        lora_addmm(**args, scale=SCALE)


def test_pays_off_only_where_measured(monkeypatch):
    """ "auto" by default, which never picks it off a Hopper GPU; "never" nowhere; "always" wherever
    the dtypes allow."""
    a, b = torch.zeros(4096, 8, dtype=BF16), torch.zeros(8, 8, dtype=BF16)
    assert LoraAddmmSettings.mode == "auto"
    assert not lora_addmm_pays_off(a, b, BF16)  # a CPU tensor: cuBLAS + expand-add stays
    monkeypatch.setattr(LoraAddmmSettings, "mode", "never")
    assert not lora_addmm_pays_off(a, b, BF16)
    monkeypatch.setattr(LoraAddmmSettings, "mode", "always")
    assert lora_addmm_pays_off(a, b, BF16)
    assert not lora_addmm_pays_off(a.float(), b.float(), FP32)  # fp32 GEMMs stay cuBLAS's
    assert not lora_addmm_pays_off(a, b, FP32)  # dX wanted in fp32 (fp32 x on a 16-bit base)
    assert not lora_addmm_pays_off(a, b.half(), BF16)


def test_where_it_pays_off_launches_from_its_plan_without_the_fit_check(recorded_launches, monkeypatch):  # noqa: F811
    """`lora_addmm_where_it_pays_off` is None wherever `lora_addmm_pays_off` says no, and elsewhere
    launches. Under "auto" (its device and row rule standing in for a Hopper GPU) the first call asks
    `tma_fits` and makes the TMA plan; a call of the same metadata launches from that plan without
    asking it; "never" still rules it out with a plan made."""
    from test_launch_plans import _THROUGH_CACHE, counted_fit_checks

    fit_checks = counted_fit_checks(monkeypatch, addmm_module, "tma_fits")
    monkeypatch.setattr(LoraAddmmSettings, "mode", "auto")
    monkeypatch.setattr(addmm_module, "_auto_device_and_rows", lambda a: True)
    where = addmm_module.lora_addmm_where_it_pays_off
    layouts = ("transposed", "token", "transposed")  # the forward's K-major weight, lora_a.T's right
    a, b, left, right = _operands(33, 40, 24, 16, BF16, FP32, *layouts)
    assert where(a, b, left, right, SCALE, BF16) is not None
    assert len(recorded_launches) == 1 and fit_checks and len(_THROUGH_CACHE) == 1
    fit_checks.clear()
    a2, b2, left2, right2 = _operands(33, 40, 24, 16, BF16, FP32, *layouts, seed=1)
    assert where(a2, b2, left2, right2, SCALE, BF16).shape == (33, 24)
    assert not fit_checks and len(recorded_launches) == 2 and len(_THROUGH_CACHE) == 1  # from the plan
    assert where(a, b, left, right, SCALE, FP32) is None  # dX wanted in fp32
    assert where(a, b.half(), left, right, SCALE, BF16) is None
    assert where(*_operands(33, 40, 20, 16, BF16, FP32, *layouts), SCALE, BF16) is None  # 40-byte rows
    monkeypatch.setattr(LoraAddmmSettings, "mode", "never")
    assert where(a2, b2, left2, right2, SCALE, BF16) is None
    assert len(recorded_launches) == 2


def count_lora_addmm_launches(monkeypatch, record) -> None:
    """Calls `record(a, b, left, right, scale)` for each lora_addmm the fused Functions launch (a
    `lora_addmm_where_it_pays_off` that did not answer None)."""
    where = shared_input.lora_addmm_where_it_pays_off

    def counting(a, b, left, right, scale, out_dtype):
        result = where(a, b, left, right, scale, out_dtype)
        if result is not None:
            record(a, b, left, right, scale)
        return result

    monkeypatch.setattr(shared_input, "lora_addmm_where_it_pays_off", counting)


@pytest.fixture
def addmm_calls(monkeypatch) -> list[tuple[int, int]]:
    """Forces the lora_addmm dX path and records each call's (rows, rank) as the Functions make it."""
    monkeypatch.setattr(LoraAddmmSettings, "mode", "always")
    calls: list[tuple[int, int]] = []
    count_lora_addmm_launches(
        monkeypatch, lambda a, b, left, right, scale: calls.append((a.shape[0], left.shape[1]))
    )
    return calls


SIXTEEN_BIT_X = [layout for layout in LAYOUTS if layout.x_dtype != FP32 and layout.autocast is None]


def _check_projection_against_float64(layout: Layout, features: tuple[int, int], bias: bool) -> None:
    """One fused projection's step (PEFT's sub-layers never called, the fused backward node) against
    float64: output, dX, dA and dB each within twice PEFT's error (test_projection_numerics' bound)."""
    in_features, out_features = features
    base = make_projection(layout, in_features, out_features, bias=bias)
    fast = adapt(copy.deepcopy(base), layout, fast=True)
    peft = adapt(base, layout, fast=False)
    randomize_lora(fast, seed=1)
    copy_lora(fast, peft)
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(3, 7, in_features, generator=generator).to(layout.x_dtype)
    grad_out = torch.randn(3, 7, out_features, generator=generator)
    with count_lora_sublayer_calls(fast) as calls:
        fast_out, fast_results = run_projection(fast, layout, x, grad_out)
    _, peft_results = run_projection(peft, layout, x, grad_out)
    assert not calls and type(fast_out.grad_fn).__name__ == FUSED_BACKWARD_NODE
    truth = float64_reference(fast.base_model.model.proj, x, grad_out.to(fast_out.dtype))
    for key, expected in truth.items():
        fast_error, peft_error = rel_err(fast_results[key], expected), rel_err(peft_results[key], expected)
        assert fast_error <= 2 * peft_error + ERROR_FLOOR, (
            f"{key}: {fast_error:.2e} vs PEFT's {peft_error:.2e}"
        )


@pytest.mark.parametrize("layout", SIXTEEN_BIT_X, ids=[layout.id for layout in SIXTEEN_BIT_X])
def test_projection_dx_through_lora_addmm(layout: Layout, addmm_calls, tma_calls, triton_launches):
    """Same bound as `test_projection_matches_peft_and_float64`, with dX from one lora_addmm call."""
    _check_projection_against_float64(layout, (128, 192) if layout.quantized else (70, 45), bias=True)
    assert addmm_calls == [(21, 5)], addmm_calls
    if TRITON_INTERPRET:  # the forward's expand-add only (it has a bias): dX took a kernel instead
        # 70 -> 45 features have rows TMA cannot read; the 4-bit layouts' 128 -> 192 take the TMA kernel.
        assert tma_calls == ([False] if layout.quantized else []), tma_calls
        assert triton_launches.get("_lora_addmm_kernel") == (None if layout.quantized else 1), triton_launches
        assert triton_launches.get("_lora_expand_add_kernel") == 1, triton_launches


@pytest.mark.parametrize("layout", SIXTEEN_BIT_X, ids=[layout.id for layout in SIXTEEN_BIT_X])
def test_projection_forward_and_dx_through_lora_addmm(
    layout: Layout, addmm_calls, tma_calls, triton_launches
):
    """Without a bias the forward's GEMM carries the term too: no expand-add at all, two lora_addmm
    calls (the TMA kernel for both, forward with a K-major weight), the same float64 bound."""
    _check_projection_against_float64(layout, (128, 192) if layout.quantized else (72, 48), bias=False)
    assert addmm_calls == [(21, 5), (21, 5)], addmm_calls
    if TRITON_INTERPRET:
        assert tma_calls == [True, False], tma_calls
        assert "_lora_expand_add_kernel" not in triton_launches, triton_launches


@pytest.mark.parametrize(
    "layout", [layout for layout in LAYOUTS if layout.x_dtype == FP32], ids=lambda layout: layout.id
)
def test_fp32_dx_keeps_cublas(layout: Layout, addmm_calls):
    """Where dX is fp32 (fp32 model, fp32 x on a 16-bit base, autocast), dX never takes it; under
    autocast the forward's output is 16-bit, and its GEMM does."""
    base = make_projection(layout, *((128, 192) if layout.quantized else (70, 45)), bias=False)
    fast = adapt(base, layout, fast=True)
    x = torch.randn(2, 5, 128 if layout.quantized else 70)
    run_projection(fast, layout, x, torch.randn(2, 5, 192 if layout.quantized else 45))
    assert addmm_calls == ([(10, 5)] if layout.autocast else [])


# Rounding of the fused model against itself on cuBLAS + expand-add: the term joins dX before the
# one rounding instead of after. The LoRA term is ~40% of W's size here (std 0.1 adapters, rank 6),
# so a lost term moves dX by tens of percent and a dropped scale by ~15%.
PATH_TOLERANCE = {"fp16": 5e-3, "bf16": 3e-2}


@pytest.mark.parametrize("adapter_dtype", [None, FP32], ids=["same", "fp32adapters"])
@pytest.mark.parametrize("dtype_id", ["fp16", "bf16"])
def test_tiny_llama_dx_through_lora_addmm(dtype_id, adapter_dtype, monkeypatch):
    dtype = {"fp16": FP16, "bf16": BF16}[dtype_id]
    monkeypatch.setattr(gated_mlp.GatedMlpSettings, "chunk_bytes", 3 * 88 * 2)  # 3 rows a chunk: 4 chunks
    model = tiny_llama(dtype)
    config = FastLoraConfig(r=6, lora_alpha=9, target_modules="all-linear")
    fast = get_peft_model(model, config, autocast_adapter_dtype=adapter_dtype == FP32)
    randomize_lora(fast, seed=5, std=0.1)
    generator = torch.Generator().manual_seed(6)
    embeds = torch.randn(2, 5, 48, generator=generator).to(dtype)
    loss_weight = torch.randn(2, 5, 61, generator=generator)

    def step(mode):
        monkeypatch.setattr(LoraAddmmSettings, "mode", mode)
        fast.zero_grad(set_to_none=True)
        x = embeds.clone().requires_grad_()
        (fast(inputs_embeds=x).logits.float() * loss_weight).sum().backward()
        return x.grad, lora_grads(fast)

    calls = []
    count_lora_addmm_launches(monkeypatch, lambda *args: calls.append(args))
    # The groups' dX through lora_addmm + addmm_ and their forward through lora_addmm per member, not
    # one lora_addmm_sum or lora_addmm_group (their own tests).
    monkeypatch.setattr(LoraAddmmSettings, "sum_members", False)
    monkeypatch.setattr(LoraAddmmSettings, "group_forward", False)
    grad_x, grads = step("always")
    # dX per layer: q/k/v as one group (rank 18), o_proj (6), the MLP's down per chunk (6), gate/up
    # (12); the forward: q, k, v and o_proj (6 each; the MLP's gate/up terms go through its activation
    # kernel and the chunked down writes into rows of one output).
    ranks = sorted(left.shape[1] for _, _, left, _, _ in calls)
    assert ranks == [6] * 9 + [12, 18], ranks
    calls.clear()
    grad_x_cublas, grads_cublas = step("never")
    assert calls == []
    tolerance = PATH_TOLERANCE[dtype_id]
    assert rel_err(grad_x, grad_x_cublas) <= tolerance
    for name, grad in grads.items():
        assert rel_err(grad, grads_cublas[name]) <= tolerance, name


# Compiles the kernel for an H100/H200 (sm_90) as the launcher would launch it there, with the
# specialization Triton gives contiguous operands, and prints its shared memory. Triton's ptxas runs
# on the CPU; a subprocess, because under TRITON_INTERPRET=1 `triton.jit` makes no compilable kernel.
_SM90_COMPILE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fastlora_peft.kernels import lora_addmm as m

fn = m._lora_addmm_kernel.kernel
names = fn.arg_names
unit_strides = {"stride_ak", "stride_bn", "stride_lm", "stride_rr", "stride_on"}  # dX's layouts
block_m, block_n, block_k, warps, stages = m.GPU_CONFIG
for dtype, right_dtype in (("bf16", "bf16"), ("bf16", "fp32"), ("fp16", "fp16"), ("fp16", "fp32")):
    precision = "tf32" if dtype == "bf16" else "tf32x3"  # dots.expand_dot_precision
    constexprs = dict(
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_R=m.RANK_TILE, GROUP_M=8, EVEN_K=True,
        LORA_AT=m.LORA_AT["prologue"], DOT_PRECISION=precision, FP32_DOT=False,
    ) | {name: 1 for name in unit_strides}
    pointers = dict(A_ptr=dtype, B_ptr=dtype, Left_ptr="fp32", Right_ptr=right_dtype, Out_ptr=dtype)
    signature = {
        name: "*" + pointers[name] if name in pointers else
        "constexpr" if name in constexprs else "fp32" if name == "scale" else "i32"
        for name in names
    }
    divisible = {
        (i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if signature[n] in ("i32", "*" + dtype)
    }
    source = ASTSource(
        fn=fn, signature=signature, attrs=divisible,
        constexprs={(names.index(name),): value for name, value in constexprs.items()},
    )
    options = dict(num_warps=warps, num_stages=stages)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    print(dtype, right_dtype, kernel.metadata.shared)
"""
H100_SHARED_MEMORY = 232448  # bytes a block may use on sm_90 (227 KB)


@compiles_for_sm90_on_cpu
def test_gpu_kernel_fits_hopper_shared_memory():
    import os
    import subprocess
    import sys

    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", _SM90_COMPILE], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.split("\n")
    shared = {tuple(line.split()[:2]): int(line.split()[2]) for line in lines if line}
    assert len(shared) == 4, result.stdout
    assert all(size <= H100_SHARED_MEMORY for size in shared.values()), shared
