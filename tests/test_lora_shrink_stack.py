"""`lora_shrink_stacking_weights` (`lora_shrink_stack`): a group's forward shrink read from each
member's lora_A, which also writes the As transposed side by side for backward's dX term.

The kernel against float64 under the interpreter (2 and 3 members, unequal ranks, ragged tiles, K
split, two rank tiles, each dot mode) with the stacked transpose bit for bit; the op's fallback
where the kernel cannot read the members as one weight; opcheck; its launch plan; and the q/k/v and
gate/up forwards, which make no cat of the As any more.
"""

from __future__ import annotations

import pytest
import torch
from conftest import FUNCTION_LAYOUTS, OpCounter, rel_err
from test_launch_plans import _planned_and_unplanned, recorded_launches  # noqa: F401
from test_lora_shrink_group import DEVICE, TEST_BLOCK_M, needs_triton

from fastlora_peft.dtypes import plan_projection_dtypes
from fastlora_peft.functions.frozen_base import FrozenBase, LoraWeights
from fastlora_peft.functions.shared_input import fused_lora_projections
from fastlora_peft.kernels import lora_shrink_stack, lora_terms
from fastlora_peft.kernels.lora_shrink_stack import (
    _lora_shrink_stack_triton,
    lora_shrink_stacking_weights,
    lora_shrink_stacking_weights_op,
    stacks_in_one_launch,
)

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
# One rounding of the outputs' dtype (the interpreter truncates bf16).
OUTPUT_TOLERANCE = {FP32: 1e-5, BF16: 1e-2, FP16: 1e-3}


