"""`CallTraces`: a fused Function's body replayed as the straight-line code it ran, without its decisions.

A fused q/k/v step makes six Triton launches, yet most of its host time is Python between them: the
checks, the five launchers' plan keys, which path each GEMM takes, the splits by rank. Every one of
those decisions is a function of the call's metadata (shapes, strides, dtypes, devices, alignment,
which gradients are needed), the settings, and the launch plans that metadata selects. So a body
called again with the same metadata runs the same torch calls and the same launches, on new tensors.

`CallTraces.key(parts, keyed)` makes a call's key; `CallTraces.call(key, inputs, body)` runs
`body()` the first time a key is seen (the launchers build their plans), then records it twice, and
from then on replays the recording: a Python function of straight-line code, written once per key,
that makes the same torch calls and the same launcher replays (`trace_unit`) with the new tensors in
place of the recorded ones, and deletes each variable after the line that reads it last (as the
body drops its intermediates: a replay holds no more memory than the body). A model's layers of one
shape share a key, so the body runs for the first three layers of a new shape and the rest replay.

How a recording stays exact (each rule fails the recording, and the key then always runs `body()`):
- Every torch call outside a unit goes through a `TorchFunctionMode`: a call that returns tensors is
  recorded; one that returns anything else must be a metadata query (`_METADATA`), whose answer the
  key already holds. `.item()`, `bool(tensor)` and the like fail it.
- Kernel launches are units: the launchers' plan replays and `CachedKernel.launch` /
  `BoundLaunch.launch` are marked with `trace_unit`, recorded as one call each, and not looked into.
  A launch outside one would be invisible; there is none.
- Every tensor a recorded call takes must be an input of the call or an output of an earlier
  recorded call (a tensor from anywhere else, e.g. a cache, fails it); every other argument must be
  a value (int, float, dtype, ...), a sequence of those, or an object of `_CONSTANT_TYPES` (a launch
  plan's bound kernel), the same for every call of the key.
- The two recordings must be the same code with the same constants.

The key holds the metadata of every input tensor (type, shape, strides, dtype, device, alignment,
requires_grad, storage offset, and which inputs share an address), the caller's parts (dtype plan,
layout, needs_input_grad) and `settings_version()`, which every change to a `VersionedSettings`
class (the switches that pick paths: `LoraAddmmSettings`, `LaunchPlans.enabled`, ...) moves.

Traces serve CUDA tensors, never under torch.compile, a dispatch mode, a tensor subclass or a CUDA
graph capture; `CallTraces.devices` widens that for the CPU tests, where the reference and the
interpreter's launches (`CachedKernel.launch`, a unit) replay the same way. A module function
patched at run time (tests do) is not seen by a trace recorded before: tests start with none
(`clear_all_traces`, `tests/conftest.py`).
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Optional, Sequence

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _get_current_dispatch_mode


class VersionedSettings(type):
    """Metaclass of the settings classes: setting or deleting a class attribute moves
    `settings_version()`, so a trace recorded under other settings is not served. The version
    names the settings' values, so settings put back (a benchmark's arms, a test's monkeypatch)
    find their traces again."""

    def __setattr__(cls, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        _settings_changed(cls, name)

    def __delattr__(cls, name: str) -> None:
        super().__delattr__(name)
        _settings_changed(cls, name)


# Every settings attribute ever set, by (class, name), with its value now; and a number for each
# combination of values seen (`settings_version()`).
_settings_values: dict = {}
_settings_numbers: dict = {}
_settings_version = [0]
_unhashable_states = [0]  # how many states held an unhashable value (numbered -1, -2, ...)
_DELETED = object()


def _settings_changed(cls: type, name: str) -> None:
    _settings_values[(cls, name)] = cls.__dict__.get(name, _DELETED)
    state = tuple((id(kind), attribute, value) for (kind, attribute), value in _settings_values.items())
    try:
        number = _settings_numbers.setdefault(state, len(_settings_numbers) + 1)
    except TypeError:  # an unhashable value: a number of its own, never seen again
        _unhashable_states[0] += 1
        number = -_unhashable_states[0]
    _settings_version[0] = number


def settings_version() -> int:
    return _settings_version[0]


class _Untraceable(Exception):
    """Why a recording cannot be replayed (the key then always runs the body)."""


# The recorder of this thread while it records, else None (read by `trace_unit` on every call).
_local = threading.local()
_local.recorder = None


def trace_unit(function: Callable) -> Callable:
    """Marks a function that launches kernels (a launcher's plan replay, a launch): a recording
    records a call of it as one step and does not look inside. Outside a recording it is called
    as it is (one more Python call)."""

    @functools.wraps(function)
    def unit(*args, **kwargs):
        recorder = getattr(_local, "recorder", None)
        if recorder is None:
            return function(*args, **kwargs)
        return recorder.unit(function, args, kwargs)

    return unit


def _metadata_queries() -> frozenset:
    tensor = torch.Tensor
    properties = (
        "shape", "dtype", "device", "is_cuda", "is_cpu", "ndim", "layout", "requires_grad", "itemsize",
        "nbytes", "is_sparse", "is_quantized", "is_meta",
    )  # fmt: skip
    methods = (
        "size", "stride", "dim", "data_ptr", "is_contiguous", "element_size", "get_device", "numel",
        "storage_offset", "is_floating_point", "is_complex", "__len__", "__hash__", "nelement",
    )  # fmt: skip
    return frozenset(
        [getattr(tensor, name).__get__ for name in properties] + [getattr(tensor, name) for name in methods]
    )


_METADATA = _metadata_queries()
_METHOD_WRAPPER = type(torch.Tensor.T.__get__)

# Torch functions that answer from their arguments' dtypes alone (in the key), asked by the bodies.
_DTYPE_QUERIES = frozenset({torch.promote_types, torch.result_type, torch.can_cast})

# Arguments taken as constants: values, equal in every call of a key.
_VALUE_TYPES = frozenset(
    {int, float, bool, str, type(None), torch.dtype, torch.device, torch.Size, torch.memory_format,
     torch.layout, slice, type(Ellipsis)}
)  # fmt: skip
# Objects taken as constants: what a launch plan holds (see `register_constant_type`).
_CONSTANT_TYPES: set = set()


def register_constant_type(kind: type) -> type:
    """Lets a recording take objects of `kind` as constants: for types whose objects hold no tensor
    and come from the key's metadata (a launch plan's bound kernel), so every call of a key has the
    same one. Usable as a class decorator."""
    _CONSTANT_TYPES.add(kind)
    return kind


class _Recorder(TorchFunctionMode):
    """Writes a body's torch calls and units as Python lines while the body runs."""

    def __init__(self, inputs: Sequence[Optional[torch.Tensor]]) -> None:
        super().__init__()
        self.slots: dict[int, str] = {}  # id(tensor) -> its variable
        self.alive: list = []  # every tensor seen, so that no id is reused while recording
        # (code, the variables it reads, the variable it defines or None), in order.
        self.lines: list[tuple[str, list[str], Optional[str]]] = []
        self.uses: list[str] = []  # the variables the expressions written since the last line read
        self.constants: list = []
        self.constant_names: dict[int, str] = {}
        self.count = 0
        self.inside_unit = 0
        self.failure: Optional[str] = None
        self.parameters = []
        for index, tensor in enumerate(inputs):
            name = f"i{index}"
            self.parameters.append(name)
            if tensor is not None:
                self._bind(tensor, name)

    def _bind(self, tensor: torch.Tensor, name: str) -> None:
        self.slots[id(tensor)] = name
        self.alive.append(tensor)

    def _constant(self, value: Any) -> str:
        name = self.constant_names.get(id(value))  # (ids stay unique: `alive` holds each constant)
        if name is None:
            name = f"c[{len(self.constants)}]"
            self.constants.append(value)
            self.alive.append(value)
            self.constant_names[id(value)] = name
        return name

    def _expression(self, value: Any) -> str:
        kind = type(value)
        if kind in _VALUE_TYPES or kind in _CONSTANT_TYPES:
            return "None" if value is None else self._constant(value)
        if isinstance(value, torch.Tensor):
            name = self.slots.get(id(value))
            if name is None:
                raise _Untraceable("a tensor that is neither an input nor made by the body")
            self.uses.append(name)
            return name
        if kind is list or kind is tuple or (issubclass(kind, tuple) and hasattr(kind, "_fields")):
            if kind is not list and not _holds_tensor(value):
                _check_constant(value)
                return self._constant(value)  # a launch plan: one object for every call of the key
            items = [self._expression(item) for item in value]
            if kind is list:
                return "[" + ", ".join(items) + "]"
            if kind is tuple:
                return "(" + "".join(item + ", " for item in items) + ")"
            return f"{self._constant(kind)}(" + ", ".join(items) + ")"
        if kind is dict:
            return (
                "{"
                + ", ".join(f"{self._expression(k)}: {self._expression(v)}" for k, v in value.items())
                + "}"
            )
        if kind.__name__ == "function" and not value.__closure__:
            return self._constant(value)  # a plain function without captured state
        raise _Untraceable(f"an argument of type {kind.__name__}")

    def _call_line(self, function: Any, args: tuple, kwargs: dict) -> str:
        self.uses = []
        parts = [self._expression(arg) for arg in args]
        parts += [f"{name}={self._expression(value)}" for name, value in kwargs.items()]
        return f"{self._constant(function)}(" + ", ".join(parts) + ")"

    def _bind_result(self, result: Any, expression: str, uses: list[str]) -> None:
        if isinstance(result, torch.Tensor):
            name = f"v{self.count}"
            self.count += 1
            self.lines.append((f"{name} = {expression}", uses, name))
            self._bind(result, name)
        elif type(result) in (list, tuple) or isinstance(result, tuple):
            for index, item in enumerate(result):
                if isinstance(item, (torch.Tensor, list, tuple)):
                    self._bind_result(item, f"{expression}[{index}]", uses)

    def _record(self, line: str, uses: list[str], result: Any) -> None:
        """Writes `line` (from `_call_line`, which read the variables `uses`) bound to what it returned."""
        if isinstance(result, torch.Tensor):
            self._bind_result(result, line, uses)
        elif _holds_tensor(result):
            name = f"r{self.count}"
            self.count += 1
            self.lines.append((f"{name} = {line}", uses, name))
            self._bind_result(result, name, [name])
        else:
            self.lines.append((line, uses, None))

    def unit(self, function: Callable, args: tuple, kwargs: dict) -> Any:
        if self.inside_unit or self.failure is not None:
            return function(*args, **kwargs)
        try:
            line = self._call_line(function, args, kwargs)  # before the call: the arguments as passed
        except _Untraceable as error:
            self.failure = str(error)
            return function(*args, **kwargs)
        uses = self.uses
        self.inside_unit += 1
        try:
            result = function(*args, **kwargs)
        finally:
            self.inside_unit -= 1
        self._record(line, uses, result)
        return result

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.inside_unit or self.failure is not None:
            return func(*args, **kwargs)
        result = func(*args, **kwargs)
        if func in _METADATA or func in _DTYPE_QUERIES:
            return result
        try:
            if result is not None and not _holds_tensor(result):
                raise _Untraceable(f"{getattr(func, '__name__', func)} answered with a value")
            line = self._call_line(func, args, kwargs)
            self._record(line, self.uses, result)
        except _Untraceable as error:
            self.failure = str(error)
        return result

    def finish(self, outputs: Any) -> "_Trace":
        if self.failure is not None:
            raise _Untraceable(self.failure)
        self.uses = []
        returned = self._expression(outputs)
        source = f"def replay(c, {', '.join(self.parameters)}):\n"
        source += "".join(f"    {line}\n" for line in _with_deletions(self.lines, set(self.uses)))
        return _Trace(source + f"    return {returned}\n", tuple(self.constants))


