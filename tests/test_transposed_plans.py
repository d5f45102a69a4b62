"""Plans served to callers that hold a tensor's transpose (`_launch.Transposed`): the q/k/v forward's
weights (`lora_addmm_group_of_weights_where_it_pays_off`, where b_i is a weight's transpose) and the
backward's lora_B (`lora_shrink_stacked_of_transposed`, where the shrink's weight is lora_B's
transpose). A hit must launch exactly what the op would with the transposes, and make no view op.
"""

from __future__ import annotations

import pytest
import torch
from test_launch_plans import _ENCODED_ADDRESSES, _THROUGH_CACHE, recorded_launches  # noqa: F401
from test_lora_addmm_group import _operands

from fastlora_peft.kernels import _launch, lora_terms
from fastlora_peft.kernels import lora_addmm_group as group_module
from fastlora_peft.kernels.lora_addmm import LoraAddmmSettings

BF16, FP32 = torch.bfloat16, torch.float32


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.empty(5, 7),
        lambda: torch.empty(7, 5).t(),
        lambda: torch.empty(6, 9, dtype=BF16)[1:, 2:],  # unaligned, strided
        lambda: torch.empty(0, 3),
    ],
    ids=["contiguous", "transposed", "unaligned", "empty"],
)
def test_a_transposed_key_part_is_the_transposes_key(make):
    tensor = make()
    part = _launch._key_part(_launch.Transposed(tensor))
    assert part == _launch.tensor_key(tensor.t()) and hash(part) == hash(_launch.tensor_key(tensor.t()))
    assert part != _launch.tensor_key(tensor) or tensor.shape[0] == tensor.shape[1]


def _counted_views(monkeypatch) -> list:
    """Calls of `Tensor.t` from here on."""
    calls: list = []
    transpose = torch.Tensor.t
    monkeypatch.setattr(torch.Tensor, "t", lambda self: calls.append(self) or transpose(self))
    return calls


def _tensor_addresses(launch: tuple, result: torch.Tensor) -> list:
    """The launch's arguments with each tensor as its address, the result's as "result"."""
    addresses = [value.data_ptr() if isinstance(value, torch.Tensor) else value for value in launch]
    return ["result" if address == result.data_ptr() else address for address in addresses]


@pytest.mark.parametrize("members", [2, 3])
def test_stacked_shrink_of_lora_b_launches_its_transposes_plan(recorded_launches, monkeypatch, members):  # noqa: F811
    """Call 1 (`lora_shrink_stacked` given B.T) makes the plan; call 2 (other tensors, given B) launches
    from it with no view op; its arguments are call 3's (call 2's transposes through the op, plans off)
    tensor for tensor by address, and a miss falls back to the op."""
    monkeypatch.setattr(lora_terms, "runs_triton", lambda tensor: True)
    M, K, R = 37, 64, 5

    def operands(seed):
        generator = torch.Generator().manual_seed(seed)
        grads = [torch.randn(M, K, generator=generator).to(BF16) for _ in range(members)]
        lora_b = [torch.randn(K, R, generator=generator) for _ in range(members)]
        return grads, lora_b, [0.5 + seed + i for i in range(members)]

    grads, lora_b, scales = operands(0)
    lora_terms.lora_shrink_stacked(grads, [b.t() for b in lora_b], scales)
    assert len(recorded_launches) == 1 and len(_THROUGH_CACHE) == 1
    grads, lora_b, scales = operands(1)
    views = _counted_views(monkeypatch)
    stacked = lora_terms.lora_shrink_stacked_of_transposed(grads, lora_b, scales)
    assert not views and len(recorded_launches) == 2 and len(_THROUGH_CACHE) == 1  # from the plan
    monkeypatch.setattr(_launch.LaunchPlans, "enabled", False)
    expected = lora_terms.lora_shrink_stacked(grads, [b.t() for b in lora_b], scales)
    assert len(recorded_launches) == 3
    planned, unplanned = recorded_launches[1], recorded_launches[2]
    assert (stacked.shape, stacked.stride()) == (expected.shape, expected.stride())
    # The results are new tensors, each at its own address: alike, and passed where the other was.
    assert _tensor_addresses(planned, stacked) == _tensor_addresses(unplanned, expected)
    # lora_B of another layout (row-major B.T, i.e. a column-major B) is not that plan.
    monkeypatch.setattr(_launch.LaunchPlans, "enabled", True)
    lora_terms.lora_shrink_stacked_of_transposed(grads, [b.t().contiguous().t() for b in lora_b], scales)
    assert len(_THROUGH_CACHE) == 3  # call 3 (plans off) and this one: not from a plan


def test_group_forward_of_weights_launches_the_plan_of_their_transposes(recorded_launches, monkeypatch):  # noqa: F811
    """The grouped forward's entry that takes the weights ([N_i, K]): a miss goes through
    `lora_addmm_group_where_it_pays_off` with their transposes and makes its plan; a hit launches the
    weights themselves (their addresses and [N_i, K] shapes in the descriptors) with no view op."""
    monkeypatch.setattr(group_module, "runs_triton", lambda tensor: True)
    monkeypatch.setattr(LoraAddmmSettings, "mode", "always")
    of_weights = group_module.lora_addmm_group_of_weights_where_it_pays_off
    widths = (72, 8, 40)
    a, b, left, right, scale = _operands(33, 40, widths, BF16, FP32)
    assert len(of_weights(a, [b_i.t() for b_i in b], left, right, scale, BF16)) == 3
    assert len(recorded_launches) == 1 and len(_THROUGH_CACHE) == 1
    a, b, left, right, scale = _operands(33, 40, widths, BF16, FP32, seed=1)
    weights = [b_i.t() for b_i in b]
    _ENCODED_ADDRESSES.clear()
    views = _counted_views(monkeypatch)
    outs = of_weights(a, weights, left, right, scale, BF16)
    assert not views and len(recorded_launches) == 2 and len(_THROUGH_CACHE) == 1  # from the plan
    assert [out.shape for out in outs] == [(33, n) for n in widths]
    assert _ENCODED_ADDRESSES[1:4] == [weight.data_ptr() for weight in weights]
    descriptors = [value[5] for value in recorded_launches[1] if type(value) is tuple and value[0] == "tma"]
    assert descriptors[1:4] == [(n, 40) for n in widths]
    assert of_weights(a, weights, left, right, scale, FP32) is None  # an fp32 output: not taken


def test_a_plans_key_holds_each_inputs_key_part(monkeypatch):
    """`LaunchPlans.key` makes a plain tensor's (and a Parameter's) `tensor_key` inline: the same key as
    `_key_part` of every input, a subclass and a `Transposed` included."""

    class Subclass(torch.Tensor):
        pass

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    tensor = torch.empty(6, 9, dtype=BF16)[1:, 2:]
    inputs = (tensor, torch.nn.Parameter(torch.empty(4, 5)), torch.empty(2, 3).as_subclass(Subclass))
    inputs += (_launch.Transposed(torch.empty(5, 7)), 4, 0.5, None, BF16, "mode", True)
    key = _launch.LaunchPlans("test").key(*inputs)
    assert key == (3, *map(_launch._key_part, inputs))
    assert key[1] == _launch.tensor_key(tensor) and key[2] == _launch.tensor_key(inputs[1])
