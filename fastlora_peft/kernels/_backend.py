"""Which implementation a kernel op runs: the Triton kernel or its pure-torch reference.

One rule for every op in this package, so a test can tell which path ran:

* CUDA tensors always run the Triton kernels.
* CPU tensors run the Triton kernels only under ``TRITON_INTERPRET=1`` (the interpreter must be
  switched on before ``triton`` is imported, so the variable is read once, here, at import).
* Every other CPU call runs the pure-torch reference, which is what CI's plain CPU tests use.
"""

from __future__ import annotations

import os

import torch

TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Name of the torch.library namespace every kernel op of this package is registered under.
OP_NAMESPACE = "fastlora"


def runs_triton(tensor: torch.Tensor) -> bool:
    """True when an op given ``tensor`` runs its Triton kernel, False when it runs the reference."""
    if tensor.device.type == "cuda":
        return True
    return tensor.device.type == "cpu" and TRITON_INTERPRET
