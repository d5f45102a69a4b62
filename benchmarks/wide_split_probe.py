"""The split shrink with its three bf16 parts in one dot, against the library's three dots: a probe.

python -m benchmarks.wide_split_probe [--smoke]

With fp32 adapters on a bf16 base, `lora_shrink` multiplies the bf16 activation by an fp32 tile split
exactly into three bf16 parts, as three dots per K step (`kernels/dots.py`, SPLIT_DOT). Inside the
NF4 training step those shrinks took 0.47 ms per step more than bf16 adapters' native ones
(docs/benchmarks.md, "Sixteenth session"), while `do_bench`, which flushes L2, timed the two alike.
This probe's kernel lays the parts side by side in one `[BLOCK_K, 4 * BLOCK_R]` bf16 tile (high,
middle, low, zeros) and makes one dot per K step, so x's tile feeds one dot instead of three; the
accumulator keeps each part's sum apart and adds them once at the end. Same K splits (`split_sum`).

Printed per shape: the library's split shrink, the same shape with a bf16 weight (the native dot,
what the split should approach), and the probe's four fastest tiles, each timed three ways:
`do_bench` (L2 flushed), back to back (`--repeat` calls between two CUDA events), and right after a
write of x (as in training, where the op before wrote it; the write's own time subtracted), with
the probe's error against float64. `--smoke` runs tiny shapes under
`TRITON_INTERPRET=1` on the CPU (correctness only: tests/test_benchmark_tools.py).

Measured in the seventeenth session (docs/benchmarks.md, "Seventeenth session"): slower than the
library's three dots at 8192 x 4096 on every tile it tried and no faster for a 2048 x 14336 chunk
(29.7 against 31.3 us L2 flushed, 27.8 against 26.8 after a write of x), so not ported.
"""

from __future__ import annotations

import argparse
import itertools
import os
from typing import Callable

import torch
import triton
import triton.language as tl

from fastlora_peft.kernels import lora_terms
from fastlora_peft.kernels._launch import cdiv
from fastlora_peft.kernels.split_sum import split_scratch, split_total