def _with_deletions(lines: list[tuple[str, list[str], Optional[str]]], returned: set[str]) -> list[str]:
    """The lines, each followed by a `del` of the variables it read (or made) last: a replay holds no
    tensor longer than the body did, which dropped its intermediates as it went (a dequantized
    weight before the next is made, each chunk of h); without these every variable would live to
    the return (the gated MLP's peak rose from 584 to 811 MiB on the H200, forty-second session)."""
    last_line: dict[str, int] = {}
    for index, (_, uses, defines) in enumerate(lines):
        if defines is not None:
            last_line[defines] = index
        for name in uses:
            last_line[name] = index
    dropped_after: dict[int, list[str]] = {}
    for name, index in last_line.items():
        if name[0] != "i" and name not in returned:  # inputs ("i0", ...) are the caller's
            dropped_after.setdefault(index, []).append(name)
    code = []
    for index, (text, _, _) in enumerate(lines):
        code.append(text)
        if index in dropped_after:
            code.append("del " + ", ".join(sorted(dropped_after[index])))
    return code


def _check_constant(value: Any) -> None:
    """Fails unless `value`, a tuple without tensors, holds only constants a trace may keep."""
    for item in value:
        kind = type(item)
        if kind in _VALUE_TYPES or kind in _CONSTANT_TYPES:
            continue
        if isinstance(item, tuple):
            _check_constant(item)
        elif not (kind.__name__ == "function" and not item.__closure__):
            raise _Untraceable(f"an argument of type {kind.__name__}")


