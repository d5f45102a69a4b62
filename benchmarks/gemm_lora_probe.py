"""Would a Triton GEMM with the LoRA term in its epilogue beat cuBLAS + lora_expand_add_ on the H200?

python -m benchmarks.gemm_lora_probe                          # CUDA: the timings below
TRITON_INTERPRET=1 python -m benchmarks.gemm_lora_probe --check   # any machine: correctness only

The fused path adds each projection's LoRA term to cuBLAS's output in a second kernel, one more read
and write of the [tokens, out] output: `lora_expand_add_`, ~3% of the MLP step and more of o_proj's
and QKV's. Folding it into the GEMM's epilogue removes that pass but needs a GEMM as fast as cuBLAS.
This probe answers that before anything is wired in. At Llama-3.1-8B block shapes (8192 tokens,
r=16, bf16), microseconds (do_bench medians) for:

* `cublas`: `torch.mm` alone, the floor's GEMM;
* `cublas+expand`: `torch.mm`, then `lora_expand_add_` in place (what the fused path runs today);
* `triton`: the kernel below without the LoRA term (its GEMM alone against cuBLAS's), best config;
* `triton+lora`: the kernel with the term added to the fp32 accumulator before the one rounding.

Forward shapes compute `x @ W.T` (W [out, in], so the kernel's second operand is read K-contiguous);
dX shapes compute `dY @ W` (read N-contiguous). The epilogue reuses `lora_terms.expand_term`, the
rank loop of lora_expand_add's kernel, with its tf32 dots (16-bit adapters into a bf16 output).

Not wired into the library: if `triton+lora` does not beat `cublas+expand` here, the epilogue path
stays closed (docs/benchmarks.md keeps the verdict).
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton
import triton.language as tl

from fastlora_peft.kernels import lora_terms as lt
from fastlora_peft.kernels._backend import TRITON_INTERPRET
from fastlora_peft.kernels._launch import cdiv
from fastlora_peft.kernels.lora_terms import expand_term


@triton.jit
def _gemm_lora_kernel(
    A_ptr, B_ptr, Left_ptr, Right_ptr, Out_ptr,
    M, N, K, R, scale,
    stride_am, stride_ak, stride_bk, stride_bn, stride_lm, stride_lr, stride_rn, stride_rr,
    stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, WITH_LORA: tl.constexpr, FP32_DOT: tl.constexpr,
):  # fmt: skip
    """Out[M, N] = A[M, K] @ B[K, N] (+ scale * Left[M, R] @ Right[N, R]^T), rounded once."""
    # Programs walk GROUP_M row blocks per column block, so neighbours share B tiles in L2.
    pid = tl.program_id(0)
    blocks_m = tl.cdiv(M, BLOCK_M)
    blocks_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * blocks_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # Edge rows and columns load a valid row (wrapped) and are masked only at the store.
    rows = offs_m.to(tl.int64)
    a_ptrs = A_ptr + (rows % M)[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = B_ptr + offs_k[:, None] * stride_bk + (offs_n % N)[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            mask_k = offs_k + k0 < K
            a = tl.load(a_ptrs, mask=mask_k[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=mask_k[:, None], other=0.0)
        if FP32_DOT:  # the interpreter computes 16-bit dots wrongly; exact in fp32 either way
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if WITH_LORA:
        acc += scale * expand_term(
            Left_ptr, Right_ptr, rows, mask_m, offs_n, mask_n, R,
            stride_lm, stride_lr, stride_rn, stride_rr,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=BLOCK_R, DOT_PRECISION="tf32",
        )  # fmt: skip
    out_ptrs = Out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(Out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): common Hopper choices for bf16 tl.dot GEMMs.
CONFIGS = (
    (128, 256, 64, 8, 3),
    (256, 128, 64, 8, 3),
    (128, 128, 64, 4, 4),
    (128, 128, 64, 8, 4),
    (128, 256, 32, 8, 4),
    (64, 256, 64, 4, 4),
)


def gemm_lora(a, b, left, right, scale, out, config=(128, 256, 64, 8, 3), with_lora=True) -> torch.Tensor:
    """out = a @ b (+ scale * left @ right.T); a [M, K], b [K, N] any strides, out [M, N]."""
    block_m, block_n, block_k, warps, stages = config
    M, K = a.shape
    N = b.shape[1]
    R = right.shape[1]
    grid = (cdiv(M, block_m) * cdiv(N, block_n),)
    _gemm_lora_kernel[grid](
        a, b, left, right, out,
        M, N, K, R, float(scale),
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), left.stride(0), left.stride(1),
        right.stride(0), right.stride(1), out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_R=max(16, triton.next_power_of_2(R)),
        GROUP_M=8, EVEN_K=K % block_k == 0, WITH_LORA=with_lora, FP32_DOT=not a.is_cuda,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def _operands(tokens, k, n, rank, transposed_weight, device, generator=None):
    """a [tokens, k], b [k, n] as the projection has it, left [tokens, r] fp32, right [n, r] bf16."""

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=generator, device=device, dtype=torch.float32).to(dtype)

    a = randn(tokens, k)
    # Forward: b = W.T with W [n, k] (K-contiguous); dX: b = W itself with W [k, n] (N-contiguous).
    b = randn(n, k).t() if transposed_weight else randn(k, n)
    b = b / k**0.5
    left = randn(tokens, rank, dtype=torch.float32)
    right = randn(n, rank) * 0.1
    return a, b, left, right


def check() -> None:
    """Tiny odd shapes under the interpreter (or CUDA), both weight layouts, against float64."""
    generator = torch.Generator().manual_seed(0)
    device = "cuda" if torch.cuda.is_available() and not TRITON_INTERPRET else "cpu"
    for (tokens, k, n, rank), transposed in itertools.product(((37, 80, 72, 5), (64, 64, 33, 16)), (1, 0)):
        a, b, left, right = _operands(tokens, k, n, rank, transposed, device, generator)
        truth = a.double() @ b.double() + 0.5 * left.double() @ right.double().T
        out = torch.empty(tokens, n, dtype=torch.bfloat16, device=device)
        for config in ((32, 32, 32, 4, 1), (16, 64, 16, 4, 1)):
            gemm_lora(a, b, left, right, 0.5, out, config)
            err = ((out.double() - truth).norm() / truth.norm()).item()
            assert err < 8e-3, (tokens, k, n, rank, transposed, config, err)  # bf16 rounding: ~3e-3
            plain = gemm_lora(a, b, left, right, 0.5, out.clone(), config, with_lora=False)
            assert ((plain.double() - a.double() @ b.double()).norm() / truth.norm()).item() < 8e-3
        print(
            f"ok tokens={tokens} k={k} n={n} rank={rank} weight {'W.T' if transposed else 'W'}: err {err:.1e}"
        )


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
    a, b, left, right = _operands(tokens, k, n, rank, forward, "cuda")
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
    for config, with_lora in itertools.product(CONFIGS, (False, True)):

        def fused(config=config, with_lora=with_lora):
            gemm_lora(a, b, left, right, 0.5, out, config, with_lora)

        try:
            timed[config, with_lora] = _us(fused)
        except Exception as error:  # out of shared memory for this config on this GPU
            print(f"  skip {config}: {type(error).__name__}")
    plain = min(t for (_, with_lora), t in timed.items() if not with_lora)
    with_terms = [(config, t) for (config, with_lora), t in timed.items() if with_lora]
    best, fused_us = min(with_terms, key=lambda item: item[1])
    gemm_lora(a, b, left, right, 0.5, out, best)
    err = ((out.float() - reference).norm() / reference.norm()).item()
    print(f"{name:12} {cublas_us:8.1f} {today_us:8.1f} {plain:8.1f} {fused_us:8.1f}  "
          f"{fused_us / today_us:10.3f}x  {best} (rel. diff to today {err:.1e})", flush=True)  # fmt: skip


def bench(tokens: int, rank: int) -> None:
    torch.manual_seed(0)
    print(f"{tokens} tokens, rank {rank}, bf16; microseconds (do_bench medians)")
    print(f"{'case':12} {'cublas':>8} {'+expand':>8} {'triton':>8} {'+lora':>8}  fused/today  best config")
    for name, k, n, forward in CASES:
        bench_case(name, k, n, forward, tokens, rank)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="correctness on tiny shapes only")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    if args.check:
        check()
        return
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: timings need a GPU; --check runs the correctness part anywhere")
    bench(args.tokens, args.rank)


if __name__ == "__main__":
    main()
