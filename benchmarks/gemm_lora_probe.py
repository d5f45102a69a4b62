"""Would a Triton GEMM with the LoRA term inside beat cuBLAS + lora_expand_add_ on the H200?

python -m benchmarks.gemm_lora_probe [--tokens 8192] [--rank 16]     # CUDA only

The fused path adds each projection's LoRA term to cuBLAS's output in a second kernel, one more read
and write of the [tokens, out] output: `lora_expand_add_`. At Llama-3.1-8B block shapes (bf16),
microseconds (do_bench medians) for:

* `cublas`: `torch.mm` alone, the floor's GEMM;
* `+expand`: `torch.mm`, then `lora_expand_add_` in place (the path without `lora_addmm`);
* `triton`: the library's `lora_addmm` kernel without the term (its GEMM against cuBLAS's);
* `+epi`: the term added to the fp32 accumulator after the K loop, before the one rounding;
* `+pro`: the term computed first, as the accumulator's start (what `lora_addmm` runs).

Each over 8 common Hopper tile configs, the fastest shown. Forward shapes compute `x @ W.T` (W [out,
in], read K-contiguous), dX shapes `dY @ W` (read N-contiguous). `fused/today` below 1.0 is where
`lora_addmm` pays off; `LoraAddmmSettings` (fastlora_peft.kernels.lora_addmm) holds the verdict.
Correctness of all three placements: `tests/test_lora_addmm.py`.
"""

from __future__ import annotations

import argparse
import itertools

import torch
from triton.runtime.errors import OutOfResources

from fastlora_peft.kernels import lora_terms as lt
from fastlora_peft.kernels.lora_addmm import LORA_AT, _lora_addmm_triton

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): common Hopper choices for bf16 tl.dot GEMMs.
CONFIGS = (
    (128, 256, 64, 8, 3),
    (256, 128, 64, 8, 3),
    (128, 128, 64, 4, 4),
    (128, 128, 64, 8, 4),
    (128, 256, 32, 8, 4),
    (64, 256, 64, 4, 4),
    (128, 256, 64, 8, 4),
    (128, 128, 64, 8, 5),
)


def _operands(tokens, k, n, rank, transposed_weight):
    """a [tokens, k], b [k, n] as the projection has it, left [tokens, r] fp32, right [n, r] bf16."""

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device="cuda", dtype=torch.float32).to(dtype)

    a = randn(tokens, k)
    # Forward: b = W.T with W [n, k] (K-contiguous); dX: b = W itself with W [k, n] (N-contiguous).
    b = randn(n, k).t() if transposed_weight else randn(k, n)
    b = b / k**0.5
    left = randn(tokens, rank, dtype=torch.float32)
    right = randn(n, rank) * 0.1
    return a, b, left, right


# (name, k, n, forward): the kernel's b is W.T for a forward, W for a dX.
CASES = (
    ("q/o fwd", 4096, 4096, True),
    ("k/v fwd", 4096, 1024, True),
    ("gate/up fwd", 4096, 14336, True),
    ("down fwd", 14336, 4096, True),
    ("q/o dX", 4096, 4096, False),
    ("gate/up dX", 14336, 4096, False),
    ("down dX", 4096, 14336, False),
)


def _us(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3


def bench_case(name: str, k: int, n: int, forward: bool, tokens: int, rank: int) -> None:
    a, b, left, right = _operands(tokens, k, n, rank, forward)
    out = torch.empty(tokens, n, dtype=torch.bfloat16, device="cuda")

    def cublas():
        torch.mm(a, b, out=out)

    def today():
        torch.mm(a, b, out=out)
        lt.lora_expand_add_(out, left, right, 0.5)

    cublas_us, today_us = _us(cublas), _us(today)
    today()
    reference = out.float().clone()
    timed = {}
    for config, lora_at in itertools.product(CONFIGS, LORA_AT):

        def fused(config=config, lora_at=lora_at):
            _lora_addmm_triton(
                a=a, b=b, left=left, right=right, scale=0.5, config=config, lora_at=lora_at, out=out
            )

        try:
            timed[config, lora_at] = _us(fused)
        except OutOfResources as error:  # shared memory, for this config
            print(f"  skip {config}: {type(error).__name__}")
    best_at = {}
    for at in LORA_AT:  # the fastest config for each place of the term
        best_at[at] = min(((c, t) for (c, w), t in timed.items() if w == at), key=lambda item: item[1])
    (best, where), fused_us = min(
        (((c, at), t) for at, (c, t) in best_at.items() if at != "none"), key=lambda item: item[1]
    )
    _lora_addmm_triton(a=a, b=b, left=left, right=right, scale=0.5, config=best, lora_at=where, out=out)
    err = ((out.float() - reference).norm() / reference.norm()).item()
    plain_us, epilogue_us, prologue_us = (best_at[at][1] for at in LORA_AT)
    times = " ".join(f"{t:8.1f}" for t in (cublas_us, today_us, plain_us, epilogue_us, prologue_us))
    ratio = fused_us / today_us
    print(f"{name:12} {times}  {ratio:10.3f}x  {where} {best} (rel. diff to today {err:.1e})", flush=True)


def bench(tokens: int, rank: int) -> None:
    torch.manual_seed(0)
    print(f"{tokens} tokens, rank {rank}, bf16; microseconds (do_bench medians)")
    head = ("case", "cublas", "+expand", "triton", "+epi", "+pro")
    print(f"{head[0]:12} " + " ".join(f"{h:>8}" for h in head[1:]) + "  fused/today  best")
    for name, k, n, forward in CASES:
        bench_case(name, k, n, forward, tokens, rank)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: timings need a GPU (tests/test_lora_addmm.py checks the kernel)")
    bench(args.tokens, args.rank)


if __name__ == "__main__":
    main()
