"""Pure-torch reference for the LoRA term kernels in ``lora_terms.py``, ``lora_expand_add.py`` and
``lora_weight_grad.py``.

Same signatures and dtype contract as the public ops; every product and sum is done in fp32 and each
result is rounded once. The ops in ``lora_terms`` check their inputs and then run these on any CPU
call outside the Triton interpreter; the tests hold the kernels to them. The kernels' dots
(``dots.py``) round where a reference does not: tf32 terms, and with bf16 adapters the fp32 left
(the rank-r bottleneck) rounded to bf16 as PEFT's bf16 path rounds it; the tests bound each by the
error it is documented to add.
"""

from __future__ import annotations

import torch


def _wide(tensor: torch.Tensor) -> torch.Tensor:
    """fp32, or float64 for float64 inputs (gradcheck runs the references in float64)."""
    return tensor.double() if tensor.dtype == torch.float64 else tensor.float()


def lora_shrink(x: torch.Tensor, weight: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``scale * x @ weight.T`` in fp32. x: [M, K], weight: [R, K] -> [M, R] float32."""
    product = _wide(x) @ _wide(weight).T
    return product if scale == 1.0 else scale * product


def lora_shrink_keeping_weight_t(
    x: torch.Tensor, weight: torch.Tensor, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``lora_shrink(x, weight, scale)``, ``weight.T`` contiguous in weight's dtype: [K, R])."""
    return lora_shrink(x, weight, scale), weight.t().contiguous()


def lora_expand_add(
    base: torch.Tensor,
    left: torch.Tensor,
    right: torch.Tensor,
    scale: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``base + scale * left @ right.T`` in fp32, rounded once to out_dtype.

    base: [M, N], left: [M, R] float32, right: [N, R] -> [M, N] out_dtype.
    """
    return (_wide(base) + scale * (_wide(left) @ _wide(right).T)).to(out_dtype)


def lora_weight_grad(left: torch.Tensor, x: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale * left.T @ x`` reduced over M in fp32. left: [M, R] float32, x: [M, K] -> [R, K] float32."""
    return scale * (_wide(left).T @ _wide(x))
