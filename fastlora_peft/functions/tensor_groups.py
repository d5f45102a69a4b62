"""Flatten named tuples of tensors into the positional tensor list `autograd.Function.apply` needs.

A Function's tensors travel as `*tensors` so autograd tracks them and `save_for_backward` keeps
them; their structure (which tensor is lora_a of which projection, where the 4-bit state is)
travels as a `layout`: the same tree with each sequence written `(its type, *children)` and a
placeholder in each tensor slot. This is the only place that knows the order, so a Function never
counts positions by hand.

Because a layout names its node types, two layouts are equal only if they rebuild the same tree
(a named tuple and a plain tuple of equal items differ), so a layout can key a cache: the
first time a layout is seen, `_codec` writes a Python function that rebuilds its tree in one
expression, and one that reads its slots back; every later call of the same structure (every
step, every layer of a model) runs those. On the CPU machine, for a q/k/v group's tree (timeit,
best of 5, two runs alternating with the walks of before): each unflatten 9.0-9.6 -> 2.0-2.1 us,
the gradients' collection 5.9 -> 2.2 us, flatten 10.1 -> 7.9-8.1 us; a fused step makes one
flatten, three unflattens and one collection. Under `torch.compile` the plain walks run: dynamo
would guard on the cache's contents and recompile whenever it grew.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, NamedTuple

import torch

_TENSOR_SLOT = "<tensor>"

# Leaves that are certainly not tensors, tested first: `isinstance(x, torch.Tensor)` on None or a
# float goes through torch's metaclass check and costs about 3x what it costs on a tensor.
_PLAIN_LEAF_TYPES = frozenset({type(None), float, int, bool, str})


def _rebuild(kind: type, items: list[Any]) -> Any:
    """A sequence of type `kind` holding `items`: a named tuple field by field, a list or a tuple."""
    if kind is tuple:
        return tuple(items)
    if kind is list:
        return items
    return kind(*items) if _is_named_tuple(kind) else kind(items)


def _is_named_tuple(kind: type) -> bool:
    """Whether a sequence type of a tree (named tuples, tuples, lists) other than tuple is a named
    tuple. issubclass, not hasattr(kind, "_fields"): the walks run under torch.compile, and dynamo in
    torch 2.11 (the GPU machine's) stops at hasattr on a class (tests/test_compile.py failed there)."""
    return issubclass(kind, tuple)


# Tensor types recognised by their exact type before `isinstance` (the adapters' and dense weights'
# Parameters, and plain tensors); any other subclass (bitsandbytes' Params4bit) takes isinstance.
_EXACT_TENSOR_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})


def _split(node: Any, tensors: list[torch.Tensor]) -> Any:
    kind = type(node)
    if kind in _PLAIN_LEAF_TYPES:
        return node
    if isinstance(node, (tuple, list)):
        # The leaves are handled here, not by a call each: a q/k/v group's tree has 18 leaves under
        # 9 sequences (27 calls of this function, 9 with the leaves inline).
        items: list[Any] = [kind]
        for value in node:
            value_kind = type(value)
            if value_kind in _PLAIN_LEAF_TYPES:
                items.append(value)
            elif value_kind in _EXACT_TENSOR_TYPES:
                tensors.append(value)
                items.append(_TENSOR_SLOT)
            else:
                items.append(_split(value, tensors))
        return tuple(items)
    if isinstance(node, torch.Tensor):
        tensors.append(node)
        return _TENSOR_SLOT
    return node


def _is_node(slot: Any) -> bool:
    return type(slot) is tuple and bool(slot) and isinstance(slot[0], type)


def _fill(slot: Any, values: Iterable[Any]) -> Any:
    if type(slot) is str:
        return next(values) if slot == _TENSOR_SLOT else slot
    if _is_node(slot):
        return _rebuild(slot[0], [_fill(child, values) for child in slot[1:]])
    return slot


def _collect_slot_values(slot: Any, node: Any, values: list[Any]) -> None:
    # A module-level function, not a closure: a nested function that calls itself is a reference
    # cycle holding `values` until the garbage collector runs, and a gradient a Function returns
    # that is still referenced when autograd accumulates it is copied instead of taken over.
    if type(slot) is str:
        if slot == _TENSOR_SLOT:
            values.append(node)
    elif _is_node(slot):
        nested = isinstance(node, (tuple, list))
        for index, child in enumerate(slot[1:]):
            _collect_slot_values(child, node[index] if nested else None, values)


class _Codec(NamedTuple):
    """A layout's two generated functions: `unflatten(layout, values)` and `collect(tree)`."""

    unflatten: Callable[[Any, Any], Any]
    collect: Callable[[Any], list[Any]]


