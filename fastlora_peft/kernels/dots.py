"""How the kernels feed `tl.dot`: the one place that decides it, and the dot they all call.

Every LoRA kernel multiplies a large activation tile (x, dY, h: 16-bit or fp32, as loaded) by a small
tile (an adapter, or an fp32 rank-R bottleneck). Four ways, chosen per launch by `dot_mode` (and
`weight_grad_dot_mode` for the weight gradients):

* `NATIVE_DOT`: both 16-bit of one dtype, on a GPU: fed as loaded, the 16-bit tensor-core rate; the
  products are exact in the fp32 accumulator.
* `SPLIT_DOT`: a bf16 activation against an fp32 tile (fp32 adapters, and every weight gradient, whose
  left operand is an fp32 bottleneck). The fp32 tile is split in registers into three bf16 parts
  (8 + 8 + 8 significant bits: exactly the fp32 value), each multiplied by the activation as loaded
  with a native bf16 dot, so the products are exact and the activation tile is never converted.
  The three dots of one step start from zero and their sum is added to the running fp32 sum with an
  ordinary fp32 add, as Triton's own tf32x3 does per step: one accumulator carried through the
  whole loop lost accuracy on the H200 (an earlier single-accumulator split gave dA 4.8e-6 relative
  error against PEFT's 5.1e-7 at o_proj size).
* `SPLIT_DOT_PAIR`: the split's two high parts (16 significant bits of the fp32 tile), for a weight
  gradient rounded to 16 bits in the end (`weight_grad_dot_mode`): two dots instead of three.
* `FP32_DOT`: both converted to fp32 and multiplied with `DOT_PRECISION` (3xTF32 for fp32 accuracy).
  fp16 activations against fp32 tiles (an fp16 split would underflow its low part), fp32 activations,
  and everything under the Triton interpreter except the split, which the interpreter runs with its
  parts converted to fp32 (it cannot multiply bf16), so CI checks the split's arithmetic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._backend import TRITON_INTERPRET

FP32_DOT, NATIVE_DOT, SPLIT_DOT, SPLIT_DOT_PAIR = 0, 1, 2, 3

# tl.dot precision when an operand is fp32 in FP32_DOT. Plain "tf32" keeps 10 mantissa bits and gives
# ~5e-4 relative error, far too coarse for fp32 adapter gradients. "tf32x3" splits each fp32 operand
# into two tf32 halves and stays on tensor cores: 2e-7 relative error against float64 on an H200
# (K=4096). "ieee" runs on CUDA cores, as accurate but far slower there: lora_weight_grad at rank 64
# took 1353us against 248us, lora_expand_add 237us against 105us (M=8192, K=N=4096).
FP32_DOT_PRECISION = "tf32x3"

# Read by `activation_dot` at compile time (a constexpr global, so the GPU compiler accepts it).
_INTERPRETED = tl.constexpr(TRITON_INTERPRET)
_16_BIT = (torch.bfloat16, torch.float16)


def dot_mode(activation: torch.Tensor, other: torch.Tensor) -> int:
    """How a kernel multiplies the large `activation` tile by the small `other` tile."""
    if activation.dtype == torch.bfloat16 and other.dtype == torch.float32:
        return SPLIT_DOT
    if activation.is_cuda and activation.dtype == other.dtype and activation.dtype in _16_BIT:
        return NATIVE_DOT
    return FP32_DOT


def weight_grad_dot_mode(activation: torch.Tensor, left: torch.Tensor, out_dtype: torch.dtype) -> int:
    """`dot_mode` of a weight gradient `left.T @ activation` rounded once to `out_dtype`: the split
    dot's two high parts (`SPLIT_DOT_PAIR`) where that rounding is to 16 bits (16-bit adapters), the
    exact three-part split where it stays fp32 (fp32 adapters, the fp32 accuracy of docs/design.md).

    The pair keeps 16 significant bits of the fp32 left: 2.5e-6 relative error against float64 at
    8192 tokens (three parts: 1.3e-7; both norm-relative), about 100x under fp16's rounding of the
    result and 800x under bf16's. H200, 8192 tokens, pair over three parts
    (docs/benchmarks/session48/pair_split_probe.log, pair_split_probe_single.log), rank 16 / 64 /
    128: the MLP's dB 0.91 / 0.77 / 0.76x, q/k/v's three dB 1.00 / 0.87-0.90 / 0.81x, o_proj's dA
    and dB 0.99 / 0.84 / 0.80x, q/k/v's stacked dA 0.81 / 0.76 / 0.82x, the MLP's gate/up dA 0.96 /
    0.78 / 0.76x.
    """
    mode = dot_mode(activation, left)
    return SPLIT_DOT_PAIR if mode == SPLIT_DOT and out_dtype in _16_BIT else mode


def dot_precision(*dtypes: torch.dtype) -> str:
    """tl.dot input precision of FP32_DOT for operands of these dtypes.

    A 16-bit value (bf16: 8 significant bits, fp16: 11) converted to fp32 is exact in tf32 (11 bits),
    so products of two 16-bit operands are exact under plain tf32 and only fp32 operands need more.
    """
    return "tf32" if torch.float32 not in dtypes else FP32_DOT_PRECISION


def expand_dot_precision(out_dtype: torch.dtype) -> str:
    """tl.dot precision of a LoRA term added into an output of `out_dtype` (lora_expand_add, the gated
    forward, lora_addmm), whose left operand is an fp32 bottleneck and right an adapter of any dtype.

    Into a bf16 output plain tf32 is enough, with 16-bit or fp32 adapters alike: it rounds both
    operands to 11 significant bits, the term then carries ~2**-11 relative error, 4x finer than the
    output's own rounding (8 bits), which PEFT's fp32 path applies to the same sum. fp16 (11 bits)
    and fp32 outputs keep 3xTF32: forcing tf32 for an fp32 output failed
    `tests/test_gpu.py::test_projection_at_8b_sizes[fp32-o]`.
    """
    return "tf32" if out_dtype == torch.bfloat16 else FP32_DOT_PRECISION


@triton.jit
def activation_dot(activation, other, acc, DOT_MODE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + activation @ other in fp32, both tiles as loaded; DOT_MODE from `dot_mode`."""
    if DOT_MODE == 1:  # NATIVE_DOT
        result = tl.dot(activation, other, acc)
    elif DOT_MODE == 2:  # SPLIT_DOT: other = high + middle + low exactly, each bf16
        high = other.to(tl.bfloat16)
        rest = other - high.to(tl.float32)
        middle = rest.to(tl.bfloat16)
        low = (rest - middle.to(tl.float32)).to(tl.bfloat16)
        if _INTERPRETED:  # the interpreter computes bf16 as integer bits: multiply exact fp32 copies
            activation = activation.to(tl.float32)
            step = tl.dot(activation, low.to(tl.float32), input_precision="ieee")
            step = tl.dot(activation, middle.to(tl.float32), step, input_precision="ieee")
            step = tl.dot(activation, high.to(tl.float32), step, input_precision="ieee")
        else:  # smallest part first, so the step's sum rounds as little as it can
            step = tl.dot(activation, low)
            step = tl.dot(activation, middle, step)
            step = tl.dot(activation, high, step)
        result = acc + step
    elif DOT_MODE == 3:  # SPLIT_DOT_PAIR: other ~ high + middle (16 significant bits), each bf16
        high = other.to(tl.bfloat16)
        middle = (other - high.to(tl.float32)).to(tl.bfloat16)
        if _INTERPRETED:
            activation = activation.to(tl.float32)
            step = tl.dot(activation, middle.to(tl.float32), input_precision="ieee")
            step = tl.dot(activation, high.to(tl.float32), step, input_precision="ieee")
        else:
            step = tl.dot(activation, middle)
            step = tl.dot(activation, high, step)
        result = acc + step
    else:  # FP32_DOT
        result = tl.dot(activation.to(tl.float32), other.to(tl.float32), acc, input_precision=DOT_PRECISION)
    return result
