"""Whether a dX's LoRA term is cheaper inside cuBLAS's reduction (K) dimension than added after it.

python -m benchmarks.augmented_k_probe

dX = g @ W + s * (g B) @ A. Today cuBLAS makes g @ W and our expand-add adds the term (a read and a
write of dX, `[tokens, in]`). The term is also one more slice of the GEMM's K dimension:
dX = [g | s g B] @ [W ; A], with K = out + r. That needs W with r rows of A under it (free where W
is written anyway: a 4-bit weight dequantized for this GEMM) and a copy of g with r columns beside
it (a read and a write of g, `[tokens, out]`): cheaper than a pass over dX where out < in (the MLP's
down projection: dh; a q/k/v group through its narrowest member).

Arms, microseconds (do_bench medians; bf16 base, rank per member 16, Llama-3.1-8B shapes; W_aug
prepared outside the timing, as the dequantization writes it): mm alone; `after`: mm, then the
expand-add (the path before); `augmented`: torch.cat of g and gB, then the mm over K = out + r;
`aug2`: the same with two copies; `mm_pad`/`aug_pad`: K padded to a multiple of 64 (zero rows and
columns), the mm alone and with the copies; `left_kernel`/`aug_kernel`: the library's
`lora_augmented_left` alone and with the padded mm (what `functions/augmented_k.py` runs).
"""

from __future__ import annotations

import torch
from triton.testing import do_bench

from fastlora_peft.kernels import lora_terms as lt
from fastlora_peft.kernels.lora_augment import lora_augmented_left


def _us(fn) -> float:
    return do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3


def probe(tokens: int, out_features: int, in_features: int, rank: int, adapter_dtype: torch.dtype) -> None:
    dev, bf16 = "cuda", torch.bfloat16
    grad = torch.randn(tokens, out_features, device=dev, dtype=bf16)
    weight = torch.randn(out_features, in_features, device=dev, dtype=bf16) / out_features**0.5
    lora_a = torch.randn(rank, in_features, device=dev, dtype=adapter_dtype) / in_features**0.5
    grad_xa = torch.randn(rank, tokens, device=dev, dtype=torch.float32).T  # token-major, as the shrink
    scale = 2.0
    grad_x = torch.empty(tokens, in_features, device=dev, dtype=bf16)
    weight_aug = torch.empty(out_features + rank, in_features, device=dev, dtype=bf16)
    weight_aug[:out_features].copy_(weight)
    torch.mul(lora_a, scale, out=weight_aug[out_features:])
    grad_aug = torch.empty(tokens, out_features + rank, device=dev, dtype=bf16)
    # K padded to a multiple of 64 (zero rows in W_aug, zero columns in g_aug, written once).
    padded = -(-(out_features + rank) // 64) * 64
    weight_pad = torch.zeros(padded, in_features, device=dev, dtype=bf16)
    weight_pad[: out_features + rank].copy_(weight_aug)
    grad_pad = torch.zeros(tokens, padded, device=dev, dtype=bf16)

    def after():
        torch.mm(grad, weight, out=grad_x)
        lt.lora_expand_add_(grad_x, grad_xa, lora_a.t(), scale)

    def augmented():
        torch.cat([grad, grad_xa], dim=1, out=grad_aug)
        torch.mm(grad_aug, weight_aug, out=grad_x)

    def copy_only():
        torch.cat([grad, grad_xa], dim=1, out=grad_aug)

    def two_copies():
        grad_aug[:, :out_features].copy_(grad)
        grad_aug[:, out_features:].copy_(grad_xa)

    def augmented_two_copies():
        two_copies()
        torch.mm(grad_aug, weight_aug, out=grad_x)

    def augmented_padded():
        grad_pad[:, :out_features].copy_(grad)
        grad_pad[:, out_features : out_features + rank].copy_(grad_xa)
        torch.mm(grad_pad, weight_pad, out=grad_x)

    def mm_padded():
        torch.mm(grad_pad, weight_pad, out=grad_x)

    # weight_pad's A rows carry the scale already (the library puts it on the left operand instead).
    def kernel_left():
        lora_augmented_left(grad, grad_xa, 1.0, padded)

    def augmented_kernel():  # what the library runs
        torch.mm(lora_augmented_left(grad, grad_xa, 1.0, padded), weight_pad, out=grad_x)

    def mm_only():
        torch.mm(grad, weight, out=grad_x)

    def tail_only():  # once per weight: s * A into W_aug's last rows
        torch.mul(lora_a, scale, out=weight_aug[out_features:])

    row = {
        name: _us(fn)
        for name, fn in [
            ("mm", mm_only),
            ("after", after),
            ("augmented", augmented),
            ("copy", copy_only),
            ("2copies", two_copies),
            ("aug2", augmented_two_copies),
            ("mm_pad", mm_padded),
            ("aug_pad", augmented_padded),
            ("left_kernel", kernel_left),
            ("aug_kernel", augmented_kernel),
            ("tail", tail_only),
        ]
    }
    after()
    reference = grad_x.float().clone()
    augmented()
    exact = (grad.double() @ weight.double()) + scale * (grad_xa.double() @ lora_a.double())
    err_after = ((reference.double() - exact).norm() / exact.norm()).item()
    err_aug = ((grad_x.double() - exact).norm() / exact.norm()).item()
    augmented_padded()
    err_pad = ((grad_x.double() - exact).norm() / exact.norm()).item()
    augmented_kernel()
    err_kernel = ((grad_x.double() - exact).norm() / exact.norm()).item()
    print(
        f"M={tokens:5d} out={out_features:5d} in={in_features:5d} r={rank:3d} {str(adapter_dtype)[6:]:8s} "
        + "  ".join(f"{name} {us:7.1f}" for name, us in row.items())
        + f"  saved by the kernel {row['after'] - row['aug_kernel']:6.1f}us"
        + f"  rel err after {err_after:.1e} aug {err_aug:.1e} padded {err_pad:.1e} kernel {err_kernel:.1e}",
        flush=True,
    )


def main() -> None:
    # (tokens, out, in, rank): the MLP's dh per chunk of 2048 rows (and 8192 unchunked, for scale), q/k/v
    # through k (out 1024, the group's three ranks), o_proj (out == in: no gain expected).
    shapes = [
        (2048, 4096, 14336, 16),
        (8192, 4096, 14336, 16),
        (8192, 1024, 4096, 48),
        (2048, 1024, 4096, 48),
        (8192, 4096, 4096, 16),
    ]
    for tokens, out_features, in_features, rank in shapes:
        for adapter_dtype in (torch.bfloat16, torch.float32):
            probe(tokens, out_features, in_features, rank, adapter_dtype)


if __name__ == "__main__":
    main()
