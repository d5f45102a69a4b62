"""The models, blocks and steps the benchmarks time: one small setup per case, no timing code.

Every block comes out of a real `transformers.LlamaForCausalLM` built from a config (no download), so
PEFT and fastlora_peft adapt it the way they adapt a user's model (fastlora_peft's block grouping
included). Providers:

* floor: the frozen base alone, x requiring grad, so forward and dX are computed: what any LoRA pays;
* peft: `peft.LoraConfig`;
* fastlora: `fastlora_peft.FastLoraConfig` with the same fields.

Adapters "fp32" are PEFT's default (`autocast_adapter_dtype=True` on a bf16 base); "bf16" keep the
base's dtype. lora_B is random, not PEFT's zeros (zeros can run faster and hide wrong results).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn

from fastlora_peft import FastLoraConfig
from fastlora_peft.blocks import SharedInputGroup

from .harness import Step, rel_err

PROVIDERS = ("floor", "peft", "fastlora")
BLOCKS = ("o", "qkv", "mlp")
LINEAR_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTER_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Geometry:
    """Model shapes and the sizes each suite runs at."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int  # e2e model only; block models use a tiny vocabulary (their embeddings are never run)
    layers: int  # e2e model
    batch: int  # blocks and e2e: batch x seq tokens
    seq: int
    rank: int
    alpha: int
    sweep_tokens: tuple[int, ...]  # batch 1
    sweep_ranks: tuple[int, ...]
    sweep_rank_tokens: int

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


# Llama-3.1-8B: the shapes of GPU.md's anchors and targets.
LLAMA_8B = Geometry(
    hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128, vocab=32000, layers=4,
    batch=4, seq=2048, rank=16, alpha=32,
    sweep_tokens=(512, 1024, 2048, 8192, 32768), sweep_ranks=(8, 16, 64, 128), sweep_rank_tokens=8192,
)  # fmt: skip
# CPU smoke test: bitsandbytes' CPU quantizer wants feature sizes that are multiples of 64.
SMOKE = Geometry(
    hidden=128, intermediate=192, heads=4, kv_heads=2, head_dim=32, vocab=256, layers=2,
    batch=2, seq=32, rank=16, alpha=32,
    sweep_tokens=(32, 64), sweep_ranks=(8, 16), sweep_rank_tokens=64,
)  # fmt: skip


def build_llama(geo: Geometry, *, layers: int, vocab: int, base: str, device: torch.device, seed: int = 0):
    """A bf16 `LlamaForCausalLM` with random weights, frozen, in train mode; NF4 decoder linears if asked.

    The same seed gives the same weights, so PEFT and fastlora models built apart can be compared.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=geo.hidden,
        intermediate_size=geo.intermediate,
        num_hidden_layers=layers,
        num_attention_heads=geo.heads,
        num_key_value_heads=geo.kv_heads,
        head_dim=geo.head_dim,
        vocab_size=vocab,
        max_position_embeddings=max(geo.seq, 4096),
        tie_word_embeddings=False,
        use_cache=False,
    )
    torch.manual_seed(seed)
    with torch.device(device):  # initialized where it runs: seconds on a GPU, minutes for 8B shapes on a CPU
        model = LlamaForCausalLM(config)
    model = model.to(torch.bfloat16).requires_grad_(False).train()
    if base == "nf4":
        quantize_decoder_linears(model, device)
    return model


def quantize_decoder_linears(model: nn.Module, device: torch.device) -> None:
    """Every nn.Linear of the decoder layers becomes a bitsandbytes NF4 `Linear4bit` (QLoRA's recipe:
    bf16 compute, double-quantized absmax); embeddings and lm_head stay bf16, as transformers leaves them.
    """
    import bitsandbytes as bnb

    for layer in model.model.layers:
        for name, linear in list(layer.named_modules()):
            if type(linear) is not nn.Linear:
                continue
            quantized = bnb.nn.Linear4bit(
                linear.in_features, linear.out_features, bias=linear.bias is not None,
                compute_dtype=torch.bfloat16, compress_statistics=True, quant_type="nf4", device="meta",
            )  # fmt: skip
            quantized.weight = bnb.nn.Params4bit(
                linear.weight.data, requires_grad=False, compress_statistics=True, quant_type="nf4",
                quant_storage=torch.uint8, module=quantized,
            )  # fmt: skip
            if linear.bias is not None:
                quantized.bias = linear.bias
            parent_name, _, child = name.rpartition(".")
            setattr(layer.get_submodule(parent_name) if parent_name else layer, child, quantized.to(device))
    # PEFT routes Linear4bit targets to its 4-bit LoRA layer only on models that say they are 4-bit.
    model.is_loaded_in_4bit = True


def adapt(model: nn.Module, provider: str, adapter: str, rank: int, alpha: int, seed: int = 1):
    """The model with LoRA on every linear layer of the decoder (or the model itself for the floor)."""
    if provider == "floor":
        return model
    config_cls = FastLoraConfig if provider == "fastlora" else LoraConfig
    config = config_cls(r=rank, lora_alpha=alpha, target_modules=LINEAR_TARGETS, lora_dropout=0.0)
    peft_model = get_peft_model(model, config, autocast_adapter_dtype=adapter == "fp32")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                # A like PEFT's init scale, B random too: the sum is a few percent of the base output.
                std = param.shape[1] ** -0.5 if "lora_A" in name else 0.02
                values = torch.randn(param.shape, generator=generator) * std
                param.data = values.to(param.device, ADAPTER_DTYPES[adapter])
    return peft_model


def fused_note(model: nn.Module) -> str:
    """fastlora_peft's report in a few words: "fused 7/7, 2 groups", naming a module that is not fused."""
    if not hasattr(model, "fastlora_report"):
        return ""
    routes = model.fastlora_report()
    fused = [route for route in routes if route.path == "fused"]
    note = f"fused {len(fused)}/{len(routes)}"
    if hasattr(model, "fastlora_groups"):
        note += f", {len(model.fastlora_groups())} groups"
    slow = [f"{route.name}: {'; '.join(route.reasons)}" for route in routes if route.path != "fused"]
    return note + (f" (not fused: {slow[0]}{' ...' if len(slow) > 1 else ''})" if slow else "")


