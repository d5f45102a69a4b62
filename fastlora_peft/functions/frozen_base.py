"""The frozen half of a projection: a dense weight, or 4-bit bytes with their quantization state."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

import torch


class FrozenBase(NamedTuple):
    """What a fused Function needs of a base layer. Never receives a gradient except `bias` when trainable.

    weight: dense `[out_features, in_features]`, or bitsandbytes' packed 4-bit bytes.
    bias: `[out_features]` or None.
    quant: a `Quant4bitState` for 4-bit weights, None for dense ones.
    """

    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    quant: Optional[Any]


class LoraWeights(NamedTuple):
    """One adapter of one projection: out = base(x) + scale * (x @ lora_a.T) @ lora_b.T."""

    lora_a: torch.Tensor  # [r, in_features]
    lora_b: torch.Tensor  # [out_features, r]
    scale: float


def base_out_features(base: FrozenBase) -> int:
    if base.quant is None:
        return base.weight.shape[0]
    return base.quant.shape[0]


def materialize_weight(
    base: FrozenBase, dtype: torch.dtype, out: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """The base weight as a dense `[out, in]` tensor of `dtype` (4-bit: dequantized by our kernel).

    4-bit weights are dequantized to the dtype bitsandbytes would give (the state's dtype), then cast
    if the compute dtype differs, so the result is bit-identical to bitsandbytes' own path.
    out: None, or a contiguous `[out, in]` tensor of `dtype` starting at its storage's start (the
    first rows of a larger buffer) that receives the weight: a 4-bit one is dequantized straight into it.
    """
    if base.quant is None:
        weight = base.weight
    else:
        from ..kernels.dequant4bit import dequantize

        if out is not None and base.quant.dtype == dtype:
            return dequantize(base.quant, base.weight, dtype, out=out)
        weight = dequantize(base.quant, base.weight, base.quant.dtype)
    if out is not None:
        return out.copy_(weight)
    return weight if weight.dtype == dtype else weight.to(dtype)


def materialize_weights(bases: Sequence[FrozenBase], dtype: torch.dtype) -> list[torch.Tensor]:
    """`materialize_weight(base, dtype)` of every base, the same bits; a group's 4-bit weights that
    `dequant4bit_group.groups` takes (one model's q/k/v) from one launch instead of one each."""
    if dequantizes_as_group(bases):
        from ..kernels.dequant4bit_group import dequantize_group

        weights = dequantize_group([base.quant for base in bases], [base.weight for base in bases])
        return [weight if weight.dtype == dtype else weight.to(dtype) for weight in weights]
    return [materialize_weight(base, dtype) for base in bases]


def dequantizes_as_group(bases: Sequence[FrozenBase]) -> bool:
    """Whether `materialize_weights` dequantizes these bases with one launch."""
    if len(bases) < 2 or any(base.quant is None for base in bases):
        return False
    from ..kernels.dequant4bit_group import groups

    return groups([base.quant for base in bases])


def weight_is_materialized_fresh(base: FrozenBase, dtype: torch.dtype) -> bool:
    """Whether `materialize_weight(base, dtype)` writes a new tensor (4-bit, or another dtype) rather
    than handing out the stored weight: then writing it into a buffer of the caller's costs nothing more."""
    return base.quant is not None or base.weight.dtype != dtype