# By layout (hashable: types, strings, numbers, None): a model has a handful of distinct ones.
_CODECS: dict[Any, _Codec] = {}
_MAX_CODECS = 1024


def _codec(layout: Any) -> _Codec | None:
    """The generated functions of `layout`, written on first sight; None under torch.compile, or for
    a layout holding an unhashable leaf (then the walks run)."""
    if torch.compiler.is_compiling():
        return None
    try:
        codec = _CODECS.get(layout)
    except TypeError:
        return None
    if codec is None:
        if len(_CODECS) >= _MAX_CODECS:  # layouts hold scales and 4-bit shapes: a few per model
            _CODECS.clear()
        codec = _CODECS[layout] = _write_codec(layout)
    return codec


def _write_codec(layout: Any) -> _Codec:
    """Python source for `layout`'s two functions, compiled once.

    unflatten(L, v): one nested expression; a named tuple is built by `tuple.__new__` (what its
    `_make` does), a leaf that is not a tensor slot is read from L itself (an equal layout may
    hold 2 where this one holds 2.0). collect(t): each sub-tree that holds a slot is read once into a
    local, None (or any non-sequence) reading as None below it, as `_collect_slot_values` does.
    """
    kinds: list[type] = []
    slot_count = [0]

    def expression(slot: Any, path: str) -> str:
        if type(slot) is str and slot == _TENSOR_SLOT:
            slot_count[0] += 1
            return f"v[{slot_count[0] - 1}]"
        if not _is_node(slot):
            return path
        kind, kind_index = slot[0], len(kinds)
        kinds.append(kind)
        items = ", ".join(expression(child, f"{path}[{index + 1}]") for index, child in enumerate(slot[1:]))
        items += "," if len(slot) == 2 else ""
        if kind is tuple:
            return f"({items})"
        if kind is list:
            return f"[{items}]"
        if _is_named_tuple(kind):
            return f"_new(K[{kind_index}], ({items}))"
        return f"K[{kind_index}](({items}))"

    lines = ["def collect(t):"]
    outputs: list[str] = []

    def has_slot(slot: Any) -> bool:
        if type(slot) is str:
            return slot == _TENSOR_SLOT
        return _is_node(slot) and any(has_slot(child) for child in slot[1:])

    def reads(slot: Any, name: str) -> None:
        if type(slot) is str and slot == _TENSOR_SLOT:
            outputs.append(name)
            return
        for index, child in enumerate(slot[1:] if _is_node(slot) else ()):
            if has_slot(child):
                child_name = f"{name}_{index}"
                lines.append(f"    {child_name} = {name}[{index}] if _seq({name}) else None")
                reads(child, child_name)

    reads(layout, "t")
    lines.append(f"    return [{', '.join(outputs)}]")
    source = f"def unflatten(L, v):\n    return {expression(layout, 'L')}\n\n" + "\n".join(lines) + "\n"
    namespace: dict[str, Any] = {"K": kinds, "_new": tuple.__new__, "_seq": _is_sequence}
    exec(compile(source, "<fastlora_peft tensor_groups codec>", "exec"), namespace)
    return _Codec(namespace["unflatten"], namespace["collect"])


def _is_sequence(node: Any) -> bool:
    return isinstance(node, (tuple, list))


def flatten_tensors(tree: Any) -> tuple[list[torch.Tensor], Any]:
    """Returns (tensors in a fixed order, layout). `tree` nests named tuples, tuples and lists."""
    tensors: list[torch.Tensor] = []
    layout = _split(tree, tensors)
    return tensors, layout


def unflatten_tensors(layout: Any, values: Iterable[Any]) -> Any:
    """Rebuilds the tree from `layout` with `values` in the tensor slots, in order.

    `values` need not be tensors: passing `ctx.needs_input_grad[k:]` gives the same tree of booleans.
    """
    codec = _codec(layout)
    if codec is not None:
        return codec.unflatten(layout, values if isinstance(values, (tuple, list)) else tuple(values))
    return _fill(layout, iter(values))


def values_in_tensor_slots(layout: Any, tree: Any) -> list[Any]:
    """The inverse of `unflatten_tensors`: what `tree` holds at each tensor slot of `layout`, in order.

    `tree` has the layout's shape but may hold None where a whole sub-tree has no value (a Function's
    backward uses this to line its gradients up with the flattened inputs).
    """
    codec = _codec(layout)
    if codec is not None:
        return codec.collect(tree)
    values: list[Any] = []
    _collect_slot_values(layout, tree, values)
    return values