def decoder_layer(model: nn.Module) -> nn.Module:
    inner = model.get_base_model() if isinstance(model, PeftModel) else model
    return inner.model.layers[0]


def block_outputs(layer: nn.Module, block: str, x: torch.Tensor) -> list[torch.Tensor]:
    attention = layer.self_attn
    if block == "o":
        return [attention.o_proj(x)]
    if block == "qkv":  # one after the other on the same hidden state, as LlamaAttention.forward calls them
        with inside_parent_forward(attention):
            return [attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)]
    return [layer.mlp(x)]


@contextmanager
def inside_parent_forward(parent: nn.Module) -> Iterator[None]:
    """Calls made here behave as if made from inside `parent.forward`.

    fastlora_peft's q/k/v group takes over the attention module's forward and serves its members only
    while that forward runs: the first projection call computes all three in one fused call, the next
    two take theirs. The QKV case calls the projections without the rest of attention (rotary, SDPA,
    o_proj), so it opens the group's `scope()`, as the group's own `__call__` does; without a group
    this does nothing. The rows' custom_fn_nodes tell which path ran: 1 for the grouped q/k/v, 3 for
    three projections.
    """
    group = parent.__dict__.get("forward")  # the group installs itself as an instance attribute
    if not isinstance(group, SharedInputGroup):
        yield
        return
    with group.scope():
        yield


def block_params(layer: nn.Module, block: str) -> list[nn.Parameter]:
    """The trainable (LoRA) parameters of the block, in a fixed order; none for the floor."""
    attention = layer.self_attn
    modules = {
        "o": [attention.o_proj],
        "qkv": [attention.q_proj, attention.k_proj, attention.v_proj],
        "mlp": [layer.mlp],
    }[block]
    return [p for module in modules for p in module.parameters() if p.requires_grad]


def block_inputs(geo: Geometry, block: str, batch: int, seq: int, device: torch.device, seed: int = 2):
    """x (bf16, requires grad) and one random upstream gradient per output of the block."""
    generator = torch.Generator(device=device).manual_seed(seed)
    in_features = geo.heads * geo.head_dim if block == "o" else geo.hidden
    out_features = {
        "o": [geo.hidden],
        "qkv": [geo.heads * geo.head_dim, geo.kv_heads * geo.head_dim, geo.kv_heads * geo.head_dim],
        "mlp": [geo.hidden],
    }[block]

    def randn(features: int) -> torch.Tensor:
        return torch.randn(batch, seq, features, generator=generator, device=device, dtype=torch.bfloat16)

    x = randn(in_features).requires_grad_()
    return x, [randn(features) for features in out_features]


