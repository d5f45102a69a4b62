"""How the TMA GEMMs' LoRA term walks the rank: ranks per tile and pipelining stages, timed.

python -m benchmarks.term_tiling_probe [--tokens 8192] [--ranks 16 64 128] [--smoke]

`lora_addmm`'s TMA kernels (one projection's, the q/k/v group's forward, the q/k/v sum's dX) start
every output tile with the LoRA term `scale * Left @ Right^T`, looped over the rank in tiles of
`term_tiling(R)` ranks (`BLOCK_R`), `RANK_STAGES` of them in flight (1: plain loads, each trip waiting
for its own). At rank 16 that is one trip; the q/k/v sum at rank 64 makes twelve (3 x 64 ranks), and
each trip's loads wait on memory in front of the K loop. This probe times every kernel at
Llama-3.1-8B shapes with each (BLOCK_R, RANK_STAGES) of `VARIANTS` in place of `term_tiling`'s, with
bf16 and fp32 adapters, and prints each variant's time and its error against the float64 sum.
`--smoke` runs tiny shapes under `TRITON_INTERPRET=1` on the CPU (correctness only:
tests/test_benchmark_tools.py).
"""

from __future__ import annotations

import argparse
import os
from contextlib import contextmanager
from typing import Callable

import torch

from benchmarks.harness import rel_err
from fastlora_peft.kernels import lora_addmm, lora_addmm_group, lora_addmm_sum

VARIANTS = ((16, 1), (16, 2), (16, 3), (16, 4), (32, 1), (32, 2), (32, 3), (64, 1))
_MODULES = (lora_addmm, lora_addmm_group, lora_addmm_sum)  # each binds `term_tiling` by name


@contextmanager
def tiling(rank_tile: int, rank_stages: int):
    """Every TMA launcher takes (rank_tile, rank_stages) for its term while inside."""
    saved = [module.term_tiling for module in _MODULES]
    for module in _MODULES:
        module.term_tiling = lambda ranks: (rank_tile, rank_stages)
    try:
        yield
    finally:
        for module, function in zip(_MODULES, saved):
            module.term_tiling = function


def cases(tokens: int, hidden: int, kv: int, inter: int, rank: int, right_dtype, device):
    """name -> (run, float64 truth): each TMA kernel at one Llama-shaped call, a fresh output per run."""
    bf16 = torch.bfloat16

    def randn(*shape, dtype=bf16, scale=1.0):
        return (torch.randn(*shape, device=device) * scale).to(dtype)

    x = randn(tokens, hidden)
    grads = [randn(tokens, n) for n in (hidden, kv, kv)]
    weights = [randn(n, hidden, scale=0.02) for n in (hidden, kv, kv)]  # [out, in] as stored
    found = {}

    # o_proj's dX: dY [M, out] @ W [out, in] + scale * (dY B) [M, r] @ A^T ([in, r] is A's transpose).
    # Lefts token-major, as the shrinks hand them over (the launchers copy them row-major from 64
    # ranks, `lora_addmm.copies_left`, and that copy is part of what the model runs).
    left = randn(rank, tokens, dtype=torch.float32).T
    right = randn(hidden, rank, dtype=right_dtype, scale=0.05)
    found["o dX"] = (
        lambda: lora_addmm._lora_addmm_tma_triton(
            a=grads[0],
            b=weights[0],
            left=left,
            right=right,
            scale=2.0,
            config=lora_addmm.tma_config(tokens, hidden, device),
        ),
        grads[0].double() @ weights[0].double() + 2.0 * left.double() @ right.double().T,
    )
    # o_proj's forward: x @ W^T (K-major) + scale * (x A) @ B^T.
    found["o fwd"] = (
        lambda: lora_addmm._lora_addmm_tma_triton(
            a=x,
            b=weights[0].t(),
            left=left,
            right=right,
            scale=2.0,
            config=lora_addmm.tma_config(tokens, hidden, device),
        ),
        x.double() @ weights[0].double().T + 2.0 * left.double() @ right.double().T,
    )
    # q/k/v dX summed: sum_i dY_i @ W_i + scale * [dY_q B_q, dY_k B_k, dY_v B_v] @ [A_q; A_k; A_v]^T.
    left3 = randn(3 * rank, tokens, dtype=torch.float32).T
    right3 = randn(hidden, 3 * rank, dtype=right_dtype, scale=0.05)
    found["qkv dX sum"] = (
        lambda: lora_addmm_sum._lora_addmm_sum_tma_triton(
            a=grads,
            b=weights,
            left=left3,
            right=right3,
            scale=2.0,
            config=lora_addmm.tma_config(tokens, hidden, device),
        ),
        sum(g.double() @ w.double() for g, w in zip(grads, weights))
        + 2.0 * left3.double() @ right3.double().T,
    )
    # q/k/v forward: x @ W_i^T + scale * (x A_i) @ B_i^T, the three (x A_i) columns of one xa.
    lefts = list(left3.split(rank, dim=1))
    rights = [randn(n, rank, dtype=right_dtype, scale=0.05) for n in (hidden, kv, kv)]
    found["qkv fwd group"] = (
        lambda: lora_addmm_group._lora_addmm_group_tma_triton(
            a=x,
            b=[w.t() for w in weights],
            left=lefts,
            right=rights,
            scale=[2.0] * 3,
            config=lora_addmm.tma_config(tokens, hidden + 2 * kv, device),
        ),
        torch.cat(
            [
                x.double() @ w.double().T + 2.0 * lf.double() @ r.double().T
                for w, lf, r in zip(weights, lefts, rights)
            ],
            dim=1,
        ),
    )
    # down's forward: h [M, inter] @ W_down^T + scale * (h A) @ B^T (K = inter).
    h = randn(tokens, inter)
    down = randn(hidden, inter, scale=0.01)
    found["down fwd"] = (
        lambda: lora_addmm._lora_addmm_tma_triton(
            a=h,
            b=down.t(),
            left=left,
            right=right,
            scale=2.0,
            config=lora_addmm.tma_config(tokens, hidden, device),
        ),
        h.double() @ down.double().T + 2.0 * left.double() @ right.double().T,
    )
    # down's dX (dh): dY [M, hidden] @ W_down [hidden, inter] + scale * (dY B) @ A^T ([inter, r]).
    right_inter = randn(inter, rank, dtype=right_dtype, scale=0.05)
    found["down dX"] = (
        lambda: lora_addmm._lora_addmm_tma_triton(
            a=grads[0],
            b=down,
            left=left,
            right=right_inter,
            scale=2.0,
            config=lora_addmm.tma_config(tokens, inter, device),
        ),
        grads[0].double() @ down.double() + 2.0 * left.double() @ right_inter.double().T,
    )
    return found


