"""`functions/tensor_groups`: the layout that carries a Function's tensors through `apply`, and the
functions generated per layout (`_codec`) that rebuild trees from it on the hot path.

The oracle is the plain walk (`_fill`, `_collect_slot_values`), which the generated functions
replace outside torch.compile: both must give the same trees, of the same types, with the very
same objects in the slots.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import pytest
import torch

from fastlora_peft.functions import tensor_groups
from fastlora_peft.functions.frozen_base import FrozenBase, LoraWeights
from fastlora_peft.functions.tensor_groups import flatten_tensors, unflatten_tensors, values_in_tensor_slots


class _State(NamedTuple):
    """A 4-bit state's shape: tensors, optional tensors and plain values side by side."""

    absmax: torch.Tensor
    nested: Optional[torch.Tensor]
    blocksize: int
    dtype: torch.dtype
    kind: str


def _tensor() -> torch.Tensor:
    return torch.zeros(1)


class _PackedWeight(torch.Tensor):
    """A tensor subclass, as bitsandbytes' Params4bit is one: found by `isinstance`, not its type."""


def _packed() -> torch.Tensor:
    return torch.zeros(1).as_subclass(_PackedWeight)


def _parameter() -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.zeros(1))


def _tensors_in(tree) -> list[torch.Tensor]:
    """Every tensor of `tree`, depth first: what flatten_tensors must hand out, in its order."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [tensor for child in tree for tensor in _tensors_in(child)]
    return []


def _trees() -> list:
    state = _State(_tensor(), None, 64, torch.bfloat16, "nf4")
    nested_state = _State(_tensor(), _tensor(), 128, torch.float16, "fp4")
    return [
        ((FrozenBase(_tensor(), None, None),), (LoraWeights(_tensor(), _tensor(), 2.0),)),
        ((FrozenBase(_packed(), _parameter(), state),), (LoraWeights(_parameter(), _parameter(), 1.0),)),
        _packed(),
        (
            (FrozenBase(_tensor(), _tensor(), state), FrozenBase(_tensor(), None, nested_state)),
            (LoraWeights(_tensor(), _tensor(), 0.5), LoraWeights(_tensor(), _tensor(), 3)),
        ),
        [_tensor(), (_tensor(), [None, _tensor()]), "text", 7],
        (_tensor(),),
        (),
    ]


def _same_tree(got, expected) -> None:
    """Equal structure and node types; the very same tensors; equal plain values of the same type."""
    assert type(got) is type(expected)
    if isinstance(expected, torch.Tensor):
        assert got is expected
    elif isinstance(expected, (tuple, list)):
        assert len(got) == len(expected)
        for got_item, expected_item in zip(got, expected):
            _same_tree(got_item, expected_item)
    else:
        assert got == expected


@pytest.mark.parametrize("index", range(len(_trees())))
def test_generated_functions_rebuild_what_the_walk_rebuilds(index):
    tree = _trees()[index]
    tensors, layout = flatten_tensors(tree)
    assert [id(tensor) for tensor in tensors] == [id(tensor) for tensor in _tensors_in(tree)]
    assert not _tensors_in(layout)  # the layout holds slots, never a tensor (it keys a cache)
    _same_tree(unflatten_tensors(layout, tensors), tree)
    _same_tree(tensor_groups._fill(layout, iter(tensors)), tree)
    needs = [position % 3 == 0 for position in range(len(tensors))]
    _same_tree(unflatten_tensors(layout, needs), tensor_groups._fill(layout, iter(needs)))
    assert unflatten_tensors(layout, iter(tensors)) is not None  # any iterable of values
    walked: list = []
    tensor_groups._collect_slot_values(layout, tree, walked)
    collected = values_in_tensor_slots(layout, tree)
    assert len(collected) == len(walked) == len(tensors)
    assert all(a is b for a, b in zip(collected, tensors))
    assert layout in tensor_groups._CODECS or not tensors


def test_collect_reads_none_below_a_missing_subtree():
    tree = _trees()[1]
    tensors, layout = flatten_tensors(tree)
    gradients = ((FrozenBase(None, "bias grad", None), None), (LoraWeights("a grad", None, 0.5), None))
    walked: list = []
    tensor_groups._collect_slot_values(layout, gradients, walked)
    assert values_in_tensor_slots(layout, gradients) == walked
    assert walked.count(None) == len(tensors) - 2 and "bias grad" in walked and "a grad" in walked


def test_layouts_equal_as_values_keep_their_own_types():
    """A named tuple and a plain tuple of equal items, or 2 and 2.0: each layout rebuilds its own."""
    named = ((FrozenBase(_tensor(), None, None),), (LoraWeights(_tensor(), _tensor(), 2.0),))
    plain = ((tuple(named[0][0]),), (tuple(named[1][0][:2]) + (2,),))
    for tree in (named, plain, named):
        tensors, layout = flatten_tensors(tree)
        _same_tree(unflatten_tensors(layout, tensors), tree)
        assert type(unflatten_tensors(layout, tensors)[1][0][2]) is type(tree[1][0][2])


def test_the_hot_path_runs_the_generated_functions_and_compile_the_walk(monkeypatch):
    tree = _trees()[1]
    tensors, layout = flatten_tensors(tree)
    unflatten_tensors(layout, tensors)

    def walk(*args):
        raise AssertionError("the walk ran")

    monkeypatch.setattr(tensor_groups, "_fill", walk)
    monkeypatch.setattr(tensor_groups, "_collect_slot_values", walk)
    _same_tree(unflatten_tensors(layout, tensors), tree)
    values_in_tensor_slots(layout, tree)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(AssertionError, match="the walk ran"):
        unflatten_tensors(layout, tensors)


def test_a_full_codec_cache_starts_over(monkeypatch):
    monkeypatch.setattr(tensor_groups, "_CODECS", {})
    monkeypatch.setattr(tensor_groups, "_MAX_CODECS", 2)
    for scale in (1.0, 2.0, 3.0):
        tree = ((FrozenBase(_tensor(), None, None),), (LoraWeights(_tensor(), _tensor(), scale),))
        tensors, layout = flatten_tensors(tree)
        _same_tree(unflatten_tensors(layout, tensors), tree)
    assert len(tensor_groups._CODECS) == 1


def test_a_layout_with_an_unhashable_leaf_takes_the_walk():
    """A leaf that cannot key the cache (a dict here) leaves the layout to the plain walks."""
    tree = (_tensor(), {"not": "hashable"}, [_tensor()])
    tensors, layout = flatten_tensors(tree)
    codecs_before = dict(tensor_groups._CODECS)
    _same_tree(unflatten_tensors(layout, tensors), tree)
    assert all(a is b for a, b in zip(values_in_tensor_slots(layout, tree), tensors))
    assert tensor_groups._CODECS == codecs_before
