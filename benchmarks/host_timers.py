"""Inclusive host time per step of every function of the library, for the fused block steps.

python -m benchmarks.host_timers [--cases qkv:2048,mlp:2048,o:8192] [--base bf16] [--adapters fp32]
    [--steps 50] [--min-us 4] [--smoke]

Every function and method defined in `fastlora_peft` (and `torch.empty`, `torch.cat`,
`Tensor.contiguous`) is wrapped by a timer that adds its inclusive host time (perf_counter) and its
calls; each step runs on an empty queue (synchronized before, outside the timers), so no line waits
for the GPU. Printed per case: the step's host time without the timers (median), with them, and
each function's microseconds and calls per step, largest first. Nested functions are all counted,
so the lines overlap; each wrapped call adds the overhead printed at the top (0.3-0.7 us on the H200
machine's host), which inflates functions with many wrapped calls below them.

`torch.autograd.Function.backward` runs on autograd's worker thread; the backward's time outside the
Function's `backward` line is autograd's own (the engine, its thread hand-over, gradient
accumulation). A few tiny helpers (`_UNTIMED`) are left unwrapped: their calls would cost more than
their bodies. `--smoke` runs the CPU smoke shapes (tests/test_benchmark_tools.py); there the kernel
ops run their torch references.

Twenty-seventh session, H200 machine (docs/benchmarks.md, `session27/host_timers_d.log`): q/k/v at
2048 tokens, 1107 us of host time a step, spent about 260 us of its backward in autograd's own work,
147 us in six launches, 75 us in ten `torch.empty`.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import pkgutil
import statistics
import time
import types
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

import fastlora_peft

from . import cases

# Helpers called many times per step whose bodies cost about what a timer adds.
_UNTIMED = frozenset(
    {"module_attribute", "tensor_key", "_key_part", "cdiv", "next_power_of_2", "runs_triton"}
)
# Dunder methods stay as they are (construction, hashing, comparison, attribute access).
_TORCH_FUNCTIONS = ("empty", "cat")


class Timers:
    """Inclusive seconds and calls by name, counted only while `on`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.on = False

    def clear(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def wrap(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        seconds, calls = self.seconds, self.calls

        def timed(*args, **kwargs):
            if not self.on:
                return function(*args, **kwargs)
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                seconds[name] += time.perf_counter() - start
                calls[name] += 1

        timed.__name__ = getattr(function, "__name__", name)
        return timed


def _library_modules() -> list[types.ModuleType]:
    prefix = fastlora_peft.__name__ + "."
    return [
        importlib.import_module(info.name) for info in pkgutil.walk_packages(fastlora_peft.__path__, prefix)
    ]


def _short(module: types.ModuleType) -> str:
    return module.__name__.split(".", 1)[1]


@contextmanager
def timed_library(timers: Timers) -> Iterator[int]:
    """Inside: the library's functions and methods (and `_TORCH_FUNCTIONS`, `Tensor.contiguous`)
    replaced by `timers`' wrappers, in every module that holds them; everything is put back on exit.
    Yields how many functions were wrapped."""
    restore: list[tuple[Any, str, Any]] = []
    replaced: dict[Any, Callable[..., Any]] = {}
    modules = _library_modules()
    for module in modules:
        for name, value in list(vars(module).items()):
            if isinstance(value, types.FunctionType) and value.__module__ == module.__name__:
                if name not in _UNTIMED:
                    replaced[value] = timers.wrap(f"{_short(module)}.{name}", value)
            elif inspect.isclass(value) and value.__module__ == module.__name__:
                for attribute, member in list(vars(value).items()):
                    if attribute.startswith("__"):
                        continue
                    raw = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
                    if not isinstance(raw, types.FunctionType):
                        continue
                    wrapped = timers.wrap(f"{_short(module)}.{name}.{attribute}", raw)
                    kind = type(member) if isinstance(member, (staticmethod, classmethod)) else None
                    restore.append((value, attribute, member))
                    setattr(value, attribute, kind(wrapped) if kind else wrapped)
    # A function is found under every module that imported it: each of those names gets the wrapper.
    for module in modules:
        for name, value in list(vars(module).items()):
            if isinstance(value, types.FunctionType) and value in replaced:
                restore.append((module, name, value))
                setattr(module, name, replaced[value])
    for name in _TORCH_FUNCTIONS:
        restore.append((torch, name, getattr(torch, name)))
        setattr(torch, name, timers.wrap(f"torch.{name}", getattr(torch, name)))
    restore.append((torch.Tensor, "contiguous", torch.Tensor.contiguous))
    torch.Tensor.contiguous = timers.wrap("Tensor.contiguous", torch.Tensor.contiguous)
    try:
        yield len(restore)
    finally:
        for owner, name, value in reversed(restore):
            setattr(owner, name, value)


def timer_overhead_us(timers: Timers, calls: int = 10000) -> float:
    """Host time one wrapped call of an empty function adds, in us."""
    empty = timers.wrap("overhead", lambda: None)
    timers.on = True
    start = time.perf_counter()
    for _ in range(calls):
        empty()
    elapsed = time.perf_counter() - start
    timers.on = False
    timers.clear()
    return elapsed / calls * 1e6


def _run(step) -> None:
    step.reset()
    step.backward(step.forward())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cases.add_block_case_arguments(parser, "qkv:2048,mlp:2048,o:8192")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--min-us", type=float, default=4.0, help="leave out lines under this many us a step")
    parser.add_argument("--smoke", action="store_true", help="CPU smoke shapes")
    args = parser.parse_args()
    geo = cases.SMOKE if args.smoke else cases.LLAMA_8B
    device = torch.device("cpu" if args.smoke else "cuda")
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    timers = Timers()
    for block, tokens in cases.block_cases(args.cases):
        spec = f"{block}:{tokens}"
        step = cases.one_layer_block_step(geo, block, "fastlora", args.base, args.adapters, tokens, device)
        for _ in range(5):
            _run(step)
        plain = []
        for _ in range(args.steps):
            synchronize()
            start = time.perf_counter()
            _run(step)
            plain.append(time.perf_counter() - start)
        synchronize()
        with timed_library(timers) as wrapped:
            overhead = timer_overhead_us(timers)
            _run(step)  # the wrappers' first calls
            synchronize()
            timers.clear()
            forward = backward = 0.0
            for _ in range(args.steps):
                step.reset()
                synchronize()
                timers.on = True
                start = time.perf_counter()
                state = step.forward()
                middle = time.perf_counter()
                step.backward(state)
                end = time.perf_counter()
                timers.on = False
                del state
                synchronize()
                forward, backward = forward + middle - start, backward + end - middle
            per_step = {name: seconds / args.steps * 1e6 for name, seconds in timers.seconds.items()}
            calls = {name: count / args.steps for name, count in timers.calls.items()}
        steps = args.steps
        print(
            f"== {spec} {args.base} base, {args.adapters} adapters: host "
            f"{statistics.median(plain) * 1e6:.0f} us a step without timers (median of {steps}); with "
            f"them forward {forward / steps * 1e6:.0f} + backward {backward / steps * 1e6:.0f} us; "
            f"{sum(calls.values()):.0f} timed calls a step, {overhead:.2f} us each; {wrapped} names wrapped",
            flush=True,
        )
        for name, micros in sorted(per_step.items(), key=lambda item: -item[1]):
            if micros >= args.min_us:
                print(f"  {micros:8.1f} us  {calls[name]:5.1f}x  {name}")
        del step
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
