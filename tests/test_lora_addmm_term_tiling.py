"""The LoRA term of the TMA GEMMs (`lora_addmm`'s, `lora_addmm_group`'s, `lora_addmm_sum`'s) past
`PIPELINED_TERM_RANKS`, where `term_tiling` pipelines its rank loop: the rule, that each launcher
launches with the tiling of the most ranks of any member, and each kernel there against float64 in
every 16-bit layout (on a GPU the pipelined loop runs; the interpreter runs the same tiles in turn).
"""

from __future__ import annotations

from typing import Iterator

import pytest
import torch
from conftest import observed_launches, rel_err
from test_lora_addmm import _operands as single_operands
from test_lora_addmm import _truth as single_truth
from test_lora_addmm_group import _operands as group_operands
from test_lora_addmm_group import _truths as group_truths
from test_lora_addmm_sum import _operands as sum_operands
from test_lora_addmm_sum import _truth as sum_truth
from test_lora_addmm_sum import needs_triton

from fastlora_peft.kernels import lora_addmm as single_module
from fastlora_peft.kernels import lora_addmm_group as group_module
from fastlora_peft.kernels import lora_addmm_sum as sum_module
from fastlora_peft.kernels._launch import LaunchPlans
from fastlora_peft.kernels.lora_addmm import (
    PIPELINED_TERM_RANKS,
    RANK_STAGES_MANY,
    RANK_TILE,
    lora_addmm,
    term_tiling,
)
from fastlora_peft.kernels.lora_addmm_group import lora_addmm_group
from fastlora_peft.kernels.lora_addmm_sum import lora_addmm_sum

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
TOLERANCE = {BF16: 1e-2, FP16: 1e-3}  # one rounding of a 16-bit result (see test_lora_addmm)
SCALE = 0.37
LAYOUTS = {"bf16": (BF16, BF16), "bf16-fp32a": (BF16, FP32), "fp16": (FP16, FP16), "fp16-fp32a": (FP16, FP32)}
# Past the threshold, five rank tiles, the last ragged.
MANY = 70


def test_the_rank_loop_pipelines_from_64_ranks():
    # One to three trips keep plain loads (one trip pipelined cost up to 67 us a GEMM); from four on,
    # each trip's loads are in flight while the one before multiplies (docs/benchmarks/session46/).
    assert PIPELINED_TERM_RANKS == 64 and RANK_STAGES_MANY == 3
    assert [term_tiling(r) for r in (1, 16, 48, 63)] == [(RANK_TILE, 1)] * 4
    assert [term_tiling(r) for r in (64, 70, 192, 384)] == [(RANK_TILE, RANK_STAGES_MANY)] * 4


@pytest.fixture
def left_strides(monkeypatch) -> list[list[tuple[int, int]]]:
    """Per launch of the three TMA kernels (filled by `term_launches`), the strides of each left
    operand it was given: the fp32 [M, R] tensors ahead of the rights, which the tests here make
    fp32 [N, R] only in the fp32-adapter layouts, contiguous (the launcher copies a transposed one).
    Launch plans are off meanwhile: on CUDA a launch of metadata seen before (another test's) is
    served from its plan, which does not pass through the kernel's `launch`."""
    monkeypatch.setattr(LaunchPlans, "enabled", False)  # the class's switch (see there)
    return []


@pytest.fixture
def term_launches(triton_launches, left_strides) -> Iterator[list[tuple[int, int]]]:
    """(BLOCK_R, RANK_STAGES) of each launch of the three TMA kernels during a test. Wraps the launch
    that `triton_launches` counts (an instance attribute, put back as found afterwards)."""
    launched: list[tuple[int, int]] = []
    kernels = (
        single_module._lora_addmm_tma_kernel,
        group_module._lora_addmm_group_tma_kernel,
        sum_module._lora_addmm_sum_tma_kernel,
    )

    def observe(grid, args, meta):
        launched.append((meta["BLOCK_R"], meta["RANK_STAGES"]))
        tensors = [arg for arg in args if isinstance(arg, torch.Tensor) and arg.dim() == 2]
        left_strides.append([t.stride() for t in tensors if t.dtype == torch.float32])

    with observed_launches(kernels, observe):
        yield launched


