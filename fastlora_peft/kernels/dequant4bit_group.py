"""``dequantize_4bit_group``: the 4-bit weights of a group (q/k/v) dequantized by one launch.

A 4-bit q/k/v group's GEMMs take all three dense weights at once, in the forward and again for dX
(`functions/group_gemms.py`). One launch here dequantizes every member: the grid is the members'
programs one after another, and each program finds its member by comparing its id with the members'
program counts. Each member's programs run `dequant4bit.dequantize_blocks`, the single kernel's
body, so the bits are the same as `dequant4bit.dequantize` gives member by member. H200, NF4 q/k/v
at 8192 tokens: 2 launches a step where there were 6, 34.7 us of dequantize kernels against 43.4
(`benchmarks.kernel_ab --switch dequant`). The plan key reads every member's tensors, as the three
single keys did, so the host saves about two launches and two op bodies (docs/benchmarks.md,
"Twenty-ninth session").

The members must share what the kernel takes as constants: blocksize, nesting and nested blocksize
(`groups`). Codes (NF4, FP4), shapes and storage may differ. One model's q/k/v always agree.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple, Optional, Sequence

import torch
import triton
import triton.language as tl

from fastlora_peft.call_traces import VersionedSettings, trace_unit
from fastlora_peft.kernels import dequant4bit_reference as reference
from fastlora_peft.kernels._backend import OP_NAMESPACE, runs_triton, skips_op_dispatch
from fastlora_peft.kernels._launch import BoundLaunch, CachedKernel, LaunchPlans, cdiv, empty_2d
from fastlora_peft.kernels.dequant4bit import (
    _ELEMENTS_PER_PROGRAM,
    Quant4bitState,
    _check_dequantize,
    _source_index,
    dequantize_blocks,
    kernel_inputs,
)

MAX_MEMBERS = 3  # q/k/v

# ---------------------------------------------------------------------------------------------------
# Kernel. The third member's slots hold the second's tensors in a group of two: never read there, as
# the grid then ends with the second member's programs.
# ---------------------------------------------------------------------------------------------------


@CachedKernel
@triton.jit
def _dequantize_4bit_group_kernel(
    Packed0, Absmax0, Code0, NestedAbsmax0, NestedCode0, NestedOffset0, Out0, numel0, bytes0, blocks0,
    Packed1, Absmax1, Code1, NestedAbsmax1, NestedCode1, NestedOffset1, Out1, numel1, bytes1, blocks1,
    Packed2, Absmax2, Code2, NestedAbsmax2, NestedCode2, NestedOffset2, Out2, numel2, bytes2, blocks2,
    programs0, programs1,
    BLOCKSIZE: tl.constexpr, NESTED_BLOCKSIZE: tl.constexpr, BLOCKS_PER_PROGRAM: tl.constexpr,
    NESTED: tl.constexpr, BF16_BY_BITS: tl.constexpr,
):  # fmt: skip
    """Member i's programs are [programs0 + ... + programs(i-1), ...): each dequantizes its blocks."""
    program = tl.program_id(0)
    if program < programs0:
        dequantize_blocks(
            program, Packed0, Absmax0, Code0, NestedAbsmax0, NestedCode0, NestedOffset0, Out0,
            numel0, bytes0, blocks0, BLOCKSIZE, NESTED_BLOCKSIZE, BLOCKS_PER_PROGRAM, NESTED, BF16_BY_BITS,
        )  # fmt: skip
    elif program < programs0 + programs1:
        dequantize_blocks(
            program - programs0, Packed1, Absmax1, Code1, NestedAbsmax1, NestedCode1, NestedOffset1, Out1,
            numel1, bytes1, blocks1, BLOCKSIZE, NESTED_BLOCKSIZE, BLOCKS_PER_PROGRAM, NESTED, BF16_BY_BITS,
        )  # fmt: skip
    else:
        dequantize_blocks(
            program - programs0 - programs1, Packed2, Absmax2, Code2, NestedAbsmax2, NestedCode2,
            NestedOffset2, Out2, numel2, bytes2, blocks2,
            BLOCKSIZE, NESTED_BLOCKSIZE, BLOCKS_PER_PROGRAM, NESTED, BF16_BY_BITS,
        )  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# Launcher. Callers have checked the members (`_check_group`).