def block_step(layer: nn.Module, block: str, x: torch.Tensor, grad_outs: list[torch.Tensor]) -> Step:
    params = block_params(layer, block)

    def reset() -> None:
        x.grad = None
        for param in params:
            param.grad = None

    def backward(outputs: list[torch.Tensor]) -> None:
        torch.autograd.backward(outputs, grad_outs)

    return Step(forward=lambda: block_outputs(layer, block, x), backward=backward, reset=reset)


def add_block_case_arguments(parser, default_cases: str) -> None:
    """`--cases block:tokens,...`, `--base` and `--adapters`: the options of the tools that time one
    block at a time in this process (host_vs_gpu, host_timers). `block_cases` reads `--cases`."""
    parser.add_argument("--cases", default=default_cases, help="block:tokens, comma-separated")
    parser.add_argument("--base", default="bf16", choices=("bf16", "nf4"))
    parser.add_argument("--adapters", default="fp32", choices=tuple(ADAPTER_DTYPES))


def block_cases(spec: str) -> list[tuple[str, int]]:
    """`"mlp:2048,o:8192"` -> `[("mlp", 2048), ("o", 8192)]`."""
    pairs = [case.split(":") for case in spec.split(",")]
    return [(block, int(tokens)) for block, tokens in pairs]


def one_layer_block_step(
    geo: Geometry, block: str, provider: str, base: str, adapters: str, tokens: int, device: torch.device
) -> Step:
    """One block of a fresh one-layer model of `geo` as `provider` adapts it, on batch 1 of `tokens`:
    what the single-block tools (profile_block, compiled_step, sustained_load) time."""
    model = build_llama(geo, layers=1, vocab=256, base=base, device=device)
    model = adapt(model, provider, adapters, geo.rank, geo.alpha)
    x, grad_outs = block_inputs(geo, block, 1, tokens, device)
    return block_step(decoder_layer(model), block, x, grad_outs)


def compare_blocks(reference: nn.Module, candidate: nn.Module, block: str, x, grad_outs) -> dict[str, float]:
    """Relative errors of the candidate's output, dX and LoRA gradients against the reference's."""
    results = []
    for layer in (decoder_layer(reference), decoder_layer(candidate)):
        x_copy = x.detach().clone().requires_grad_()
        params = block_params(layer, block)
        for param in params:
            param.grad = None
        outputs = block_outputs(layer, block, x_copy)
        torch.autograd.backward(outputs, grad_outs)
        flat = torch.cat([out.detach().flatten().float() for out in outputs])
        grads = torch.cat([p.grad.flatten().float() for p in params])
        results.append((flat, x_copy.grad, grads))
        for param in params:
            param.grad = None
    (out_ref, dx_ref, dp_ref), (out, dx, dp) = results
    return {
        "rel_err_out": rel_err(out, out_ref),
        "rel_err_dx": rel_err(dx, dx_ref),
        "rel_err_dparams": rel_err(dp, dp_ref),
    }


def copy_lora(source: nn.Module, target: nn.Module) -> None:
    """Same adapter values in both (the keys are the same: fastlora_peft keeps PEFT's)."""
    target_params = dict(target.named_parameters())
    with torch.no_grad():
        for name, param in source.named_parameters():
            if "lora_" in name:
                target_params[name].copy_(param)


def model_step(model: nn.Module, input_ids: torch.Tensor, provider: str) -> Step:
    """forward + loss, then backward + AdamW step + zero_grad: one training step of the whole model.

    The floor has no trainable parameter, so its embeddings' output is made to require grad: backward
    then runs dX through every layer, what the frozen base costs under any LoRA (it also computes the
    first layer's dX, which a LoRA run skips: about 1% of the step at 8B shapes).
    """
    optimizer: torch.optim.Optimizer | None = None
    if provider == "floor":
        model.enable_input_require_grads()
    else:
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=1e-5)

    def forward() -> torch.Tensor:
        return model(input_ids=input_ids, labels=input_ids, use_cache=False).loss

    def backward(loss: torch.Tensor) -> None:
        loss.backward()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return Step(forward=forward, backward=backward)


def free_memory() -> None:
    """After the caller dropped its models: collect them and give cached blocks back to the driver, so
    each case starts from a clean allocator and one case's leftovers never count in the next one's peak."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
