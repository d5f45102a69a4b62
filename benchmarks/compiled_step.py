"""The blocks and the training step eager and under torch.compile, beside the floor compiled alike.

python -m benchmarks.compiled_step [--case o|qkv|mlp|model] [--adapters fp32|bf16] [--base bf16|nf4]
                                   [--tokens N] [--modes eager,default,reduce-overhead] [--smoke]

The o_proj and QKV blocks are host-bound in eager mode (docs/benchmarks.md); a FastLora model traces
as one graph (tests/test_compile.py), so `mode="reduce-overhead"` (CUDA graphs) can take the host out.
Each mode compiles the floor's step the same way, and prints both and their ratio. `--smoke` runs
tiny shapes on the CPU with the `aot_eager` backend: it proves the script runs, not what it costs.
"""

from __future__ import annotations

import argparse

import torch
from torch._dynamo.utils import counters

from . import cases
from .harness import Clock, Step, time_side_by_side


def build_step(case: str, provider: str, args, geo: cases.Geometry, device: torch.device) -> Step:
    if case == "model":
        model = cases.build_llama(geo, layers=geo.layers, vocab=geo.vocab, base=args.base, device=device)
        model = cases.adapt(model, provider, args.adapters, geo.rank, geo.alpha)
        generator = torch.Generator(device=device).manual_seed(3)
        ids = torch.randint(0, geo.vocab, (geo.batch, geo.seq), generator=generator, device=device)
        return cases.model_step(model, ids, provider)
    return cases.one_layer_block_step(
        geo, case, provider, args.base, args.adapters, args.tokens or geo.tokens, device
    )


def compiled(step: Step, mode: str, smoke: bool) -> Step:
    if mode == "eager":
        return step
    options = {"backend": "aot_eager"} if smoke else {"mode": None if mode == "default" else mode}
    return Step(forward=torch.compile(step.forward, **options), backward=step.backward, reset=step.reset)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="o", choices=(*cases.BLOCKS, "model"))
    parser.add_argument("--base", default="bf16", choices=("bf16", "nf4"))
    parser.add_argument("--adapters", default="bf16", choices=tuple(cases.ADAPTER_DTYPES))
    parser.add_argument("--tokens", type=int, help="blocks: batch 1 of this many tokens (default 4 x 2048)")
    parser.add_argument("--modes", default="eager,default,reduce-overhead")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, aot_eager")
    args = parser.parse_args()

    geo = cases.SMOKE if args.smoke else cases.LLAMA_8B
    device = torch.device("cpu" if args.smoke else "cuda")
    repeats, warmup = (1, 2) if args.smoke else (args.repeats, 5)
    for mode in args.modes.split(","):
        torch._dynamo.reset()
        counters.clear()
        steps = {
            provider: compiled(build_step(args.case, provider, args, geo, device), mode, args.smoke)
            for provider in ("floor", "fastlora")
        }
        timings = time_side_by_side(steps, Clock(device), warmup=warmup, repeats=repeats, rounds=1)
        floor, fast = timings["floor"].step_ms, timings["fastlora"].step_ms
        # CUDA graphs that inductor skipped or re-recorded would leave the host in the step.
        inductor = {key: value for key, value in counters["inductor"].items() if "cudagraph" in key}
        print(
            f"{args.case} {args.base}/{args.adapters} {mode:16s} floor {floor:8.3f} ms  "
            f"fastlora {fast:8.3f} ms  x floor {fast / floor:5.2f}  {inductor or ''}",
            flush=True,
        )
        del steps
        cases.free_memory()


if __name__ == "__main__":
    main()
