"""The in-place variants (`lora_expand_add_`, `gated_act_backward_`) against their out-of-place ops."""

from __future__ import annotations

import pytest
import torch
from conftest import TRITON_INTERPRET, rel_err

from fastlora_peft.kernels import gated_act, lora_terms


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
def test_lora_expand_add_in_place(dtype, triton_launches):
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(37, 70, generator=generator).to(dtype)
    left = torch.randn(37, 5, generator=generator)
    right = torch.randn(5, 70, generator=generator).t()  # lora_a.T-like view
    expected = lora_terms.lora_expand_add(base, left, right, 0.75, dtype)
    buffer = base.clone()
    assert lora_terms.lora_expand_add_(buffer, left, right, 0.75) is buffer
    assert torch.equal(buffer, expected)
    if TRITON_INTERPRET:
        assert triton_launches["_lora_expand_add_kernel"] == 2


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gated_act_backward_in_place(activation, dtype):
    generator = torch.Generator().manual_seed(1)
    gate, up, grad_h = (torch.randn(37, 23, generator=generator).to(dtype) for _ in range(3))
    expected_gate, expected_up = gated_act.gated_act_backward(grad_h, gate, up, activation)
    gate_buffer, up_buffer = gate.clone(), up.clone()
    gated_act.gated_act_backward_(grad_h, gate_buffer, up_buffer, activation)
    assert rel_err(gate_buffer, expected_gate) == 0 and rel_err(up_buffer, expected_up) == 0


def test_in_place_ops_pass_opcheck():
    generator = torch.Generator().manual_seed(2)
    base = torch.randn(7, 9, generator=generator)
    left, right = torch.randn(7, 3, generator=generator), torch.randn(9, 3, generator=generator)
    torch.library.opcheck(lora_terms.lora_expand_add_inplace_op, (base, left, right, 0.5))
    gate, up, grad_h = (torch.randn(7, 9, generator=generator) for _ in range(3))
    torch.library.opcheck(gated_act._gated_act_backward_inplace_op, (grad_h, gate, up, "silu"))
