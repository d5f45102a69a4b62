"""Profiles one fused o_proj and one QKV forward+backward at Llama-3.1-8B shapes on CUDA.

python -m benchmarks.profile_block      (prints the kernels by CUDA time, and host time per step)
"""

from __future__ import annotations

import time

import torch
from peft import get_peft_model
from torch import nn

from fastlora_peft import FastLoraConfig


class OneProjection(nn.Module):
    def __init__(self, proj):
        super().__init__()
        self.proj = proj

    def forward(self, x):
        return self.proj(x)


def main() -> None:
    torch.manual_seed(0)
    model = OneProjection(nn.Linear(4096, 4096, bias=False)).to("cuda", torch.bfloat16).requires_grad_(False)
    model = get_peft_model(model, FastLoraConfig(r=16, lora_alpha=32, target_modules=["proj"]))
    x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)

    def step():
        model(x).backward(grad)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        step()
    host = (time.perf_counter() - start) / 20
    torch.cuda.synchronize()
    total = (time.perf_counter() - start) / 20
    print(f"host time per step {host * 1e3:.3f} ms, wall per step {total * 1e3:.3f} ms")
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
    ) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))


if __name__ == "__main__":
    main()
