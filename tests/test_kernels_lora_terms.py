"""Tests for the LoRA term ops: the Triton kernels and the pure-torch reference against float64.

Run the kernels on CPU with ``TRITON_INTERPRET=1 python -m pytest tests/test_kernels_lora_terms.py``.
Without it, the ops run the reference on CPU and the kernel-only tests skip.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from fastlora_peft.kernels import dots, lora_terms, split_sum
from fastlora_peft.kernels import lora_expand_add as expand_add_module
from fastlora_peft.kernels import lora_terms_reference as reference
from fastlora_peft.kernels import lora_weight_grad as weight_grad_module
from fastlora_peft.kernels._backend import runs_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Decided from the environment, not from runs_triton, so a broken dispatch rule cannot vouch for itself.
EXPECT_TRITON = DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not EXPECT_TRITON, reason="Triton needs CUDA or TRITON_INTERPRET=1")

FP32, BF16, FP16 = torch.float32, torch.bfloat16, torch.float16

# Relative error ||got - want|| / ||want|| allowed, by the dtype the result is stored in. The float64
# truth is computed from the same (already rounded) inputs, so an fp32 result is only fp32
# accumulation away from it (measured ~1e-7). A 16-bit result adds one rounding: bf16 values are
# 2**-7 apart, and the interpreter truncates fp32 -> bf16 (3.4e-3 measured; GPUs round to nearest,
# 1.6e-3); fp16 values are 2**-10 apart (2e-4 measured).
TOLERANCE = {FP32: 1e-5, BF16: 1e-2, FP16: 1e-3}
# A bf16 activation against an fp32 operand (dots.SPLIT_DOT): the fp32 operand is split exactly into
# three bf16 parts, so the products are exact and only fp32 sums are left (~1e-7 on the interpreter
# and the H200). Held tighter than TOLERANCE[FP32], so a split that drops a part (1e-5) fails.
SPLIT_TOLERANCE = 1e-6

# (id, activation dtype, adapter dtype): x/base/grad_out vs lora_a/lora_b.
DTYPE_CASES = [
    ("fp32", FP32, FP32),
    ("bf16", BF16, BF16),
    ("fp16", FP16, FP16),
    ("bf16-x-fp32-w", BF16, FP32),
    ("fp16-x-fp32-w", FP16, FP32),
]
# (M tokens, K or N features, R rank): odd sizes, an empty batch, a single token, a rank of 1.
SHAPES = [(0, 19, 5), (1, 70, 1), (37, 19, 16), (37, 70, 5)]
LAYOUTS = ["contig", "transposed", "sliced"]
SCALE = 0.37


def _case_params():
    return [
        pytest.param(
            x_dtype, w_dtype, shape, layout, id=f"{name}-m{shape[0]}-k{shape[1]}-r{shape[2]}-{layout}"
        )
        for name, x_dtype, w_dtype in DTYPE_CASES
        for shape in SHAPES
        for layout in LAYOUTS
    ]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _make(rows: int, cols: int, dtype: torch.dtype, layout: str) -> torch.Tensor:
    """A random [rows, cols] tensor laid out as asked: contiguous, a transposed view, or a strided slice."""
    if layout == "contig":
        return torch.randn(rows, cols, device=DEVICE).to(dtype)
    if layout == "transposed":  # like lora_b.T or lora_a.T
        return torch.randn(cols, rows, device=DEVICE).to(dtype).T
    full = torch.randn(rows + 3, 2 * cols + 1, device=DEVICE).to(dtype)
    return full[2 : 2 + rows, 1::2]  # storage offset and a column stride of 2


def assert_rel_close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    assert got.shape == want.shape, f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    want = want.double()
    norm = want.norm().item()
    if norm == 0.0:
        assert torch.equal(got.double(), want), "expected exact zeros"
        return
    err = (got.double() - want).norm().item() / norm
    assert err <= tol, f"relative error {err:.3e} > {tol:.1e}"


def _check_op(op: str, args: tuple, truth: torch.Tensor, out_dtype: torch.dtype, tol: float = 0.0) -> None:
    """The public op and the reference each against float64, and against each other."""
    tol = tol or TOLERANCE[out_dtype]
    want = getattr(reference, op)(*args)
    got = getattr(lora_terms, op)(*args)
    # lora_shrink hands out token-major [M, R] (what lora_weight_grad reads without a copy); the
    # others contiguous results.
    layout_ok = got.T.is_contiguous() if op == "lora_shrink" else got.is_contiguous()
    assert got.dtype == out_dtype and layout_ok, (op, got.stride())
    assert_rel_close(want, truth, tol)
    assert_rel_close(got, truth, tol)
    assert_rel_close(got, want, tol)


# ----------------------------------------------------------------------------------------------------
# Every op, every dtype case, shape and layout, through the public op (Triton when EXPECT_TRITON).
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("x_dtype, w_dtype, shape, layout", _case_params())
def test_lora_shrink(x_dtype, w_dtype, shape, layout):
    M, K, R = shape
    x = _make(M, K, x_dtype, layout)
    weight = _make(R, K, w_dtype, layout)
    truth = x.double() @ weight.double().T
    tol = SPLIT_TOLERANCE if (x_dtype, w_dtype) == (BF16, FP32) else TOLERANCE[FP32]
    _check_op("lora_shrink", (x, weight), truth, FP32, tol)
    _check_op("lora_shrink", (x, weight, SCALE), SCALE * truth, FP32, tol)


@pytest.mark.parametrize("x_dtype, w_dtype, shape, layout", _case_params())
def test_lora_shrink_keeping_weight_t(x_dtype, w_dtype, shape, layout, monkeypatch):
    # One projection's forward shrink: lora_shrink's result bit for bit, and weight.T contiguous in
    # weight's dtype (dX's term reads it so), written by the same launch.
    M, K, R = shape
    x = _make(M, K, x_dtype, layout)
    weight = _make(R, K, w_dtype, layout)
    kernel = _LaunchCounter(lora_terms._lora_shrink_kernel)
    monkeypatch.setattr(lora_terms, "_lora_shrink_kernel", kernel)
    got, weight_t = lora_terms.lora_shrink_keeping_weight_t(x, weight, SCALE)
    assert kernel.launches == (1 if EXPECT_TRITON and M else 0)
    assert got.T.is_contiguous() and torch.equal(got, lora_terms.lora_shrink(x, weight, SCALE))
    assert weight_t.dtype == w_dtype and weight_t.is_contiguous() and torch.equal(weight_t, weight.T)
    want, want_t = reference.lora_shrink_keeping_weight_t(x, weight, SCALE)
    tol = SPLIT_TOLERANCE if (x_dtype, w_dtype) == (BF16, FP32) else TOLERANCE[FP32]
    assert_rel_close(got, want, tol)
    assert torch.equal(weight_t, want_t)
    assert_rel_close(got, SCALE * (x.double() @ weight.double().T), tol)


@needs_triton
@pytest.mark.parametrize("w_dtype", [FP32, BF16])
def test_shrink_writes_weight_t_from_every_split_and_rank_tile(w_dtype):
    # The row blocks take turns writing weight.T, each over some K steps of its split's columns and
    # its rank tile. Three row blocks; three splits, two of four K steps (row block 0 takes steps 0
    # and 3) and a short one of two; two rank tiles. The buffer starts as NaN, so a K step or rank
    # tile left unwritten shows.
    x = _make(37, 150, BF16, "contig")
    weight = _make(5, 150, w_dtype, "transposed")
    weight_t = torch.full((150, 5), float("nan"), dtype=w_dtype, device=DEVICE)
    got = lora_terms._lora_shrink_triton(
        x=x, weight=weight, scale=SCALE, weight_t=weight_t, split=3, block_m=16, block_k=16, block_r=4
    )
    assert torch.equal(weight_t, weight.T)
    tol = SPLIT_TOLERANCE if w_dtype == FP32 else TOLERANCE[FP32]
    assert_rel_close(got, SCALE * (x.double() @ weight.double().T), tol)


# A group's three dY_i @ B_i (q/k/v: K_i = N_i, its own rank and scale each), written side by side.
STACKED_MEMBERS = [(19, 5, 0.37), (70, 3, 1.5), (23, 16, 0.25)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rows", [0, 1, 37])  # 37: members' column blocks start at unaligned addresses
@pytest.mark.parametrize("name, x_dtype, w_dtype", DTYPE_CASES, ids=[case[0] for case in DTYPE_CASES])
def test_lora_shrink_stacked(name, x_dtype, w_dtype, rows, layout, monkeypatch):
    kernel = _LaunchCounter(lora_terms._lora_shrink_kernel)
    monkeypatch.setattr(lora_terms, "_lora_shrink_kernel", kernel)
    xs = [_make(rows, k, x_dtype, layout) for k, _, _ in STACKED_MEMBERS]
    weights = [_make(r, k, w_dtype, "transposed") for k, r, _ in STACKED_MEMBERS]  # lora_b.T
    scales = [scale for _, _, scale in STACKED_MEMBERS]
    got = lora_terms.lora_shrink_stacked(xs, weights, scales)
    # One shrink launch per member into its columns (none for an empty batch, or on the reference path).
    assert kernel.launches == (len(xs) if EXPECT_TRITON and rows else 0)
    assert got.dtype == FP32 and got.shape == (rows, sum(r for _, r, _ in STACKED_MEMBERS))
    assert got.T.is_contiguous(), "not token-major: lora_weight_grad would copy it"
    tol = SPLIT_TOLERANCE if (x_dtype, w_dtype) == (BF16, FP32) else TOLERANCE[FP32]
    start = 0
    for x, weight, (_, rank, scale) in zip(xs, weights, STACKED_MEMBERS):
        block = got[:, start : start + rank]
        assert_rel_close(block, scale * (x.double() @ weight.double().T), tol)
        assert torch.equal(block, lora_terms.lora_shrink(x, weight, scale)), "differs from lora_shrink"
        start += rank


@pytest.mark.parametrize("rank", [80, 130])  # two and three 64-wide rank tiles
@pytest.mark.parametrize("name, x_dtype, w_dtype", DTYPE_CASES, ids=[case[0] for case in DTYPE_CASES])
def test_shrinks_past_64_ranks_in_every_dtype_case(name, x_dtype, w_dtype, rank, monkeypatch):
    """A lone shrink (lora_a as PEFT stores it) and a group's dY_i @ B_i (lora_b.T) past 64 ranks, with
    their default launches (64-wide rank tiles, `shrink_rank_block`), against float64."""
    launches = _recorded_launches(monkeypatch)
    tol = SPLIT_TOLERANCE if (x_dtype, w_dtype) == (BF16, FP32) else TOLERANCE[FP32]
    x, weight = _make(37, 70, x_dtype, "contig"), _make(rank, 70, w_dtype, "contig")
    _check_op("lora_shrink", (x, weight, SCALE), SCALE * (x.double() @ weight.double().T), FP32, tol)
    xs = [_make(37, k, x_dtype, "contig") for k in (70, 19)]
    weights = [_make(rank, k, w_dtype, "transposed") for k in (70, 19)]
    got = lora_terms.lora_shrink_stacked(xs, weights, [0.5, 1.5])
    for start, x_i, weight_i, scale in ((0, xs[0], weights[0], 0.5), (rank, xs[1], weights[1], 1.5)):
        assert_rel_close(got[:, start : start + rank], scale * (x_i.double() @ weight_i.double().T), tol)
    if EXPECT_TRITON:
        assert launches, "the shrinks made no launch"
        assert {meta["BLOCK_R"] for _, _, meta in launches} == {64}, [m for _, _, m in launches]


def _recorded_launches(monkeypatch) -> list[tuple]:
    """(kernel name, args, meta) of every launch as the launchers decide it: plans off (a plan would
    replay an earlier decision; tests/test_launch_plans.py pins that it passes what the launcher would)."""
    from fastlora_peft.kernels._launch import CachedKernel, LaunchPlans

    monkeypatch.setattr(LaunchPlans, "enabled", False)
    launches = []
    launch = CachedKernel.launch
    monkeypatch.setattr(
        CachedKernel,
        "launch",
        lambda self, grid, args, meta: (
            launches.append((self.name, args, meta)) or launch(self, grid, args, meta)
        ),
    )
    return launches


@pytest.mark.parametrize("layout", ["contig", "transposed"])
def test_lora_shrink_split_dot_over_a_64_wide_rank_tile(layout, monkeypatch):
    # A q/k/v group's stacked A (rank 48) takes its own tiles and warps with the split dot (lora_terms'
    # _WIDE_SPLIT_LAUNCH); the ranks above have one tile of at most 16. Pinned: the launch it makes.
    launches = _recorded_launches(monkeypatch)
    x, weight = _make(130, 70, BF16, layout), _make(48, 70, FP32, layout)
    _check_op(
        "lora_shrink", (x, weight, SCALE), SCALE * (x.double() @ weight.double().T), FP32, SPLIT_TOLERANCE
    )
    if EXPECT_TRITON:
        names = ("BLOCK_M", "BLOCK_K", "num_warps", "num_stages")
        expected = dict(zip(names, lora_terms._WIDE_SPLIT_LAUNCH))
        assert launches, "the shrink made no launch"
        for _, _, meta in launches:
            assert meta["DOT_MODE"] == dots.SPLIT_DOT and meta["BLOCK_R"] == 64, meta
            assert {name: meta[name] for name in names} == expected, meta


@pytest.mark.parametrize(
    "weight_dtype, rank", [(BF16, 48), (BF16, 32), (FP16, 64), (BF16, 16), (BF16, 80), (FP16, 80)]
)
def test_lora_shrink_16_bit_weight_over_a_wide_rank_tile(weight_dtype, rank, monkeypatch):
    # 16-bit adapters over a rank tile of 32 to 64 (a q/k/v group's stacked A at rank 48, an MLP's
    # gate/up at 32) take lora_terms' _WIDE_NATIVE_LAUNCH; a rank tile of 16 keeps 32-row tiles; past
    # 64 ranks the tiles are 64 wide (`shrink_rank_block`), two of them at rank 80, with
    # _MANY_RANKS_NATIVE_LAUNCH.
    launches = _recorded_launches(monkeypatch)
    x, weight = _make(130, 300, weight_dtype, "contig"), _make(rank, 300, weight_dtype, "transposed")
    truth = SCALE * (x.double() @ weight.double().T)
    _check_op("lora_shrink", (x, weight, SCALE), truth, FP32)
    if EXPECT_TRITON:
        names = ("BLOCK_M", "BLOCK_K", "num_warps", "num_stages")
        rank_tile = min(64, max(16, 1 << (rank - 1).bit_length()))
        wide = 32 <= rank_tile <= 64
        narrow = {"BLOCK_M": 32, "BLOCK_K": 128}
        launch = lora_terms._MANY_RANKS_NATIVE_LAUNCH if rank > 64 else lora_terms._WIDE_NATIVE_LAUNCH
        expected = dict(zip(names, launch)) if wide else narrow
        assert launches, "the shrink made no launch"
        for _, _, meta in launches:
            assert meta["BLOCK_R"] == rank_tile, meta
            assert {name: meta[name] for name in expected} == expected, meta


@pytest.mark.parametrize("rank", [32, 80])
def test_stacked_shrink_of_16_bit_weights_keeps_32_row_tiles_to_64_ranks(rank, monkeypatch):
    # A group's dY_i @ B_i with bf16 B of rank 32 runs lora_shrink_group's kernel with 32 x 128 tiles
    # (measured faster than _WIDE_NATIVE_LAUNCH there at 2048 tokens), while one such shrink alone
    # takes the wide launch. Past 64 ranks a member is two or more 64-wide rank tiles: there the group
    # takes the launch one such shrink alone takes (H200, the MLP's dgate B_gate + dup B_up at rank
    # 128, 8192 tokens: 312-315 -> 224-226 us; docs/benchmarks/session51/g/shrink_group_probe.log).
    launches = _recorded_launches(monkeypatch)
    xs = [_make(37, k, BF16, "contig") for k in (70, 19)]
    weights = [_make(rank, k, BF16, "transposed") for k in (70, 19)]
    got = lora_terms.lora_shrink_stacked(xs, weights, [0.5, 1.5])
    for start, x, weight, scale in ((0, xs[0], weights[0], 0.5), (rank, xs[1], weights[1], 1.5)):
        truth = scale * (x.double() @ weight.double().T)
        assert_rel_close(got[:, start : start + rank], truth, TOLERANCE[FP32])
    if EXPECT_TRITON:
        assert [name for name, _, _ in launches] == ["_lora_shrink_group_kernel"]
        meta = launches[0][2]
        tiles = (meta["BLOCK_M"], meta["BLOCK_K"], meta["BLOCK_R"], meta["num_warps"], meta["num_stages"])
        if rank <= 64:
            assert tiles[:3] == (32, 128, 32), meta
        else:
            block_m, block_k, warps, stages = lora_terms._MANY_RANKS_NATIVE_LAUNCH
            assert tiles == (block_m, block_k, 64, warps, stages), meta


@pytest.mark.parametrize("base_dtype, right_dtype, shape, layout", _case_params())
def test_lora_expand_add(base_dtype, right_dtype, shape, layout):
    M, N, R = shape
    base = _make(M, N, base_dtype, layout)
    left = _make(M, R, FP32, layout)
    right = _make(N, R, right_dtype, layout)
    truth = base.double() + SCALE * (left.double() @ right.double().T)
    _check_op("lora_expand_add", (base, left, right, SCALE, base_dtype), truth, base_dtype)


@pytest.mark.parametrize(
    "base_dtype, out_dtype",
    [(BF16, FP32), (FP32, BF16), (FP16, BF16)],
    ids=["bf16-to-fp32", "fp32-to-bf16", "fp16-to-bf16"],
)
def test_lora_expand_add_out_dtype(base_dtype, out_dtype):
    base = _make(37, 45, base_dtype, "sliced")
    left = _make(37, 5, FP32, "contig")
    right = _make(45, 5, BF16, "transposed")
    truth = base.double() + SCALE * (left.double() @ right.double().T)
    _check_op("lora_expand_add", (base, left, right, SCALE, out_dtype), truth, out_dtype)


def test_dot_modes():
    # A bf16 activation against an fp32 tile takes the exact split on a GPU and under the interpreter
    # (which multiplies the parts in fp32); fp16 against fp32 (its low part would underflow) and fp32
    # activations take 3xTF32; 16-bit pairs of one dtype go native on a GPU only.
    cpu = {dtype: torch.ones(2, 2, dtype=dtype) for dtype in (FP32, BF16, FP16)}
    assert dots.dot_mode(cpu[BF16], cpu[FP32]) == dots.SPLIT_DOT
    for activation, other in [(FP16, FP32), (FP32, FP32), (FP32, BF16), (BF16, BF16), (FP16, FP16)]:
        assert dots.dot_mode(cpu[activation], cpu[other]) == dots.FP32_DOT, (activation, other)
    if DEVICE == "cuda":
        for dtype in (BF16, FP16):
            gpu = torch.ones(2, 2, dtype=dtype, device=DEVICE)
            assert dots.dot_mode(gpu, gpu) == dots.NATIVE_DOT


def test_expand_add_uses_plain_tf32_only_into_bf16():
    # Plain tf32 rounds the fp32 bottleneck and the adapter to 11 bits: below a bf16 output's rounding,
    # not below an fp16 or fp32 one's (the GPU tests check the accuracy it gives). bf16 adapters into
    # bf16 take one bf16 dot (the bottleneck rounded to bf16, as PEFT's bf16 path rounds xA); a group
    # with one adapter of another dtype does not.
    assert dots.expand_dot_precision(BF16, FP32) == "tf32"
    assert dots.expand_dot_precision(BF16, BF16) == dots.TERM_IN_BF16 == "bf16"
    assert dots.expand_dot_precision(BF16, BF16, FP32, BF16) == "tf32"
    assert dots.expand_dot_precision(BF16, FP16) == "tf32"
    for out_dtype, right_dtype in itertools.product((FP16, FP32), (BF16, FP16, FP32)):
        assert dots.expand_dot_precision(out_dtype, right_dtype) == "tf32x3", out_dtype


def test_lora_expand_add_rounds_once():
    # fp16 values near 2048 are 2 apart. 2048 + (1 + 2**-12) = 2049.000244 rounds up to 2050; rounding
    # the LoRA term to fp16 first (1 + 2**-12 -> 1.0) gives the tie 2049, which rounds to even: 2048.
    # (fp16, not bf16: the interpreter truncates fp32 -> bf16 but rounds fp32 -> fp16 to nearest.)
    base = torch.full((3, 5), 2048.0, device=DEVICE, dtype=FP16)
    left = torch.ones(3, 1, device=DEVICE)
    right = torch.full((5, 1), 1.0 + 2.0**-12, device=DEVICE)
    out = lora_terms.lora_expand_add(base, left, right, 1.0, FP16)
    assert torch.equal(out, torch.full_like(base, 2050.0))


@pytest.mark.parametrize("x_dtype, _w_dtype, shape, layout", _case_params())
def test_lora_weight_grad(x_dtype, _w_dtype, shape, layout):
    M, K, R = shape
    left = _make(M, R, FP32, layout)
    x = _make(M, K, x_dtype, layout)
    truth = -SCALE * (left.double().T @ x.double())
    tol = SPLIT_TOLERANCE if x_dtype == BF16 else TOLERANCE[FP32]  # left is fp32: split for bf16 x
    _check_op("lora_weight_grad", (left, x, -SCALE), truth, FP32, tol)
    # K-major: the same values, laid out so that the transpose (lora_B's gradient) is dense.
    k_major = lora_terms.lora_weight_grad(left, x, -SCALE, k_major=True)
    assert k_major.shape == truth.shape and k_major.T.is_contiguous(), k_major.stride()
    assert_rel_close(k_major, truth, tol)


# ----------------------------------------------------------------------------------------------------
# The launchers with small blocks, so tiny shapes still cover several tiles, loop trips and splits.
# ----------------------------------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("x_dtype, w_dtype", [(FP32, FP32), (BF16, FP32)], ids=["fp32", "bf16-x-fp32-w"])
def test_multi_tile_launchers(x_dtype, w_dtype):
    M, K, N, R = 37, 70, 45, 37  # R = 37 spans three rank tiles of 16
    x = _make(M, K, x_dtype, "sliced")
    lora_a = _make(R, K, w_dtype, "transposed")
    lora_b = _make(N, R, w_dtype, "contig")
    base = _make(M, N, x_dtype, "transposed")
    left = _make(M, R, FP32, "contig")
    tol = TOLERANCE[FP32]
    split_tol = SPLIT_TOLERANCE if x_dtype == BF16 else tol  # shrink and weight grad read x

    for split in (1, 2, 3):  # K = 70 in 3 splits of 32 columns: the last one is partial
        got = lora_terms._lora_shrink_triton(
            x=x, weight=lora_a, split=split, block_m=16, block_k=16, block_r=16
        )
        assert_rel_close(got, x.double() @ lora_a.double().T, split_tol)
        # Every split's partial scaled, so the sum is scaled once (the q/k/v group's dY_i @ B_i).
        got = lora_terms._lora_shrink_triton(
            x=x, weight=lora_a, scale=SCALE, split=split, block_m=16, block_k=16, block_r=16
        )
        assert_rel_close(got, SCALE * (x.double() @ lora_a.double().T), split_tol)

    got = expand_add_module._lora_expand_add_triton(
        base=base, left=left, right=lora_b, scale=SCALE, out_dtype=FP32, block_m=16, block_n=16, block_r=16
    )
    assert_rel_close(got, base.double() + SCALE * (left.double() @ lora_b.double().T), tol)
    # In place (out is base itself), a rank inside one rank tile, several row and column tiles.
    in_place, narrow_left, narrow_b = base.contiguous(), left[:, :11], lora_b[:, :11]
    truth = in_place.double() + SCALE * (narrow_left.double() @ narrow_b.double().T)
    expand_add_module._lora_expand_add_triton(
        base=in_place, left=narrow_left, right=narrow_b, scale=SCALE, out_dtype=x_dtype, out=in_place,
        block_m=16, block_n=16,
    )  # fmt: skip
    assert_rel_close(in_place, truth, TOLERANCE[x_dtype])

    truth = SCALE * (left.double().T @ x.double())
    for split, k_major in itertools.product(
        (1, 2, 3), (False, True)
    ):  # 3 splits of 16 rows: the last one is partial
        got = weight_grad_module._lora_weight_grad_triton(
            left=left, x=x, scale=SCALE, k_major=k_major, split=split, block_m=16, block_k=16, block_r=16
        )
        assert (got.T if k_major else got).is_contiguous(), (k_major, got.stride())
        assert_rel_close(got, truth, split_tol)


@needs_triton
@pytest.mark.parametrize("x_dtype, w_dtype", [(BF16, FP32), (FP16, FP32), (BF16, BF16)], ids=str)
def test_launchers_feed_the_dots_as_dot_mode_says(x_dtype, w_dtype, monkeypatch):
    # Accuracy alone cannot tell the split dot from 3xTF32 (both reach ~1e-7): pin which mode and
    # precision each launch of the shrink, the weight gradient, the expand-add and the gated kernels
    # gets, so a launcher that stops asking `dot_mode` (a silent 2x slowdown on the GPU) fails here.
    from fastlora_peft.kernels import gated_act_lora, gated_act_lora_forward

    launches = _recorded_launches(monkeypatch)
    x = _make(37, 70, x_dtype, "contig")
    weight = _make(5, 70, w_dtype, "contig")
    left = _make(37, 5, FP32, "contig")
    lora_terms.lora_shrink(x, weight)
    lora_terms.lora_weight_grad(left, x, SCALE)
    lora_terms.lora_expand_add_(x.clone(), left, _make(70, 5, w_dtype, "contig"), SCALE)
    gate, up = _make(37, 70, x_dtype, "contig"), _make(37, 70, x_dtype, "contig")
    right = _make(70, 5, w_dtype, "contig")
    gated_act_lora_forward.gated_act_lora_forward_(gate, up, "silu", left, right, SCALE, left, right, SCALE)
    gated_act_lora.gated_act_backward_weight_grad_(x.clone(), gate, up, "silu", left, SCALE)
    seen = {name: meta for name, _, meta in launches}
    split = x_dtype == BF16  # a bf16 activation against an fp32 tile (every weight gradient's left)
    if x_dtype == w_dtype:  # 16-bit pair: as loaded on a GPU; the interpreter multiplies fp32 only
        shrink_mode = dots.NATIVE_DOT if DEVICE == "cuda" else dots.FP32_DOT
    else:
        shrink_mode = dots.SPLIT_DOT if split else dots.FP32_DOT
    assert seen["_lora_shrink_kernel"]["DOT_MODE"] == shrink_mode
    for kernel in ("_lora_weight_grad_kernel", "_gated_act_backward_weight_grad_kernel"):
        assert seen[kernel]["DOT_MODE"] == (dots.SPLIT_DOT if split else dots.FP32_DOT), kernel
    # Into bf16: one bf16 dot with bf16 adapters, plain tf32 with fp32 ones; into fp16 3xTF32. The
    # gated forward follows the same rule at every rank (5 here).
    expand_precision = ("bf16" if w_dtype == BF16 else "tf32") if x_dtype == BF16 else "tf32x3"
    assert seen["_lora_expand_add_kernel"]["DOT_PRECISION"] == expand_precision
    assert seen["_gated_act_lora_forward_kernel"]["DOT_PRECISION"] == expand_precision


@needs_triton
@pytest.mark.parametrize("x_dtype", [BF16, FP16], ids=str)
def test_shrink_copies_a_transposed_fp32_weight_only_for_tf32x3(x_dtype, monkeypatch):
    # g @ B in every backward of PEFT's default layout reads lora_b.T (fp32, rank dim contiguous).
    # 3xTF32 dots want it copied K-contiguous (3x faster there); the split dot reads it as it is,
    # and a copy would cost one more op's host time per projection.
    launches = _recorded_launches(monkeypatch)
    x = _make(37, 70, x_dtype, "contig")
    lora_b_t = _make(70, 5, FP32, "contig").T
    got = lora_terms.lora_shrink(x, lora_b_t)
    assert_rel_close(
        got, x.double() @ lora_b_t.double().T, SPLIT_TOLERANCE if x_dtype == BF16 else TOLERANCE[FP32]
    )
    ((_, args, _),) = launches
    launched = args[1]
    if x_dtype == BF16:
        assert launched is lora_b_t
    else:
        assert launched.is_contiguous() and launched.data_ptr() != lora_b_t.data_ptr()


@needs_triton
def test_split_sums_leave_their_counters_at_zero():
    # The last program of each tile sums the splits and resets the tile's counter. A counter left
    # behind would make the next launch's tile wait for one arrival too many: its result never written.
    x = _make(37, 70, BF16, "sliced")
    weight = _make(21, 70, FP32, "contig")
    left = _make(37, 21, FP32, "transposed")
    for split in (3, 2, 3):  # one buffer across launches of different tile counts
        blocks = dict(block_m=16, block_k=16, block_r=16)
        got = lora_terms._lora_shrink_triton(x=x, weight=weight, split=split, **blocks)
        assert_rel_close(got, x.double() @ weight.double().T, SPLIT_TOLERANCE)
        got = weight_grad_module._lora_weight_grad_triton(
            left=left, x=x, scale=SCALE, split=split, out_dtype=BF16, **blocks
        )
        assert got.dtype == BF16
        assert_rel_close(got, SCALE * (left.double().T @ x.double()), TOLERANCE[BF16])
    assert split_sum._SCRATCH, "the split launches used no counters"
    for scratch in split_sum._SCRATCH.values():
        assert not scratch.counters.any(), scratch.counters.nonzero()


def test_scratch_is_cached_only_from_the_default_memory_pool(monkeypatch):
    # The allocator's snapshot decides: a segment of pool (0, 0) is the default pool's; a graph
    # pool's segment, or an address in no listed segment, is not; no snapshot at all (another
    # allocator backend) cannot tell pools apart, so the buffer is cached as before.
    tensor = torch.empty(8)
    address = tensor.data_ptr()

    def snapshot_of(pool, start=address - 64):
        return lambda: [{"address": start, "total_size": 4096, "segment_pool_id": pool}]

    monkeypatch.setattr(torch.cuda, "memory_snapshot", snapshot_of((0, 0)))
    assert split_sum.in_default_memory_pool(tensor)
    monkeypatch.setattr(torch.cuda, "memory_snapshot", snapshot_of((1, 2)))
    assert not split_sum.in_default_memory_pool(tensor)
    monkeypatch.setattr(torch.cuda, "memory_snapshot", snapshot_of((0, 0), start=address + 64))
    assert not split_sum.in_default_memory_pool(tensor)

    def no_snapshot():
        raise RuntimeError("not supported by this allocator backend")

    monkeypatch.setattr(torch.cuda, "memory_snapshot", no_snapshot)
    assert split_sum.in_default_memory_pool(tensor)


@needs_triton
def test_split_launches_reuse_their_scratch():
    # Partials and counters are kept per stream, not allocated per launch (each allocation is host
    # time in a host-bound step); a smaller launch after a larger one reads only its own partials.
    x = _make(37, 70, BF16, "sliced")
    weight = _make(21, 70, FP32, "contig")
    blocks = dict(block_m=16, block_k=16, block_r=16)
    lora_terms._lora_shrink_triton(x=x, weight=weight, split=3, **blocks)
    key = (x.device, 0)
    scratch = split_sum._SCRATCH[key]
    for rows, split in ((37, 2), (20, 3), (37, 3)):
        got = lora_terms._lora_shrink_triton(x=x[:rows], weight=weight, split=split, **blocks)
        assert_rel_close(got, x[:rows].double() @ weight.double().T, SPLIT_TOLERANCE)
        assert split_sum._SCRATCH[key] is scratch, (rows, split)


@pytest.mark.parametrize("k_major", [False, True], ids=["r-major", "k-major"])
def test_lora_weight_grad_rounds_once_to_out_dtype(k_major):
    # The adapters' dtype written by the op itself (no cast by the caller), from the fp32 sum. A bf16
    # result multiplies the left rounded to bf16 (`dots.ROUNDED_DOT`; on the CPU, without Triton,
    # the reference keeps it fp32): the fp32 sum to compare with is that left's.
    left = _make(37, 5, FP32, "contig")
    x = _make(37, 19, BF16, "contig")
    left_seen = left.to(BF16).float() if EXPECT_TRITON else left
    want = lora_terms.lora_weight_grad(left_seen, x, SCALE, k_major=k_major)
    got = lora_terms.lora_weight_grad(left, x, SCALE, k_major=k_major, out_dtype=BF16)
    assert got.dtype == BF16 and got.stride() == want.stride(), (got.dtype, got.stride(), want.stride())
    # Within one bf16 step of the fp32 sum (GPUs round to nearest, the interpreter truncates).
    assert ((got.float() - want).abs() <= want.abs() * 2.0**-7).all()


@needs_triton
def test_lora_weight_grad_is_deterministic():
    left = _make(37, 5, FP32, "contig")
    x = _make(37, 19, BF16, "contig")
    runs = [
        weight_grad_module._lora_weight_grad_triton(
            left=left, x=x, scale=SCALE, split=3, block_m=16, block_k=16
        )
        for _ in range(2)
    ]
    assert torch.equal(runs[0], runs[1])


# ----------------------------------------------------------------------------------------------------
# Dispatch: the kernel runs exactly when it should, the reference otherwise.
# ----------------------------------------------------------------------------------------------------


class _LaunchCounter:
    """Stands in for a @triton.jit kernel and counts ``kernel[grid](...)`` launches."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.launches = 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


