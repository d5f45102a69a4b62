"""`CachedKernel`: launches a `@triton.jit` kernel with Triton's per-call specialization work done once.

``kernel[grid](*args, **meta)`` spends most of its host time before the launch: it binds the
arguments, specializes each one, builds a cache key (``str()`` of the options dict included) and
checks the kernel's globals. On the H200 machine's host, `lora_terms._lora_shrink_triton` on tiny
tensors (an allocation and one launch) took 63us of host time through ``kernel[grid]`` and 40us
with this cache, then 26us with plain-int launch arithmetic (below), against ~15us for a tiny
``torch.mm`` (a scratch script that became `benchmarks/launch_overhead.py`). A fused o_proj step
makes six launches and was host-bound (~1.8 ms of host time for ~1.0 ms of GPU work).

``CachedKernel(kernel)[grid](*args, **meta)`` computes a cheaper key that is at least as fine as
Triton's and, on a hit, launches the compiled kernel Triton chose for that key the first time,
through the compiled kernel's own launcher.

The key holds, per argument, everything Triton 3.x specializes a kernel on:

* a tensor: its dtype and whether its address is 16-byte aligned;
* an int: its value when 0 or 1, else whether it is a multiple of 16 and whether it fits in 32 bits
  (Triton makes 1 a constant, marks multiples of 16, and picks i32/i64/u64 by range);
* a float: nothing (always an fp32 argument); None and constexpr values: the value itself;
* a host-side TMA `TensorDescriptor`: its tensor's dtype and alignment, block shape, padding, and its
  shape and strides keyed as ints (they reach the kernel as int arguments);
* the keyword arguments (constexprs and launch options such as num_warps) with their values, and
  the current CUDA device.

Two calls with the same key therefore get the same Triton specialization key, so reusing the first
call's compiled kernel is exactly what Triton's own path would launch (`tests/test_kernel_launch.py`
checks that against ``kernel[grid]`` on CUDA). Under the Triton interpreter there is no compiled
kernel: calls go through ``kernel[grid]`` unchanged.

A hit calls the compiled kernel's C launch function itself (`_DirectLaunch`), with what the compiled
kernel's Python launch wrapper would pass it, when that wrapper would add nothing: no scratch memory,
and no launch hook registered (Triton 3.6 keeps an empty hook chain, and its wrapper then still builds
a metadata dict and the C launcher calls both empty chains, on every launch). Otherwise, or when the
kernel's launcher is not the CUDA one, the hit goes through ``compiled[grid]`` as before.

A kernel with host-side TMA descriptor parameters gets the same direct launch. Triton wraps its C
launch in a Python function that encodes every descriptor (`cuTensorMapEncodeTiled`, through
`fill_tma_descriptor`) on every launch, after the launcher built a `TensorDescriptor` object for it.
Here each descriptor parameter has a `TmaEncoder` instead: it encodes a (tensor address, shape,
strides) once and hands the same encoded descriptor to every later launch that reads the same
memory through the same shape (an encoded descriptor holds nothing but those numbers and the
compiled kernel's block and swizzle, so reuse is exact). A launch plan passes the tensors themselves
where the kernel takes descriptors: no `TensorDescriptor` is built on a hit.

Launch plans (`LaunchPlans`, `BoundLaunch`, below) skip the key too: a launcher that meets inputs
of the same metadata again launches the `BoundLaunch` its first call returned, with the numbers it
derived then (see `lora_terms` and `dequant4bit`).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch
from triton import knobs
from triton.tools.tensor_descriptor import TensorDescriptor

from ..call_traces import PLAIN_TENSOR_TYPES, VersionedSettings, register_constant_type, trace_unit
from ._backend import TRITON_INTERPRET

# The hook chains' type where Triton has them (3.6), else a class no hook is an instance of.
_HookChain = getattr(knobs, "HookChain", type("_NoHookChain", (), {}))

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def _argument_key(arg: Any) -> Any:
    """What Triton's specialization can see of one non-constexpr argument (see the module docstring)."""
    # ints and floats first: most arguments are, and `isinstance(x, torch.Tensor)` on a non-tensor
    # goes through torch's metaclass check (~0.25 us each on the CI machine, a dozen per launch).
    kind = type(arg)
    if kind is int:
        if arg == 0 or arg == 1:
            return arg
        return (arg % 16 == 0, _INT32_MIN <= arg <= _INT32_MAX)
    if kind is float:
        return float
    if arg is None:
        return None
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    if kind is TensorDescriptor:
        # What a host-side TMA descriptor can be specialized on: its tensor's dtype and alignment,
        # block shape and padding, and its shape and strides as the ints they are passed as.
        return (
            TensorDescriptor, arg.base.dtype, arg.base.data_ptr() % 16 == 0, tuple(arg.block_shape),
            arg.padding, tuple(map(_argument_key, arg.shape)), tuple(map(_argument_key, arg.strides)),
        )  # fmt: skip
    # bool, numpy scalars, anything else: its type and value, so nothing is ever merged by mistake.
    return (type(arg), arg)


