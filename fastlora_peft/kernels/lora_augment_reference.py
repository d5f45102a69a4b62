"""Pure-torch reference for ``lora_augment.py``: the same contract, the scaling in fp32."""

from __future__ import annotations

import torch


def lora_augmented_left(grad: torch.Tensor, grad_xa: torch.Tensor, scale: float, width: int) -> torch.Tensor:
    """``[grad | scale * grad_xa | 0]``: [M, width] of grad's dtype, contiguous.

    grad: [M, N]; grad_xa: [M, R] float32 (float64 under gradcheck); N + R <= width.
    """
    tokens, out_features = grad.shape
    rank = grad_xa.shape[1]
    out = grad.new_zeros((tokens, width))
    out[:, :out_features] = grad
    wide = torch.float64 if grad_xa.dtype == torch.float64 else torch.float32
    out[:, out_features : out_features + rank] = (scale * grad_xa.to(wide)).to(grad.dtype)
    return out
