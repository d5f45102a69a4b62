"""Host time of one call of each kernel op on tiny CUDA tensors: what a launch costs before any work.

python -m benchmarks.launch_overhead

Tiny shapes make the GPU work negligible, so the time per call is the host's: argument checks, the
op's Python, the launch. `fastlora_peft/kernels/_launch.py` cites what this printed on the H200
machine (a tiny `torch.mm` is the yardstick).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from fastlora_peft.kernels import lora_terms


def host_us(call: Callable[[], object], calls: int = 2000) -> float:
    for _ in range(50):
        call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


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
    for name, call in calls.items():
        print(f"{name:32s} host {host_us(call):6.1f} us/call")


if __name__ == "__main__":
    main()