def _operands(m, k, ranks, x_dtype, weight_dtype, seed=0, device=DEVICE):
    """x [m, k] and each member's lora_A [r_i, k] (contiguous, as PEFT makes it)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=generator).to(device, x_dtype)
    weights = [(torch.randn(r, k, generator=generator) / k**0.5).to(device, weight_dtype) for r in ranks]
    return x, weights


def _truth(x, weights):
    return x.double() @ torch.cat(weights).double().T


@needs_triton
@pytest.mark.parametrize("split", [None, 3], ids=["by_rule", "split"])
@pytest.mark.parametrize(
    "x_dtype, weight_dtype", [(BF16, FP32), (BF16, BF16), (FP16, FP16), (FP16, FP32), (FP32, FP32)]
)
@pytest.mark.parametrize("ranks", [(3, 5, 4), (6, 2), (70, 50, 20)], ids=str)
def test_kernel_matches_float64_and_stacks_the_transpose_exactly(ranks, x_dtype, weight_dtype, split):
    """Short row blocks and 16-column steps: several row blocks, K steps and splits; ranks (70, 50, 20)
    (the launcher's own call: the op keeps it to one tile) take two rank tiles, the second starting
    inside member 1's rows."""
    x, weights = _operands(37, 70, ranks, x_dtype, weight_dtype)
    tiles = dict(split=split, block_m=TEST_BLOCK_M, block_k=16)
    xa, weight_t = _lora_shrink_stack_triton(x=x, weights=weights, **tiles)
    assert xa.dtype == FP32 and xa.shape == (37, sum(ranks)) and xa.stride() == (1, 37)  # token-major
    assert rel_err(xa, _truth(x, weights)) < 1e-5
    assert weight_t.is_contiguous() and torch.equal(weight_t, torch.cat(weights).t())


@needs_triton
@pytest.mark.parametrize(
    "ranks, weight_dtype", [((16, 16, 16), BF16), ((32, 32, 32), FP32), ((48, 40), BF16)]
)
def test_the_launch_takes_the_tiles_of_all_the_ranks(ranks, weight_dtype, monkeypatch):
    """The stack launches with `lora_shrink`'s tiles for one weight of every member's ranks (rank
    tile, row and column steps, warps, stages), not for its first member's alone: 48 ranks take one
    64-wide tile and the wide launch, where 16 would take a 16-wide tile and 32-row steps."""
    from test_kernels_lora_terms import _recorded_launches

    launches = _recorded_launches(monkeypatch)
    x, weights = _operands(37, 70, ranks, BF16, weight_dtype)
    xa, _ = _lora_shrink_stack_triton(x=x, weights=weights)
    assert rel_err(xa, _truth(x, weights)) < 1e-5
    config = lora_terms._shrink_config(x, torch.cat(weights))
    assert config != lora_terms._shrink_config(x, weights[0])  # the test tells them apart
    ((_, _, meta),) = [launch for launch in launches if "stack" in launch[0]]
    names = ("BLOCK_R", "BLOCK_M", "BLOCK_K", "num_warps", "num_stages")
    expected = (config.block_r, config.block_m, config.block_k, config.num_warps, config.num_stages)
    assert tuple(meta[name] for name in names) == expected, meta


@needs_triton
@pytest.mark.parametrize("weight_dtype", [BF16, FP32])
def test_the_split_rule_is_told_every_rank_tile(weight_dtype, monkeypatch):
    """Past 64 ranks (here 140: three 64-wide tiles) the K-split rule is told the programs of every
    rank tile, as `lora_shrink`'s launch tells it."""
    from fastlora_peft.kernels._launch import LaunchPlans

    monkeypatch.setattr(LaunchPlans, "enabled", False)
    asked = []
    monkeypatch.setattr(lora_terms, "shrink_splits", lambda *args: asked.append(args) or 2)
    x, weights = _operands(37, 70, (70, 50, 20), BF16, weight_dtype)
    xa, _ = _lora_shrink_stack_triton(x=x, weights=weights)
    assert rel_err(xa, _truth(x, weights)) < 1e-5
    config = lora_terms._shrink_config(x, torch.cat(weights))
    assert config.block_r == 64
    assert [args[0] for args in asked] == [-(-37 // config.block_m) * 3]


@pytest.mark.parametrize(
    "change",
    ["dtypes", "transposed", "four", "one"],
)
def test_the_op_stacks_what_one_launch_cannot_read(change):
    """Members of two dtypes (promoted, as `stacked_lora_a_t` does), a weight not row-contiguous, more
    than three members, one member: the op makes the cat and the shrink, with the same contract."""
    x, weights = _operands(9, 64, (3, 5, 4, 2), BF16, FP32)
    weights = {
        "dtypes": [weights[0], weights[1].to(BF16)],
        "transposed": [w.t().contiguous().t() for w in weights[:3]],
        "four": weights,
        "one": weights[:1],
    }[change]
    assert not stacks_in_one_launch(x, weights)
    xa, weight_t = lora_shrink_stacking_weights(x, weights)
    assert rel_err(xa, _truth(x, weights)) < 1e-5 and xa.stride() == (1, 9)
    assert weight_t.dtype == FP32 and weight_t.is_contiguous()
    assert torch.equal(weight_t, torch.cat([w.to(FP32) for w in weights]).t())


def test_what_one_launch_reads():
    x, weights = _operands(9, 64, (3, 5, 4), BF16, FP32)
    assert stacks_in_one_launch(x, weights) and stacks_in_one_launch(x, weights[:2])
    assert not stacks_in_one_launch(x[:0], weights)  # no tokens
    assert not stacks_in_one_launch(x, [weights[0], weights[1][:0]])  # a member of rank 0
    assert not stacks_in_one_launch(x, [weights[0], torch.randn(5, 128)[:, :64]])  # other strides
    # Any number of ranks (past 64, 64-wide rank tiles, as lora_shrink's).
    x, weights = _operands(9, 64, (64, 64), BF16, FP32)
    assert stacks_in_one_launch(x, weights) and stacks_in_one_launch(x, [*weights, weights[0][:1]])


def test_float64_runs_the_reference_and_opcheck():
    x, weights = _operands(9, 64, (3, 5), torch.float64, torch.float64, device="cpu")
    xa, weight_t = lora_shrink_stacking_weights(x, weights)
    assert xa.dtype == torch.float64 and torch.allclose(xa, _truth(x, weights))
    torch.library.opcheck(lora_shrink_stacking_weights_op, (x, weights))
    x, weights = _operands(9, 64, (3, 5, 4), BF16, FP32, device="cpu")
    torch.library.opcheck(lora_shrink_stacking_weights_op, (x, weights))


@pytest.mark.parametrize("members", [2, 3])
def test_plan_launches_what_the_launcher_would(recorded_launches, members):  # noqa: F811
    """Call 2 (other tensors, same metadata) launches from call 1's plan what the launcher would,
    with each member's weight in its own slot (a group of two repeats its last)."""

    def make_inputs(seed):
        x, weights = _operands(33, 64, (3, 5, 4)[:members], BF16, FP32, seed=seed, device="cpu")
        return dict(x=x, weights=weights)

    launch = _planned_and_unplanned(recorded_launches, _lora_shrink_stack_triton, make_inputs)
    assert launch[3] == 77 and launch[4] == 1234  # the current stream, the compiled function
    assert len(lora_shrink_stack._STACK_PLANS.plans) == 1


def _forward_ops(shapes, dtype, adapter_dtype):
    """fused_lora_projections of a group with these (in, out) shapes and rank-4/5/6 adapters: the ops
    it dispatched, and its outputs against float64."""
    generator = torch.Generator().manual_seed(3)
    bases, loras = [], []
    for index, (features_in, features_out) in enumerate(shapes):
        weight = torch.randn(features_out, features_in, generator=generator).to(dtype)
        bases.append(FrozenBase(weight, None, None))
        rank = 4 + index
        lora_a = torch.randn(rank, features_in, generator=generator).to(adapter_dtype)
        lora_b = torch.randn(features_out, rank, generator=generator).to(adapter_dtype)
        loras.append(LoraWeights(lora_a, lora_b, 0.5 + index))
    x = torch.randn(3, 7, shapes[0][0], generator=generator).to(dtype)
    plan = plan_projection_dtypes(dtype, dtype, quantized=False, device_type="cpu")
    with OpCounter() as ops:
        outputs = fused_lora_projections(x, bases, loras, plan)
    for out, base, lora in zip(outputs, bases, loras):
        delta = lora.scale * lora.lora_b.double() @ lora.lora_a.double()
        truth = x.reshape(21, -1).double() @ (base.weight.double() + delta).T
        assert rel_err(out.reshape(21, -1), truth) < OUTPUT_TOLERANCE[dtype]
    return dict(ops.ops)


DENSE_LAYOUTS = [name for name, (_, _, quantized) in FUNCTION_LAYOUTS.items() if not quantized]


@pytest.mark.parametrize("layout_id", DENSE_LAYOUTS)
def test_a_group_forward_shrinks_without_a_cat(layout_id):
    """q/k/v's forward in every dense layout: one `lora_shrink_stacking_weights`, no cat and no
    `lora_shrink`, outputs within one rounding of float64. (4-bit bases: `test_op_budget.py` counts
    the same op there, with the weights dequantized.)"""
    dtype, adapter_dtype, _ = FUNCTION_LAYOUTS[layout_id]
    ops = _forward_ops([(64, 64), (64, 32), (64, 32)], dtype, adapter_dtype)
    assert ops.get("fastlora.lora_shrink_stacking_weights") == 1, ops
    assert "cat" not in ops and "fastlora.lora_shrink" not in ops, ops