class _DirectLaunch(NamedTuple):
    """What a compiled kernel's launch wrapper hands its C launch function besides grid, stream and args."""

    launch: Callable[..., None]  # the compiled launcher's C `launch` (see triton/backends/nvidia/driver.py)
    function: int  # the CUfunction handle
    cooperative: bool
    pdl: bool
    packed_metadata: Any
    # One per TMA descriptor parameter, in order: what the C launch takes for it (`TmaEncoder`).
    encoders: tuple = ()
    # Positions of the pointer parameters, whose tensors the launch passes as their addresses (ints):
    # given a tensor, the C launch calls its `data_ptr` and then the driver's `cuPointerGetAttribute`
    # for each one; given an int, it takes the address as it is.
    pointers: tuple[int, ...] = ()


class TmaEncoder:
    """The C launch's arguments for one TMA descriptor parameter of one compiled kernel: the encoded
    descriptor, then the shape and strides, as Triton's wrapper makes them (`make_tensordesc_arg`),
    each (address, shape, strides, padding) encoded once.

    `meta` is the compiled kernel's `tensordesc_meta` entry (block, swizzle, element type); `fill` is
    Triton's `fill_tma_descriptor` (a parameter so the CPU tests can stand one in).
    """

    # Distinct (address, shape, strides) seen; past this many they are dropped and encoded again as
    # they recur (activations come from the caching allocator's few addresses per shape).
    MAX_ENCODED = 1024

    def __init__(self, meta: dict, fill: Callable[..., Any], host_elem_types: dict[int, int]) -> None:
        if meta.get("fp4_padded"):
            raise ValueError("TmaEncoder: fp4-padded descriptors are not supported")
        self.fill = fill
        self.swizzle = meta["swizzle"]
        self.elem_size = meta["elem_size"]
        # Triton numbers TMA element types differently on the host and the device.
        self.host_elem_type = host_elem_types[meta["elem_type"]]
        self.block_size = meta["block_size"]
        self.encoded: dict[tuple, Any] = {}

    def __call__(self, arg: Any) -> tuple:
        """`arg`: a `TensorDescriptor`, or a tensor read whole (zero padding, the block from `meta`).
        Returns what the C launch takes for it, kept whole with its encoding: a hit builds nothing."""
        if type(arg) is TensorDescriptor:
            padding = 1 if arg.padding == "nan" else 0
            key = (arg.base.data_ptr(), tuple(arg.shape), tuple(arg.strides), padding)
        else:
            # The Size as it is: it hashes and compares as the tuple of its ints (a descriptor of the
            # whole tensor finds the same entry), and `tuple()` of it costs as much as the lookup.
            key = (arg.data_ptr(), arg.shape, arg.stride(), 0)
        expanded = self.encoded.get(key)
        if expanded is None:
            if len(self.encoded) >= self.MAX_ENCODED:
                self.encoded.clear()
            address, shape, strides, padding = key
            encoded = self.fill(
                address, self.swizzle, self.elem_size, self.host_elem_type, self.block_size,
                list(shape), list(strides), padding,
            )  # fmt: skip
            expanded = self.encoded[key] = (encoded, *shape, *strides)
        return expanded


