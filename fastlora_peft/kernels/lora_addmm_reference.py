"""Pure-torch reference for ``lora_addmm.py``: the same contract, every product and sum in fp32."""

from __future__ import annotations

import torch

from fastlora_peft.kernels.lora_terms_reference import _wide


def lora_addmm(
    a: torch.Tensor, b: torch.Tensor, left: torch.Tensor, right: torch.Tensor, scale: float
) -> torch.Tensor:
    """``a @ b + scale * left @ right.T`` in fp32, rounded once to a's dtype.

    a: [M, K], b: [K, N] (one dtype), left: [M, R] float32, right: [N, R] -> [M, N] a's dtype.
    """
    return (_wide(a) @ _wide(b) + scale * (_wide(left) @ _wide(right).T)).to(a.dtype)


def lora_addmm_sum(
    a: list[torch.Tensor], b: list[torch.Tensor], left: torch.Tensor, right: torch.Tensor, scale: float
) -> torch.Tensor:
    """``sum_i a[i] @ b[i] + scale * left @ right.T`` in fp32, rounded once to a[0]'s dtype.

    a[i]: [M, K_i], b[i]: [K_i, N] (one dtype), left: [M, R] float32, right: [N, R] -> [M, N].
    """
    total = scale * (_wide(left) @ _wide(right).T)
    for a_i, b_i in zip(a, b):
        total = total + _wide(a_i) @ _wide(b_i)
    return total.to(a[0].dtype)