_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def _wide_split_shrink_kernel(
    X_ptr, W_ptr, Out_ptr, Partial_ptr, Counter_ptr,
    M, K, R, k_per_split, n_splits, scale,
    stride_xm, stride_xk, stride_wr, stride_wk,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """Out[M, R] (token-major, fp32) = scale * X[M, K] (bf16) @ W[R, K]^T (fp32), W in three bf16 parts."""
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    # Column c of the wide tile: part c // BLOCK_R (0 high, 1 middle, 2 low, 3 zeros) of rank c % BLOCK_R.
    wide = tl.arange(0, 4 * BLOCK_R)
    part = wide // BLOCK_R
    rank = wide % BLOCK_R
    mask_w = (part < 3) & (rank < R)
    k_start = pid_s * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    x_ptrs = X_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + (k_start + offs_k)[None, :] * stride_xk
    w_ptrs = W_ptr + (k_start + offs_k)[:, None] * stride_wk + rank[None, :] * stride_wr
    acc = tl.zeros((BLOCK_M, 4 * BLOCK_R), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        mask_k = offs_k + k0 < k_end
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_w[None, :], other=0.0)  # each element 3 times (L1)
        high = w.to(tl.bfloat16)
        rest = w - high.to(tl.float32)
        middle = rest.to(tl.bfloat16)
        low = (rest - middle.to(tl.float32)).to(tl.bfloat16)
        parts = tl.where(part[None, :] == 0, high, tl.where(part[None, :] == 1, middle, low))
        if _INTERPRETED:  # the interpreter computes bf16 as integer bits: exact fp32 copies instead
            acc = tl.dot(x.to(tl.float32), parts.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, parts, acc)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    # Each part's sum over K apart until here; low + middle + high (the zeros' block adds nothing).
    total = tl.sum(tl.reshape(acc, (BLOCK_M, 4, BLOCK_R)), axis=1)
    offs_r = tl.arange(0, BLOCK_R)
    offsets = offs_m.to(tl.int64)[:, None] + offs_r[None, :] * M  # token-major [M, R]
    mask = mask_m[:, None] & (offs_r < R)[None, :]
    if SPLIT:
        is_last, summed = split_total(
            total, Partial_ptr, offsets, mask, pid_s, n_splits, M * R, Counter_ptr + pid_m
        )
        if is_last:
            tl.store(Out_ptr + offsets, scale * summed, mask=mask)
    else:
        tl.store(Out_ptr + offsets, scale * total, mask=mask)


def wide_split_shrink(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: float = 1.0,
    *,
    block_m: int = 64,
    block_k: int = 64,
    warps: int = 4,
    stages: int = 4,
    split: int | None = None,
) -> torch.Tensor:
    """scale * x @ weight.T as `lora_shrink` gives it (fp32, token-major), through the probe's kernel;
    K split like the library's shrink (about two programs per SM when row blocks are fewer than SMs)."""
    M, K = x.shape
    R = weight.shape[0]
    block_r = max(16, triton.next_power_of_2(R))
    row_blocks = cdiv(M, block_m)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 1
    if split is None:
        split = 1 if row_blocks >= sms else min(cdiv(2 * sms, row_blocks), cdiv(K, 4 * block_k))
    k_per_split = cdiv(cdiv(K, max(split, 1)), block_k) * block_k
    split = cdiv(K, k_per_split)
    out = torch.empty((R, M), dtype=torch.float32, device=x.device).T
    partial, counters = split_scratch(x.device, split * M * R, row_blocks) if split > 1 else (out, out)
    _wide_split_shrink_kernel[(row_blocks, split)](
        x, weight, out, partial, counters,
        M, K, R, k_per_split, split, float(scale),
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
        BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_R=block_r, SPLIT=split > 1,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def _events_us(fn: Callable[[], object], repeat: int) -> float:
    """Mean time of `repeat` back-to-back calls of `fn` between two CUDA events, microseconds."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat * 1e3


def _times(fn: Callable[[], object], x: torch.Tensor, repeat: int) -> tuple[float, float, float]:
    """(do_bench median with L2 flushed, back to back, right after x was written), microseconds.

    The last is as in training, where x (or dY) was just written by the op before: each call follows
    a copy into x, whose own time (timed alone the same way) is subtracted.
    """
    from triton.testing import do_bench

    source = x.clone()
    copy_us = _events_us(lambda: x.copy_(source), repeat)
    after_write = _events_us(lambda: (x.copy_(source), fn()), repeat) - copy_us
    return do_bench(fn, warmup=5, rep=30) * 1e3, _events_us(fn, repeat), after_write


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1"
    )
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()
    torch.manual_seed(0)
    device = torch.device("cpu" if args.smoke else "cuda")
    # (rows, K, rank, lora_B.T): the NF4 training step's split shrinks (docs/benchmarks/session16).
    shapes = [(37, 200, 5, False), (70, 96, 16, True)] if args.smoke else [
        (8192, 4096, 16, False), (8192, 4096, 16, True), (8192, 4096, 32, False), (2048, 14336, 16, False),
    ]  # fmt: skip
    smoke_configs = [dict(block_m=16, block_k=32, warps=4, stages=1, split=split) for split in (1, 3)]
    configs = smoke_configs if args.smoke else [
        dict(block_m=m, block_k=k, warps=w, stages=s)
        for m, k, w, s in itertools.product((64, 128), (64, 128), (4, 8), (3, 4))
    ]  # fmt: skip
    for rows, k, rank, transposed in shapes:
        x = torch.randn(rows, k, device=device).to(torch.bfloat16)
        weight = (
            torch.randn(k, rank, device=device).t() if transposed else torch.randn(rank, k, device=device)
        )
        truth = x.double() @ weight.double().T
        name = f"M={rows} K={k} R={rank}{' B.T' if transposed else ''}"
        library_error = _rel(lora_terms.lora_shrink(x, weight), truth)
        if args.smoke:
            for config in configs:
                error = _rel(wide_split_shrink(x, weight, **config), truth)
                print(f"{name} {config}: error {error:.1e} (library {library_error:.1e})", flush=True)
            continue
        time_shape(name, x, weight, truth, library_error, configs, args.repeat)


def time_shape(name, x, weight, truth, library_error, configs, repeat) -> None:
    split_us = _times(lambda: lora_terms.lora_shrink(x, weight), x, repeat)
    native_weight = weight.to(torch.bfloat16)
    native_us = _times(lambda: lora_terms.lora_shrink(x, native_weight), x, repeat)
    print(
        f"{name} (us: L2 flushed / back to back / after a write of x): library split "
        f"{' / '.join(f'{t:.1f}' for t in split_us)}, native bf16 weight "
        f"{' / '.join(f'{t:.1f}' for t in native_us)}, library error {library_error:.1e}",
        flush=True,
    )
    results = []
    for config in configs:
        try:
            error = _rel(wide_split_shrink(x, weight, **config), truth)
            times = _times(lambda config=config: wide_split_shrink(x, weight, **config), x, repeat)
        except Exception as failure:  # out of shared memory or registers for this config
            print(f"  skip {config}: {type(failure).__name__}", flush=True)
            continue
        results.append((times, error, config))
    for times, error, config in sorted(results, key=lambda item: item[0][2])[:4]:
        print(f"  wide {config}: {' / '.join(f'{t:.1f}' for t in times)}, error {error:.1e}", flush=True)


if __name__ == "__main__":
    main()
