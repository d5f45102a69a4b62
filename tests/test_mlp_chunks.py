"""The gated MLP's down projection in chunks of token rows: the row ranges, the same output and every
gradient as one chunk, a pin that several chunks really ran, and a float64 gradcheck across chunks.

Odd sizes throughout (37 tokens in 3 uneven chunks); under TRITON_INTERPRET=1 the fp32 cases run the
Triton kernels, so the shapes stay tiny.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import TRITON_INTERPRET, assert_rel_close

from fastlora_peft.dtypes import DtypePlan
from fastlora_peft.functions import gated_mlp
from fastlora_peft.functions.frozen_base import FrozenBase, LoraWeights
from fastlora_peft.functions.gated_mlp import GatedMlpSettings, fused_gated_mlp, token_chunks

HIDDEN, INTERMEDIATE, TOKENS = 10, 24, 37
ONE_CHUNK = 2**40
MLP_LAYOUTS = ("gate-up-down", "gate_up-down")  # Llama-like, Phi-3's fused gate_up
ACTIVATIONS = ("silu", "gelu_tanh")
# Relative errors (norm-wise) allowed: chunking changes only the order of sums (dA_down over tokens,
# GEMM row blocking), measured at 1.5e-7 in fp32; a wrong or missing chunk is off by O(1).
TOLERANCES = {torch.float32: 1e-6, torch.float64: 1e-12}
DTYPE_IDS = {torch.float32: "fp32", torch.float64: "fp64"}
BF16_BYTES = 2
LLAMA_8B_INTERMEDIATE = 14336


def random_mlp(
    mlp_layout: str,
    dtype: torch.dtype,
    tokens: int = TOKENS,
    seed: int = 0,
    hidden: int = HIDDEN,
    intermediate: int = INTERMEDIATE,
    down_rank: int = 5,
    gate_up_rank: int | None = None,
):
    """x `[tokens, HIDDEN]`, bases, loras of one gated MLP: unequal ranks and scales, trainable biases
    on up (or gate_up) and down, lora_B random (a zero B would hide wrong dA). gate_up_rank: gate's
    (gate_up's) rank, up's 3 fewer (default 3 and 2, gate_up 4)."""
    generator = torch.Generator().manual_seed(seed)

    def tensor(*shape, grad=True):
        values = torch.randn(*shape, generator=generator, dtype=torch.float64) * 0.5
        return values.to(dtype).requires_grad_(grad)

    def projection(in_features, out_features, rank, scale, bias):
        bias_tensor = tensor(out_features) if bias else None
        base = FrozenBase(tensor(out_features, in_features, grad=False), bias_tensor, None)
        return base, LoraWeights(tensor(rank, in_features), tensor(out_features, rank), scale)

    gate_rank, up_rank, gate_up_rank = (
        (3, 2, 4) if gate_up_rank is None else (gate_up_rank, gate_up_rank - 3, gate_up_rank)
    )
    if mlp_layout == "gate-up-down":
        shapes = [(hidden, intermediate, gate_rank, 0.5, False), (hidden, intermediate, up_rank, 1.5, True)]
    else:
        shapes = [(hidden, 2 * intermediate, gate_up_rank, 0.75, True)]
    shapes.append((intermediate, hidden, down_rank, 1.25, True))
    projections = [projection(*shape) for shape in shapes]
    bases, loras = [p[0] for p in projections], [p[1] for p in projections]
    return tensor(tokens, hidden), bases, loras


def trainable_tensors(x, bases, loras) -> list[torch.Tensor]:
    tensors = [x] + [t for lora in loras for t in (lora.lora_a, lora.lora_b)]
    tensors += [base.bias for base in bases if base.bias is not None]
    return [t for t in tensors if t.requires_grad]


def bytes_for_chunks(
    count: int, dtype: torch.dtype, tokens: int = TOKENS, intermediate: int = INTERMEDIATE
) -> int:
    """A chunk size that splits the test's h `[tokens, intermediate]` into `count` chunks."""
    chunk_bytes = math.ceil(tokens * intermediate * dtype.itemsize / count)
    assert len(token_chunks(tokens, intermediate, dtype.itemsize, chunk_bytes)) == count
    return chunk_bytes


def run_mlp(monkeypatch, chunk_bytes, x, bases, loras, activation):
    """The output and the gradient of every trainable tensor, for a fixed random upstream gradient."""
    monkeypatch.setattr(GatedMlpSettings, "chunk_bytes", chunk_bytes)
    plan = DtypePlan(x.dtype, x.dtype)
    out = fused_gated_mlp(x, bases, loras, plan, activation)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)
    grads = torch.autograd.grad(out, trainable_tensors(x, bases, loras), grad_out)
    return out.detach(), grads


