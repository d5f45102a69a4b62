"""How the kernels feed `tl.dot`: the one place that decides it, and the dot they all call.

Every LoRA kernel multiplies a large activation tile (x, dY, h: 16-bit or fp32, as loaded) by a small
tile (an adapter, or an fp32 rank-R bottleneck). Five ways, chosen per launch by `dot_mode` (and
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
  gradient rounded to fp16 in the end (`weight_grad_dot_mode`): two dots instead of three.
* `ROUNDED_DOT`: the fp32 tile rounded to bf16, one native dot, for a weight gradient rounded to bf16
  in the end: the rounding PEFT's bf16-adapter path gives the same operand.
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

FP32_DOT, NATIVE_DOT, SPLIT_DOT, SPLIT_DOT_PAIR, ROUNDED_DOT = 0, 1, 2, 3, 4

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
    """`dot_mode` of a weight gradient `left.T @ activation` rounded once to `out_dtype`: where the
    split dot would run (a bf16 activation against the fp32 bottleneck), the exact three parts for an
    fp32 result (fp32 adapters, the fp32 accuracy of docs/design.md), the two high parts
    (`SPLIT_DOT_PAIR`) for an fp16 one, and the left rounded to bf16 (`ROUNDED_DOT`) for a bf16 one.

    The pair keeps 16 significant bits of the left: 2.5e-6 relative error against float64 at 8192
    tokens (three parts: 1.3e-7; both norm-relative), about 100x under fp16's rounding of the result.
    A bf16 result is rounded to 8 bits anyway; its left rounded to bf16 too, as PEFT's bf16 path
    rounds xA and dY B (lora_A's output is lora_B's input), gives 2.3e-3 against the pair's 1.7e-3,
    most of either the result's own rounding. H200, 8192 tokens, one launch (fifty-first session,
    docs/benchmarks/session51/a/bf16_term_probe.log), pair -> rounded, us, rank 16 / 64 / 128:
    o_proj's dA 45 / 53 / 58 -> 45 / 46-51 / 46, q/k/v's stacked dA 36 / 97 / 189 -> 35 / 66 / 115;
    pair over three parts (forty-eighth session, session48/pair_split_probe*.log) 0.76-1.00x.
    """
    mode = dot_mode(activation, left)
    if mode != SPLIT_DOT or out_dtype == torch.float32:
        return mode
    return ROUNDED_DOT if out_dtype == torch.bfloat16 else SPLIT_DOT_PAIR


def dot_precision(*dtypes: torch.dtype) -> str:
    """tl.dot input precision of FP32_DOT for operands of these dtypes.

    A 16-bit value (bf16: 8 significant bits, fp16: 11) converted to fp32 is exact in tf32 (11 bits),
    so products of two 16-bit operands are exact under plain tf32 and only fp32 operands need more.
    """
    return "tf32" if torch.float32 not in dtypes else FP32_DOT_PRECISION


# `expand_dot_precision`'s answer for bf16 adapters into a bf16 output: not a `tl.dot` precision but
# a mode of `lora_expand_add.expand_term`, which rounds the fp32 bottleneck to bf16 in registers and
# multiplies it by the adapter as loaded, at the bf16 tensor-core rate.
TERM_IN_BF16 = "bf16"


def expand_dot_precision(out_dtype: torch.dtype, *right_dtypes: torch.dtype) -> str:
    """How the LoRA term `left @ right.T` (lora_expand_add, the gated forward, lora_addmm) is multiplied
    into an output of `out_dtype`: its left operand is an fp32 bottleneck, its right operands (a
    group's, one for each member) adapters of `right_dtypes`.

    * bf16 adapters into a bf16 output: `TERM_IN_BF16`, the bottleneck rounded to bf16 (8 significant
      bits) and one native bf16 dot, the rounding PEFT's bf16-adapter path gives xA and dY B (lora_A's
      bf16 output is lora_B's input). The term then carries ~2**-9 relative error, the output's own
      rounding. Against plain tf32 it halves the term's tensor-core work and leaves the adapter tile
      as loaded, which the rank-64 and rank-128 terms need (the sweep's bf16-adapter rows fell to
      PEFT's bf16 path there).
    * Otherwise into a bf16 output plain tf32: it rounds both operands to 11 significant bits, the
      term then carries ~2**-11 relative error, 4x finer than the output's own rounding (8 bits),
      which PEFT's fp32 path applies to the same sum (fp32 adapters keep their bottleneck finer than
      bf16). fp16 (11 bits) and fp32 outputs keep 3xTF32: forcing tf32 for an fp32 output failed
      `tests/test_gpu.py::test_projection_at_8b_sizes[fp32-o]`.
    """
    if out_dtype != torch.bfloat16:
        return FP32_DOT_PRECISION
    if right_dtypes and all(dtype == torch.bfloat16 for dtype in right_dtypes):
        return TERM_IN_BF16
    return "tf32"


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
    elif DOT_MODE == 4:  # ROUNDED_DOT: other rounded to bf16 (8 significant bits), one dot
        if _INTERPRETED:
            result = tl.dot(activation.to(tl.float32), bf16_rounded(other), acc, input_precision="ieee")
        else:
            result = tl.dot(activation, other.to(tl.bfloat16), acc)
    else:  # FP32_DOT
        result = tl.dot(activation.to(tl.float32), other.to(tl.float32), acc, input_precision=DOT_PRECISION)
    return result


@triton.jit
def bf16_rounded(tile):
    """The fp32 tile rounded to the nearest bf16 (ties to even), as fp32: what a GPU's conversion to
    bf16 gives. For the interpreter, whose conversion truncates (up to 2**-8 relative, always toward
    zero, which biases a sum of many rounded products: 2x PEFT's bf16-path error on dA in the CPU
    tests). Finite values only."""
    bits = tile.to(tl.float32).to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def term_dot(left, right, acc, DOT_PRECISION: tl.constexpr):
    """acc + left @ right in fp32 for a LoRA term: left a tile of the bottleneck, right the adapter's,
    both as loaded; DOT_PRECISION from `expand_dot_precision`."""
    if DOT_PRECISION == "bf16":  # TERM_IN_BF16: the bottleneck rounded to bf16, the adapter bf16
        if _INTERPRETED:  # the interpreter computes bf16 as integer bits: multiply exact fp32 copies
            result = tl.dot(bf16_rounded(left), right.to(tl.float32), acc, input_precision="ieee")
        else:
            result = tl.dot(left.to(tl.bfloat16), right.to(tl.bfloat16), acc)
    else:
        result = tl.dot(left.to(tl.float32), right.to(tl.float32), acc, input_precision=DOT_PRECISION)
    return result
