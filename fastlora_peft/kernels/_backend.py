"""Which implementation a kernel op runs: the Triton kernel or its pure-torch reference.

One rule for every op in this package, so a test can tell which path ran:

* CUDA tensors always run the Triton kernels.
* CPU tensors run the Triton kernels only under ``TRITON_INTERPRET=1`` (the interpreter must be
  switched on before ``triton`` is imported, so the variable is read once, here, at import).
* Every other CPU call runs the pure-torch reference, which is what CI's plain CPU tests use.
* float64 tensors always run the reference, in float64: the kernels compute in fp32, and float64
  exists here only for `torch.autograd.gradcheck` of the autograd Functions.
"""

from __future__ import annotations

import os

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from ..call_traces import PLAIN_TENSOR_TYPES

TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Name of the torch.library namespace every kernel op of this package is registered under.
OP_NAMESPACE = "fastlora"


def skips_op_dispatch(*tensors) -> bool:
    """True for an eager call on plain tensors: run the op's body directly, not through torch.library.

    The library op's dispatch costs host time on every call (the dequant op: 56us through the op
    against 31us direct on the H200 machine), and a fused block makes about ten such calls, so a
    short step becomes host-bound. Under torch.compile, a dispatch mode (fake tensors, tracing) or
    a tensor subclass, the registered op runs, so compile and opcheck see it.
    """
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return False
    for tensor in tensors:  # a loop, not all(<generator>): this runs on every op call
        if tensor is not None and type(tensor) not in PLAIN_TENSOR_TYPES:
            return False
    return True


def runs_triton(tensor: torch.Tensor) -> bool:
    """True when an op given ``tensor`` runs its Triton kernel, False when it runs the reference."""
    if tensor.dtype == torch.float64:
        return False
    # is_cuda / is_cpu, not device.type: each `.device` builds a torch.device (about 1 us per op call).
    if tensor.is_cuda:
        return True
    return TRITON_INTERPRET and tensor.is_cpu


def _fix_interpreter_loop_bounds() -> None:
    """Let the Triton 3.6 interpreter run loops whose bounds are kernel arguments under numpy >= 2.4.

    The interpreter holds a scalar argument as a 1-element array and turns it into a Python int with
    ``int(array)``, which numpy 2.4 rejects ("only 0-dimensional arrays can be converted"), so every
    ``for k0 in range(0, K, BLOCK_K)`` fails (triton-lang/triton#9171). Wrap the patch that installs
    ``tl.tensor.__index__`` so it reads the one element instead. Interpreter only; GPUs never see it.
    """
    from triton.runtime import interpreter

    patch_lang_tensor = interpreter._patch_lang_tensor
    if getattr(patch_lang_tensor, "_fastlora_fixed", False):
        return

    def _patch_lang_tensor(tensor, scope):
        patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    _patch_lang_tensor._fastlora_fixed = True
    interpreter._patch_lang_tensor = _patch_lang_tensor


if TRITON_INTERPRET:
    _fix_interpreter_loop_bounds()