@pytest.fixture
def call_rows(monkeypatch) -> dict[str, list[int]]:
    """Rows of each call of the activation kernels as the gated MLP calls them, by kernel name."""
    names = ("gated_act_lora_forward_", "gated_act_backward_", "gated_act_backward_weight_grad_")
    rows: dict[str, list[int]] = {name: [] for name in names}
    for name, row_arg in zip(names, (0, 1, 1)):  # gate's rows
        original = getattr(gated_mlp, name)

        def counting(*args, _name=name, _row_arg=row_arg, _original=original):
            rows[_name].append(args[_row_arg].shape[0])
            return _original(*args)

        monkeypatch.setattr(gated_mlp, name, counting)
    return rows


# --- the row ranges ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tokens, chunk_bytes",
    [(37, 1184), (37, 1), (1, 1), (0, 64), (2048, 2**26), (8191, 2**26), (100, 99 * 24 * 4)],
    ids=["37-3chunks", "37-row-each", "one-row", "no-rows", "2048", "8191-odd", "just-over"],
)
def test_token_chunks_cover_every_row_once_in_near_equal_chunks(tokens, chunk_bytes):
    intermediate, element_size = 24 if tokens < 2048 else LLAMA_8B_INTERMEDIATE, 4
    chunks = token_chunks(tokens, intermediate, element_size, chunk_bytes)
    rows = [row for chunk in chunks for row in range(tokens)[chunk]]
    assert rows == list(range(tokens))
    sizes = [chunk.stop - chunk.start for chunk in chunks]
    assert len(chunks) >= 1 and max(sizes) - min(sizes) <= 1
    # at most one row over the budget (the split is even, not rounded down)
    assert (max(sizes) - 1) * intermediate * element_size <= chunk_bytes or max(sizes) == 1


@pytest.mark.parametrize("tokens, expected", [(2048, [2048]), (8192, [2048] * 4), (4096, [2048] * 2)])
def test_token_chunks_at_llama_8b_shapes(tokens, expected):
    # 2048 x 14336 bf16 is 56 MiB: one chunk, the launches of the unchunked MLP; 8192 tokens: four.
    chunks = token_chunks(tokens, LLAMA_8B_INTERMEDIATE, BF16_BYTES, GatedMlpSettings.chunk_bytes)
    assert [chunk.stop - chunk.start for chunk in chunks] == expected


@pytest.mark.parametrize("tokens", [8192, 8191, 6000, 1000, 300])
def test_aligned_token_chunks_start_at_multiples_of_the_alignment(tokens):
    # dh's augmented chunks at 8B shapes (I + K_pad = 14336 + 4160): 1638-row chunks made the gated
    # backward kernel and the dh GEMM slower than 256-aligned ones (H200, gated_mlp).
    chunks = token_chunks(tokens, LLAMA_8B_INTERMEDIATE + 4160, BF16_BYTES, GatedMlpSettings.chunk_bytes, 256)
    rows = [row for chunk in chunks for row in range(tokens)[chunk]]
    assert rows == list(range(tokens))
    plain = token_chunks(tokens, LLAMA_8B_INTERMEDIATE + 4160, BF16_BYTES, GatedMlpSettings.chunk_bytes)
    assert len(chunks) == len(plain)
    sizes = [chunk.stop - chunk.start for chunk in chunks]
    if tokens // len(chunks) >= 256:
        assert all(chunk.start % 256 == 0 for chunk in chunks), chunks
        assert max(sizes) <= max(p.stop - p.start for p in plain) + 256, sizes
    else:  # too few rows for the alignment: the even split
        assert chunks == plain
    if tokens == 8192:
        # dh + the left operand: at most 1792 x 18496 x 2 bytes = 63.2 MiB of the 64.
        assert sizes == [1536, 1792, 1536, 1792, 1536]


