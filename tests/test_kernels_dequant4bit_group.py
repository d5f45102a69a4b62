"""``fastlora::dequantize_4bit_group``: a group's 4-bit weights from one launch, bit for bit what the
single op (and bitsandbytes) gives member by member; the fused q/k/v path takes it.

The single op's tests (test_kernels_dequant4bit.py) pin its arithmetic against bitsandbytes; here
the group is compared with bitsandbytes and with that op, over members that differ in everything a
member may differ in (code, storage, shape, element count against the program size).
"""

from __future__ import annotations

import pytest
import torch
from conftest import LaunchSpy
from test_kernels_dequant4bit import (
    CASES,
    Case,
    _random_inputs,
    assert_bitwise_equal,
    needs_reference_path,
    needs_triton,
    quantized,
)

from fastlora_peft.kernels import dequant4bit, dequant4bit_group, dequant4bit_reference
from fastlora_peft.kernels._backend import runs_triton
from fastlora_peft.kernels._launch import LaunchPlans
from fastlora_peft.kernels.dequant4bit import Quant4bitState
from fastlora_peft.kernels.dequant4bit_group import Member, dequantize_group, groups

pytest.importorskip("bitsandbytes")

_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _group_cases(nested: bool, blocksize: int, dtype: torch.dtype, count: int) -> list[Case]:
    """`count` of the single op's cases sharing the group's constants, the rest of each differing."""
    chosen = [
        case for case in CASES if (case.nested, case.blocksize, case.dtype) == (nested, blocksize, dtype)
    ]
    # NF4 and FP4, both storages, other shapes: the cases cycle through them (see CASES).
    chosen = sorted(chosen, key=lambda case: (case.quant_type, case.storage == torch.uint8))
    return chosen[-count:]


GROUPS = [
    (nested, blocksize, dtype, count)
    for nested in (False, True)
    for blocksize, dtype, count in ((64, torch.bfloat16, 3), (128, torch.float16, 2), (256, torch.float32, 3))
]


def _group_id(group) -> str:
    nested, blocksize, dtype, count = group
    return f"{'nested' if nested else 'plain'}-b{blocksize}-{_DTYPE_NAMES[dtype]}-{count}members"


@pytest.mark.parametrize("group", GROUPS, ids=_group_id)
def test_group_matches_bitsandbytes_member_by_member(group) -> None:
    cases = _group_cases(*group)
    assert len(cases) == group[3] and len({(case.quant_type, case.storage, case.shape) for case in cases}) > 1
    packed = [quantized(case)[0] for case in cases]
    states = [Quant4bitState.from_bnb(quantized(case)[1], data) for case, data in zip(cases, packed)]
    assert groups(states)
    weights = dequantize_group(states, packed)
    assert len(weights) == len(cases)
    for weight, case, state, data in zip(weights, cases, states, packed):
        assert weight.is_contiguous()
        assert_bitwise_equal(weight, quantized(case)[2])
        assert_bitwise_equal(weight, dequant4bit.dequantize(state, data))


_MEMBER_SHAPES = ((7, 50), (3, 5), (33, 70))


def _members(nested: bool, count: int, seed: int) -> list[Member]:
    """Odd element counts (partial last blocks and programs); the second member FP4, the others NF4."""
    members = []
    for index, (rows, cols) in enumerate(_MEMBER_SHAPES[:count]):
        inputs = _random_inputs(rows, cols, 32, nested, seed=seed + index)
        if index == 1:
            inputs["code"] = dequant4bit_reference.code_for("fp4").to(inputs["code"].device)
        members.append(Member(*(inputs[name] for name in Member._fields)))
    return members


def _single(member: Member, nested: bool, out_dtype: torch.dtype) -> torch.Tensor:
    return dequant4bit_reference.dequantize_4bit(
        *member[:6], 32, 3 if nested else 0, member.rows, member.cols, out_dtype
    )


@needs_triton
@pytest.mark.parametrize("count", [1, 2, 3])
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
@pytest.mark.parametrize("out_dtype", list(_DTYPE_NAMES), ids=_DTYPE_NAMES.get)
def test_triton_group_masks_match_reference(count, nested, out_dtype) -> None:
    """Several programs per member (64 elements a program), each member's last one partial."""
    members = _members(nested, count, seed=count)
    outs = dequant4bit_group._dequantize_4bit_group_triton(
        members, 32, 3 if nested else 0, out_dtype, elements_per_program=64
    )
    assert len(outs) == count
    for member, out in zip(members, outs):
        assert_bitwise_equal(out, _single(member, nested, out_dtype))


@needs_triton
def test_one_launch_dequantizes_every_member(monkeypatch) -> None:
    group_spy = LaunchSpy(dequant4bit_group._dequantize_4bit_group_kernel)
    single_spy = LaunchSpy(dequant4bit._dequantize_4bit_kernel)
    monkeypatch.setattr(dequant4bit_group, "_dequantize_4bit_group_kernel", group_spy)
    monkeypatch.setattr(dequant4bit, "_dequantize_4bit_kernel", single_spy)
    monkeypatch.setattr(LaunchPlans, "enabled", False)  # through the spied kernels, not a plan
    members = _members(True, 3, seed=5)
    outs = dequant4bit_group._dequantize_4bit_group_triton(
        members, 32, 3, torch.bfloat16, elements_per_program=64
    )
    # 350, 15 and 2310 elements in programs of two 32-element blocks: 6 + 1 + 37 programs.
    assert group_spy.grids == [(44,)] and single_spy.grids == []
    for member, out in zip(members, outs):
        assert_bitwise_equal(out, _single(member, True, torch.bfloat16))


