"""Whether a block's step is bound by its host or its GPU, from wall-clock numbers alone.

python -m benchmarks.host_vs_gpu [--cases mlp:2048,qkv:2048,o:8192] [--base bf16] [--adapters fp32]
    [--rounds 3] [--smoke]

For the floor and the fused block of each case (`block:tokens`, batch 1), medians over rounds of 10
steps each:

* events: forward and backward times from CUDA events around them, as the blocks suite times them;
* prefilled: the same events with a sleep kernel queued ahead of every step, so the GPU never waits
  for the host inside the step: the step's GPU time (kernels and the gaps their dependencies leave);
* host alone: host time of forward and of backward, each step started on an empty queue;
* back to back: host time per step without a synchronize, and wall time per step.

events over prefilled is what the host adds to the suite's number. Where events exceed prefilled,
the step is host-bound and only host time moves it; where they are equal, only GPU time does. On
the H200 machine (docs/benchmarks.md, twenty-sixth session) the 2048-token MLP read 2.414 ms
against 2.242 prefilled, q/k/v at 2048 tokens 1.881 against 0.370 (the probe this tool was made
from, `docs/benchmarks/session26/host_vs_gpu_probe.py.txt`; the tool itself has not run there yet).

`--smoke` runs the CPU smoke shapes: no CUDA events and no sleep kernel there, so it prints the host
columns only (tests/test_benchmark_tools.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Callable, NamedTuple

import torch

from . import cases
from .harness import Clock, Step, _time_iterations

# About 4 ms of sleep at the H200's clock: more than any case's host time per step, so the host
# never catches up with the GPU inside a step.
_PREFILL_CYCLES = 8_000_000


class Reading(NamedTuple):
    fwd_ms: float
    bwd_ms: float

    @property
    def step_ms(self) -> float:
        return self.fwd_ms + self.bwd_ms


def event_times(step: Step, repeats: int, clock: Clock, prefill_cycles: int = 0) -> Reading:
    """Median forward and backward times as the blocks suite takes them (`harness._time_iterations`),
    each step optionally behind a sleep kernel queued in its reset, just before its first event."""
    if prefill_cycles:
        reset = step.reset
        step = dataclasses.replace(step, reset=lambda: (reset(), torch.cuda._sleep(prefill_cycles)))
    times = _time_iterations(step, clock, repeats)
    return Reading(statistics.median(f for f, _ in times), statistics.median(b for _, b in times))


def host_alone(step: Step, repeats: int, synchronize: Callable[[], None]) -> Reading:
    """Median host time of forward and of backward, every step started on an empty queue."""
    forward, backward = [], []
    for _ in range(repeats):
        step.reset()
        synchronize()
        start = time.perf_counter()
        state = step.forward()
        middle = time.perf_counter()
        step.backward(state)
        end = time.perf_counter()
        del state
        forward.append(middle - start)
        backward.append(end - middle)
    return Reading(statistics.median(forward) * 1e3, statistics.median(backward) * 1e3)


def back_to_back(step: Step, repeats: int, synchronize: Callable[[], None]) -> tuple[float, float]:
    """(host, wall) ms per step over `repeats` steps with one synchronize at the end."""
    synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        step.reset()
        step.backward(step.forward())
    host = time.perf_counter() - start
    synchronize()
    wall = time.perf_counter() - start
    return host / repeats * 1e3, wall / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cases.add_block_case_arguments(parser, "mlp:2048,qkv:2048,o:8192,qkv:8192")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="CPU smoke shapes, host columns only")
    args = parser.parse_args()
    geo = cases.SMOKE if args.smoke else cases.LLAMA_8B
    device = torch.device("cpu" if args.smoke else "cuda")
    cuda = device.type == "cuda"
    clock = Clock(device)
    synchronize = torch.cuda.synchronize if cuda else (lambda: None)
    repeats = 2 if args.smoke else 10
    for block, tokens in cases.block_cases(args.cases):
        for provider in ("floor", "fastlora"):
            step = cases.one_layer_block_step(geo, block, provider, args.base, args.adapters, tokens, device)
            for _ in range(2 if args.smoke else 5):
                step.reset()
                step.backward(step.forward())
            synchronize()
            rounds = []
            for _ in range(args.rounds):
                events = event_times(step, repeats, clock) if cuda else None
                prefilled = event_times(step, repeats, clock, _PREFILL_CYCLES) if cuda else None
                rounds.append(
                    (
                        events,
                        prefilled,
                        host_alone(step, repeats, synchronize),
                        back_to_back(step, repeats, synchronize),
                    )
                )
            line = f"{block}:{tokens} {args.base} {args.adapters} {provider:8s}"
            if cuda:
                events = _median_reading([r[0] for r in rounds])
                prefilled = _median_reading([r[1] for r in rounds])
                line += f" | events {_fwd_bwd_step(events)} | prefilled {_fwd_bwd_step(prefilled)}"
            alone = _median_reading([r[2] for r in rounds])
            host = statistics.median(r[3][0] for r in rounds)
            wall = statistics.median(r[3][1] for r in rounds)
            line += (
                f" | host alone fwd {alone.fwd_ms:.3f} bwd {alone.bwd_ms:.3f}"
                f" | back to back host {host:.3f} wall {wall:.3f} ms"
            )
            print(line, flush=True)
            del step
            if cuda:
                torch.cuda.empty_cache()


def _fwd_bwd_step(reading: Reading) -> str:
    return f"fwd {reading.fwd_ms:.3f} bwd {reading.bwd_ms:.3f} step {reading.step_ms:.3f}"


def _median_reading(readings: list[Reading]) -> Reading:
    return Reading(
        statistics.median(r.fwd_ms for r in readings), statistics.median(r.bwd_ms for r in readings)
    )


if __name__ == "__main__":
    main()