def _c_launch_inside(wrapper: Callable[..., None]) -> Optional[Callable[..., None]]:
    """The C launch that Triton's descriptor-encoding wrapper (`wrap_handle_tensordesc`) closes over."""
    if type(wrapper).__name__ == "builtin_function_or_method":
        return wrapper
    closure = dict(zip(wrapper.__code__.co_freevars, wrapper.__closure__ or ()))
    cell = closure.get("launcher")
    launch = None if cell is None else cell.cell_contents
    return launch if type(launch).__name__ == "builtin_function_or_method" else None


def _direct_launch(compiled) -> Optional[_DirectLaunch]:
    """The C launch of `compiled` when its Python wrapper would only forward to it (or, for TMA
    descriptors, encode them, which `TmaEncoder` does instead), else None."""
    launcher = compiled.run  # loads the module (handles) on first use
    if type(launcher).__name__ != "CudaLauncher":
        return None
    if launcher.global_scratch_size > 0 or launcher.profile_scratch_size > 0:
        return None  # the wrapper allocates scratch memory per launch
    descriptor_metas = getattr(compiled.metadata, "tensordesc_meta", None) or ()
    launch = _c_launch_inside(launcher.launch)
    wrapped = launch is not launcher.launch
    if launch is None or (wrapped and not descriptor_metas) or None in descriptor_metas:
        return None  # a wrapper we do not know, or descriptors decomposed into pointers and sizes
    encoders = ()
    if descriptor_metas:
        from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST
        from triton.runtime.driver import driver

        fill = driver.active.utils.fill_tma_descriptor
        encoders = tuple(TmaEncoder(meta, fill, TMA_DTYPE_DEVICE_TO_HOST) for meta in descriptor_metas)
    return _DirectLaunch(
        launch,
        compiled.function,
        launcher.launch_cooperative_grid,
        launcher.launch_pdl,
        compiled.packed_metadata,
        encoders,
        pointer_positions(compiled.src.signature),
    )


def pointer_positions(signature: dict[str, Any]) -> tuple[int, ...]:
    """The positions of a compiled kernel's pointer parameters in its signature (parameter name ->
    Triton type, in order: "*bf16" a pointer, "i32" an int, "constexpr" a constant or None, a TMA
    descriptor's "tensordesc<...>", a tuple's a tuple)."""
    return tuple(
        position
        for position, kind in enumerate(signature.values())
        if isinstance(kind, str) and kind.startswith("*")
    )


def _launch_hooks_registered() -> bool:
    runtime = knobs.runtime
    enter, exit_ = runtime.launch_enter_hook, runtime.launch_exit_hook
    # Triton 3.6 holds hook chains (empty when nothing is registered); older versions None or a
    # callable. Asked on every launch: the chains' case is tested first, without a generator (about
    # 3 us a launch on the H200 machine's host with one).
    if type(enter) is _HookChain and type(exit_) is _HookChain:
        return bool(enter.calls) or bool(exit_.calls)
    return any(hook is not None and getattr(hook, "calls", True) for hook in (enter, exit_))


