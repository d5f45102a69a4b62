"""Where a projection's LoRA term is best added on CUDA: after cuBLAS, or as its C input (beta = 1).

python -m benchmarks.epilogue_probe

(a) `out = x @ W.T` (cuBLAS), then `out += s * left @ right.T` in place (our expand-add kernel: one
    read and one write of out); (b) `out = s * left @ right.T` written by the expand kernel alone (no
    read), then `out.addmm_(x, W.T)` (cuBLAS reads out as C in its epilogue); (c) the mm alone.
Microseconds, do_bench medians, at Llama-3.1-8B block shapes.
"""

from __future__ import annotations

import torch
from triton.testing import do_bench

from fastlora_peft.kernels import lora_expand_add as expand_add_module


def _us(fn) -> float:
    return do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3


def probe(tokens: int, k: int, n: int, rank: int, adapter_dtype: torch.dtype) -> None:
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    left = torch.randn(tokens, rank, device="cuda", dtype=torch.float32)
    right = torch.randn(n, rank, device="cuda", dtype=adapter_dtype)
    out = torch.empty(tokens, n, device="cuda", dtype=torch.bfloat16)
    zero = torch.zeros((), device="cuda", dtype=torch.bfloat16).expand(tokens, n)

    def after():
        torch.mm(x, weight.t(), out=out)
        expand_add_module._lora_expand_add_triton(
            base=out, left=left, right=right, scale=0.5, out_dtype=out.dtype, out=out
        )

    def as_c():
        expand_add_module._lora_expand_add_triton(
            base=zero, left=left, right=right, scale=0.5, out_dtype=out.dtype, out=out
        )
        out.addmm_(x, weight.t())

    def expand_only():
        expand_add_module._lora_expand_add_triton(
            base=zero, left=left, right=right, scale=0.5, out_dtype=out.dtype, out=out
        )

    def mm_only():
        torch.mm(x, weight.t(), out=out)

    def addmm_only():
        out.addmm_(x, weight.t())

    row = {
        name: _us(fn)
        for name, fn in [
            ("mm", mm_only),
            ("addmm_", addmm_only),
            ("expand", expand_only),
            ("after", after),
            ("as_c", as_c),
        ]
    }
    # The two orders agree to bf16 rounding.
    after()
    reference = out.float().clone()
    as_c()
    diff = (out.float() - reference).abs().max().item() / reference.abs().max().item()
    print(
        f"M={tokens:5d} K={k:5d} N={n:5d} r={rank:3d} {str(adapter_dtype)[6:]:8s} "
        + "  ".join(f"{name} {us:7.1f}" for name, us in row.items())
        + f"  saved {row['after'] - row['as_c']:6.1f}us  max rel diff {diff:.1e}",
        flush=True,
    )


def main() -> None:
    for tokens in (8192, 2048):
        for k, n in ((4096, 4096), (4096, 14336), (14336, 4096), (4096, 1024)):
            for adapter_dtype in (torch.bfloat16, torch.float32):
                probe(tokens, k, n, 16, adapter_dtype)


if __name__ == "__main__":
    main()