def _op_inputs(nested: bool, count: int = 3) -> dict:
    members = _members(nested, count, seed=11)
    inputs = {name: [getattr(member, name) for member in members] for name in Member._fields}
    return dict(inputs, blocksize=32, nested_blocksize=3 if nested else 0, out_dtype=torch.bfloat16)


@needs_reference_path
def test_reference_runs_without_triton(monkeypatch) -> None:
    def triton_must_not_run(*args, **kwargs):
        raise AssertionError("the Triton launcher ran on a plain CPU call")

    monkeypatch.setattr(dequant4bit_group, "_dequantize_4bit_group_triton", triton_must_not_run)
    inputs = _op_inputs(True)
    outs = dequant4bit_group.dequantize_4bit_group(**inputs)
    members = _members(True, 3, seed=11)
    for member, out in zip(members, outs):
        assert_bitwise_equal(out, _single(member, True, torch.bfloat16))


@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
def test_opcheck(nested: bool) -> None:
    torch.library.opcheck(dequant4bit_group.dequantize_4bit_group, (), _op_inputs(nested))


def test_compiled_call_matches_the_eager_one() -> None:
    """Under torch.compile dequantize_group goes through the library op, with no graph break."""
    cases = _group_cases(True, 64, torch.bfloat16, 3)
    packed = [quantized(case)[0] for case in cases]
    states = [Quant4bitState.from_bnb(quantized(case)[1], data) for case, data in zip(cases, packed)]
    compiled = torch.compile(dequantize_group, fullgraph=True, backend="eager")
    for actual, case in zip(compiled(states, packed), cases):
        assert_bitwise_equal(actual, quantized(case)[2])


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda inputs: inputs["rows"].pop(), "one entry per member"),
        (lambda inputs: inputs.update({name: inputs[name] * 2 for name in Member._fields}), "1 to 3 members"),
        (lambda inputs: inputs["absmax"].__setitem__(1, inputs["absmax"][1][:-1]), "one value per block"),
        (lambda inputs: inputs["nested_absmax"].__setitem__(2, None), "given together"),
    ],
    ids=["lengths", "four-members", "absmax-size", "nested-partly"],
)
def test_bad_inputs_raise(change, message) -> None:
    inputs = _op_inputs(True)
    change(inputs)
    with pytest.raises(ValueError, match=message):
        dequant4bit_group.dequantize_4bit_group(**inputs)


def test_mixed_nesting_raises() -> None:
    members = _members(True, 2, seed=3) + _members(False, 1, seed=4)
    inputs = {name: [getattr(member, name) for member in members] for name in Member._fields}
    with pytest.raises(ValueError, match="all nested or all plain"):
        dequant4bit_group.dequantize_4bit_group(
            **inputs, blocksize=32, nested_blocksize=3, out_dtype=torch.float32
        )


def test_groups_needs_the_kernels_constants_alike(monkeypatch) -> None:
    cases = _group_cases(True, 64, torch.bfloat16, 3)
    states = [Quant4bitState.from_bnb(quantized(case)[1], quantized(case)[0]) for case in cases]
    assert groups(states) and groups(states[:2])
    monkeypatch.setattr(dequant4bit_group.DequantizeGroupSettings, "enabled", False)  # plans_ab's switch
    assert not groups(states)
    monkeypatch.undo()
    assert not groups(states[:1]) and not groups(states + states[:1])
    for change in ({"blocksize": 128}, {"nested_blocksize": 128}, {"dtype": torch.float16}):
        assert not groups([states[0], states[1]._replace(**change)]), change
    plain = Quant4bitState.from_bnb(*reversed(quantized(_group_cases(False, 64, torch.bfloat16, 1)[0])[:2]))
    assert not groups([states[0], plain])


@pytest.mark.skipif(
    not runs_triton(torch.empty(0)), reason="counts Triton launches of a CPU step (TRITON_INTERPRET=1)"
)
def test_a_4bit_qkv_step_dequantizes_by_group(triton_launches) -> None:
    """A fused 4-bit q/k/v step (test_op_budget's, on CPU tensors: the per-member path) dequantizes
    its three weights with one launch in the forward and one for dX, never with the single kernel.
    On a GPU the TMA GEMMs' path does the same (test_op_budget's TMA budgets, by op)."""
    from test_op_budget import CASES as BUDGET_CASES
    from test_op_budget import LAYOUTS, _counted_step

    run, shapes, *_ = BUDGET_CASES["qkv"]
    _counted_step(run, LAYOUTS["nf4-fp32-adapters"], shapes)
    assert triton_launches.get("_dequantize_4bit_group_kernel") == 2
    assert "_dequantize_4bit_kernel" not in triton_launches


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=_DTYPE_NAMES.get)
def test_materialize_weights_gives_what_materialize_weight_does(dtype) -> None:
    """The group's weights in the compute dtype: fp16 states (a model loaded in fp16) dequantized to
    fp16, bit-exact, then cast where the layer computes in another dtype, as one weight is."""
    from fastlora_peft.functions.frozen_base import (
        FrozenBase,
        dequantizes_as_group,
        materialize_weight,
        materialize_weights,
    )

    cases = _group_cases(True, 64, torch.float16, 3)
    bases = [
        FrozenBase(quantized(case)[0], None, Quant4bitState.from_bnb(quantized(case)[1], quantized(case)[0]))
        for case in cases
    ]
    assert dequantizes_as_group(bases)
    for weight, base in zip(materialize_weights(bases, dtype), bases):
        assert_bitwise_equal(weight, materialize_weight(base, dtype))
