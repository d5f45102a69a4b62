"""Kernel time of a library switch on and off, the two arms interleaved step by step in one profile.

python -m benchmarks.kernel_ab [--switch augmented|plans|addmm|sum|group|wgrad|shrink|dequant|gated
    | --against-floor] [--block mlp] [--base nf4] [--adapters fp32] [--tokens 8192] [--steps 12]
    [--rows 25] [--smoke]

Profiling one arm after the other read the GEMMs a change did not touch 1-7% apart on the H200 (its
clock moves under load; docs/benchmarks.md, "Seventeenth session"), more than the change itself. Here
the arms alternate (A B B A A B ..., `harness.balanced_round_order`) inside one `torch.profiler`
session: each step runs under a `record_function` range that closes after a synchronize, and every
GPU activity (kernel, memcpy, memset) is credited to the step whose range holds its start (the
trace puts host and GPU events on one clock). Printed per kernel name: calls and microseconds per
step in each arm and their difference, largest first, then the totals and their ratio.

`--against-floor`: the arms are the frozen base alone (the blocks suite's floor, its own one-layer
model of the same geometry) and the fused block, so their kernel time per step is compared inside
one profile, as the block's time over the floor is, without the host.

`--smoke` runs the CPU smoke shapes and credits the host's aten ops instead of kernels: it proves the
attribution, not a timing (tests/test_benchmark_tools.py).
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import tempfile
from collections import defaultdict
from typing import Iterable, NamedTuple

import torch

from . import cases
from .harness import balanced_round_order, run_once
from .plans_ab import SWITCHES, library_defaults, with_switch

_RANGE_PREFIX = "kernel_ab:"
_GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


class Window(NamedTuple):
    arm: str
    start_us: float
    end_us: float


class Activity(NamedTuple):
    name: str
    start_us: float
    duration_us: float


def credit_to_arms(
    windows: list[Window], activities: Iterable[Activity]
) -> dict[str, dict[str, list[float]]]:
    """{arm: {name: [calls, microseconds]}}, each activity credited to the window holding its start;
    activities outside every window (warm-up leftovers, the profiler's own) are dropped."""
    windows = sorted(windows, key=lambda window: window.start_us)
    starts = [window.start_us for window in windows]
    credited: dict[str, dict[str, list[float]]] = {
        window.arm: defaultdict(lambda: [0, 0.0]) for window in windows
    }
    for activity in activities:
        index = bisect.bisect_right(starts, activity.start_us) - 1
        if index < 0 or activity.start_us > windows[index].end_us:
            continue
        entry = credited[windows[index].arm][activity.name]
        entry[0] += 1
        entry[1] += activity.duration_us
    return credited


def _trace_events(prof) -> list[dict]:
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as file:
            return [event for event in json.load(file)["traceEvents"] if event.get("ph") == "X"]


def windows_and_activities(events: list[dict], on_gpu: bool) -> tuple[list[Window], list[Activity]]:
    """The steps' ranges (host `user_annotation` events named `kernel_ab:<arm>:<i>`) and what to credit:
    GPU activities, or on the CPU the aten ops (nested ones each counted: a check of the attribution)."""
    windows = [
        Window(event["name"][len(_RANGE_PREFIX) :].rsplit(":", 1)[0], event["ts"], event["ts"] + event["dur"])
        for event in events
        if event.get("cat") == "user_annotation" and event["name"].startswith(_RANGE_PREFIX)
    ]
    if on_gpu:
        chosen = [event for event in events if event.get("cat") in _GPU_CATEGORIES]
    else:
        chosen = [e for e in events if e.get("cat") == "cpu_op" and e["name"].startswith("aten::")]
    return windows, [Activity(event["name"], event["ts"], event["dur"]) for event in chosen]


def report(credited: dict[str, dict[str, list[float]]], steps_per_arm: dict[str, int], rows: int = 25) -> str:
    """Per name: calls and us per step in each arm, and the difference (second arm minus first)."""
    first, second = list(credited)
    names = set(credited[first]) | set(credited[second])

    def per_step(arm: str, name: str) -> tuple[float, float]:
        calls, micros = credited[arm].get(name, (0, 0.0))
        return calls / steps_per_arm[arm], micros / steps_per_arm[arm]

    table = []
    for name in names:
        (calls_a, us_a), (calls_b, us_b) = per_step(first, name), per_step(second, name)
        table.append((us_b - us_a, name, calls_a, us_a, calls_b, us_b))
    table.sort(key=lambda row: -abs(row[0]))
    lines = [f"{'us/step ' + first:>22s} {'us/step ' + second:>22s} {'diff':>9s}  name (calls per step)"]
    for diff, name, calls_a, us_a, calls_b, us_b in table[:rows]:
        lines.append(
            f"{us_a:12.1f} ({calls_a:4.1f}x) {us_b:12.1f} ({calls_b:4.1f}x) {diff:+9.1f}  {name[:70]}"
        )
    total_a = sum(row[3] for row in table)
    total_b = sum(row[5] for row in table)
    lines.append(f"{total_a:20.1f} {total_b:22.1f} {total_b - total_a:+9.1f}  total")
    if total_a > 0:
        lines.append(f"{second} / {first}: {total_b / total_a:.3f}")
    return "\n".join(lines)


def against_floor_arms(geo, block: str, base: str, adapters: str, tokens: int, device) -> dict:
    """`--against-floor`'s arms: the frozen base alone and the fused block, each its own one-layer model."""
    return {
        "floor": cases.one_layer_block_step(geo, block, "floor", base, adapters, tokens, device),
        "fastlora": cases.one_layer_block_step(geo, block, "fastlora", base, adapters, tokens, device),
    }


def profile_arms(arms: dict, steps: int, device: torch.device) -> tuple[dict, dict[str, int]]:
    """Warms each arm up, then runs `steps` steps of each, interleaved, inside one profile: returns
    (`credit_to_arms`' {arm: {name: [calls, us]}}, steps per arm)."""
    for step in arms.values():
        for _ in range(3):
            run_once(step)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    steps_per_arm = dict.fromkeys(arms, 0)
    with torch.profiler.profile(activities=activities) as prof:
        for index in range(steps):
            for arm in balanced_round_order(list(arms), index):
                with torch.profiler.record_function(f"{_RANGE_PREFIX}{arm}:{index}"):
                    run_once(arms[arm])
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                steps_per_arm[arm] += 1
    windows, credited_events = windows_and_activities(_trace_events(prof), device.type == "cuda")
    return credit_to_arms(windows, credited_events), steps_per_arm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--switch", default="augmented", choices=sorted(SWITCHES))
    parser.add_argument(
        "--against-floor", action="store_true", help="arms: the floor and the fused block (no switch)"
    )
    parser.add_argument("--block", default="mlp", choices=cases.BLOCKS)
    parser.add_argument("--base", default="nf4", choices=("bf16", "nf4"))
    parser.add_argument("--adapters", default="fp32", choices=sorted(cases.ADAPTER_DTYPES))
    parser.add_argument("--tokens", type=int, default=None, help="default: the geometry's batch x seq")
    parser.add_argument("--steps", type=int, default=12, help="profiled steps per arm")
    parser.add_argument("--rows", type=int, default=25, help="names printed, largest difference first")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (proves it runs)")
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    geo = cases.SMOKE if args.smoke else cases.LLAMA_8B
    tokens = args.tokens or geo.tokens
    switch = SWITCHES[args.switch]
    restore_defaults = library_defaults()
    if args.against_floor:
        arms = against_floor_arms(geo, args.block, args.base, args.adapters, tokens, device)
    else:
        fused = cases.one_layer_block_step(
            geo, args.block, "fastlora", args.base, args.adapters, tokens, device
        )
        arms = {
            args.switch: with_switch(fused, switch, True),
            f"no_{args.switch}": with_switch(fused, switch, False),
        }
    try:
        credited, steps_per_arm = profile_arms(arms, args.steps, device)
    finally:
        restore_defaults()
    print(
        f"{args.block} {args.base} {args.adapters} {tokens} tokens, {args.steps} steps per arm, interleaved:"
    )
    print(report(credited, steps_per_arm, args.rows))


if __name__ == "__main__":
    main()
