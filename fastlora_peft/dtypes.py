"""The one place where the fused path decides its dtypes.

Contract (what PEFT returns for the same layout, made explicit):

* compute dtype: the dtype of the large base matmul's operands. The autocast dtype inside
  `torch.autocast`; otherwise the base weight's dtype (for bitsandbytes 4-bit layers, the layer's
  `compute_dtype`, which bitsandbytes itself sets from the first input when it is None).
* output dtype: dense layers return the autocast dtype inside autocast, else the input's dtype
  (`nn.Linear` needs input and weight to agree; when they do not, e.g. fp32 activations from
  norms upcast by `prepare_model_for_kbit_training` reaching a bf16 weight, PEFT's dense layer
  raises and we return the input's dtype, as bitsandbytes' 4-bit layer does). 4-bit layers always
  return the input's dtype, as bitsandbytes does.
* dX has the input's dtype; adapter gradients have the adapters' dtype and are accumulated in fp32
  by the kernels (fp32 adapters never see 16-bit-rounded gradients). The LoRA terms read x in its
  own dtype and convert in registers, so no fp32 copy of x is made. How the kernels multiply (the
  rank-r bottleneck kept fp32, or rounded to bf16 for bf16 adapters as PEFT's bf16 path rounds it)
  is decided in `kernels/dots.py`.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager, NamedTuple, Optional

import torch


class DtypePlan(NamedTuple):
    compute_dtype: torch.dtype  # operands of the base matmul: x is cast to it (only if it differs), W too
    out_dtype: torch.dtype  # the layer's output


def autocast_off(device_type: str) -> ContextManager:
    """Autocast switched off for `device_type` inside (the plans already hold every dtype), entered
    only when it is on: `torch.autocast(..., enabled=False)` costs host time on every call."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The autocast dtype in force for `device_type`, or None outside autocast."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def plan_projection_dtypes(
    x_dtype: torch.dtype, base_dtype: torch.dtype, *, quantized: bool, device_type: str
) -> DtypePlan:
    """Dtypes of one fused projection (or block of projections sharing an input).

    x_dtype: the activation's dtype; base_dtype: the dense weight's dtype, or a 4-bit layer's
    compute dtype; quantized: True for bitsandbytes 4-bit bases.
    """
    amp = autocast_dtype(device_type)
    compute_dtype = amp if amp is not None else base_dtype
    if quantized:
        return DtypePlan(compute_dtype, x_dtype)
    return DtypePlan(compute_dtype, amp if amp is not None else x_dtype)
