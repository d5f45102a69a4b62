"""Launch plans on and off in one process: each fused block's step, alternating, beside the floor.

python -m benchmarks.plans_ab [--tokens 8192] [--blocks o,qkv,mlp] [--bases bf16,nf4] [--adapters fp32]

The blocks the plans are for (o_proj, q/k/v) are host-bound, and their host time moves by tens of
percent between processes and machines, so a before/after of `LaunchPlans` is only readable inside
one process: the same fused model runs with `LaunchPlans.enabled` True ("plans") and False
("no_plans"), interleaved round by round with the floor by `harness.time_side_by_side`.
"""

from __future__ import annotations

import argparse

import torch

from fastlora_peft.kernels._launch import LaunchPlans

from . import cases
from .harness import Clock, Step, time_side_by_side


def with_plans(step: Step, enabled: bool) -> Step:
    """The same step, with launch plans switched on or off for its forward and backward."""

    def forward():
        LaunchPlans.enabled = enabled
        return step.forward()

    return Step(forward=forward, backward=step.backward, reset=step.reset)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--blocks", default="o,qkv,mlp")
    parser.add_argument("--bases", default="bf16")
    parser.add_argument("--adapters", default="fp32", choices=sorted(cases.ADAPTER_DTYPES))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (proves it runs)")
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    geo = cases.SMOKE if args.smoke else cases.LLAMA_8B
    default = LaunchPlans.enabled
    for base in args.bases.split(","):
        for block in args.blocks.split(","):
            layout = (base, args.adapters, args.tokens, device)
            floor = cases.one_layer_block_step(geo, block, "floor", *layout)
            fused = cases.one_layer_block_step(geo, block, "fastlora", *layout)
            steps = {"floor": floor, "plans": with_plans(fused, True), "no_plans": with_plans(fused, False)}
            timings = time_side_by_side(
                steps, Clock(device), warmup=5, repeats=args.repeats, rounds=args.rounds
            )
            LaunchPlans.enabled = default
            floor_ms = timings["floor"].step_ms
            columns = [
                f"{name} {t.step_ms:.3f} ms ({t.step_ms / floor_ms:.2f}x, spread {t.spread_pct:.0f}%)"
                for name, t in timings.items()
            ]
            print(f"{block:4s} {base} {args.tokens}: " + "  ".join(columns), flush=True)
            del floor, fused, steps
            cases.free_memory()


if __name__ == "__main__":
    main()
