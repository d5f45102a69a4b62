"""The fused path under CUDA graphs: captured by hand, and through torch.compile's cudagraph trees.

The split kernels (shrink, weight gradient, the gated backward's dA_down) meet their splits through
counters that must be zero at every launch (`kernels/split_sum.py`). Eager launches share one cached
scratch (partials and counters) per stream; a captured launch gets its own, its counters zeroed
inside the graph; scratch made while a graph's memory pool takes the allocations is not cached. A
counter left non-zero, or shared with memory a graph pool hands out, loses a tile's result: far off
eager, not a rounding difference. GPU only (skipped without CUDA).
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import count_lora_sublayer_calls, lora_grads, randomize_lora, rel_err, tiny_llama_config
from peft import get_peft_model
from torch import nn

from fastlora_peft import FastLoraConfig
from fastlora_peft.kernels import gated_act_lora, lora_terms, lora_weight_grad, split_sum

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture
def split_launches(monkeypatch):
    """Records, per call of split_scratch, whether the stream was capturing."""
    calls: list[bool] = []
    original = split_sum.split_scratch

    def recording(device, partial_elements, tiles):
        calls.append(torch.cuda.is_current_stream_capturing())
        return original(device, partial_elements, tiles)

    for module in (lora_terms, lora_weight_grad, gated_act_lora):  # every launcher that splits
        monkeypatch.setattr(module, "split_scratch", recording)
    return calls


def assert_cached_counters_zero() -> None:
    torch.cuda.synchronize()
    for key, scratch in split_sum._SCRATCH.items():
        assert not scratch.counters.any(), (key, scratch.counters.nonzero())


def test_captured_launches_get_scratch_of_their_own():
    # A replay may run beside eager launches on another stream: it must not share their buffer, even
    # when its capture stream already has one cached.
    device = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        cached = split_sum.split_scratch(device, 256, 64)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        captured = split_sum.split_scratch(device, 256, 64)
    assert captured.counters.data_ptr() != cached.counters.data_ptr()
    assert captured.partials.data_ptr() != cached.partials.data_ptr()
    assert split_sum._SCRATCH[(device, stream.cuda_stream)] is cached


def test_scratch_made_in_a_graph_memory_pool_is_not_cached():
    # torch.compile's cudagraph trees warm a graph up with this thread's allocations in the graph's
    # pool, and may hand that memory to their own tensors later.
    device = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.Stream()
    pool = torch.cuda.MemPool()
    with torch.cuda.stream(stream), torch.cuda.use_mem_pool(pool):
        in_pool = split_sum.split_scratch(device, 256, 64)
    assert not split_sum.in_default_memory_pool(in_pool.counters)
    assert (device, stream.cuda_stream) not in split_sum._SCRATCH
    assert not in_pool.counters.any()
    with torch.cuda.stream(stream):
        cached = split_sum.split_scratch(device, 256, 64)
    assert split_sum.in_default_memory_pool(cached.counters)
    assert split_sum._SCRATCH[(device, stream.cuda_stream)] is cached


def test_split_kernels_replayed_from_a_graph_match_eager(split_launches):
    # 4096 tokens: fewer row blocks than SMs, so the shrink splits K and the weight grad splits tokens.
    tokens, features, rank = 4096, 4096, 16
    generator = torch.Generator(device="cuda").manual_seed(0)

    def inputs():
        x = torch.randn(tokens, features, generator=generator, device="cuda").bfloat16()
        left = torch.randn(tokens, rank, generator=generator, device="cuda")
        return x, left

    weight = torch.randn(rank, features, generator=generator, device="cuda") * 0.02

    def run(x, left):
        return lora_terms.lora_shrink(x, weight, 0.5), lora_terms.lora_weight_grad(left, x, 0.25)

    static_x, static_left = inputs()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as torch.cuda.graph asks
        for _ in range(3):
            run(static_x, static_left)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_outputs = run(static_x, static_left)
    assert sum(split_launches) == 2, split_launches  # both captured launches split
    for _ in range(3):
        x, left = inputs()
        static_x.copy_(x)
        static_left.copy_(left)
        graph.replay()
        eager = run(x, left)  # eager launches between replays, on the cached buffer
        for got, want in zip(static_outputs, eager):
            assert torch.equal(got, want)  # the splits are summed in order: bit-identical
    assert_cached_counters_zero()


def projection_base(layout: str) -> nn.Module:
    """One 1024 x 1024 bf16 projection, dense or NF4 (quantized by bitsandbytes on the move to CUDA)."""
    if layout.startswith("nf4"):
        import bitsandbytes as bnb

        layer = bnb.nn.Linear4bit(
            1024, 1024, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4", quant_storage=torch.uint8
        )
        return nn.Sequential(layer).cuda()
    return nn.Sequential(nn.Linear(1024, 1024, bias=False)).cuda().bfloat16()


# PEFT's default layout (fp32 adapters on a bf16 base), bf16 adapters, and fp32 adapters on NF4 (the
# dequantize kernel captured too).
GRAPHED_LAYOUTS = ("bf16-fp32adapters", "bf16-bf16adapters", "nf4-fp32adapters")


@pytest.mark.parametrize("layout", GRAPHED_LAYOUTS)
def test_fused_projection_in_make_graphed_callables_matches_eager(split_launches, layout):
    torch.manual_seed(0)
    base = projection_base(layout)
    config = FastLoraConfig(r=16, lora_alpha=32, target_modules=["0"], lora_dropout=0.0)
    fp32_adapters = layout.endswith("fp32adapters")
    eager = get_peft_model(copy.deepcopy(base), config, autocast_adapter_dtype=fp32_adapters)
    randomize_lora(eager, seed=1, std=0.05)
    adapter_dtype = torch.float32 if fp32_adapters else torch.bfloat16
    assert {p.dtype for n, p in eager.named_parameters() if "lora_" in n} == {adapter_dtype}
    graphed = copy.deepcopy(eager)
    sample = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    graphed_call = torch.cuda.make_graphed_callables(graphed, (sample,))
    assert any(split_launches), "nothing split while capturing"
    assert_graphed_matches_eager(graphed_call, graphed, eager, out_features=1024, adapter_grads=2)
    assert_cached_counters_zero()


def assert_graphed_matches_eager(graphed_call, graphed, eager, out_features: int, adapter_grads: int) -> None:
    """Three steps of [2048, 1024] bf16 inputs: the graphed callable's output, dX and adapter gradients
    against the eager model's, each through the fused path (PEFT's sub-layers never called)."""
    for step in range(3):
        x = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16)
        grad_out = torch.randn(2048, out_features, device="cuda", dtype=torch.bfloat16)
        results = {}
        for name, call, model in (("graphed", graphed_call, graphed), ("eager", eager, eager)):
            model.zero_grad(set_to_none=True)
            x_leaf = x.clone().requires_grad_()
            with count_lora_sublayer_calls(model) as sublayer_calls:
                out = call(x_leaf)
            assert not sublayer_calls, (name, sublayer_calls)  # the fused path, not PEFT's
            out.backward(grad_out)
            results[name] = (out.detach(), x_leaf.grad, lora_grads(model))
        (out_g, dx_g, grads_g), (out_e, dx_e, grads_e) = results["graphed"], results["eager"]
        # The same kernels either way; cuBLAS may pick another algorithm under capture, hence a bound
        # (a lost tile or a stale counter is O(1)).
        assert rel_err(out_g, out_e) <= 1e-5, step
        assert rel_err(dx_g, dx_e) <= 1e-5, step
        assert grads_g.keys() == grads_e.keys() and len(grads_e) == adapter_grads
        for key in grads_e:
            assert rel_err(grads_g[key], grads_e[key]) <= 1e-5, (step, key)


def test_model_compiled_with_cuda_graphs_matches_compiled_without(split_launches):
    from transformers import LlamaForCausalLM

    # Sizes where every split kernel splits: 2048 tokens, K of 1024 and 2048.
    torch.manual_seed(0)
    llama_config = tiny_llama_config(
        hidden_size=1024, intermediate_size=2048, num_attention_heads=8, num_key_value_heads=4,
        vocab_size=128, max_position_embeddings=1024,
    )  # fmt: skip
    base = LlamaForCausalLM(llama_config).cuda().bfloat16()
    base.config.use_cache = False
    config = FastLoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, lora_dropout=0.0)
    plain = get_peft_model(base.train(), config)  # fp32 adapters on the bf16 base
    randomize_lora(plain, seed=1, std=0.05)
    graphed = copy.deepcopy(plain)

    # Two functions (two code objects), so each compiled cache holds its own mode's graph. The
    # reference is the same compiled graph without CUDA graphs: inductor's own fusions change bf16
    # roundings against eager (1.1e-2 on q_proj's dA in a first run), CUDA graphs change nothing.
    def loss_without_graphs(model, ids):
        return model(input_ids=ids, labels=ids).loss

    def loss_with_graphs(model, ids):
        return model(input_ids=ids, labels=ids).loss

    runs = {
        "graphs": (torch.compile(loss_with_graphs, mode="reduce-overhead"), graphed),
        "plain": (torch.compile(loss_without_graphs), plain),
    }
    torch._dynamo.utils.counters.clear()
    generator = torch.Generator(device="cuda").manual_seed(2)
    for step in range(4):  # warm-up, capture, then replays
        ids = torch.randint(0, 128, (2, 1024), generator=generator, device="cuda")
        grads = {}
        for name, (run, model) in runs.items():
            model.zero_grad(set_to_none=True)
            run(model, ids).backward()
            grads[name] = {key: grad.clone() for key, grad in lora_grads(model).items()}
        assert len(grads["plain"]) == 2 * len(TARGETS)
        for key, want in grads["plain"].items():
            error = rel_err(grads["graphs"][key], want)
            assert error <= 1e-3, (step, key, error)  # a lost tile or a stale counter is O(1)
    skips = torch._dynamo.utils.counters["inductor"].get("cudagraph_skips", 0)
    assert skips == 0, dict(torch._dynamo.utils.counters["inductor"])
    assert any(split_launches), "nothing split"
    assert_cached_counters_zero()


class Nf4Attention(nn.Module):
    """q/k/v as bitsandbytes NF4 layers reading one input: one shared-input group after injection."""

    def __init__(self):
        super().__init__()
        import bitsandbytes as bnb

        def nf4(out_features):
            return bnb.nn.Linear4bit(
                1024, out_features, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4",
                compress_statistics=True, quant_storage=torch.uint8,
            )  # fmt: skip

        self.q_proj, self.k_proj, self.v_proj = nf4(1024), nf4(256), nf4(256)

    def forward(self, x):
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)


class Nf4Model(nn.Module):
    """The attention one level down, as in a transformer layer."""

    def __init__(self):
        super().__init__()
        self.attn = Nf4Attention()

    @property
    def dummy_inputs(self):
        return {"x": torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)}

    def forward(self, x):
        return self.attn(x)


def test_nf4_qkv_group_in_make_graphed_callables_matches_eager(triton_launches):
    """The group's one dequantize launch each way (`dequant4bit_group`) captured and replayed."""
    torch.manual_seed(0)
    base = Nf4Model().cuda()  # bitsandbytes quantizes on the move
    config = FastLoraConfig(
        r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj"], lora_dropout=0.0
    )
    eager = get_peft_model(base, config)  # fp32 adapters
    assert eager.base_model.model.attn.q_proj.__dict__.get("fastlora_group") is not None, "no q/k/v group"
    randomize_lora(eager, seed=1, std=0.05)
    graphed = copy.deepcopy(eager)
    sample = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    # Counted from here: injection's grouping trace ran each layer alone (one launch a weight).
    triton_launches.clear()
    graphed_call = torch.cuda.make_graphed_callables(graphed, (sample,))
    assert triton_launches.get("_dequantize_4bit_group_kernel", 0) >= 2  # forward and dX, captured
    assert "_dequantize_4bit_kernel" not in triton_launches
    assert_graphed_matches_eager(graphed_call, graphed, eager, out_features=1536, adapter_grads=6)