class CachedKernel:
    """``CachedKernel(kernel)[grid](*args, **meta)`` launches like ``kernel[grid](*args, **meta)``.

    Used as a decorator above ``@triton.jit``, so the module attribute is the cached launcher and
    ``.kernel`` the JIT (or, under the interpreter, interpreted) function.

    Positional arguments are the kernel's leading parameters; keyword arguments its remaining
    parameters (the constexprs) and the launch options (num_warps, num_stages, ...).
    """

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.name = kernel.fn.__name__
        parameters = list(inspect.signature(kernel.fn).parameters.values())
        self.arg_names: Sequence[str] = tuple(param.name for param in parameters)
        # Constexprs must come as keywords: the key takes their values from `meta`, while a positional
        # int is keyed only by what Triton specializes a runtime int on (BLOCK_M=32 and 64 would merge).
        # (Annotations may be strings under `from __future__ import annotations`.)
        constexprs = [i for i, param in enumerate(parameters) if "constexpr" in str(param.annotation)]
        self.positional_limit = min(constexprs, default=len(parameters))
        # Compiled kernels by our key, kept per instance: each kernel has its own.
        self.compiled: dict[Any, Any] = {}
        # Their C launch functions (`_DirectLaunch`, or None where Triton's wrapper must run), same key.
        self.direct: dict[Any, Optional[_DirectLaunch]] = {}

    def __getitem__(self, grid: tuple[int, ...]):
        return lambda *args, **meta: self.launch(grid, args, meta)

    def key(self, args: Sequence[Any], meta: dict[str, Any], device: int) -> tuple:
        """The cache key of a launch on CUDA device `device` (Triton compiles for the current one)."""
        return (device, tuple(meta.items()), *map(_argument_key, args))

    @trace_unit
    def launch(
        self, grid: tuple[int, ...], args: Sequence[Any], meta: dict[str, Any]
    ) -> Optional["BoundLaunch"]:
        """Launches; returns the launch bound to its compiled kernel (`BoundLaunch`), or None under
        the interpreter, where every call must go through ``kernel[grid]``."""
        if len(args) > self.positional_limit:
            raise TypeError(
                f"{self.name}: pass its constexpr parameters "
                f"{list(self.arg_names[self.positional_limit :])} as keywords"
            )
        if TRITON_INTERPRET:
            self.kernel[grid](*args, **meta)
            return None
        device = torch.cuda.current_device()
        key = self.key(args, meta, device)
        compiled = self.compiled.get(key)
        if compiled is None:
            # Triton's own path: specializes, compiles (or loads its cache) and launches; it returns
            # the compiled kernel it launched, which every later call with this key reuses.
            compiled = self.kernel[grid](*args, **meta)
            if hasattr(compiled, "result"):  # Triton's asynchronous compile mode hands back a future
                compiled = compiled.result()
            self.compiled[key] = compiled
            self.direct[key] = _direct_launch(compiled)
            return self.bound(compiled, self.direct[key], grid, args, meta, device)
        bound = self.bound(compiled, self.direct.get(key), grid, args, meta, device)
        bound.launch(*args)
        return bound

    def bound(self, compiled, direct, grid, args, meta, device) -> "BoundLaunch":
        constexprs = tuple(meta[name] for name in self.arg_names[len(args) :])
        descriptors = tuple(
            (position, tuple(arg.block_shape))
            for position, arg in enumerate(args)
            if type(arg) is TensorDescriptor
        )
        return BoundLaunch(self.name, compiled, direct, grid, constexprs, device, descriptors)


