"""Training through the HF `Trainer` and TRL's `SFTTrainer`: the fused path runs, adapters learn."""

from __future__ import annotations

import pytest
import torch
from conftest import count_lora_sublayer_calls, tiny_llama
from peft import get_peft_model

from fastlora_peft import FastLoraConfig
from fastlora_peft.functions.gated_mlp import LoraGatedMlpFunction
from fastlora_peft.functions.shared_input import LoraSharedInputFunction

# Per forward of the one-layer model: q/k/v as one call, o_proj, and the whole MLP as one call.
CALLS_PER_FORWARD = {"LoraSharedInputFunction": 2, "LoraGatedMlpFunction": 1}


@pytest.fixture
def fused_calls(monkeypatch) -> dict[str, int]:
    """Counts forwards of each fused autograd Function (reset it after building the model)."""
    calls = dict.fromkeys(CALLS_PER_FORWARD, 0)
    for function in (LoraSharedInputFunction, LoraGatedMlpFunction):
        original = function.forward

        def counting(*args, _name=function.__name__, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(function, "forward", staticmethod(counting))
    return calls


def word_tokenizer():
    """A word-level tokenizer built in memory (no downloads), with a pad and an eos token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = "the a cat dog sat ran on mat log fast slow and".split()
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{word: index + 3 for index, word in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def lora_snapshot(model):
    return {name: param.detach().clone() for name, param in model.named_parameters() if "lora_" in name}


def assert_trained(model, before):
    changed = [
        name
        for name, param in model.named_parameters()
        if "lora_" in name and not torch.equal(param, before[name])
    ]
    assert len(changed) == len(before), f"only {len(changed)} of {len(before)} adapter tensors changed"


def test_hf_trainer_trains_through_the_fused_path(tmp_path, fused_calls):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    model = get_peft_model(tiny_llama(), FastLoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 61, (8, 6), generator=generator).tolist()
    dataset = Dataset.from_dict({"input_ids": ids, "labels": ids})
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-2,
        report_to=[], save_strategy="no", use_cpu=True, logging_steps=1,
    )  # fmt: skip
    before = lora_snapshot(model)
    fused_calls.update(dict.fromkeys(fused_calls, 0))
    with count_lora_sublayer_calls(model) as sublayer_calls:
        Trainer(model=model, args=args, train_dataset=dataset).train()
    assert not sublayer_calls
    assert fused_calls == {name: 2 * count for name, count in CALLS_PER_FORWARD.items()}  # two steps
    assert_trained(model, before)


def test_trl_sft_trainer_trains_through_the_fused_path(tmp_path, fused_calls):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    tokenizer = word_tokenizer()
    model = get_peft_model(
        tiny_llama(vocab_size=len(tokenizer), pad_token_id=0, eos_token_id=1, bos_token_id=1),
        FastLoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
    )
    texts = ["the cat sat on the mat", "a dog ran fast", "the dog sat on a log", "a cat ran slow and fast"]
    dataset = Dataset.from_dict({"text": texts * 2})
    args = SFTConfig(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-2,
        report_to=[], save_strategy="no", use_cpu=True, logging_steps=1, max_length=16,
    )  # fmt: skip
    before = lora_snapshot(model)
    fused_calls.update(dict.fromkeys(fused_calls, 0))
    with count_lora_sublayer_calls(model) as sublayer_calls:
        SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer).train()
    assert not sublayer_calls
    # TRL turns on gradient checkpointing by default: each step's forward runs again in backward.
    forwards_per_step = 2 if args.gradient_checkpointing else 1
    assert fused_calls == {name: 2 * count * forwards_per_step for name, count in CALLS_PER_FORWARD.items()}
    assert_trained(model, before)