# --- chunked == one chunk -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=DTYPE_IDS.get)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("mlp_layout", MLP_LAYOUTS)
def test_chunked_output_and_grads_equal_one_chunk(
    monkeypatch, call_rows, triton_launches, mlp_layout, activation, dtype
):
    x, bases, loras = random_mlp(mlp_layout, dtype)
    whole_out, whole_grads = run_mlp(monkeypatch, ONE_CHUNK, x, bases, loras, activation)
    # Backward recomputes h only inside the fused activation backward + dA_down op, never alone.
    assert call_rows == {
        "gated_act_lora_forward_": [TOKENS],
        "gated_act_backward_": [],
        "gated_act_backward_weight_grad_": [TOKENS],
    }
    for rows in call_rows.values():
        rows.clear()

    out, grads = run_mlp(monkeypatch, bytes_for_chunks(3, dtype), x, bases, loras, activation)
    chunk_rows = [12, 12, 13]
    assert call_rows == {
        "gated_act_lora_forward_": chunk_rows,
        "gated_act_backward_": [],
        "gated_act_backward_weight_grad_": chunk_rows,  # once per chunk, in order, every row
    }
    if TRITON_INTERPRET and dtype == torch.float32:  # float64 runs the references
        assert triton_launches.get("_gated_act_backward_weight_grad_kernel") == 1 + 3, triton_launches
        # gate's and up's LoRA terms are added by the activation kernel, not by expand-adds.
        assert triton_launches.get("_gated_act_lora_forward_kernel") == 1 + 3, triton_launches
        assert "_gated_act_backward_kernel" not in triton_launches, triton_launches
    assert_rel_close(out, whole_out, TOLERANCES[dtype], "out")
    names = ["x"] + [f"{p}.lora_{ab}" for p in range(len(loras)) for ab in "ab"] + ["biases"] * 2
    for name, grad, whole_grad in zip(names, grads, whole_grads, strict=True):
        assert whole_grad.abs().max() > 0, f"{name}: a zero gradient tests nothing"
        assert_rel_close(grad, whole_grad, TOLERANCES[dtype], name)


@pytest.mark.parametrize("mlp_layout", MLP_LAYOUTS)
def test_chunks_without_down_lora_a_grad_never_recompute_h(monkeypatch, call_rows, mlp_layout):
    dtype = torch.float32
    x, bases, loras = random_mlp(mlp_layout, dtype, seed=1)
    loras[-1] = loras[-1]._replace(lora_a=loras[-1].lora_a.detach())  # dA_down is the only reader of h
    whole_out, whole_grads = run_mlp(monkeypatch, ONE_CHUNK, x, bases, loras, "silu")
    for rows in call_rows.values():
        rows.clear()
    out, grads = run_mlp(monkeypatch, bytes_for_chunks(4, dtype), x, bases, loras, "silu")
    assert call_rows["gated_act_lora_forward_"] == [9, 9, 9, 10], "forward only: no h recomputed"
    assert call_rows["gated_act_backward_"] == [9, 9, 9, 10]
    assert call_rows["gated_act_backward_weight_grad_"] == [], "no dA_down, no h in backward"
    assert_rel_close(out, whole_out, TOLERANCES[dtype], "out")
    for index, (grad, whole_grad) in enumerate(zip(grads, whole_grads, strict=True)):
        assert_rel_close(grad, whole_grad, TOLERANCES[dtype], f"trainable tensor {index}")


def test_chunks_keep_the_second_backward_error(monkeypatch):
    x, bases, loras = random_mlp("gate-up-down", torch.float64, seed=2)
    monkeypatch.setattr(GatedMlpSettings, "chunk_bytes", bytes_for_chunks(3, torch.float64))
    out = fused_gated_mlp(x, bases, loras, DtypePlan(torch.float64, torch.float64), "silu")
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="overwrite_saved_preactivations"):
        out.sum().backward()


# --- float64 gradcheck through several chunks ---------------------------------------------------


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("mlp_layout", MLP_LAYOUTS)
def test_chunked_gated_mlp_gradcheck(monkeypatch, mlp_layout, activation):
    # gradcheck runs backward many times through one graph: keep the saved gate/up intact.
    monkeypatch.setattr(GatedMlpSettings, "overwrite_saved_preactivations", False)
    tokens = 7
    monkeypatch.setattr(GatedMlpSettings, "chunk_bytes", bytes_for_chunks(3, torch.float64, tokens))
    x, bases, loras = random_mlp(mlp_layout, torch.float64, tokens=tokens, seed=3)
    assert gradcheck_mlp(x, bases, loras, activation)


def gradcheck_mlp(x, bases, loras, activation: str) -> bool:
    """torch.autograd.gradcheck of the fused MLP (float64) in x and every trainable tensor."""
    plan = DtypePlan(torch.float64, torch.float64)

    def function(x, *tensors):
        it = iter(tensors)
        new_loras = [LoraWeights(next(it), next(it), lora.scale) for lora in loras]
        new_bases = [FrozenBase(b.weight, next(it) if b.bias is not None else None, None) for b in bases]
        return fused_gated_mlp(x, new_bases, new_loras, plan, activation)

    return torch.autograd.gradcheck(function, trainable_tensors(x, bases, loras))


