"""The split bf16 dot against 3xTF32, per kernel at Llama-3.1-8B shapes on CUDA: time and accuracy.

python -m benchmarks.dot_modes_probe [--tokens 8192] [--rank 16]

Each LoRA kernel that multiplies a bf16 activation by an fp32 tile (fp32 adapters' shrinks, every
weight gradient, the gated backward's dA_down) runs once as `dots.dot_mode` now picks it
(SPLIT_DOT) and once forced back to FP32_DOT (3xTF32, the mode before); the expand-adds into bf16
(lora_expand_add, the gated forward) run with plain tf32 and with 3xTF32. Printed: do_bench medians
and the relative error against float64 of the same inputs (the gated kernels' times include two
clones of their [rows, I] inputs, both modes alike).
"""

from __future__ import annotations

import argparse
import contextlib
from functools import partial
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from fastlora_peft.kernels import dots, gated_act_lora, gated_act_lora_forward, lora_expand_add, lora_terms

BF16, FP32 = torch.bfloat16, torch.float32


def _bench(fn: Callable[[], object]) -> float:
    return do_bench(fn, warmup=5, rep=40) * 1e3  # microseconds


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


@contextlib.contextmanager
def forced_fp32_dots() -> Iterator[None]:
    """dot_mode gives FP32_DOT wherever it gave SPLIT_DOT, and expand terms take 3xTF32: the old rules."""

    def old_mode(activation, other):
        mode = dots.dot_mode(activation, other)
        return dots.FP32_DOT if mode == dots.SPLIT_DOT else mode

    modules = (lora_terms, gated_act_lora)
    saved = [module.dot_mode for module in modules]
    saved_expand = (lora_expand_add.expand_dot_precision, gated_act_lora_forward.expand_dot_precision)
    for module in modules:
        module.dot_mode = old_mode
    lora_expand_add.expand_dot_precision = gated_act_lora_forward.expand_dot_precision = lambda out_dtype: (
        dots.FP32_DOT_PRECISION
    )
    try:
        yield
    finally:
        for module, mode in zip(modules, saved):
            module.dot_mode = mode
        lora_expand_add.expand_dot_precision, gated_act_lora_forward.expand_dot_precision = saved_expand


def _compare(name: str, run: Callable[[], torch.Tensor], truth: torch.Tensor) -> None:
    new_us, new_err = _bench(run), _rel(run(), truth)
    with forced_fp32_dots():
        old_us, old_err = _bench(run), _rel(run(), truth)
    print(
        f"{name:44s} new {new_us:7.1f} us  err {new_err:.1e}   old {old_us:7.1f} us  err {old_err:.1e}"
        f"   new/old {new_us / old_us:5.2f}",
        flush=True,
    )


def _projection_kernels(tokens: int, k: int, rank: int) -> None:
    x = torch.randn(tokens, k, device="cuda", dtype=BF16)
    lora_a = torch.randn(rank, k, device="cuda", dtype=FP32) / k**0.5
    left = torch.randn(tokens, rank, device="cuda", dtype=FP32)
    truth = x.double() @ lora_a.double().T
    _compare(f"shrink x[{tokens},{k}] @ A fp32", partial(lora_terms.lora_shrink, x, lora_a), truth)
    _compare(
        f"weight_grad left.T @ x[{tokens},{k}]",
        partial(lora_terms.lora_weight_grad, left, x, 1.0),
        left.double().T @ x.double(),
    )
    base = torch.randn(tokens, k, device="cuda", dtype=BF16)
    right = torch.randn(k, rank, device="cuda", dtype=FP32) / rank**0.5
    _compare(
        f"expand_add into bf16 [{tokens},{k}], B fp32",
        partial(
            lora_expand_add._lora_expand_add_triton,
            base=base,
            left=left,
            right=right,
            scale=0.5,
            out_dtype=BF16,
        ),
        base.double() + 0.5 * left.double() @ right.double().T,
    )


def _gated_kernels(rows: int, inter: int, rank: int) -> None:
    gate = torch.randn(rows, inter, device="cuda", dtype=BF16)
    up = torch.randn(rows, inter, device="cuda", dtype=BF16)
    grad_h = torch.randn(rows, inter, device="cuda", dtype=BF16)
    left = torch.randn(rows, rank, device="cuda", dtype=FP32)
    h = (F.silu(gate.float()) * up.float()).to(BF16)

    def backward() -> torch.Tensor:
        gate_grad, up_grad = gate.clone(), up.clone()  # the kernel writes the gradients into them
        return gated_act_lora.gated_act_backward_weight_grad_(grad_h, gate_grad, up_grad, "silu", left, 1.0)

    _compare(f"gated backward + dA_down [{rows},{inter}]", backward, left.double().T @ h.double())
    right = torch.randn(inter, rank, device="cuda", dtype=FP32) / rank**0.5
    gate_truth = gate.double() + 0.5 * left.double() @ right.double().T

    def forward() -> torch.Tensor:
        return gated_act_lora_forward.gated_act_lora_forward_(
            gate.clone(), gate.clone(), "silu", left, right, 0.5, left, right, 0.5
        )

    _compare(f"gated forward, B fp32 [{rows},{inter}]", forward, F.silu(gate_truth) * gate_truth)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, {args.tokens} tokens, rank {args.rank}")
    for k in (4096, 14336):
        _projection_kernels(args.tokens, k, args.rank)
    _gated_kernels(min(args.tokens, 2048), 14336, args.rank)  # one chunk of the MLP


if __name__ == "__main__":
    main()