def _op_inputs(op: str) -> tuple:
    x = _make(5, 19, BF16, "contig")
    if op == "lora_shrink":
        return (x, _make(3, 19, FP32, "transposed"))
    if op == "lora_expand_add":
        return (
            _make(5, 23, BF16, "contig"),
            _make(5, 3, FP32, "contig"),
            _make(23, 3, BF16, "contig"),
            SCALE,
            BF16,
        )
    return (_make(5, 3, FP32, "contig"), x, SCALE)


@pytest.mark.parametrize("op", ["lora_shrink", "lora_expand_add", "lora_weight_grad"])
def test_dispatch_runs_triton_iff_expected(op, monkeypatch):
    module = {"lora_shrink": lora_terms, "lora_expand_add": expand_add_module}.get(op, weight_grad_module)
    kernel = _LaunchCounter(getattr(module, f"_{op}_kernel"))
    monkeypatch.setattr(module, f"_{op}_kernel", kernel)
    reference_calls = []
    original = getattr(reference, op)
    monkeypatch.setattr(reference, op, lambda *args: reference_calls.append(op) or original(*args))

    args = _op_inputs(op)
    getattr(lora_terms, op)(*args)

    assert runs_triton(args[0]) == EXPECT_TRITON
    if EXPECT_TRITON:
        assert (kernel.launches, len(reference_calls)) == (1, 0), "the Triton kernel was skipped"
    else:
        assert (kernel.launches, len(reference_calls)) == (0, 1), "the reference was skipped"


