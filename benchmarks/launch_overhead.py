"""Host time of one call of each kernel op on tiny CUDA tensors: what a launch costs before any work.

python -m benchmarks.launch_overhead

Tiny shapes make the GPU work negligible, so the time per call is the host's: argument checks, the
op's Python, the launch. `fastlora_peft/kernels/_launch.py` cites what this printed on the H200
machine (a tiny `torch.mm` is the yardstick). Each op is also timed with its cache hits sent through
Triton's own Python launch wrapper instead of the C launch function (`_launch._DirectLaunch`).
"""

from __future__ import annotations

from typing import Callable

import torch

from fastlora_peft.kernels import _launch, lora_terms

from .harness import host_and_wall_us

launch_hooks_registered = _launch._launch_hooks_registered


def host_us(call: Callable[[], object]) -> float:
    return host_and_wall_us(call, calls=2000, rounds=1)[0]


def main() -> None:
    device = torch.device("cuda")
    x = torch.randn(64, 256, device=device, dtype=torch.bfloat16)
    lora_a = torch.randn(16, 256, device=device, dtype=torch.bfloat16)
    lora_a_fp32 = lora_a.float()
    base = torch.randn(64, 128, device=device, dtype=torch.bfloat16)
    left = torch.randn(64, 16, device=device)
    right = torch.randn(128, 16, device=device, dtype=torch.bfloat16)
    calls = {
        "torch.mm (yardstick)": lambda: x @ lora_a.t(),
        "lora_shrink": lambda: lora_terms.lora_shrink(x, lora_a),
        "lora_shrink, fp32 adapter": lambda: lora_terms.lora_shrink(x, lora_a_fp32),
        "lora_expand_add_ (in place)": lambda: lora_terms.lora_expand_add_(base, left, right, 2.0),
        "lora_weight_grad": lambda: lora_terms.lora_weight_grad(left, x, 2.0),
    }
    # The same calls with every cache hit sent through Triton's Python launch wrapper (what a
    # registered launch hook forces), measured alternately so both see the same machine state.
    with_wrapper = {}
    for _ in range(3):
        for name, call in calls.items():
            direct = host_us(call)
            _launch._launch_hooks_registered = lambda: True
            try:
                wrapped = host_us(call)
            finally:
                _launch._launch_hooks_registered = launch_hooks_registered
            best = with_wrapper.get(name, (float("inf"), float("inf")))
            with_wrapper[name] = (min(best[0], direct), min(best[1], wrapped))
    for name, (direct, wrapped) in with_wrapper.items():
        print(f"{name:32s} host {direct:6.1f} us/call  (through Triton's wrapper: {wrapped:6.1f})")


if __name__ == "__main__":
    main()
