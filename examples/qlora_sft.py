"""QLoRA supervised fine-tuning with TRL's SFTTrainer and fused FastLora adapters.

    python examples/qlora_sft.py --model meta-llama/Llama-3.1-8B --dataset trl-lib/Capybara --out out

Needs a CUDA GPU, the model and the data set (downloaded by transformers / datasets). Everything
except the config class is the usual PEFT + TRL recipe: the saved adapter loads back with
`PeftModel.from_pretrained` after `import fastlora_peft`, or converts to a plain LoRA folder.
"""

from __future__ import annotations

import argparse

import torch
from datasets import load_dataset
from peft import get_peft_model, prepare_model_for_kbit_training
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig
from trl import SFTConfig, SFTTrainer

from fastlora_peft import FastLoraConfig, to_plain_lora


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--out", default="out")
    parser.add_argument("--max-steps", type=int, default=100)
    args = parser.parse_args()

    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_use_double_quant=True,
    )
    model = AutoModelForCausalLM.from_pretrained(
        args.model, quantization_config=quantization, dtype=torch.bfloat16
    )
    model = prepare_model_for_kbit_training(model)
    model = get_peft_model(model, FastLoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    print(model.format_fastlora_report())  # every module fused, q/k/v and MLPs as single calls

    trainer = SFTTrainer(
        model=model,
        args=SFTConfig(output_dir=args.out, max_steps=args.max_steps, bf16=True, logging_steps=10),
        train_dataset=load_dataset(args.dataset, split="train"),
        processing_class=AutoTokenizer.from_pretrained(args.model),
    )
    trainer.train()
    model.save_pretrained(args.out)
    to_plain_lora(args.out, f"{args.out}-lora")  # for serving stacks that only know LoRA


if __name__ == "__main__":
    main()
