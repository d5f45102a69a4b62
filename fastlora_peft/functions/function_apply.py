"""A fused Function's call, without the Python wrapper's per-call work where that work does nothing.

`torch.autograd.Function.apply` (Python) binds default arguments when the Function defines
`setup_context` (ours do not) and, outside functorch transforms, rebuilds the argument tuple with any
"dead" functorch wrapper unwrapped (a tensor left over from a finished `vmap`/`grad`) before it calls
the C apply. That pass over every argument (a q/k/v group's 16, a gated MLP's 17) and the wrapper's
other work cost o_proj's and q/k/v's steps 4.5-6 us on the CPU proxy (fifty-seventh session), on host
time that bounds those blocks on the GPU machine. Our Functions call the C apply directly when
no transform is active, dynamo is not tracing (it recognises `Function.apply` by name and must see
it), and neither activation is a functorch wrapper (the other arguments are the modules' own
parameters and buffers; a dead wrapper among them would be a module built inside a finished
transform). Everything else goes through `Function.apply` as before.
"""

from __future__ import annotations

from typing import Any

import torch

_is_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_transforms_active = torch._C._are_functorch_transforms_active
# `_FunctionBase.apply` unbound: its `__get__(None, cls)` is the C apply for `cls` (what
# `super().apply` reaches inside `Function.apply`).
_C_APPLY = torch._C._FunctionBase.__dict__["apply"]


def direct_apply(function: type[torch.autograd.Function]):
    """`function`'s C apply, for `apply_function` (made once per Function class)."""
    if "setup_context" in vars(function):
        raise TypeError(f"{function.__name__} defines setup_context: its apply binds default arguments")
    return _C_APPLY.__get__(None, function)


def apply_function(function: type[torch.autograd.Function], c_apply, *args: Any):
    """`function.apply(*args)`; by `c_apply` (from `direct_apply(function)`) where the wrapper's work
    would do nothing (module docstring). The activations are args[0] (x) and args[1] where it is a
    tensor (the shared-input Function's x after dropout)."""
    second = args[1]
    if (
        torch.compiler.is_compiling()
        or _transforms_active()
        or _is_functorch_wrapped(args[0])
        or (isinstance(second, torch.Tensor) and _is_functorch_wrapped(second))
    ):
        return function.apply(*args)
    return c_apply(*args)
