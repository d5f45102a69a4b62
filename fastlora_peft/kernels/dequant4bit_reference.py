"""Pure-torch reference for the 4-bit dequantization kernel in ``dequant4bit.py``.

Same signature and dtype contract as the public op ``dequantize_4bit``, and bit-identical to
bitsandbytes' own ``dequantize_4bit`` (its CUDA and CPU kernels), which compute, per element:

* nested (double-quantized) statistics first: ``absmax = fp32(nested_code[q] * nested_absmax[blk])``,
  then ``absmax = fp32(absmax + offset)`` -- two roundings, never one fused multiply-add;
* ``value = fp32(code[nibble] * absmax[element // blocksize])``, rounded once more (to nearest even)
  to the output dtype. The high nibble of byte ``i`` is element ``2 i``, the low nibble ``2 i + 1``.

Each step below is one torch op, so each rounds exactly once, in that order. No bitsandbytes import.
"""

from __future__ import annotations

import torch

# The 16 values each 4-bit code stands for, as bitsandbytes' kernels hold them (fp32, by code).
# NF4: quantiles of N(0, 1) scaled to [-1, 1] (QLoRA). FP4: 1 sign bit, 2 exponent bits and 1 mantissa
# bit, divided by 12 (its largest magnitude); codes 8..15 are codes 0..7 negated, so code 8 is -0.0
# (``bitsandbytes.functional.get_4bit_type("fp4")`` gives +0.0 there; its kernels do not use it).
NF4_CODE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip
_FP4_MAGNITUDES = (0.0, 0.005208333333, 0.66666667, 1.0, 0.33333333, 0.5, 0.16666667, 0.25)
FP4_CODE = _FP4_MAGNITUDES + tuple(-value for value in _FP4_MAGNITUDES)


def code_for(quant_type: str, device: torch.device | str | None = None) -> torch.Tensor:
    """The [16] float32 code table of ``quant_type`` ("nf4" or "fp4")."""
    tables = {"nf4": NF4_CODE, "fp4": FP4_CODE}
    if quant_type not in tables:
        raise ValueError(f"quant_type must be 'nf4' or 'fp4', got {quant_type!r}")
    return torch.tensor(tables[quant_type], dtype=torch.float32, device=device)


def block_scales(
    absmax: torch.Tensor,
    nested_absmax: torch.Tensor | None,
    nested_code: torch.Tensor | None,
    nested_offset: torch.Tensor | None,
    nested_blocksize: int,
) -> torch.Tensor:
    """The float32 scale of each quantization block: ``absmax`` itself, or its nested dequantization.

    absmax: [blocks] float (plain) or uint8 (nested); nested_absmax: [ceil(blocks / nested_blocksize)]
    float32; nested_code: [256] float32; nested_offset: one float32 value. Returns [blocks] float32.
    """
    if nested_absmax is None:
        return absmax.reshape(-1).float()
    quantized = absmax.reshape(-1).view(torch.uint8).long()
    second_level = nested_absmax.reshape(-1).float().repeat_interleave(nested_blocksize)[: quantized.numel()]
    scales = nested_code.float()[quantized] * second_level  # rounded to fp32 here ...
    return scales + nested_offset.reshape(()).float()  # ... and here: no fused multiply-add


def dequantize_4bit(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    code: torch.Tensor,
    nested_absmax: torch.Tensor | None,
    nested_code: torch.Tensor | None,
    nested_offset: torch.Tensor | None,
    blocksize: int,
    nested_blocksize: int,
    rows: int,
    cols: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Unpack and scale bitsandbytes' 4-bit weight. Returns [rows, cols] out_dtype, contiguous.

    packed: ceil(rows * cols / 2) bytes in any shape and storage dtype (read as raw uint8), elements in
    row-major order, blocks of ``blocksize`` consecutive elements sharing one scale. See
    ``block_scales`` for absmax and the nested arguments; code: [16] float32.
    """
    numel = rows * cols
    data = packed.reshape(-1).view(torch.uint8)[: (numel + 1) // 2]
    nibbles = torch.stack([data >> 4, data & 0x0F], dim=-1).reshape(-1)[:numel].long()
    scales = block_scales(absmax, nested_absmax, nested_code, nested_offset, nested_blocksize)
    per_element = scales.repeat_interleave(blocksize)[:numel]
    values = code.float()[nibbles] * per_element  # fp32, one rounding
    return values.to(out_dtype).reshape(rows, cols)
