"""The kernels whose splits meet in `split_sum.split_total` (the last program of a tile to count in
sums every split's fp32 partial, in split order), run with their programs in a shuffled order.

The interpreter runs a launch's programs one at a time with the grid's first axis outermost, so in
CI a tile's splits always count in in split order and the last split always sums: a sum keyed to
the split's index instead of the count, or two tiles (or problems) sharing a counter or partials,
would pass. `conftest.programs_in_shuffled_order` hands the programs out in a seeded random order
(still one at a time: races between them are a GPU matter); the results must equal the in-order
ones to the bit (the sums' order is fixed), match the pure-torch references, and leave every
counter at zero.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_rel_close, programs_in_shuffled_order, requires_interpreter

from fastlora_peft.kernels import gated_act_lora, gated_act_reference, lora_terms
from fastlora_peft.kernels import lora_weight_grad as single_module
from fastlora_peft.kernels import lora_weight_grad_group as group_module
from fastlora_peft.kernels.split_sum import split_scratch

pytestmark = requires_interpreter
SEEDS = [0, 1, 2]
TOKENS = 37


def _random(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _shrink(reference=False):
    # K = 70 in 16-wide steps, three K splits, 16-row tiles: 3 row tiles x 3 splits.
    x, weight = _random(TOKENS, 70, seed=1, dtype=torch.bfloat16), _random(5, 70, seed=2)
    if reference:
        return [x.double() @ weight.double().T]
    return [lora_terms._lora_shrink_triton(x=x, weight=weight, split=3, block_m=16, block_k=16)]


def _weight_grad(reference=False):
    # dB's shape: left [37, 5] token-major, x [37, 45] in 16-wide column tiles, three token splits.
    left, x = _random(5, TOKENS, seed=3).T, _random(TOKENS, 45, seed=4, dtype=torch.bfloat16)
    if reference:
        return [0.7 * left.double().T @ x.double()]
    return [
        single_module._lora_weight_grad_triton(
            left=left, x=x, scale=0.7, k_major=True, split=3, block_m=16, block_k=16
        )
    ]


def _grouped_weight_grads(reference=False):
    # Three problems of one rank in one launch (each with its own partials and counters).
    lefts = [_random(6, TOKENS, seed=5 + i).T for i in range(3)]
    xs = [_random(TOKENS, k, seed=9 + i, dtype=torch.bfloat16) for i, k in enumerate((16, 50, 33))]
    if reference:
        return [s * left.double().T @ x.double() for s, left, x in zip((0.5, 1.0, 2.0), lefts, xs)]
    outs = [group_module._new_out(6, x.shape[1], True, torch.float32, x.device) for x in xs]
    group_module._launch_group(lefts, xs, [0.5, 1.0, 2.0], outs, split=3, block_m=8, block_k=16)
    return outs


def _gated_backward(reference=False):
    # One chunk's gated backward with dA_down's share: 16-column tiles, three row splits. It writes
    # the gate/up gradients into gate and up (made afresh on each call).
    grad_h, gate, up = (_random(TOKENS, 40, seed=12 + i, dtype=torch.bfloat16) for i in range(3))
    left = _random(4, TOKENS, seed=15).T
    if reference:
        grad_gate, grad_up, out = gated_act_reference.gated_act_backward_weight_grad(
            grad_h, gate, up, "silu", left, 1.3
        )
        return [out, grad_gate, grad_up]
    out = gated_act_lora._gated_act_backward_weight_grad_triton(
        grad_h=grad_h, gate=gate, up=up, activation="silu", left=left, scale=1.3, split=3, block_m=16,
        block_i=16, num_warps=4, num_stages=1, split_per_sm=2,
    )  # fmt: skip
    return [out, gate, up]


KERNELS = {
    "shrink": _shrink,
    "weight-grad": _weight_grad,
    "grouped-weight-grads": _grouped_weight_grads,
    "gated-backward": _gated_backward,
}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_split_sums_hold_in_any_program_order(kernel, seed):
    run = KERNELS[kernel]
    split_scratch(torch.device("cpu"), 1, 1).partials.fill_(float("nan"))
    in_order = run()
    split_scratch(torch.device("cpu"), 1, 1).partials.fill_(float("nan"))
    with programs_in_shuffled_order(seed):
        shuffled = run()
    for got, want, truth in zip(shuffled, in_order, run(reference=True), strict=True):
        assert torch.equal(got, want), f"{kernel}: the result depends on the programs' order"
        # The fp32 sums of 16-bit products to their summation order; bf16 results, and the gated
        # kernel's dA share (h rounded to bf16 in-kernel, where the interpreter's cast truncates
        # and the reference's rounds to nearest), to bf16's rounding.
        exact = want.dtype == torch.float32 and kernel != "gated-backward"
        assert_rel_close(want, truth, 1e-5 if exact else 1e-2, kernel)
    assert int(split_scratch(torch.device("cpu"), 1, 1).counters.abs().sum()) == 0, (
        "a counter was left counted"
    )


def test_the_shuffle_reaches_the_interpreter():
    """The order really changes: a kernel that records its programs' first axis in launch order."""
    import triton
    import triton.language as tl

    @triton.jit
    def record(Order_ptr, Count_ptr):
        slot = tl.atomic_add(Count_ptr, 1)
        tl.store(Order_ptr + slot, tl.program_id(0))

    order, count = torch.zeros(12, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    with programs_in_shuffled_order(0):
        record[(12,)](order, count)
    assert sorted(order.tolist()) == list(range(12)) and order.tolist() != list(range(12))
