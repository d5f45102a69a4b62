"""Host time of a fused block's step on the CPU, every Triton launch stubbed: the CPU proxy.

python -m benchmarks.host_proxy [--blocks o,qkv,mlp] [--base bf16|nf4] [--adapters fp32|bf16]
    [--addmm hopper|always|never] [--no-traces] [--rounds 7] [--steps 50] [--ab SETTING=VALUE]
    [--cprofile N] [--smoke]

The o_proj, q/k/v and 2048-token blocks are bound by host time on the GPU machine, and a host change
worth a few microseconds is lost in that machine's run-to-run spread (docs/benchmarks.md). Here the
library runs as it would on an H200 except that no kernel runs: each kernel's launch goes through
the library's own path (launch plans, call traces, `BoundLaunch.launch` with its pointer and TMA
descriptor arguments) down to the C launch, which is a stub. The fused step's host time on this
machine is then the library's Python, its aten ops on tiny CPU tensors, and autograd. The tensors
are CPU tensors: what CUDA itself costs (allocations, real launches, descriptor encodes by the
driver) is not in these numbers, so they rank host changes rather than predict the GPU machine's
step. Since the thirty-first session this was `scratch_gpu/host_proxy.py`, untracked.

Models are built at `cases.SMOKE` (64 tokens, rank 16) and their groups verified before the stubs go
in. `--addmm hopper` decides `lora_addmm` as on an H200 at any row count (its "auto" mode with the
device check answering Hopper and `min_tokens` 0); "always"/"never" set `LoraAddmmSettings.mode`.
`--ab` times two arms in one process, the settings as they are and with one setting changed
(`module:Class.attribute=literal`, e.g. `fastlora_peft.call_traces:CallTraces.enabled=False`),
alternating every round and reversing their order every other round. `--smoke` (CI) checks that
the stubs are reached: every block launches, and every fused Function's call traces replay.
"""

from __future__ import annotations

import argparse
import ast
import cProfile
import importlib
import os
import pkgutil
import pstats
import statistics
import sys
import time
from typing import Any, Callable, NamedTuple

import torch

from . import cases

PROXY_TOKENS = 64


class _EveryKey(dict):
    """A CachedKernel's compiled kernels: every key answers (no kernel is compiled)."""

    def get(self, key: Any, default: Any = None) -> Any:
        return _COMPILED


_COMPILED = object()


class _DirectLaunches(dict):
    """A CachedKernel's direct launches, one per key, into the stub C launch: pointer positions and
    TMA descriptors read off the key (`_launch.CachedKernel.key`: the device, the constexprs, then
    one `_argument_key` per argument), as `_launch._direct_launch` reads them off the compiled kernel."""

    def __init__(self, launch: Callable[..., None]) -> None:
        super().__init__()
        self.launch = launch

    def get(self, key: Any, default: Any = None) -> Any:
        direct = dict.get(self, key)
        if direct is None:
            from triton.tools.tensor_descriptor import TensorDescriptor

            from fastlora_peft.kernels import _launch

            argument_keys = key[2:]
            pointers = tuple(
                i
                for i, arg in enumerate(argument_keys)
                if type(arg) is tuple and isinstance(arg[0], torch.dtype)
            )
            encoders = tuple(
                _launch.TmaEncoder(_ENCODER_META, _stub_descriptor, {10: 9})
                for arg in argument_keys
                if type(arg) is tuple and arg[0] is TensorDescriptor
            )
            direct = self[key] = _launch._DirectLaunch(self.launch, 1, False, False, None, encoders, pointers)
        return direct


_ENCODER_META = dict(swizzle=3, elem_size=2, elem_type=10, block_size=[16, 32], fp4_padded=False)


class LaunchCounter:
    """The stub C launch: counts calls; with `check`, also kernel arguments passed as tensors (the
    real launch takes pointers as addresses), at a cost that stays out of the timed runs."""

    def __init__(self, check: bool) -> None:
        self.calls = 0
        self.tensor_arguments = 0
        self.check = check

    def __call__(self, *args: Any) -> None:
        self.calls += 1
        if self.check:
            # The C launch's leading 13 arguments are grid, stream and metadata; then the kernel's.
            self.tensor_arguments += sum(type(arg) is torch.Tensor for arg in args[13:])


def _stub_descriptor(address, swizzle, elem_size, elem_type, block, shape, strides, padding):
    """Stands in for Triton's `fill_tma_descriptor` (a driver call on the GPU machine)."""
    return (
        "tma",
        address,
        swizzle,
        elem_size,
        elem_type,
        tuple(block),
        tuple(shape),
        tuple(strides),
        padding,
    )


def install_launch_stubs(counter: LaunchCounter, traces: bool) -> None:
    """Every `CachedKernel` of `fastlora_peft.kernels` answers with a direct launch into `counter`, and
    the launchers plan and launch for CPU tensors as for CUDA ones. Process-wide and for good: a
    benchmark process's state, never a test's."""
    from fastlora_peft import kernels
    from fastlora_peft.call_traces import CallTraces
    from fastlora_peft.kernels import _launch

    if traces:  # the traced replays, as on CUDA
        CallTraces.devices = frozenset({"cpu", "cuda"})
    _launch.LaunchPlans.enabled = True
    _launch.LaunchPlans.serve = lambda self, tensor: self.enabled
    torch.cuda.current_device = lambda: 0
    torch._C._cuda_getCurrentRawStream = lambda device: 0
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"{kernels.__name__}.{info.name}")
        if hasattr(module, "runs_triton"):
            # float64 keeps the reference (as on the GPU); everything else is "launched".
            module.runs_triton = lambda tensor: tensor.dtype != torch.float64
        for value in list(vars(module).values()):
            if isinstance(value, _launch.CachedKernel):
                value.compiled = _EveryKey()
                value.direct = _DirectLaunches(counter)


