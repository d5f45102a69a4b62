"""Flatten named tuples of tensors into the positional tensor list `autograd.Function.apply` needs.

A Function's tensors travel as `*tensors` so autograd tracks them and `save_for_backward` keeps
them; their structure (which tensor is lora_a of which projection, where the 4-bit state is)
travels as a `layout` of the same named tuples with a placeholder in each tensor slot. This is the
only place that knows the order, so a Function never counts positions by hand.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

_TENSOR_SLOT = "<tensor>"

# These run three or four times per fused step (flatten in forward; unflatten of the tensors and of
# needs_input_grad, and values_in_tensor_slots, in backward) over a tree of 27 nodes for a q/k/v
# group, so they test the cheap cases first and build no generators: on the CPU machine of CI the
# four calls on such a tree took 40 against 60 us before (timeit, best of 5 repeats).


def _rebuild(kind: type, items: list[Any]) -> Any:
    """A sequence of type `kind` holding `items`: a named tuple field by field, a list or a tuple."""
    if kind is tuple:
        return tuple(items)
    if kind is list:
        return items
    return kind(*items) if hasattr(kind, "_fields") else kind(items)


# Leaves that are certainly not tensors, tested first: `isinstance(x, torch.Tensor)` on None or a
# float goes through torch's metaclass check and costs about 3x what it costs on a tensor.
_PLAIN_LEAF_TYPES = frozenset({type(None), float, int, bool, str})


def _split(node: Any, tensors: list[torch.Tensor]) -> Any:
    if type(node) in _PLAIN_LEAF_TYPES:
        return node
    if isinstance(node, (tuple, list)):
        return _rebuild(type(node), [_split(value, tensors) for value in node])
    if isinstance(node, torch.Tensor):
        tensors.append(node)
        return _TENSOR_SLOT
    return node


def _fill(node: Any, values: Iterable[Any]) -> Any:
    if type(node) is str:
        return next(values) if node == _TENSOR_SLOT else node
    if isinstance(node, (tuple, list)):
        return _rebuild(type(node), [_fill(value, values) for value in node])
    return node


def flatten_tensors(tree: Any) -> tuple[list[torch.Tensor], Any]:
    """Returns (tensors in a fixed order, layout). `tree` nests named tuples, tuples and lists."""
    tensors: list[torch.Tensor] = []
    layout = _split(tree, tensors)
    return tensors, layout


def unflatten_tensors(layout: Any, values: Iterable[Any]) -> Any:
    """Rebuilds the tree from `layout` with `values` in the tensor slots, in order.

    `values` need not be tensors: passing `ctx.needs_input_grad[k:]` gives the same tree of booleans.
    """
    iterator = iter(values)
    tree = _fill(layout, iterator)
    return tree


def values_in_tensor_slots(layout: Any, tree: Any) -> list[Any]:
    """The inverse of `unflatten_tensors`: what `tree` holds at each tensor slot of `layout`, in order.

    `tree` has the layout's shape but may hold None where a whole sub-tree has no value (a Function's
    backward uses this to line its gradients up with the flattened inputs).
    """
    values: list[Any] = []
    _collect_slot_values(layout, tree, values)
    return values


def _collect_slot_values(slot: Any, node: Any, values: list[Any]) -> None:
    # A module-level function, not a closure: a nested function that calls itself is a reference
    # cycle holding `values` until the garbage collector runs, and a gradient a Function returns
    # that is still referenced when autograd accumulates it is copied instead of taken over.
    if type(slot) is str:
        if slot == _TENSOR_SLOT:
            values.append(node)
    elif isinstance(slot, (tuple, list)):
        nested = isinstance(node, (tuple, list))
        for index, sub_slot in enumerate(slot):
            _collect_slot_values(sub_slot, node[index] if nested else None, values)