class BoundLaunch:
    """One compiled kernel with its grid and constexprs settled: ``bound(*args)`` launches it with new
    runtime arguments on the current stream.

    For launchers that cache everything they derive from their inputs' shapes, strides, dtypes and
    alignment (a launch plan): a later call whose arguments have the same `CachedKernel.key` launches
    the same compiled kernel without recomputing the key (about 17 arguments, the largest share of a
    launch's host time). The caller is responsible for that sameness, by keying its plan on them.
    """

    __slots__ = ("name", "compiled", "direct", "grid", "constexprs", "device", "descriptors")

    def __init__(
        self,
        name: str,
        compiled,
        direct: Optional[_DirectLaunch],
        grid,
        constexprs: tuple,
        device: int,
        descriptors: tuple[tuple[int, tuple[int, ...]], ...] = (),
    ):
        self.name = name  # the kernel's, for counting launches in tests
        self.compiled = compiled
        # A kernel with TMA descriptors launches directly only with one encoder per descriptor.
        usable = direct is not None and len(direct.encoders) == len(descriptors)
        self.direct = direct if usable else None
        self.grid = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        self.constexprs = constexprs
        self.device = device
        # (position, block shape) of each TMA descriptor parameter. A caller may pass the tensor itself
        # there (read whole, zero padding): a plan's launch builds no descriptor object.
        self.descriptors = descriptors

    def __call__(self, *args: Any) -> None:
        """A launch plan's launch (tests count these by `name`)."""
        self.launch(*args)

    @trace_unit
    def launch(self, *args: Any) -> None:
        direct = self.direct
        if direct is None or _launch_hooks_registered():
            if self.descriptors:
                args = self._with_descriptor_objects(args)
            self.compiled[self.grid](*args, *self.constexprs)
            return
        pointers = direct.pointers
        if pointers:
            # Each tensor's address taken here: the C launch would also ask the driver about it.
            args = list(args)
            for position in pointers:
                args[position] = args[position].data_ptr()
        if self.descriptors:
            args = self._with_encoded_descriptors(args, direct.encoders)
        grid_x, grid_y, grid_z = self.grid
        stream = torch._C._cuda_getCurrentRawStream(self.device)
        # The C launch's arguments as the wrapper passes them: grid, stream, function, cooperative,
        # pdl, the two scratch buffers (none), packed metadata, launch metadata and the two hooks
        # (none: no hook is registered), then the kernel's parameters.
        direct.launch(
            grid_x, grid_y, grid_z, stream, direct.function, direct.cooperative, direct.pdl, None, None,
            direct.packed_metadata, None, None, None, *args, *self.constexprs,
        )  # fmt: skip

    def _with_encoded_descriptors(self, args: tuple, encoders: tuple) -> list:
        """args with each descriptor parameter expanded into what the C launch takes for it. The
        kernels take their descriptors first, side by side: no empty run of arguments between two
        is sliced (with seven descriptors, 1.9 against 1.1 us a launch on the CPU machine)."""
        expanded: list = []
        extend = expanded.extend
        start = 0
        for (position, _), encode in zip(self.descriptors, encoders):
            if position != start:
                extend(args[start:position])
            extend(encode(args[position]))
            start = position + 1
        extend(args[start:])
        return expanded

    def _with_descriptor_objects(self, args: tuple) -> list:
        """args with a tensor given for a descriptor parameter wrapped as Triton's wrapper wants it."""
        args = list(args)
        for position, block_shape in self.descriptors:
            if type(args[position]) is not TensorDescriptor:
                args[position] = TensorDescriptor.from_tensor(args[position], list(block_shape))
        return args


# A call trace takes kernels and their bound launches as constants (`call_traces`): they hold no
# tensor, and the key of a trace fixes which ones its calls reach.
register_constant_type(CachedKernel)
register_constant_type(BoundLaunch)


def tensor_key(tensor: torch.Tensor) -> tuple:
    """All of a tensor a launcher's decisions and Triton's specialization can depend on."""
    return (tensor.shape, tensor.stride(), tensor.dtype, tensor.get_device(), tensor.data_ptr() % 16 == 0)


