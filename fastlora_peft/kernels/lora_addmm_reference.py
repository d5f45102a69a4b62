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
