"""Profiles one block of the benchmark's Llama-3.1-8B layer on CUDA: kernels by CUDA time, host time.

python -m benchmarks.profile_block --block o --adapters fp32 [--provider fastlora] [--base bf16] [--cprofile]
    [--gaps] [--rank R]

`--gaps` lists where the GPU sits idle inside a step (wall time above the kernels' sum): for each
idle stretch, the kernel after it and the host op that launched that kernel.

The block, inputs and adapters are the blocks suite's (`benchmarks.cases`), so the numbers explain
its rows: host time per step against wall time per step tells whether the block is host-bound.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import os
import pstats
import tempfile
import time
from collections import defaultdict

import torch

from . import cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block", default="o", choices=cases.BLOCKS)
    parser.add_argument("--provider", default="fastlora", choices=cases.PROVIDERS)
    parser.add_argument("--base", default="bf16", choices=("bf16", "nf4"))
    parser.add_argument("--adapters", default="fp32", choices=tuple(cases.ADAPTER_DTYPES))
    parser.add_argument(
        "--tokens", type=int, default=cases.LLAMA_8B.tokens, help="batch 1 of this many tokens"
    )
    parser.add_argument("--rank", type=int, help="LoRA rank (alpha 2 x rank, as the sweep)")
    parser.add_argument("--cprofile", action="store_true", help="also print Python functions by own time")
    parser.add_argument("--cpu-ops", action="store_true", help="also print torch ops by host (CPU) time")
    parser.add_argument("--gaps", action="store_true", help="also list GPU idle stretches and their cause")
    parser.add_argument(
        "--sync-debug", action="store_true", help="warn on every host-device synchronization in one step"
    )
    args = parser.parse_args()

    geo, device = cases.LLAMA_8B, torch.device("cuda")
    if args.rank is not None:
        geo = dataclasses.replace(geo, rank=args.rank, alpha=geo.alpha * args.rank // geo.rank)
    step = cases.one_layer_block_step(
        geo, args.block, args.provider, args.base, args.adapters, args.tokens, device
    )

    def run() -> None:
        step.reset()
        step.backward(step.forward())

    for _ in range(5):
        run()
    torch.cuda.synchronize()
    if args.sync_debug:
        # A hidden synchronization makes the host wait for the GPU, so "host alone" below would
        # measure GPU time too; torch names each synchronizing call it sees (not Triton's).
        torch.cuda.set_sync_debug_mode("warn")
        run()
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        run()
    host = (time.perf_counter() - start) / 20
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / 20
    # Host time with an empty launch queue: back to back, a GPU-bound step blocks its host once the
    # queue is full, and "host" above then counts waiting too.
    alone = 0.0
    for _ in range(20):
        torch.cuda.synchronize()
        begin = time.perf_counter()
        run()
        alone += time.perf_counter() - begin
    print(f"{args.block} {args.base} {args.adapters} {args.provider} r={geo.rank} {args.tokens} tokens: "
          f"host {host * 1e3:.3f} ms/step, wall {wall * 1e3:.3f} ms/step, "
          f"host alone {alone / 20 * 1e3:.3f} ms/step")  # fmt: skip
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            run()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
    if args.cpu_ops:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                run()
            torch.cuda.synchronize()
        ops = prof.key_averages()
        print(ops.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=50))
    if args.gaps:
        print_gaps(run)
    if args.cprofile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(20):
            run()
        profiler.disable()
        torch.cuda.synchronize()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(40)


def print_gaps(run, steps: int = 3, min_gap_us: float = 5.0) -> None:
    """Idle GPU stretches over `steps` steps, grouped by the host op that launched the next kernel.

    Kernels are matched to their launching runtime call through the trace's correlation id, and the
    runtime call to the innermost host op around it on the same thread.
    """
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as file:
            events = json.load(file)["traceEvents"]
    complete = [e for e in events if e.get("ph") == "X"]
    gpu = sorted(
        (e for e in complete if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"]
    )
    launch_kinds = ("cuda_runtime", "cuda_driver")
    launches = {e["args"]["correlation"]: e for e in complete if e.get("cat") in launch_kinds}
    host_ops = defaultdict(list)
    for e in complete:
        if e.get("cat") in ("cpu_op", "python_function", "user_annotation"):
            host_ops[e["tid"]].append(e)

    def launching_op(kernel: dict) -> str:
        launch = launches.get(kernel["args"].get("correlation"))
        if launch is None:
            return "?"
        at = launch["ts"]
        around = [e for e in host_ops[launch["tid"]] if e["ts"] <= at < e["ts"] + e["dur"]]
        inner = min(around, key=lambda e: e["dur"], default=None)
        return f"{launch['name']} in {inner['name'] if inner else '-'}"

    busy = sum(e["dur"] for e in gpu)
    span = gpu[-1]["ts"] + gpu[-1]["dur"] - gpu[0]["ts"]
    by_cause: dict[str, list[float]] = defaultdict(list)
    for before, after in zip(gpu, gpu[1:]):
        idle = after["ts"] - (before["ts"] + before["dur"])
        if idle >= min_gap_us:
            by_cause[f"{after['name'][:60]} <- {launching_op(after)[:70]}"].append(idle)
    print(f"GPU span {span / steps / 1e3:.3f} ms/step, busy {busy / steps / 1e3:.3f}, "
          f"idle {(span - busy) / steps / 1e3:.3f}; stretches >= {min_gap_us:g} us, per step:")  # fmt: skip
    rows = sorted(by_cause.items(), key=lambda item: -sum(item[1]))
    for cause, gaps in rows[:25]:
        print(f"  {sum(gaps) / steps:8.1f} us  {len(gaps) / steps:5.1f}x  max {max(gaps):7.1f}  {cause}")


if __name__ == "__main__":
    main()
