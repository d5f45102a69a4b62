"""How a block's step time drifts with how long the GPU has been busy (clocks under the power cap).

python -m benchmarks.sustained_load [--block mlp] [--adapters bf16] [--tokens 8192]

For the fused block and the floor: after a second of idle, the wall time per step of runs of 5, 20
and 100 steps, and the kernels' CUDA time per step of the same number of steps run right after,
under the profiler. On the H200 an 8192-token MLP step drew ~690 W, the machine's power cap: the SM
clock fell from 1980 to ~1450-1620 MHz within a fraction of a second (`nvidia-smi
--query-gpu=clocks.sm,power.draw,clocks_event_reasons.active --format=csv -lms 200` beside it shows
reason 0x4, the software power cap), so a longer timed loop reads a slower step, kernels included.
"""

from __future__ import annotations

import argparse
import time

import torch

from . import cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block", default="mlp", choices=cases.BLOCKS)
    parser.add_argument("--adapters", default="bf16", choices=tuple(cases.ADAPTER_DTYPES))
    parser.add_argument("--tokens", type=int, default=cases.LLAMA_8B.tokens, help="batch 1 of these")
    args = parser.parse_args()
    geo, device = cases.LLAMA_8B, torch.device("cuda")
    for provider in ("fastlora", "floor"):
        step = cases.one_layer_block_step(
            geo, args.block, provider, "bf16", args.adapters, args.tokens, device
        )

        def run(step=step) -> None:
            step.reset()
            step.backward(step.forward())

        for _ in range(5):
            run()
        for steps in (5, 20, 100, 5):
            time.sleep(1.0)  # let the clock recover
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(steps):
                run()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - start) / steps * 1e3
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    run()
                torch.cuda.synchronize()
            kernels = sum(event.self_device_time_total for event in prof.key_averages()) / steps / 1e3
            print(f"{provider:8} {steps:3d} steps after 1 s idle: wall {wall:.3f} ms/step; "
                  f"next {steps} profiled: kernels {kernels:.3f} ms/step", flush=True)  # fmt: skip
        del step
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