# ---------------------------------------------------------------------------------------------------


class Member(NamedTuple):
    """One weight of a group: the inputs of `dequant4bit.dequantize_4bit` that differ by member."""

    packed: torch.Tensor
    absmax: torch.Tensor
    code: torch.Tensor
    nested_absmax: Optional[torch.Tensor]
    nested_code: Optional[torch.Tensor]
    nested_offset: Optional[torch.Tensor]
    rows: int
    cols: int


class _GroupPlan(NamedTuple):
    """What `_dequantize_4bit_group_triton` derived from its inputs' metadata, to launch the same again."""

    launch: BoundLaunch
    device: torch.device
    # For each tensor argument: its index in the call's `_flat(members)`, or -1 - i for the out made
    # for member i.
    sources: tuple[int, ...]
    sizes: tuple[tuple[int, ...], ...]  # per slot: numel, packed bytes, blocks
    programs: tuple[int, int]  # the first two members' program counts


_GROUP_PLANS = LaunchPlans("dequantize_4bit_group")

_TENSORS_PER_MEMBER = 6  # Member's first fields; rows and cols follow
_MEMBER_FIELDS = len(Member._fields)


def _flat(members: Sequence[Member]) -> tuple:
    """Every member's fields in one tuple: member i's from i * len(Member._fields) on."""
    return tuple(itertools.chain.from_iterable(members))


def _group_plan_key(flat_members: tuple, blocksize: int, nested_blocksize: int, out_dtype) -> tuple:
    return _GROUP_PLANS.key(*flat_members, blocksize, nested_blocksize, out_dtype)


def _empty_outs(members: Sequence[Member], out_dtype: torch.dtype, device: torch.device) -> list:
    return [empty_2d(member.rows, member.cols, out_dtype, device) for member in members]