# ----------------------------------------------------------------------------------------------------
# Input checks and torch.library registration.
# ----------------------------------------------------------------------------------------------------


def _t(*shape, dtype=FP32):
    return torch.randn(*shape, device=DEVICE).to(dtype)


BAD_INPUTS = [
    pytest.param(
        "lora_shrink",
        lambda: (_t(3, 5), _t(2, 6)),
        r"weight must be \[R, K\] with K.*=5, got shape \[2, 6\]",
        id="shrink-k",
    ),
    pytest.param(
        "lora_shrink", lambda: (_t(5), _t(2, 5)), r"x must be 2-D \[M, K\], got shape \[5\]", id="shrink-1d"
    ),
    pytest.param(
        "lora_shrink",
        lambda: (_t(3, 5).to(torch.int32), _t(2, 5)),
        r"x must be float32, bfloat16 or float16",
        id="shrink-int32",
    ),
    pytest.param(
        "lora_expand_add",
        lambda: (_t(3, 7), _t(3, 2, dtype=BF16), _t(7, 2), 1.0, FP32),
        r"left must be float32",
        id="expand-left-bf16",
    ),
    pytest.param(
        "lora_expand_add",
        lambda: (_t(3, 7), _t(4, 2), _t(7, 2), 1.0, FP32),
        r"left must be \[M, R\] with M.*=3, got shape \[4, 2\]",
        id="expand-m",
    ),
    pytest.param(
        "lora_expand_add",
        lambda: (_t(3, 7), _t(3, 2), _t(6, 2), 1.0, FP32),
        r"right must be \[N, R\] with N.*=7, got shape \[6, 2\]",
        id="expand-n",
    ),
    pytest.param(
        "lora_expand_add",
        lambda: (_t(3, 7), _t(3, 2), _t(7, 4), 1.0, FP32),
        r"right must be \[N, R\] with R.*=2, got shape \[7, 4\]",
        id="expand-r",
    ),
    pytest.param(
        "lora_expand_add",
        lambda: (_t(3, 7), _t(3, 2), _t(7, 2), 1.0, torch.int32),
        r"out_dtype must be",
        id="expand-out-int32",
    ),
    pytest.param(
        "lora_weight_grad",
        lambda: (_t(3, 2), _t(4, 5), 1.0),
        r"x must be \[M, K\] with M.*=3, got shape \[4, 5\]",
        id="wgrad-m",
    ),
    pytest.param(
        "lora_weight_grad",
        lambda: (_t(3, 2, dtype=FP16), _t(3, 5), 1.0),
        r"left must be float32",
        id="wgrad-left-fp16",
    ),
]


