"""The benchmark probes' own kernels compute what they claim, so a GPU verdict drawn from them holds."""

from __future__ import annotations

import pytest
import torch

from fastlora_peft.kernels._backend import TRITON_INTERPRET


@pytest.mark.skipif(
    not (TRITON_INTERPRET or torch.cuda.is_available()), reason="needs TRITON_INTERPRET=1 or CUDA"
)
def test_gemm_lora_probe_kernel_matches_float64():
    from benchmarks import gemm_lora_probe

    gemm_lora_probe.check()  # raises on a wrong product, a missing LoRA term or a wrong layout