def _same_constant(mine: Any, theirs: Any) -> bool:
    """Whether two recordings' constants are the same: values equal, tuples item by item, any other
    object the same one (a property's getter, a new method-wrapper at each access, by equality)."""
    if mine is theirs:
        return True
    kind = type(mine)
    if kind is not type(theirs):
        return False
    if kind in _VALUE_TYPES or kind is _METHOD_WRAPPER:
        return mine == theirs
    if isinstance(mine, tuple):
        return len(mine) == len(theirs) and all(map(_same_constant, mine, theirs))
    return False


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (list, tuple)):
        for item in value:
            if _holds_tensor(item):
                return True
    return False


@functools.lru_cache(maxsize=256)
def _replay_function(source: str) -> Callable:
    """The function a trace's source defines. Its only names are its parameters (the constants come
    in as `c`), so traces of one source share it: keys that differ only in metadata (a new sequence
    length) record the same source. Compiling only the adopted trace, once per source, took a
    recorded q/k/v step on the CPU proxy from 2.93-2.99 to 1.67-1.75 ms (forty-third session)."""
    namespace: dict = {}
    exec(compile(source, "<fastlora call trace>", "exec"), namespace)
    return namespace["replay"]


class _Trace:
    """A recorded body: its source and constants; `replay` once it is adopted (`adopt`)."""

    __slots__ = ("source", "constants", "replay")

    def __init__(self, source: str, constants: tuple) -> None:
        self.source = source
        self.constants = constants
        self.replay: Optional[Callable] = None

    def adopt(self) -> "_Trace":
        """Compiles the source (only a trace that replays needs it: not the first recording)."""
        self.replay = functools.partial(_replay_function(self.source), self.constants)
        return self

    def same_as(self, other: "_Trace") -> bool:
        if self.source != other.source or len(self.constants) != len(other.constants):
            return False
        return all(map(_same_constant, self.constants, other.constants))