@pytest.mark.parametrize(
    "make_args, message",
    [
        pytest.param(
            lambda: ([_t(3, 5)], [_t(2, 5), _t(2, 5)], [1.0]), r"one weight and one scale per x", id="lengths"
        ),
        pytest.param(lambda: ([], [], []), r"at least one", id="empty"),
        pytest.param(
            lambda: ([_t(3, 5), _t(4, 5)], [_t(2, 5), _t(2, 5)], [1.0, 1.0]),
            r"with M=3 \(xs\[0\]'s\)",
            id="m",
        ),
        pytest.param(
            lambda: ([_t(3, 5), _t(3, 6)], [_t(2, 5), _t(2, 5)], [1.0, 1.0]),
            r"weight must be \[R, K\]",
            id="k",
        ),
    ],
)
def test_lora_shrink_stacked_bad_inputs_raise(make_args, message):
    with pytest.raises(ValueError, match=message):
        lora_terms.lora_shrink_stacked(*make_args())


@pytest.mark.parametrize("op, make_args, message", BAD_INPUTS)
def test_bad_inputs_raise(op, make_args, message):
    with pytest.raises(ValueError, match=message):
        getattr(lora_terms, op)(*make_args())


OPCHECK_CASES = [
    pytest.param(lora_terms.lora_shrink_op, lambda: (_t(7, 19), _t(19, 5).T), id="shrink"),
    pytest.param(lora_terms.lora_shrink_op, lambda: (_t(7, 19), _t(19, 5).T, 0.5), id="shrink-scaled"),
    pytest.param(
        lora_terms.lora_shrink_keeping_weight_t_op, lambda: (_t(7, 19), _t(5, 19), 0.5), id="shrink-keeping"
    ),
    pytest.param(
        lora_terms.lora_expand_add_op, lambda: (_t(7, 23), _t(7, 5), _t(5, 23).T, SCALE, FP32), id="expand"
    ),
    pytest.param(
        lora_terms.lora_expand_add_op,
        lambda: (_t(7, 23), _t(7, 5), _t(23, 5), SCALE, BF16),
        id="expand-bf16-out",
    ),
    pytest.param(
        lora_terms.lora_shrink_stacked_op,
        lambda: ([_t(7, 19), _t(7, 11, dtype=BF16)], [_t(19, 5).T, _t(3, 11)], [0.5, 2.0]),
        id="shrink-stacked",
    ),
    pytest.param(lora_terms.lora_weight_grad_op, lambda: (_t(7, 5), _t(19, 7).T, SCALE), id="wgrad"),
    pytest.param(
        lora_terms.lora_weight_grad_op, lambda: (_t(7, 5), _t(19, 7).T, SCALE, True), id="wgrad-k-major"
    ),
]


@pytest.mark.parametrize("op, make_args", OPCHECK_CASES)
def test_opcheck(op, make_args):
    torch.library.opcheck(op, make_args())
