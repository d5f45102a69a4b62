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


def _is_named_tuple(node: Any) -> bool:
    return isinstance(node, tuple) and hasattr(node, "_fields")


def _split(node: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(node, torch.Tensor):
        tensors.append(node)
        return _TENSOR_SLOT
    if _is_named_tuple(node):
        return type(node)(*(_split(value, tensors) for value in node))
    if isinstance(node, (tuple, list)):
        return type(node)(_split(value, tensors) for value in node)
    return node


def _fill(node: Any, values: Iterable[Any]) -> Any:
    if isinstance(node, str) and node == _TENSOR_SLOT:
        return next(values)
    if _is_named_tuple(node):
        return type(node)(*(_fill(value, values) for value in node))
    if isinstance(node, (tuple, list)):
        return type(node)(_fill(value, values) for value in node)
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
    if isinstance(slot, str) and slot == _TENSOR_SLOT:
        values.append(node)
    elif isinstance(slot, (tuple, list)):
        for index, sub_slot in enumerate(slot):
            _collect_slot_values(sub_slot, node[index] if isinstance(node, (tuple, list)) else None, values)