# --- chunks under the other dtype layouts ------------------------------------------------------

# id: (x dtype, base weight dtype, NF4 base?, plan), adapters fp32 throughout (PEFT's default).
MIXED_LAYOUTS = {
    # PEFT's default layout, fp32 adapters on a bf16 base: chunks are written into the bf16 output.
    "bf16-fp32adapters": (torch.bfloat16, torch.bfloat16, False, DtypePlan(torch.bfloat16, torch.bfloat16)),
    "fp16-fp32adapters": (torch.float16, torch.float16, False, DtypePlan(torch.float16, torch.float16)),
    # fp32 activations on a bf16 base: the base matmuls run in bf16, the outputs are fp32, so each
    # chunk's base output cannot be written into the fp32 output directly and is copied there.
    "fp32x-on-bf16": (torch.float32, torch.bfloat16, False, DtypePlan(torch.bfloat16, torch.float32)),
    # NF4 bases (double-quantized absmax, bf16 compute): the down weight is dequantized once per pass.
    "nf4-fp32adapters": (torch.bfloat16, torch.bfloat16, True, DtypePlan(torch.bfloat16, torch.bfloat16)),
    "nf4-fp32x": (torch.float32, torch.bfloat16, True, DtypePlan(torch.bfloat16, torch.float32)),
}
# bitsandbytes quantizes on the CPU only feature sizes that are multiples of 64.
NF4_HIDDEN, NF4_INTERMEDIATE = 64, 128


def nf4_base(base: FrozenBase) -> FrozenBase:
    import bitsandbytes.functional as bnb_functional

    from fastlora_peft.kernels.dequant4bit import Quant4bitState

    packed, quant_state = bnb_functional.quantize_4bit(
        base.weight.detach().to(torch.bfloat16), blocksize=64, compress_statistics=True, quant_type="nf4"
    )
    return FrozenBase(packed, base.bias, Quant4bitState.from_bnb(quant_state, packed))


@pytest.mark.parametrize("mlp_layout", MLP_LAYOUTS)
@pytest.mark.parametrize("layout_id", list(MIXED_LAYOUTS))
def test_chunks_under_other_dtype_layouts(monkeypatch, call_rows, mlp_layout, layout_id):
    x_dtype, base_dtype, quantized, plan = MIXED_LAYOUTS[layout_id]
    sizes = dict(hidden=NF4_HIDDEN, intermediate=NF4_INTERMEDIATE) if quantized else {}
    x, bases, loras = random_mlp(mlp_layout, torch.float32, **sizes)
    x = x.detach().to(x_dtype).requires_grad_()
    bases = [
        FrozenBase(
            base.weight.detach().to(base_dtype),
            None if base.bias is None else base.bias.detach().to(base_dtype).requires_grad_(),
            None,
        )
        for base in bases
    ]
    if quantized:
        bases = [nf4_base(base) for base in bases]

    # One chunk of a 4-bit down projection may take dh's term inside its GEMM where augmented_k's rule
    # says so (tested in test_augmented_k), several chunks never: compare like with like here.
    monkeypatch.setattr(gated_mlp, "augmented_member", lambda *args: None)

    def run(chunk_bytes):
        monkeypatch.setattr(GatedMlpSettings, "chunk_bytes", chunk_bytes)
        out = fused_gated_mlp(x, bases, loras, plan, "silu")
        grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.dtype)
        return out.detach(), torch.autograd.grad(out, trainable_tensors(x, bases, loras), grad_out)

    whole_out, whole_grads = run(ONE_CHUNK)
    intermediate = sizes.get("intermediate", INTERMEDIATE)
    # h has the output dtype: three chunks of 12, 12, 13 rows in forward, the same again in backward
    # (the fused activation backward + dA_down), after one chunk of all rows each.
    chunked_out, chunked_grads = run(bytes_for_chunks(3, plan.out_dtype, intermediate=intermediate))
    assert call_rows["gated_act_lora_forward_"] == [TOKENS, 12, 12, 13]
    assert call_rows["gated_act_backward_weight_grad_"] == [TOKENS, 12, 12, 13]
    assert chunked_out.dtype == plan.out_dtype
    # Each row's output is computed by the same ops either way (bit-identical on the CPU); only the
    # order of the sums over tokens (dA_down) changes: 1.3e-7 measured. A skipped copy is off by O(1).
    assert_rel_close(chunked_out, whole_out, 1e-6, "out")
    for index, (chunked, whole) in enumerate(zip(chunked_grads, whole_grads)):
        assert_rel_close(chunked, whole, 1e-6, f"grad {index}")