@needs_triton
@pytest.mark.parametrize("layout", LAYOUTS)
def test_single_projection_term_past_the_threshold(layout, term_launches, triton_launches):
    dtype, right_dtype = LAYOUTS[layout]
    a, b, left, right = single_operands(37, 72, 40, MANY, dtype, right_dtype, "dense", "token", "transposed")
    out = lora_addmm(a, b, left, right, SCALE)
    assert triton_launches == {"_lora_addmm_tma_kernel": 1} and term_launches == [term_tiling(MANY)]
    assert rel_err(out, single_truth(a, b, left, right).to(out.device)) <= TOLERANCE[dtype]
    assert rel_err(out, single_truth(a, b, left, right, scale=1.0).to(out.device)) > 10 * TOLERANCE[dtype]


@needs_triton
@pytest.mark.parametrize("layout", LAYOUTS)
def test_group_term_takes_its_widest_member(layout, term_launches, triton_launches):
    dtype, right_dtype = LAYOUTS[layout]
    # The widest member in the middle: the tiling must come from the most ranks, not the first's.
    a, b, left, right, scale = group_operands(37, 40, (40, 24, 8), dtype, right_dtype, ranks=[5, MANY, 20])
    outs = lora_addmm_group(a, b, left, right, scale)
    assert triton_launches == {"_lora_addmm_group_tma_kernel": 1}
    assert term_launches == [(RANK_TILE, RANK_STAGES_MANY)]  # the first member's 5 ranks: one stage
    for out, truth, wrong in zip(
        outs, group_truths(a, b, left, right, scale), group_truths(a, b, left, right, [1.0] * 3)
    ):
        assert rel_err(out, truth) <= TOLERANCE[dtype]
        assert rel_err(out, wrong) > 10 * TOLERANCE[dtype]


@needs_triton
@pytest.mark.parametrize("layout", LAYOUTS)
def test_sum_term_over_all_members_ranks(layout, term_launches, triton_launches):
    dtype, right_dtype = LAYOUTS[layout]
    a, b, left, right = sum_operands(37, (24, 40, 8), 40, 3 * 24, dtype, right_dtype)  # a q/k/v of rank 24
    out = lora_addmm_sum(a, b, left, right, SCALE)
    assert triton_launches == {"_lora_addmm_sum_tma_kernel": 1} and term_launches == [term_tiling(72)]
    assert term_tiling(72) == (RANK_TILE, RANK_STAGES_MANY)
    assert rel_err(out, sum_truth(a, b, left, right).to(out.device)) <= TOLERANCE[dtype]
    assert rel_err(out, sum_truth(a, b, left, right, scale=1.0).to(out.device)) > 10 * TOLERANCE[dtype]


# --- the term's left operand row-major from PIPELINED_TERM_RANKS on (`copies_left`) ---------------


@needs_triton
@pytest.mark.parametrize("ranks", [PIPELINED_TERM_RANKS - 1, MANY])
def test_single_projection_left_is_copied_row_major_from_64_ranks(ranks, term_launches, left_strides):
    a, b, left, right = single_operands(37, 72, 40, ranks, BF16, BF16, "dense", "token", "dense")
    assert left.stride() == (1, 37)  # token-major, as lora_shrink hands it out
    out = lora_addmm(a, b, left, right, SCALE)
    assert left_strides == [[(ranks, 1) if ranks >= PIPELINED_TERM_RANKS else (1, 37)]]
    assert rel_err(out, single_truth(a, b, left, right).to(out.device)) <= TOLERANCE[BF16]


@needs_triton
@pytest.mark.parametrize("ranks", [[5, 40, 20], [5, MANY, 20]])
def test_group_lefts_are_copied_row_major_from_64_ranks_of_any_member(ranks, term_launches, left_strides):
    a, b, left, right, scale = group_operands(37, 40, (40, 24, 8), BF16, BF16, ranks=ranks)
    outs = lora_addmm_group(a, b, left, right, scale)
    # The three lefts as columns of one copy: one set of strides, the kernel's (it reads left 0's).
    copied = max(ranks) >= PIPELINED_TERM_RANKS
    assert left_strides == [[(sum(ranks), 1) if copied else (1, 37)] * 3]
    for out, truth in zip(outs, group_truths(a, b, left, right, scale)):
        assert rel_err(out, truth) <= TOLERANCE[BF16]


@needs_triton
@pytest.mark.parametrize("ranks", [3 * 16, 3 * 24])
def test_sum_left_is_copied_row_major_from_64_ranks(ranks, term_launches, left_strides):
    a, b, left, right = sum_operands(37, (24, 40, 8), 40, ranks, BF16, BF16)
    out = lora_addmm_sum(a, b, left, right, SCALE)
    assert left_strides == [[(ranks, 1) if ranks >= PIPELINED_TERM_RANKS else (1, 37)]]
    assert rel_err(out, sum_truth(a, b, left, right).to(out.device)) <= TOLERANCE[BF16]