def set_addmm_mode(mode: str) -> None:
    from fastlora_peft.kernels import lora_addmm, lora_addmm_group, lora_addmm_sum
    from fastlora_peft.kernels.lora_addmm import LoraAddmmSettings

    if mode != "hopper":
        LoraAddmmSettings.mode = mode
        return

    def hopper_rows(tensor: torch.Tensor) -> bool:
        # The real rule's answer on an H200, with what it reads (`is_cuda`, the cached device check).
        return (
            not tensor.is_cuda
            and tensor.shape[0] >= LoraAddmmSettings.min_tokens
            and tensor.device is not None
        )

    LoraAddmmSettings.mode = "auto"
    LoraAddmmSettings.min_tokens = 0
    for module in (lora_addmm, lora_addmm_group, lora_addmm_sum):
        module._auto_device_and_rows = hopper_rows


class Setting(NamedTuple):
    """One settings attribute, `module:Class.attribute=literal`, and its value as it is."""

    owner: Any
    attribute: str
    value: Any
    original: Any

    @classmethod
    def parse(cls, spec: str) -> "Setting":
        path, _, literal = spec.partition("=")
        module_name, _, dotted = path.partition(":")
        if not literal or not dotted:
            raise SystemExit(f"--ab {spec!r}: expected module:Class.attribute=VALUE")
        owner = importlib.import_module(module_name)
        *parents, attribute = dotted.split(".")
        for parent in parents:
            owner = getattr(owner, parent)
        return cls(owner, attribute, ast.literal_eval(literal), getattr(owner, attribute))

    def apply(self, changed: bool) -> None:
        setattr(self.owner, self.attribute, self.value if changed else self.original)


def time_steps(run: Callable[[], None], steps: int) -> float:
    """Microseconds a step over `steps` back-to-back steps."""
    start = time.perf_counter()
    for _ in range(steps):
        run()
    return (time.perf_counter() - start) / steps * 1e6


def summary(times: list[float]) -> str:
    return f"best {min(times):6.1f}  median {statistics.median(times):6.1f} us/step"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", default="o,qkv,mlp")
    parser.add_argument("--base", default="bf16", choices=("bf16", "nf4"))
    parser.add_argument("--adapters", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--addmm", default="hopper", choices=("hopper", "always", "never"))
    parser.add_argument("--no-traces", action="store_true", help="call traces off (as on the CPU)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--ab", metavar="SETTING=VALUE", help="a second arm with this setting changed")
    parser.add_argument("--cprofile", type=int, metavar="N", help="profile each block, print N lines")
    parser.add_argument("--smoke", action="store_true", help="CI: 2 rounds of 3 steps, stubs checked")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("benchmarks.host_proxy: unset TRITON_INTERPRET (the proxy stubs the launches instead)")
    if args.smoke:
        args.rounds, args.steps, args.warmup = 2, 3, 3
    torch.set_num_threads(1)
    blocks = args.blocks.split(",")
    steps = {
        block: cases.one_layer_block_step(
            cases.SMOKE, block, "fastlora", args.base, args.adapters, PROXY_TOKENS, torch.device("cpu")
        )
        for block in blocks
    }
    counter = LaunchCounter(check=args.smoke)
    install_launch_stubs(counter, traces=not args.no_traces)
    set_addmm_mode(args.addmm)
    setting = Setting.parse(args.ab) if args.ab else None
    arms = (False, True) if setting else (False,)
    print(
        f"CPU proxy: {args.base} base, {args.adapters} adapters, lora_addmm {args.addmm}, traces "
        f"{'off' if args.no_traces else 'on'}, {PROXY_TOKENS} tokens, "
        f"{args.rounds} rounds x {args.steps} steps" + (f"; B = {args.ab}" if setting else ""),
        flush=True,
    )
    for block, step in steps.items():

        def run(step=step) -> None:
            step.reset()
            step.backward(step.forward())

        times: dict[bool, list[float]] = {arm: [] for arm in arms}
        launches: dict[bool, float] = {}
        for round_index in range(args.rounds):
            for arm in arms if round_index % 2 == 0 else arms[::-1]:
                if setting:
                    setting.apply(arm)
                time_steps(run, args.warmup if round_index < 2 else max(args.warmup // 6, 1))
                calls = counter.calls
                times[arm].append(time_steps(run, args.steps))
                launches[arm] = (counter.calls - calls) / args.steps
        if setting:
            setting.apply(False)
        for arm in arms:
            label = f"{block:>4s}{(' B' if arm else ' A') if setting else ''}"
            print(f"{label}: {summary(times[arm])}, {launches[arm]:.0f} launches a step", flush=True)
        if args.cprofile:
            profile = cProfile.Profile()
            profile.enable()
            time_steps(run, 4 * args.steps)
            profile.disable()
            pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(args.cprofile)
    if args.smoke:
        return _smoke_check(counter, blocks)
    return 0


def _smoke_check(counter: LaunchCounter, blocks: list[str]) -> int:
    """The stubs were reached, with addresses for pointers, and every fused Function's traces replay."""
    from fastlora_peft.functions import gated_mlp, shared_input

    traces = [shared_input._FORWARD_TRACES, shared_input._BACKWARD_TRACES]
    if "mlp" in blocks:
        traces += [gated_mlp._FORWARD_TRACES, gated_mlp._BACKWARD_TRACES]
    replaying = {t.name: any(entry.trace is not None for entry in t.entries.values()) for t in traces}
    print(f"smoke: {counter.calls} launches, {counter.tensor_arguments} tensors passed, traces {replaying}")
    ok = counter.calls > 0 and counter.tensor_arguments == 0 and all(replaying.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
