"""Profiles one block of the benchmark's Llama-3.1-8B layer on CUDA: kernels by CUDA time, host time.

python -m benchmarks.profile_block --block o --adapters fp32 [--provider fastlora] [--base bf16] [--cprofile]

The block, inputs and adapters are the blocks suite's (`benchmarks.cases`), so the numbers explain
its rows: host time per step against wall time per step tells whether the block is host-bound.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

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
    parser.add_argument("--cprofile", action="store_true", help="also print Python functions by own time")
    parser.add_argument("--cpu-ops", action="store_true", help="also print torch ops by host (CPU) time")
    parser.add_argument(
        "--sync-debug", action="store_true", help="warn on every host-device synchronization in one step"
    )
    args = parser.parse_args()

    geo, device = cases.LLAMA_8B, torch.device("cuda")
    model = cases.build_llama(geo, layers=1, vocab=256, base=args.base, device=device)
    model = cases.adapt(model, args.provider, args.adapters, geo.rank, geo.alpha)
    layer = cases.decoder_layer(model)
    x, grad_outs = cases.block_inputs(geo, args.block, 1, args.tokens, device)
    step = cases.block_step(layer, args.block, x, grad_outs)

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
    print(f"{args.block} {args.base} {args.adapters} {args.provider} {args.tokens} tokens: "
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
    if args.cprofile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(20):
            run()
        profiler.disable()
        torch.cuda.synchronize()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    main()
