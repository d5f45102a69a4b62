"""`lora_weight_grads`: a Function's weight gradients in as few launches as their shapes allow.

The grouped kernel against float64 under the interpreter (2-4 problems, ragged column tiles, split
tokens, K-major and row-major outputs, a scale each); which problems share a launch, and that a
grouped launch computes bit for bit what `lora_weight_grad`'s kernel does per problem; the reference
path, checks, opcheck and the fake; its launch plan; and the fused Functions: o_proj's dA and dB in
one launch, q/k/v's three dB in one, in every layout against float64, PEFT's sub-layers never called.
"""

from __future__ import annotations

from typing import Iterator

import pytest
import torch
from conftest import (
    FUNCTION_LAYOUTS,
    TRITON_INTERPRET,
    compiles_for_sm90_on_cpu,
    observed_launches,
    rel_err,
    requires_interpreter,
)
from test_launch_plans import _THROUGH_CACHE, _same_launch, recorded_launches  # noqa: F401

from fastlora_peft.dtypes import plan_projection_dtypes
from fastlora_peft.functions.frozen_base import FrozenBase, LoraWeights, materialize_weight
from fastlora_peft.functions.shared_input import fused_lora_projections
from fastlora_peft.kernels import _launch
from fastlora_peft.kernels import lora_weight_grad as single_module
from fastlora_peft.kernels import lora_weight_grad_group as group_module
from fastlora_peft.kernels._launch import cdiv
from fastlora_peft.kernels.dots import ROUNDED_DOT, SPLIT_DOT, SPLIT_DOT_PAIR
from fastlora_peft.kernels.lora_weight_grad_group import (
    WeightGradGroupSettings,
    launch_groups,
    lora_weight_grads,
    lora_weight_grads_op,
)

BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
needs_triton = pytest.mark.skipif(
    not (TRITON_INTERPRET or torch.cuda.is_available()), reason="Triton needs CUDA or TRITON_INTERPRET=1"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Token rows per step in the kernel tests: 8 gives several steps on tiny shapes under the interpreter;
# a GPU's tl.dot wants a reduction of at least 16.
TEST_BLOCK_M = 8 if DEVICE == "cpu" else 16


def _problems(m, shapes, x_dtype, seed=0, device=DEVICE):
    """Per (rank, columns): a token-major fp32 left [m, rank] (as lora_shrink hands it out), an x [m,
    columns] of x_dtype, and a scale of its own."""
    generator = torch.Generator().manual_seed(seed)
    lefts = [torch.randn(rank, m, generator=generator).T.to(device) for rank, _ in shapes]
    xs = [torch.randn(m, columns, generator=generator).to(device, x_dtype) for _, columns in shapes]
    scales = [0.5 + i for i in range(len(shapes))]
    return lefts, xs, scales


def _truth(left, x, scale):
    return scale * (left.double().T @ x.double())


# (tokens, [(rank, columns) per problem], K-major per problem): o_proj's dA and dB, q/k/v's three dB
# (ragged: columns not a multiple of the 16-wide test tile), four problems, ranks that are no tile.
GROUP_CASES = [
    (37, [(5, 40), (5, 33)], [False, True]),
    (70, [(4, 48), (4, 19), (4, 17)], [True, True, True]),
    (29, [(6, 16), (6, 50), (6, 7), (6, 33)], [False, True, False, True]),
]


@needs_triton
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("x_dtype, out_dtype", [(BF16, FP32), (BF16, BF16), (FP16, FP16), (FP32, FP32)])
@pytest.mark.parametrize("case", GROUP_CASES, ids=str)
def test_grouped_kernel_matches_float64(case, x_dtype, out_dtype, split):
    m, shapes, k_major = case
    lefts, xs, scales = _problems(m, shapes, x_dtype)
    outs = [group_module._new_out(r, k, km, out_dtype, DEVICE) for (r, k), km in zip(shapes, k_major)]
    # 16-wide column tiles and short row steps: several tiles per problem, several steps per split.
    group_module._launch_group(lefts, xs, scales, outs, split=split, block_m=TEST_BLOCK_M, block_k=16)
    tolerance = 1e-5 if out_dtype == FP32 else 1e-2
    for left, x, scale, out, km in zip(lefts, xs, scales, outs, k_major):
        assert out.dtype == out_dtype and out.T.is_contiguous() == km
        assert rel_err(out, _truth(left, x, scale)) < tolerance


@needs_triton
def test_each_problem_keeps_its_split_partials_apart():
    """On a GPU the programs of all problems run at once, so each problem's fp32 split partials must
    have memory of their own: problem i's split s at n_splits * R * (K_0 + ... + K_{i-1}) + s * R * K_i,
    laid out like its output. (The interpreter runs a tile's splits one after another, so results alone
    cannot show two problems sharing partials.)"""
    from fastlora_peft.kernels.split_sum import split_scratch

    m, shapes, k_major = GROUP_CASES[1]
    lefts, xs, scales = _problems(m, shapes, BF16)
    outs = [group_module._new_out(r, k, km, FP32, DEVICE) for (r, k), km in zip(shapes, k_major)]
    launched = group_module._launch_group(lefts, xs, scales, outs, split=3, block_m=TEST_BLOCK_M, block_k=16)
    rank, widths = shapes[0][0], [k for _, k in shapes]
    rows_per_split = cdiv(cdiv(m, 3), TEST_BLOCK_M) * TEST_BLOCK_M  # 70 rows in 3 splits of whole steps
    partials = split_scratch(xs[0].device, 3 * rank * sum(widths), 1).partials  # the launch's scratch
    assert launched is None or launched[3] == (3 * rank * sum(widths), sum(-(-k // 16) for k in widths))
    start = 0
    for left, x, width, km in zip(lefts, xs, widths, k_major):
        for split in range(3):
            rows = slice(split * rows_per_split, (split + 1) * rows_per_split)
            region = partials[start + split * rank * width : start + (split + 1) * rank * width]
            got = region.view(width, rank).T if km else region.view(rank, width)
            assert rel_err(got, left[rows].double().T @ x[rows].double()) < 1e-5
        start += 3 * rank * width


@pytest.mark.parametrize(
    "shapes, expected",
    [
        ([(16, 64), (16, 64)], [(0, 1)]),  # o_proj: dA and dB
        ([(48, 64), (16, 64), (16, 32), (16, 32)], [(0,), (1, 2, 3)]),  # q/k/v: dA of rank 3r alone
        ([(8, 64)] * 5, [(0, 1, 2, 3), (4,)]),  # at most MAX_PROBLEMS a launch
        ([(32, 64), (32, 9000)], [(0,), (1,)]),  # rank 32: 128-row steps up to 8192 columns, 64 past
        ([(70, 64), (70, 9000)], [(0,), (1,)]),  # two 64-wide rank tiles: 4 warps up to 8192 columns
        ([(70, 64), (70, 8192)], [(0, 1)]),
        ([(16, 64), (16, 0), (16, 64)], [(0, 2), (1,)]),  # no columns: lora_weight_grad's zeros
        ([(16, 64), (16, 1)], [(0,), (1,)]),  # one column (K = 1, and a row stride of 1)
    ],
)
def test_launch_groups_joins_what_lora_weight_grad_tiles_alike(shapes, expected):
    lefts, xs, _ = _problems(9, shapes, BF16)
    assert launch_groups(lefts, xs) == expected


@pytest.mark.parametrize(
    "rank, columns, tokens, rows_and_warps",
    [
        (16, 64, 8192, (64, 8)), (16, 9000, 8192, (64, 8)), (32, 64, 8192, (128, 8)),
        (32, 9000, 8192, (64, 8)), (40, 64, 8192, (64, 4)), (64, 8192, 8192, (64, 4)),
        (128, 64, 2048, (64, 4)), (64, 9000, 8192, (64, 8)), (64, 64, 8191, (128, 8)),
        (40, 64, 2048, (128, 8)),
    ],
)  # fmt: skip
def test_grouped_tiling_by_ranks_columns_and_tokens(rank, columns, tokens, rows_and_warps):
    """Row steps and warps of a grouped launch (session48's probes, docs/benchmarks.md): 64-wide rank
    tiles over up to 8192 columns take 64 rows and 4 warps from 8192 tokens on, or with two rank
    tiles (q/k/v's dB at rank 128 and 8192 tokens 164 -> 131 us); one such tile under 8192 tokens,
    and 32-wide tiles, 128 rows; past 8192 columns, or at rank 16, 64 rows and 8 warps."""
    assert single_module.weight_grad_tiling(rank, columns, tokens) == rows_and_warps


@pytest.fixture
def weight_grad_metas(monkeypatch) -> Iterator[list[dict]]:
    """The keyword arguments (constexprs and launch options) of every launch of the two
    weight-gradient kernels during a test, in order. Launch plans are off meanwhile (a planned launch
    does not pass the kernel's `launch`; `observed_launches` puts the kernels back as found)."""
    monkeypatch.setattr(_launch.LaunchPlans, "enabled", False)
    metas: list[dict] = []
    kernels = (single_module._lora_weight_grad_kernel, group_module._lora_weight_grad_group_kernel)
    with observed_launches(kernels, lambda grid, args, meta: metas.append(dict(meta))):
        yield metas


@needs_triton
@pytest.mark.parametrize(
    "rank, rows_and_warps", [(70, (64, 4)), (40, (128, 8)), (20, (128, 8)), (9, (64, 8))]
)
def test_grouped_launch_takes_the_tiling_rules_rows_and_warps(rank, rows_and_warps, weight_grad_metas):
    """With no row step or warps given, `_launch_group` launches with `weight_grad_tiling`'s rows and
    warps for its rank, first member's columns and tokens, and stays exact."""
    lefts, xs, scales = _problems(37, [(rank, 40), (rank, 33)], BF16)
    outs = [group_module._new_out(rank, k, False, FP32, DEVICE) for k in (40, 33)]
    group_module._launch_group(lefts, xs, scales, outs, block_k=16)
    assert [(meta["BLOCK_M"], meta["num_warps"]) for meta in weight_grad_metas] == [rows_and_warps]
    for out, left, x, scale in zip(outs, lefts, xs, scales):
        assert rel_err(out, _truth(left, x, scale)) < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Llama-3.1-8B sizes: too slow for the interpreter")
@pytest.mark.parametrize("rank, tokens", [(128, 8192), (64, 8192), (64, 2048)])
def test_grouped_launch_at_q_k_v_sizes_matches_float64(rank, tokens, triton_launches):
    """q/k/v's three dB at rank 64 / 128 in one grouped launch with the default tiling (64 rows and 4
    warps from 8192 tokens or two rank tiles, else 128 rows and 8 warps): fp32 accuracy against
    float64."""
    lefts, xs, scales = _problems(tokens, [(rank, 4096), (rank, 1024), (rank, 1024)], BF16)
    outs = lora_weight_grads(lefts, xs, scales, [True] * 3, FP32)
    assert dict(triton_launches) == {"_lora_weight_grad_group_kernel": 1}
    for out, left, x, scale in zip(outs, lefts, xs, scales):
        assert rel_err(out, _truth(left, x, scale)) < 1e-5  # a 16-bit rounding reads ~1e-3


@needs_triton
@pytest.mark.parametrize("out_dtype, mode", [(BF16, ROUNDED_DOT), (FP16, SPLIT_DOT_PAIR), (FP32, SPLIT_DOT)])
def test_gradients_rounded_to_16_bits_take_the_pair_split(out_dtype, mode, weight_grad_metas):
    """A bf16 activation against the fp32 left: a gradient rounded to bf16 in the end (bf16 adapters)
    multiplies the left rounded to bf16 (as PEFT's bf16 path does), one rounded to fp16 the left's two
    high bf16 parts, an fp32 one (fp32 adapters) all three; the single and the grouped launch alike,
    each within its output's rounding of float64."""
    lefts, xs, scales = _problems(70, [(20, 40), (20, 33), (20, 17)], BF16)
    single = lora_weight_grads(lefts[:1], xs[:1], scales[:1], [False], out_dtype)
    grouped = lora_weight_grads(lefts[1:], xs[1:], scales[1:], [True, False], out_dtype)
    assert [meta["DOT_MODE"] for meta in weight_grad_metas] == [mode, mode]
    bound = 1e-5 if out_dtype == FP32 else 4e-3  # one rounding of a 16-bit result
    for out, left, x, scale in zip(single + grouped, lefts, xs, scales):
        assert out.dtype == out_dtype and rel_err(out, _truth(left, x, scale)) < bound


@needs_triton
@pytest.mark.parametrize(
    "rounded_to, mode",
    [(None, SPLIT_DOT), (FP32, SPLIT_DOT), (BF16, ROUNDED_DOT), (FP16, SPLIT_DOT_PAIR)],
)
def test_an_fp32_result_rounded_to_16_bits_later_takes_the_pair(rounded_to, mode, weight_grad_metas):
    """rounded_to: the caller sums fp32 results and rounds the sum to 16 bits in the end (the gated
    MLP's dA_down chunks past its fused kernel's ranks): the dot that rounding asks for (the pair for
    fp16, the left rounded to bf16 for bf16), and still an fp32 result."""
    lefts, xs, scales = _problems(70, [(20, 40)], BF16)
    out = single_module.lora_weight_grad(lefts[0], xs[0], scales[0], rounded_to=rounded_to)
    assert [meta["DOT_MODE"] for meta in weight_grad_metas] == [mode]
    assert out.dtype == FP32
    error = rel_err(out, _truth(lefts[0], xs[0], scales[0]))
    # The left rounded to bf16 to nearest: ~2**-9 per product, 1.8e-3 here (truncated, as the
    # interpreter's own cast does, it read 3.3e-3: `dots.bf16_rounded` rounds to nearest there).
    bounds = {SPLIT_DOT_PAIR: (1e-7, 3e-5), ROUNDED_DOT: (3e-4, 3e-3)}
    low, high = bounds.get(mode, (0.0, 1e-6))
    assert low < error < high


@needs_triton
@pytest.mark.parametrize("grouped", [False, True])
def test_pair_split_keeps_16_significant_bits_of_the_left(grouped, monkeypatch):
    """The pair's arithmetic, forced on an fp32 result: ~1e-5 relative error against float64 (2**-17
    per product), under a 16-bit rounding by 100x or more; the high part alone reads ~2e-3. The
    three-part split beside it is exact to fp32 (~1e-7)."""
    monkeypatch.setattr(_launch.LaunchPlans, "enabled", False)  # a plan would keep the first arm's mode
    module = group_module if grouped else single_module
    lefts, xs, scales = _problems(70, [(20, 40), (20, 33)] if grouped else [(20, 40)], BF16)
    errors = {}
    for mode in (SPLIT_DOT, SPLIT_DOT_PAIR, ROUNDED_DOT):
        monkeypatch.setattr(module, "weight_grad_dot_mode", lambda *args, _mode=mode: _mode)
        outs = lora_weight_grads(lefts, xs, scales, [False] * len(lefts), FP32)
        errors[mode] = max(
            rel_err(out, _truth(left, x, s)) for out, left, x, s in zip(outs, lefts, xs, scales)
        )
    assert errors[SPLIT_DOT] < 1e-6
    assert 1e-7 < errors[SPLIT_DOT_PAIR] < 3e-5
    assert 3e-4 < errors[ROUNDED_DOT] < 3e-3  # the left rounded to bf16: PEFT's bf16 path


def test_launch_groups_keeps_other_layouts_and_dtypes_apart(monkeypatch):
    lefts, xs, _ = _problems(9, [(16, 64)] * 4, BF16)
    xs[1] = xs[1].to(FP16)  # another activation dtype
    xs[2] = xs[2].T.contiguous().T  # columns not contiguous
    lefts[3] = torch.randn(16, 2 * 9)[:, :9].T  # a left of another rank stride (18, not 9)
    assert launch_groups(lefts, xs) == [(0,), (1,), (2,), (3,)]
    lefts, xs, _ = _problems(9, [(16, 64)] * 2, BF16)
    xs[1] = xs[1][:, 5:6]  # one column of a wider x: K = 1 with a row stride of 64
    assert launch_groups(lefts, xs) == [(0,), (1,)]
    lefts, xs, _ = _problems(9, [(16, 64)] * 2, BF16)
    monkeypatch.setattr(WeightGradGroupSettings, "enabled", False)
    assert launch_groups(lefts, xs) == [(0,), (1,)]


@needs_triton
@pytest.mark.parametrize("out_dtype", [FP32, BF16])
def test_grouped_launch_computes_what_lora_weight_grad_does(out_dtype, triton_launches, monkeypatch):
    """q/k/v's four gradients: dA (rank 3r) through lora_weight_grad's kernel, the three dB through
    one grouped launch, bit for bit what lora_weight_grad's kernel gives each alone (the same tiles,
    steps and sums); with the setting off, four of lora_weight_grad's launches."""
    lefts, xs, scales = _problems(45, [(12, 40), (4, 40), (4, 24), (4, 24)], BF16)
    lefts[0] = lefts[0].contiguous()  # row-major: copied token-major inside, as lora_weight_grad does
    k_major = [False, True, True, True]
    grouped = lora_weight_grads(lefts, xs, scales, k_major, out_dtype)
    assert dict(triton_launches) == {"_lora_weight_grad_kernel": 1, "_lora_weight_grad_group_kernel": 1}
    triton_launches.clear()
    monkeypatch.setattr(WeightGradGroupSettings, "enabled", False)
    alone = lora_weight_grads(lefts, xs, scales, k_major, out_dtype)
    assert dict(triton_launches) == {"_lora_weight_grad_kernel": 4}
    for got, want, left, x, scale in zip(grouped, alone, lefts, xs, scales):
        assert got.stride() == want.stride() and got.dtype == want.dtype == out_dtype
        assert torch.equal(got, want)
        assert rel_err(got, _truth(left, x, scale)) < (1e-5 if out_dtype == FP32 else 1e-2)


# (column tiles, tokens, splits) on an H200 at rank tile 16 (3 programs per SM, 132 SMs: 396 places):
# the MLP's three dB (2 x 112 + 32 tiles), q/k/v's (32 + 8 + 8), o_proj's dA and dB (32 + 32).
@pytest.mark.parametrize(
    "tiles, tokens, splits",
    [(256, 2048, 1), (256, 8192, 1), (48, 8192, 8), (48, 2048, 4), (64, 8192, 6), (64, 2048, 4)]
    + [(500, 8192, 1)],
)
def test_group_split_keeps_the_programs_within_one_wave(tiles, tokens, splits, monkeypatch):
    """Two programs per SM, lora_weight_grad's rule, split the MLP's dB in two: 512 programs against
    396 places, measured slower than one (docs/benchmarks/session24/wgrad_split_probe.log)."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(group_module, "_num_sms", lambda device: 132)
    monkeypatch.setattr(group_module, "_programs_per_sm", lambda device, shared: 233472 // shared)
    shared = 3 * 64 * (128 * 2 + 16 * 4)  # three stages of a 64 x 128 bf16 x tile and a 64 x 16 fp32 left
    assert group_module._group_split(tokens, tiles, shared, cuda) == splits


# (column x rank tiles, tokens, splits) of lora_weight_grad's own launch on an H200 (132 SMs, two
# programs each: 264 places): q/k/v's stacked dA and the MLP's gate/up dA at K=4096 (32 tiles), a
# K=14336 rank-16 gradient (112), K=1024 (8), and more tiles than places.
@pytest.mark.parametrize(
    "tiles, tokens, splits",
    [(32, 8192, 8), (32, 2048, 4), (112, 8192, 2), (8, 8192, 16), (1, 8192, 16), (300, 8192, 1)],
)
def test_single_launch_splits_within_one_wave(tiles, tokens, splits, monkeypatch):
    """Rounded up (the rule before), q/k/v's dA at 8192 tokens made 9 splits, 288 programs against
    264 places, and took 52.3us against 39.8 in 8 (docs/benchmarks/session30/wgrad_rows_probe.log)."""
    monkeypatch.setattr(single_module, "_num_sms", lambda device: 132)
    assert single_module.token_splits(tokens, tiles, torch.device("cuda")) == splits


def _split_three_ways(monkeypatch, module, rule: str) -> tuple[list, list]:
    """`module.<rule>` answers 3 and records what it was asked; `module.split_scratch` records the sizes
    it is asked for. Returns (asked, scratch sizes)."""
    asked, scratch_sizes = [], []
    monkeypatch.setattr(module, rule, lambda *args: asked.append(args) or 3)
    real_scratch = module.split_scratch
    monkeypatch.setattr(
        module,
        "split_scratch",
        lambda device, *sizes: scratch_sizes.append(sizes) or real_scratch(device, *sizes),
    )
    return asked, scratch_sizes


@needs_triton
def test_grouped_launch_takes_its_split_from_group_split(monkeypatch):
    """The launch asks `_group_split` (tokens, column tiles, one program's shared memory estimate) and
    splits the tokens as it answers: the split scratch is that many partials, the results exact."""
    m, shapes, k_major = GROUP_CASES[1]
    lefts, xs, scales = _problems(m, shapes, BF16)
    outs = [group_module._new_out(r, k, km, FP32, DEVICE) for (r, k), km in zip(shapes, k_major)]
    asked, scratch_sizes = _split_three_ways(monkeypatch, group_module, "_group_split")
    group_module._launch_group(lefts, xs, scales, outs, block_m=TEST_BLOCK_M, block_k=16)
    rank, widths = shapes[0][0], [k for _, k in shapes]
    one_program = 3 * TEST_BLOCK_M * (16 * 2 + 16 * 4)  # 3 stages of a bf16 x tile and an fp32 left tile
    assert asked == [(m, sum(-(-k // 16) for k in widths), one_program, xs[0].device)]
    assert scratch_sizes[0][0] == 3 * rank * sum(widths)  # three splits' partials
    for out, left, x, scale in zip(outs, lefts, xs, scales):
        assert rel_err(out, _truth(left, x, scale)) < 1e-5


@needs_triton
def test_single_launch_takes_its_split_from_token_splits(monkeypatch):
    """`lora_weight_grad`'s own launch asks `token_splits` (tokens, column x rank tiles) and splits
    the tokens as it answers: the split scratch is that many partials, the result exact."""
    (left,), (x,), (scale,) = _problems(40, [(5, 37)], BF16)
    asked, scratch_sizes = _split_three_ways(monkeypatch, single_module, "token_splits")
    out = single_module._lora_weight_grad_triton(
        left=left, x=x, scale=scale, block_m=TEST_BLOCK_M, block_k=16
    )
    assert asked == [(40, 3, x.device)]  # 37 columns in 16-wide tiles, one rank tile
    assert scratch_sizes[0][0] == 3 * 5 * 37  # three splits' partials
    assert rel_err(out, _truth(left, x, scale)) < 1e-5


def test_programs_per_sm_reads_the_devices_shared_memory(monkeypatch):
    from types import SimpleNamespace

    from fastlora_peft.kernels import _lora_common

    count = _lora_common._programs_per_sm.__wrapped__
    cuda = torch.device("cuda")
    h200 = SimpleNamespace(shared_memory_per_multiprocessor=233472)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: h200)
    assert count(cuda, 63488) == 3  # the rank-16 tile's sm_90 compile
    assert count(cuda, 212992) == 2  # the rank-64 tile's: one fits, two are assumed as before
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace())
    assert count(cuda, 63488) == 2  # not reported
    assert count(torch.device("cpu"), 63488) == 2


def test_reference_path_matches_lora_weight_grad():
    # float64 runs the reference everywhere (gradcheck); plain CPU tensors do outside the interpreter.
    generator = torch.Generator().manual_seed(3)
    lefts = [torch.randn(11, r, generator=generator, dtype=FP64) for r in (3, 5)]
    xs = [torch.randn(11, k, generator=generator, dtype=FP64) for k in (7, 4)]
    outs = lora_weight_grads(lefts, xs, [0.5, -2.0], [False, True])
    for out, left, x, scale, km in zip(outs, lefts, xs, [0.5, -2.0], [False, True]):
        want = single_module.lora_weight_grad(left, x, scale, k_major=km)
        assert out.dtype == FP64 and out.stride() == want.stride() and torch.equal(out, want)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda lefts, xs: (lefts[:1], xs, [1.0, 1.0], [False, False]), "one x, scale and k_major per left"),
        (lambda lefts, xs: ([], [], [], []), "at least one"),
        (
            lambda lefts, xs: ([lefts[0], lefts[1][:5]], [xs[0], xs[1][:5]], [1.0] * 2, [False] * 2),
            "lefts\\[0\\]'s M",
        ),
        (lambda lefts, xs: ([lefts[0].to(BF16), lefts[1]], xs, [1.0, 1.0], [False, False]), "float32"),
        (
            lambda lefts, xs: (lefts, [xs[0], xs[1][:5]], [1.0, 1.0], [False, False]),
            "M \\(left.shape\\[0\\]\\)",
        ),
    ],
)
def test_checks(make, message):
    lefts, xs, _ = _problems(9, [(4, 8), (4, 8)], FP32)
    with pytest.raises(ValueError, match=message):
        lora_weight_grads(*make(lefts, xs))


def test_opcheck():
    lefts, xs, scales = _problems(9, [(4, 8), (3, 5)], FP32)
    torch.library.opcheck(lora_weight_grads_op, (lefts, xs, scales, [False, True], FP32))
    torch.library.opcheck(lora_weight_grads_op, (lefts, xs, scales, [True, False], None))


def test_group_plan_launches_what_the_launcher_would(recorded_launches, monkeypatch):  # noqa: F811
    """q/k/v's four gradients: call 1 makes the plan (two launches: lora_weight_grad's, the group's),
    call 2 launches both from it with its own tensors and scales, call 3 (plans off) must launch the
    same arguments. (The op body, whose plan it is: on CPU tensors it is told they run Triton.)"""
    monkeypatch.setattr(group_module, "runs_triton", lambda tensor: True)

    def make_inputs(seed):
        # CPU tensors stand in for CUDA ones (recorded_launches), on any machine.
        lefts, xs, scales = _problems(600, [(12, 40), (4, 40), (4, 24), (4, 24)], BF16, seed, device="cpu")
        return lefts, xs, [scale + seed for scale in scales], [False, True, True, True], BF16

    group_module._lora_weight_grads_body(*make_inputs(0))
    assert len(recorded_launches) == 2 and len(_THROUGH_CACHE) == 2
    second = make_inputs(1)
    group_module._lora_weight_grads_body(*second)
    assert len(recorded_launches) == 4 and len(_THROUGH_CACHE) == 2, "call 2 did not launch from its plan"
    _launch.LaunchPlans.enabled = False
    try:
        group_module._lora_weight_grads_body(*second)
    finally:
        _launch.LaunchPlans.enabled = True
    inputs = [*second[0], *second[1]]
    for planned, unplanned in zip(recorded_launches[2:4], recorded_launches[4:6]):
        _same_launch(planned, unplanned, inputs)
    floats = [value for value in recorded_launches[3] if type(value) is float]
    assert floats == [2.5, 3.5, 4.5]  # call 2's own scales (the three dB; the fourth slot is None)


def _projections(shapes, layout, seed=0):
    dtype, adapter_dtype, quantized = layout
    generator = torch.Generator().manual_seed(seed)
    bases, loras = [], []
    for rank, (in_features, out_features) in zip((4, 4, 4), shapes):
        weight = (torch.randn(out_features, in_features, generator=generator) / in_features**0.5).to(dtype)
        base = FrozenBase(weight, None, None)
        if quantized:
            import bitsandbytes.functional as bnb_functional

            from fastlora_peft.kernels.dequant4bit import Quant4bitState

            packed, state = bnb_functional.quantize_4bit(
                weight, blocksize=64, compress_statistics=True, quant_type="nf4"
            )
            base = FrozenBase(packed, None, Quant4bitState.from_bnb(state, packed))
        lora_a = torch.randn(rank, in_features, generator=generator) / in_features**0.5
        lora_b = torch.randn(out_features, rank, generator=generator)  # not zero: a zero B hides dA
        loras.append(
            LoraWeights(
                lora_a.to(adapter_dtype).requires_grad_(), lora_b.to(adapter_dtype).requires_grad_(), 0.75
            )
        )
        bases.append(base)
    return bases, loras


def _float64_grads(x, bases, loras, grads, plan):
    """Every adapter gradient of the projections in float64, on the weights the fused path reads."""
    x64 = x.detach().double()
    params = []
    for lora in loras:
        params += [
            lora.lora_a.detach().double().requires_grad_(),
            lora.lora_b.detach().double().requires_grad_(),
        ]
    outs = []
    for index, (base, lora) in enumerate(zip(bases, loras)):
        weight = materialize_weight(base, plan.compute_dtype).double()
        a, b = params[2 * index], params[2 * index + 1]
        outs.append(x64 @ weight.T + lora.scale * (x64 @ a.T) @ b.T)
    torch.autograd.backward(outs, [grad.double() for grad in grads])
    return [param.grad for param in params]


@requires_interpreter  # CPU tensors: on a GPU machine without the interpreter they take the reference
@pytest.mark.parametrize("layout_id", list(FUNCTION_LAYOUTS))
@pytest.mark.parametrize("case", ["o", "qkv"])
def test_fused_projections_take_their_weight_grads_grouped(
    case, layout_id, triton_launches, weight_grad_metas
):
    """o_proj's dA and dB in one launch, q/k/v's three dB in one (dA of the three in another), every
    adapter gradient against float64 in every layout the fused path takes."""
    layout = FUNCTION_LAYOUTS[layout_id]
    shapes = [(64, 64)] if case == "o" else [(64, 64), (64, 128), (64, 128)]
    bases, loras = _projections(shapes, layout)
    x = torch.randn(2, 9, 64).to(layout[0]).requires_grad_()
    plan = plan_projection_dtypes(layout[0], layout[0], quantized=layout[2], device_type="cpu")
    outputs = fused_lora_projections(x, bases, loras, plan)
    grads = [torch.randn_like(out) for out in outputs]
    triton_launches.clear()
    torch.autograd.backward(outputs, grads)
    want = {
        "o": {"_lora_weight_grad_group_kernel": 1},
        "qkv": {"_lora_weight_grad_group_kernel": 1, "_lora_weight_grad_kernel": 1},
    }
    assert {k: v for k, v in triton_launches.items() if "weight_grad" in k} == want[case]
    if layout[0] == BF16:  # the split dot: all three parts for fp32 adapters, the pair for fp16 ones
        want_mode = {FP32: SPLIT_DOT, BF16: ROUNDED_DOT}.get(layout[1], SPLIT_DOT_PAIR)
        assert [meta["DOT_MODE"] for meta in weight_grad_metas] == [want_mode] * len(weight_grad_metas)
        assert len(weight_grad_metas) == sum(want[case].values())
    truths = _float64_grads(
        x.reshape(-1, 64), bases, loras, [g.reshape(-1, g.shape[-1]) for g in grads], plan
    )
    got = [grad for lora in loras for grad in (lora.lora_a.grad, lora.lora_b.grad)]
    # fp32 adapters: fp32 sums of exact 16-bit products (PEFT's fp32 path gets ~1e-7 here); 16-bit
    # adapters: one rounding of the gradient.
    tolerance = 1e-5 if layout[1] == FP32 else (1e-2 if layout[1] == BF16 else 2e-3)
    for value, truth in zip(got, truths):
        assert value.dtype == layout[1]
        assert rel_err(value, truth) < tolerance


# Compiles lora_weight_grad's kernel and the grouped kernel for an H100/H200 (sm_90) as launches at
# Llama sizes specialize them (16-byte aligned pointers, sizes and strides multiples of 16; the
# grouped kernel's unspecialized output strides, and the single kernel's output strides, one of which
# is 1 at its launches, as plain ints), and prints each one's shared memory and its memory and MMA
# instructions by kind. A subprocess: under TRITON_INTERPRET=1 `triton.jit` makes no compilable kernel.
_SM90_COMPILE = r"""
import collections
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fastlora_peft.kernels import lora_weight_grad, lora_weight_grad_group
from fastlora_peft.kernels.dots import SPLIT_DOT

kernels = {
    "single": lora_weight_grad._lora_weight_grad_kernel.kernel,
    "group": lora_weight_grad_group._lora_weight_grad_group_kernel.kernel,
}
unspecialized = set(lora_weight_grad_group._UNSPECIALIZED)
for block_r, block_m in ((16, 64), (64, 128)):
    for name, fn in kernels.items():
        constexprs = dict(
            BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=128, DOT_PRECISION="tf32x3", DOT_MODE=SPLIT_DOT,
            SPLIT=True,
        )
        names = fn.arg_names
        if name == "group":  # three problems: the fourth slot's arguments are None
            fourth = [arg for arg in names if arg.removesuffix("_ptr").endswith("3")]
            constexprs.update(PROBLEMS=3, **dict.fromkeys(fourth))
        else:
            constexprs.update(stride_xk=1, stride_lm=1)
        def kind(arg):
            if arg in constexprs:
                return "constexpr"
            if arg.startswith(("X", "Out")):
                return "*bf16"
            if arg.startswith("Counter"):
                return "*i32"
            return "*fp32" if arg.endswith("_ptr") else "fp32" if arg.startswith("scale") else "i32"
        signature = {arg: kind(arg) for arg in names}
        plain = ("stride_o", "rows_per_split", "n_splits")
        divisible = [
            i for i, arg in enumerate(names)
            if signature[arg] not in ("constexpr", "fp32") and arg not in unspecialized
            and not arg.startswith(plain)
        ]
        source = ASTSource(
            fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in constexprs.items()},
            attrs={(i,): [["tt.divisibility", 16]] for i in divisible},
        )
        options = dict(num_warps=8, num_stages=3)  # lora_weight_grad's launch
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        ops = collections.Counter()
        for line in kernel.asm["ptx"].split("\n"):
            words = line.strip().rstrip(";").split()
            words = words[1:] if words and words[0].startswith("@") else words
            if words and words[0].startswith(("cp.async", "ld.global", "st.global", "wgmma.mma_async")):
                operands = " ".join(words[1:]).split(",")
                size = operands[2].strip() if words[0].startswith(("cp.async.ca.", "cp.async.cg.")) else ""
                ops[f"{words[0]} {size}".strip()] += 1
        print(name, block_r, kernel.metadata.shared, dict(sorted(ops.items())))
"""


@compiles_for_sm90_on_cpu
def test_grouped_kernel_compiles_to_lora_weight_grads_loads_and_dots_on_hopper():
    """The grouped kernel's pick of a problem must not cost its loop anything on the GPU: for sm_90 it
    compiles to the same shared memory and the same asynchronous copies (16-byte for x), loads, stores
    and wgmma instructions as lora_weight_grad's kernel, at rank tiles 16 and 64."""
    import os
    import subprocess
    import sys

    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", _SM90_COMPILE], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    compiled = {}
    for line in result.stdout.strip().split("\n"):
        name, block_r, rest = line.split(" ", 2)
        compiled[name, int(block_r)] = rest
    for block_r in (16, 64):
        assert compiled["group", block_r] == compiled["single", block_r]
        assert "cp.async.cg.shared.global 0x10" in compiled["group", block_r]  # x in 16-byte copies


@requires_interpreter  # CPU tensors, as above
@pytest.mark.parametrize("layout_id", list(FUNCTION_LAYOUTS))
def test_gated_mlp_makes_downs_db_with_gate_and_up_in_one_launch(layout_id, triton_launches, monkeypatch):
    """The MLP's backward: gate/up's dA (rank 2r) alone, and gate's, up's and down's dB in one grouped
    launch; every adapter gradient bit for bit what one lora_weight_grad launch per gradient gives."""
    from fastlora_peft.functions.gated_mlp import fused_gated_mlp

    layout = FUNCTION_LAYOUTS[layout_id]
    plan = plan_projection_dtypes(layout[0], layout[0], quantized=layout[2], device_type="cpu")
    grads = {}
    for grouped in (True, False):
        monkeypatch.setattr(WeightGradGroupSettings, "enabled", grouped)
        bases, loras = _projections([(64, 128), (64, 128), (128, 64)], layout)
        x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(1)).to(layout[0])
        out = fused_gated_mlp(x, bases, loras, plan, "silu")
        triton_launches.clear()
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out.dtype))
        launches = {k: v for k, v in triton_launches.items() if k.startswith("_lora_weight_grad")}
        want = {"_lora_weight_grad_kernel": 1, "_lora_weight_grad_group_kernel": 1} if grouped else None
        assert launches == (want or {"_lora_weight_grad_kernel": 4}), launches
        grads[grouped] = [grad for lora in loras for grad in (lora.lora_a.grad, lora.lora_b.grad)]
    for got, want in zip(grads[True], grads[False]):
        assert got.dtype == want.dtype == layout[1] and torch.equal(got, want)


@pytest.mark.parametrize("split_dtypes", ["members", "a_and_b"])
def test_mixed_adapter_dtypes_make_each_gradient_in_its_own_dtype(split_dtypes, monkeypatch):
    """A group whose adapters do not share one dtype (q's fp32 beside k's and v's bf16, or every A
    fp32 beside bf16 B) cannot round all its gradients in one kernel: each goes through
    lora_weight_grad with its own dtype, against float64."""
    from fastlora_peft.functions import shared_input

    layout = FUNCTION_LAYOUTS["fp32-adapters-on-bf16"]
    bases, loras = _projections([(64, 64), (64, 128), (64, 128)], layout)
    for index, lora in enumerate(loras):
        a_dtype = FP32 if (split_dtypes == "a_and_b" or index == 0) else BF16
        b_dtype = BF16 if (split_dtypes == "a_and_b" or index > 0) else FP32
        a = lora.lora_a.detach().to(a_dtype).requires_grad_()
        loras[index] = LoraWeights(a, lora.lora_b.detach().to(b_dtype).requires_grad_(), lora.scale)
    grouped_calls, made = [], []
    monkeypatch.setattr(shared_input, "lora_weight_grads", lambda *args: grouped_calls.append(args))
    weight_grad = shared_input.lora_weight_grad

    def spy(*args, **kwargs):  # what each gradient comes out as, before autograd would cast it
        result = weight_grad(*args, **kwargs)
        made.append((kwargs["k_major"], result.dtype))
        return result

    monkeypatch.setattr(shared_input, "lora_weight_grad", spy)
    x = torch.randn(2, 9, 64).to(BF16).requires_grad_()
    plan = plan_projection_dtypes(BF16, BF16, quantized=False, device_type="cpu")
    outputs = fused_lora_projections(x, bases, loras, plan)
    grads = [torch.randn_like(out) for out in outputs]
    torch.autograd.backward(outputs, grads)
    assert not grouped_calls
    # dB_i in lora_B_i's dtype; dA of the group in the A's dtype where they share one, else fp32
    # (each member's slice then cast to its A's dtype).
    a_dtypes = {lora.lora_a.dtype for lora in loras}
    a_made = next(iter(a_dtypes)) if len(a_dtypes) == 1 else FP32
    assert made == [(False, a_made)] + [(True, lora.lora_b.dtype) for lora in loras]
    truths = _float64_grads(
        x.reshape(-1, 64), bases, loras, [g.reshape(-1, g.shape[-1]) for g in grads], plan
    )
    got = [grad for lora in loras for grad in (lora.lora_a.grad, lora.lora_b.grad)]
    params = [param for lora in loras for param in (lora.lora_a, lora.lora_b)]
    for value, truth, param in zip(got, truths, params):
        assert value.dtype == param.dtype
        assert rel_err(value, truth) < (1e-5 if param.dtype == FP32 else 1e-2)