class LaunchPlans(metaclass=VersionedSettings):
    """A launcher's launch plans: what it derived from its inputs' metadata (tiles, splits, grid,
    sizes, strides) and the `BoundLaunch` it made, by that metadata and the current CUDA device.

    A launcher looks its inputs up first and, on a hit, allocates its outputs and launches with the
    plan's numbers: its own arithmetic and `CachedKernel.key` are skipped. On the H200 machine those
    were most of a launch's host time (a fused o_proj step makes six launches and was host-bound).
    The key holds every tensor's shape, strides, dtype, device and 16-byte alignment, and the
    launcher's other inputs, so a hit is a call the launcher would have made identically.
    """

    # Distinct shapes seen (e.g. every sequence length of a run without packing); past this many the
    # plans are dropped and rebuilt as they recur, a miss costing one ordinary launch.
    MAX_PLANS = 4096
    # Under the interpreter no launch is bound (`CachedKernel.launch` returns None): nothing to plan.
    # One switch for every launcher, on the class; the slots make setting it on one instance an
    # error. Such an attribute would shadow the class's switch: pytest 9.1 restored one patched on
    # an instance as an instance attribute (pytest-dev/pytest#10644), and three GPU tests that turn
    # plans off on the class were then served plans (docs/gpu-results.md, twenty-fifth session).
    enabled = not TRITON_INTERPRET
    __slots__ = ("name", "plans")

    def __init__(self, name: str) -> None:
        self.name = name
        self.plans: dict[tuple, Any] = {}

    def serve(self, tensor: torch.Tensor) -> bool:
        """Whether an op body may look a plan up for a call on `tensor`: plans on, and a CUDA tensor
        (only those are launched outside the interpreter; CPU tensors run the reference, and a key
        asks for the current CUDA device, which a CPU-only torch does not have)."""
        return self.enabled and tensor.is_cuda

    def key(self, *inputs: Any) -> tuple:
        """The current CUDA device, then each input's `_key_part`: a plain tensor's `tensor_key` made
        here, without the calls (most inputs are tensors; about 30% of a ten-tensor key's host time)."""
        parts: list = [torch.cuda.current_device()]
        for item in inputs:
            if type(item) in PLAIN_TENSOR_TYPES:  # keyed inline (a subclass: `_key_part`)
                parts.append(
                    (item.shape, item.stride(), item.dtype, item.get_device(), item.data_ptr() % 16 == 0)
                )
            else:
                parts.append(_key_part(item))
        return tuple(parts)

    def get(self, key: tuple) -> Any:
        return self.plans.get(key)

    def add(self, key: tuple, plan: Any) -> None:
        if len(self.plans) >= self.MAX_PLANS:
            self.plans.clear()
        self.plans[key] = plan


# Launcher arguments taken into a key as they are (tested first: `isinstance(x, torch.Tensor)` on a
# non-tensor goes through torch's metaclass check).
_PLAIN_KEY_TYPES = frozenset({int, float, bool, str, type(None), torch.dtype})


class Transposed(NamedTuple):
    """A 2-D tensor that a plan's key takes as its transpose: the key part `tensor_key(tensor.t())`
    has, without the view. For a launcher that reads the transpose only through its address (the
    tensor's own) and the strides its plan holds, whose caller has the tensor: a plan's hit then
    launches with the tensor itself (a view op is about 1.5 us on the H200 machine's host)."""

    tensor: torch.Tensor


def _key_part(item: Any) -> Any:
    """A tensor by its metadata (any tensor type: a key must never hold, and keep alive, a tensor)."""
    if type(item) in _PLAIN_KEY_TYPES:
        return item
    if isinstance(item, torch.Tensor):
        return tensor_key(item)
    if type(item) is Transposed:
        tensor = item.tensor
        rows, columns = tensor.shape
        row_stride, column_stride = tensor.stride()
        return (
            torch.Size((columns, rows)), (column_stride, row_stride), tensor.dtype, tensor.get_device(),
            tensor.data_ptr() % 16 == 0,
        )  # fmt: skip
    return item


def empty_2d(
    rows: int, columns: int, dtype: torch.dtype, device: torch.device, column_major: bool = False
) -> torch.Tensor:
    """An uninitialized [rows, columns] tensor, row-major, or column-major (strides (1, rows): the
    token-major layout of a shrink's result, a K-major weight gradient), with the strides
    `torch.empty` and its transpose give. One `torch.empty_strided` call: `torch.empty` parses its
    overloads for about 0.6 us more on the CPU machine, and a `.T` after it is one more op (1.2 us)."""
    strides = (1, max(rows, 1)) if column_major else (max(columns, 1), 1)
    return torch.empty_strided((rows, columns), strides, dtype=dtype, device=device)


# Host-side launch arithmetic. Triton 3.6's `triton.cdiv` and `triton.next_power_of_2` are
# constexpr functions: called from Python each unwraps its arguments through a wrapper (cProfile
# counted ~38 such calls per fused o_proj step). Plain ints took the shrink launcher from 40 to 26us
# of host time on the H200 machine.
def cdiv(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def next_power_of_2(value: int) -> int:
    return value if value <= 1 else 1 << (value - 1).bit_length()