def _error(out, truth) -> float:
    if isinstance(out, (list, tuple)):
        out = torch.cat(list(out), dim=1)
    return rel_err(out, truth.to(out.device))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64, 128])
    parser.add_argument("--cases", nargs="+", default=None, help="names of `cases` to time (default all)")
    parser.add_argument("--variants", nargs="+", default=None, help="of VARIANTS, as 16x3 (default all)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes under the interpreter")
    args = parser.parse_args(argv)
    smoke = args.smoke
    if smoke and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--smoke runs under TRITON_INTERPRET=1")
    device = torch.device("cpu" if smoke else "cuda")
    tokens, hidden, kv, inter = (40, 64, 32, 96) if smoke else (args.tokens, 4096, 1024, 14336)
    ranks = [70] if smoke else args.ranks  # five rank tiles, the last ragged
    variants = [(16, 1), (16, 3)] if smoke else VARIANTS
    if args.variants:
        variants = [tuple(int(n) for n in v.split("x")) for v in args.variants]
    torch.manual_seed(0)
    bench: Callable
    if smoke:
        bench = lambda fn: float("nan")  # noqa: E731
    else:
        from triton.testing import do_bench

        bench = lambda fn: 1000 * do_bench(fn, warmup=25, rep=200)  # noqa: E731
    print(f"tokens {tokens}; us per call (do_bench median, L2 flushed), relative error vs float64")
    for right_dtype in (torch.bfloat16, torch.float32):
        for rank in ranks:
            found = cases(tokens, hidden, kv, inter, rank, right_dtype, device)
            for name, (run, truth) in found.items():
                if args.cases and name not in args.cases:
                    continue
                cells = []
                for rank_tile, rank_stages in variants:
                    with tiling(rank_tile, rank_stages):
                        try:
                            error = _error(run(), truth)
                            cells.append(f"{rank_tile}x{rank_stages} {bench(run):7.1f} ({error:.1e})")
                        except Exception as failure:  # noqa: BLE001 - a variant that cannot launch
                            cells.append(f"{rank_tile}x{rank_stages} {type(failure).__name__}")
                adapters = "bf16" if right_dtype == torch.bfloat16 else "fp32"
                print(f"{adapters} r{rank:<4d} {name:14s} | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