class TraceEntry:
    """One key's state: calls seen, the first recording, then the trace (or `untraceable`).
    Hashed by identity: a backward's key holds its forward's entry (`CallTraces.key`'s `parts`)."""

    __slots__ = ("calls", "recorded", "trace", "untraceable")

    def __init__(self) -> None:
        self.calls = 0
        self.recorded: Optional[_Trace] = None
        self.trace: Optional[_Trace] = None
        self.untraceable = False


# Tensors of exactly these types: what a key, a plan or an op's direct call reads by metadata alone
# (a subclass may carry more, and goes its slower, checked way). One set for `call_traces`,
# `kernels._launch` and `kernels._backend`.
PLAIN_TENSOR_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})


class CallTraces:
    """One Function body's traces by key (see the module docstring)."""

    # The switch for every Function's traces; and the device types they serve on ("cpu" is for tests:
    # there every op runs the reference or the interpreter).
    enabled = True
    devices = frozenset({"cuda"})
    # Past this many keys the traces are dropped and recorded again as they recur.
    MAX_TRACES = 1024
    # Why the last recording failed, by trace name (for tests and probes).
    failures: dict = {}
    differing: dict = {}

    def __init__(self, name: str) -> None:
        self.name = name
        self.entries: dict = {}

    def key(self, parts: tuple, keyed: Sequence[Optional[torch.Tensor]]) -> Optional[tuple]:
        """The key of a call whose body's decisions read `parts` (hashable) and the metadata of the
        `keyed` tensors (at least one of them not None), or None where traces do not serve it."""
        if (
            not CallTraces.enabled
            or torch.compiler.is_compiling()
            or _get_current_dispatch_mode() is not None
        ):
            return None
        key = [settings_version(), parts]
        addresses: dict[int, int] = {}
        first = None
        for index, tensor in enumerate(keyed):
            if tensor is None:
                key.append(None)
                continue
            kind = type(tensor)
            if kind not in PLAIN_TENSOR_TYPES:
                return None
            if first is None:
                first = tensor
            address = tensor.data_ptr()
            key.append(
                (kind, tensor.shape, tensor.stride(), tensor.dtype, tensor.get_device(), address % 16 == 0,
                 tensor.requires_grad, tensor.storage_offset(), addresses.setdefault(address, index))
            )  # fmt: skip
        if first is None:
            return None
        device = "cuda" if first.is_cuda else first.device.type  # (is_cuda: no torch.device made)
        if device not in CallTraces.devices:
            return None
        if device == "cuda" and torch.cuda.is_current_stream_capturing():
            return None  # a graph capture records the body's own calls (its scratch differs)
        return tuple(key)

    def call(
        self, key: Optional[tuple], inputs: Sequence[Optional[torch.Tensor]], body: Callable[[], Any]
    ) -> tuple[Any, Optional[TraceEntry]]:
        """(body()'s result, the key's entry): the result by `body()` itself, or by the key's trace
        replayed on `inputs` (the tensors `body` reads, in a fixed order). key: from `key`, or None
        to run `body()` (no entry)."""
        if key is None:
            return body(), None
        entry = self.entries.get(key)
        if entry is None:
            if len(self.entries) >= self.MAX_TRACES:
                self.entries.clear()
            entry = self.entries[key] = TraceEntry()
        trace = entry.trace
        if trace is not None:
            return trace.replay(*inputs), entry
        if entry.untraceable:
            return body(), entry
        entry.calls += 1
        if entry.calls == 1:
            return body(), entry  # the launchers make their plans: recordings start from the second call
        return self._record(entry, inputs, body), entry

    def _record(self, entry: TraceEntry, inputs, body) -> Any:
        recorder = _Recorder(inputs)
        _local.recorder = recorder
        try:
            with recorder:
                result = body()
        finally:
            _local.recorder = None
        try:
            trace = recorder.finish(result)
        except _Untraceable as error:
            CallTraces.failures[self.name] = str(error)
            entry.untraceable = True
            return result
        if entry.recorded is None:
            entry.recorded = trace
        elif entry.recorded.same_as(trace):
            entry.trace, entry.recorded = trace.adopt(), None
        else:
            CallTraces.failures[self.name] = "two recordings differ"
            CallTraces.differing[self.name] = (entry.recorded, trace)
            entry.untraceable = True
        return result

    def clear(self) -> None:
        self.entries.clear()


def clear_all_traces() -> None:
    """Drops every Function's traces (tests call it between tests: a test may patch a module)."""
    for traces in _ALL_TRACES:
        traces.clear()
    CallTraces.failures.clear()
    CallTraces.differing.clear()


_ALL_TRACES: list[CallTraces] = []


def call_traces(name: str) -> CallTraces:
    traces = CallTraces(name)
    _ALL_TRACES.append(traces)
    return traces