def _dequantize_4bit_group_triton(
    members: Sequence[Member],
    blocksize: int,
    nested_blocksize: int,
    out_dtype: torch.dtype,
    elements_per_program: int = _ELEMENTS_PER_PROGRAM,
    bf16_by_bits: Optional[bool] = None,
) -> list[torch.Tensor]:
    device = members[0].packed.device
    defaults = elements_per_program == _ELEMENTS_PER_PROGRAM and bf16_by_bits is None
    plan_key = None
    if defaults and _GROUP_PLANS.enabled:
        flat_members = _flat(members)
        plan_key = _group_plan_key(flat_members, blocksize, nested_blocksize, out_dtype)
        plan = _GROUP_PLANS.get(plan_key)
        if plan is not None:
            return _run_group_plan(plan, members, flat_members, out_dtype)
    outs = _empty_outs(members, out_dtype, device)
    nested = members[0].nested_absmax is not None
    blocks_per_program = max(1, elements_per_program // blocksize)
    arguments, sizes, programs = [], [], []
    for member, out in zip(members, outs):
        numel = member.rows * member.cols
        num_blocks = cdiv(numel, blocksize)
        arguments.append((*kernel_inputs(member[:_TENSORS_PER_MEMBER]), out))
        sizes.append((numel, (numel + 1) // 2, num_blocks))
        programs.append(cdiv(num_blocks, blocks_per_program))
    if sum(programs) == 0:
        return outs
    # A group of one or two fills the later slots with its last member (the grid never reaches them).
    slots = list(range(len(members))) + [len(members) - 1] * (MAX_MEMBERS - len(members))
    programs += [0] * (MAX_MEMBERS - len(members))
    if bf16_by_bits is None:  # as the single launcher: the interpreter's casts truncate
        bf16_by_bits = device.type != "cuda"
    launched = [tensor for slot in slots for tensor in arguments[slot]]
    launched_sizes = tuple(sizes[slot] for slot in slots)
    bound = _dequantize_4bit_group_kernel[(sum(programs),)](
        *_interleave(launched, launched_sizes), programs[0], programs[1],
        BLOCKSIZE=blocksize, NESTED_BLOCKSIZE=nested_blocksize if nested else 1,
        BLOCKS_PER_PROGRAM=blocks_per_program, NESTED=nested,
        BF16_BY_BITS=bf16_by_bits and out_dtype == torch.bfloat16,
        num_warps=4,
        enable_fp_fusion=False,  # bit-exactness: see the nested scale in dequant4bit's kernel
    )  # fmt: skip
    # Planned only when the kernel read the caller's tensors as they were (see the single launcher).
    # Each slot's tensors are found among its own member's inputs only: members may share a tensor
    # (the cached NF4 code) in this call and not in a later one with the same metadata.
    sources = []
    for slot, member in zip(slots, (members[slot] for slot in slots)):
        own = member[:_TENSORS_PER_MEMBER]
        for tensor in arguments[slot][:_TENSORS_PER_MEMBER]:
            index = _source_index(tensor, own)
            sources.append(None if index is None else slot * _MEMBER_FIELDS + index)
        sources.append(-1 - slot)  # the out made for member `slot`
    if plan_key is not None and bound is not None and None not in sources:
        plan = _GroupPlan(bound, device, tuple(sources), launched_sizes, (programs[0], programs[1]))
        _GROUP_PLANS.add(plan_key, plan)
    return outs


def _interleave(launched: list, launched_sizes: list) -> list:
    """Each member slot's seven tensors followed by its three sizes, as the kernel takes them."""
    values = []
    per_slot = _TENSORS_PER_MEMBER + 1
    for slot, sizes in enumerate(launched_sizes):
        values += launched[slot * per_slot : (slot + 1) * per_slot]
        values += sizes
    return values


@trace_unit
def _run_group_plan(plan: _GroupPlan, members: Sequence[Member], flat_members: tuple, out_dtype) -> list:
    outs = _empty_outs(members, out_dtype, plan.device)
    tensors = [outs[-1 - source] if source < 0 else flat_members[source] for source in plan.sources]
    plan.launch(*_interleave(tensors, plan.sizes), *plan.programs)
    return outs


# ---------------------------------------------------------------------------------------------------
# Public op: checks, dispatch, fake implementation.
# ---------------------------------------------------------------------------------------------------


def _check_group(
    members: Sequence[Member], blocksize: int, nested_blocksize: int, out_dtype: torch.dtype
) -> None:
    op = "dequantize_4bit_group"
    if not 1 <= len(members) <= MAX_MEMBERS:
        raise ValueError(f"{op}: 1 to {MAX_MEMBERS} members, got {len(members)}")
    for member in members:
        _check_dequantize(*member[:_TENSORS_PER_MEMBER], blocksize, nested_blocksize, *member[6:], out_dtype)
    nesting = {member.nested_absmax is not None for member in members}
    if len(nesting) > 1:
        raise ValueError(f"{op}: the members must be all nested or all plain")
    devices = {member.packed.device for member in members}
    if len(devices) > 1:
        raise ValueError(f"{op}: all members must be on one device, got {devices}")


def _members(packed, absmax, code, nested_absmax, nested_code, nested_offset, rows, cols) -> list[Member]:
    lists = (packed, absmax, code, nested_absmax, nested_code, nested_offset, rows, cols)
    if len({len(values) for values in lists}) > 1:
        counts = [len(values) for values in lists]
        raise ValueError(f"dequantize_4bit_group: one entry per member in every list, got {counts}")
    return [Member(*values) for values in zip(*lists)]


def _dequantize_4bit_group_eager(
    members: Sequence[Member], blocksize: int, nested_blocksize: int, out_dtype: torch.dtype
) -> list[torch.Tensor]:
    """The op's body. As in `dequant4bit._dequantize_4bit_eager`, a plan hit launches without the
    checks: the key holds every tensor's shape, dtype and device, the sizes and the settings."""
    if members and _GROUP_PLANS.serve(members[0].packed):
        flat_members = _flat(members)
        plan = _GROUP_PLANS.get(_group_plan_key(flat_members, blocksize, nested_blocksize, out_dtype))
        if plan is not None:
            return _run_group_plan(plan, members, flat_members, out_dtype)
    _check_group(members, blocksize, nested_blocksize, out_dtype)
    if runs_triton(members[0].packed):
        return _dequantize_4bit_group_triton(members, blocksize, nested_blocksize, out_dtype)
    return [
        reference.dequantize_4bit(
            *member[:_TENSORS_PER_MEMBER], blocksize, nested_blocksize, *member[6:], out_dtype
        ).contiguous()
        for member in members
    ]


@torch.library.custom_op(f"{OP_NAMESPACE}::dequantize_4bit_group", mutates_args=())
def dequantize_4bit_group(
    packed: list[torch.Tensor],
    absmax: list[torch.Tensor],
    code: list[torch.Tensor],
    nested_absmax: list[Optional[torch.Tensor]],
    nested_code: list[Optional[torch.Tensor]],
    nested_offset: list[Optional[torch.Tensor]],
    blocksize: int,
    nested_blocksize: int,
    rows: list[int],
    cols: list[int],
    out_dtype: torch.dtype,
) -> list[torch.Tensor]:
    """`dequant4bit.dequantize_4bit` of each member (entry i of every list), in one launch: a list of
    dense [rows[i], cols[i]] out_dtype tensors. The members share blocksize, nested_blocksize and
    nesting (all nested or all plain); see `dequantize_4bit` for each input."""
    members = _members(packed, absmax, code, nested_absmax, nested_code, nested_offset, rows, cols)
    return _dequantize_4bit_group_eager(members, blocksize, nested_blocksize, out_dtype)


@dequantize_4bit_group.register_fake
def _(
    packed, absmax, code, nested_absmax, nested_code, nested_offset, blocksize, nested_blocksize, rows, cols,
    out_dtype,
):  # fmt: skip
    members = _members(packed, absmax, code, nested_absmax, nested_code, nested_offset, rows, cols)
    _check_group(members, blocksize, nested_blocksize, out_dtype)
    return [member.packed.new_empty((member.rows, member.cols), dtype=out_dtype) for member in members]


class DequantizeGroupSettings(metaclass=VersionedSettings):
    """Whether a group's 4-bit weights are dequantized by one launch (read at every call). False
    dequantizes them one launch each (`benchmarks.plans_ab --switch dequant`)."""

    enabled = True


def groups(states: Sequence[Quant4bitState]) -> bool:
    """Whether one `dequantize_group` takes these states: 2 to `MAX_MEMBERS` of them sharing the
    kernel's constants (blocksize, nesting, nested blocksize) and the dtype they dequantize to."""
    if not DequantizeGroupSettings.enabled or not 1 < len(states) <= MAX_MEMBERS:
        return False
    first = states[0]
    return all(
        state.blocksize == first.blocksize
        and state.nested_blocksize == first.nested_blocksize
        and state.nested == first.nested
        and state.dtype == first.dtype
        for state in states
    )


def dequantize_group(states: Sequence[Quant4bitState], packed: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each state's dense weight in its dtype (bit-exact with `dequant4bit.dequantize(state, packed)`),
    from one launch. `groups(states)` must hold. packed: each member's ``Params4bit`` or its data.

    On plain tensors in eager mode this runs the op's body directly; under torch.compile, a dispatch
    mode or a tensor subclass it calls ``fastlora::dequantize_4bit_group`` (see `dequant4bit.dequantize`).
    """
    packed = [tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor for tensor in packed]
    members = [
        Member(
            data,
            state.absmax,
            state.code,
            state.nested_absmax,
            state.nested_code,
            state.nested_offset,
            state.rows,
            state.cols,
        )  # fmt: skip
        for data, state in zip(packed, states)
    ]
    first = states[0]
    if skips_op_dispatch(*packed, *(state.absmax for state in states)):
        return _dequantize_4bit_group_eager(members, first.blocksize, first.nested_blocksize, first.dtype)
    *tensors, rows, cols = [list(values) for values in zip(*members)]
    return dequantize_4bit_group(*tensors, first.blocksize, first.nested_blocksize, rows, cols, first.dtype)
