"""What the LoRA-term kernels share: the dtypes their ops take, the rank tile, the SM count, and the
input checks of the op bodies (run unless a launch plan serves the call: lora_terms' `_PLANS_SKIP_CHECKS`).
"""

from __future__ import annotations

import functools

import torch

from fastlora_peft.kernels._launch import next_power_of_2

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# float64 is accepted for gradcheck only: it always runs the reference, in float64 (see _backend).
_CHECKED_DTYPES = (*_SUPPORTED_DTYPES, torch.float64)


def _rank_block(rank: int, cap: int) -> int:
    """Rank tile: a power of two >= 16 (tl.dot's minimum) covering ``rank``, at most ``cap``."""
    return min(max(16, next_power_of_2(rank)), cap)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # the interpreter runs programs one by one: no point splitting the work further


@functools.cache
def _programs_per_sm(device: torch.device, shared_bytes: int) -> int:
    """Programs of `shared_bytes` of shared memory each that one SM of `device` holds at once, by
    shared memory alone and at least 2 (what the token-split rules assumed before); 2 where torch does
    not report the SM's shared memory."""
    if device.type != "cuda":
        return 2
    per_sm = getattr(torch.cuda.get_device_properties(device), "shared_memory_per_multiprocessor", 0)
    return max(2, per_sm // max(shared_bytes, 1))


def one_wave_splits(programs: int, slots: int, most: int) -> int:
    """Splits of a launch of `programs` programs unsplit (each split multiplies them) that keep every
    program within one wave of the `slots` the SMs hold at once: at least one, at most `most`. A
    wave and a bit costs a second wave; one split fewer costs longer programs. The rule of the
    grouped weight gradients' token splits and of `lora_shrink`'s K splits with the split dot."""
    return max(1, min(slots // programs, most))


def _check_2d(op: str, name: str, tensor: torch.Tensor, layout: str) -> None:
    if tensor.dim() != 2:
        raise ValueError(f"{op}: {name} must be 2-D {layout}, got shape {list(tensor.shape)}")
    if tensor.dtype not in _CHECKED_DTYPES:
        raise ValueError(f"{op}: {name} must be float32, bfloat16 or float16, got {tensor.dtype}")


def _check_dim(
    op: str, name: str, tensor: torch.Tensor, layout: str, dim: int, expected: int, what: str
) -> None:
    if tensor.shape[dim] != expected:
        raise ValueError(
            f"{op}: {name} must be {layout} with {what}={expected}, got shape {list(tensor.shape)}"
        )


def _check_fp32(op: str, name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{op}: {name} must be float32 (the output of lora_shrink), got {tensor.dtype}")


def _check_devices(op: str, **tensors: torch.Tensor) -> None:
    first, *others = tensors.values()
    device = first.device
    for tensor in others:  # a loop: this runs on every op call
        if tensor.device == device:
            continue
        devices = {name: t.device for name, t in tensors.items()}
        raise ValueError(f"{op}: all inputs must be on one device, got {devices}")
