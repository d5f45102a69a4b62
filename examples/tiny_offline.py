"""A tiny Llama built from its config (no downloads), adapted with FastLora, trained a few steps.

python examples/tiny_offline.py          (CPU: add TRITON_INTERPRET=1 to run the Triton kernels)
"""

from __future__ import annotations

import torch
from peft import get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from fastlora_peft import FastLoraConfig


def main(steps: int = 3) -> float:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128,
    )  # fmt: skip
    model = get_peft_model(
        LlamaForCausalLM(config), FastLoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
    )
    print(model.format_fastlora_report())
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    input_ids = torch.randint(0, config.vocab_size, (4, 16))
    loss = None
    for step in range(steps):
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step}: loss {loss.item():.4f}")
    return loss.item()


if __name__ == "__main__":
    main()
