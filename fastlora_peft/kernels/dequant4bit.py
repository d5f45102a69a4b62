"""Triton kernel that dequantizes bitsandbytes' 4-bit (NF4/FP4) weights, bit-identical to bitsandbytes.

``_dequantize_4bit_kernel`` -> ``_dequantize_4bit_triton`` (launcher) -> ``dequantize_4bit`` (the
``fastlora::dequantize_4bit`` library op, with a fake) -> ``dequantize(state, packed)`` for callers that
hold a ``Quant4bitState`` (read from a ``Params4bit`` by ``Quant4bitState.from_bnb``).

The arithmetic, its order and its roundings are bitsandbytes' (see ``dequant4bit_reference``): the
nested statistics are ``fp32(fp32(nested_code[q] * nested_absmax) + offset)`` and every weight is
``fp32(code[nibble] * absmax)`` rounded to nearest-even into the output dtype. So the result equals
``bitsandbytes.functional.dequantize_4bit`` bit for bit only in the dtype bitsandbytes produces,
``quant_state.dtype``: a caller computing in another dtype passes ``state.dtype`` and casts afterwards
(asking for fp32 straight away skips bitsandbytes' rounding to a 16-bit dtype and gives other values).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from fastlora_peft.call_traces import trace_unit
from fastlora_peft.kernels import dequant4bit_reference as reference
from fastlora_peft.kernels._backend import OP_NAMESPACE, runs_triton, skips_op_dispatch
from fastlora_peft.kernels._launch import BoundLaunch, CachedKernel, LaunchPlans, cdiv, empty_2d

_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# bitsandbytes' blocksizes for 4-bit weights. The kernel needs a power of two of at least 2.
_BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
_NESTED_CODE_SIZE = 256  # the second-level (8-bit) code: one entry per uint8 value

# ---------------------------------------------------------------------------------------------------
# Kernel. One program dequantizes BLOCKS_PER_PROGRAM whole quantization blocks, laid out as a
# [BLOCKS_PER_PROGRAM, BLOCKSIZE // 2] tile of bytes: one scale per row, loaded once and broadcast.
# ---------------------------------------------------------------------------------------------------


@CachedKernel
@triton.jit
def _dequantize_4bit_kernel(
    Packed_ptr, Absmax_ptr, Code_ptr, NestedAbsmax_ptr, NestedCode_ptr, NestedOffset_ptr, Out_ptr,
    numel, num_bytes, num_blocks,
    BLOCKSIZE: tl.constexpr, NESTED_BLOCKSIZE: tl.constexpr, BLOCKS_PER_PROGRAM: tl.constexpr,
    NESTED: tl.constexpr, BF16_BY_BITS: tl.constexpr,
):  # fmt: skip
    """Out[e] = code[nibble(e)] * scale[e // BLOCKSIZE] for e < numel; byte i holds e = 2i (high), 2i+1."""
    dequantize_blocks(
        tl.program_id(0), Packed_ptr, Absmax_ptr, Code_ptr, NestedAbsmax_ptr, NestedCode_ptr,
        NestedOffset_ptr, Out_ptr, numel, num_bytes, num_blocks,
        BLOCKSIZE, NESTED_BLOCKSIZE, BLOCKS_PER_PROGRAM, NESTED, BF16_BY_BITS,
    )  # fmt: skip


@triton.jit
def dequantize_blocks(
    program, Packed_ptr, Absmax_ptr, Code_ptr, NestedAbsmax_ptr, NestedCode_ptr, NestedOffset_ptr,
    Out_ptr, numel, num_bytes, num_blocks,
    BLOCKSIZE: tl.constexpr, NESTED_BLOCKSIZE: tl.constexpr, BLOCKS_PER_PROGRAM: tl.constexpr,
    NESTED: tl.constexpr, BF16_BY_BITS: tl.constexpr,
):  # fmt: skip
    """Program `program`'s share of one weight: blocks [program * BLOCKS_PER_PROGRAM, ...). The body of
    `_dequantize_4bit_kernel` and of each member's programs in `dequant4bit_group`."""
    HALF_BLOCK: tl.constexpr = BLOCKSIZE // 2
    # The program's first block, widened to int64 before it meets an element count: a 128k x 16k
    # embedding has 2**31 elements. In-tile offsets stay int32 and move the 64-bit pointers.
    first_block = program.to(tl.int64) * BLOCKS_PER_PROGRAM
    offs_block = tl.arange(0, BLOCKS_PER_PROGRAM)
    block_mask = offs_block < num_blocks - first_block
    if NESTED:
        blocks = first_block + offs_block
        quantized = tl.load(Absmax_ptr + blocks, mask=block_mask, other=0).to(tl.int32)
        second_level = tl.load(NestedAbsmax_ptr + blocks // NESTED_BLOCKSIZE, mask=block_mask, other=0.0)
        # Two roundings, as bitsandbytes (one kernel, then a torch add): the launcher turns off fp
        # fusion, or the compiler would make this one fma with one rounding and a different result.
        scale = tl.load(NestedCode_ptr + quantized) * second_level
        scale = scale + tl.load(NestedOffset_ptr)
    else:
        scale = tl.load(Absmax_ptr + first_block + offs_block, mask=block_mask, other=0.0)
    scale = scale[:, None]

    offs_byte = offs_block[:, None] * HALF_BLOCK + tl.arange(0, HALF_BLOCK)[None, :]
    # Masked against a byte count (not 2 * offs_byte < elements): Triton then knows the mask is
    # constant over 16 bytes and issues one 16-byte load a thread instead of 16 single-byte loads.
    byte_mask = offs_byte < num_bytes - first_block * HALF_BLOCK
    packed = tl.load(Packed_ptr + first_block * HALF_BLOCK + offs_byte, mask=byte_mask, other=0)
    high = tl.load(Code_ptr + (packed >> 4).to(tl.int32))  # 16-entry table: stays in L1
    low = tl.load(Code_ptr + (packed & 0x0F).to(tl.int32))
    # [BLOCKS, HALF_BLOCK] pairs -> [BLOCKS, BLOCKSIZE] in element order: high nibble first.
    values = tl.interleave(high * scale, low * scale)
    if BF16_BY_BITS:
        # Round to nearest even on the fp32 bits (add 0x7FFF plus the lowest kept bit, drop 16 bits):
        # exact for every non-NaN value, the same as the cvt.rn.bf16 instruction a plain cast emits.
        bits = values.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        out_values = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        out_values = values.to(Out_ptr.dtype.element_ty)
    offs_out = offs_block[:, None] * BLOCKSIZE + tl.arange(0, BLOCKSIZE)[None, :]
    out_mask = offs_out < numel - first_block * BLOCKSIZE
    tl.store(Out_ptr + first_block * BLOCKSIZE + offs_out, out_values, mask=out_mask)


# ---------------------------------------------------------------------------------------------------
# Launcher. Callers have checked shapes, dtypes and devices.
# ---------------------------------------------------------------------------------------------------

# Elements one program writes. The kernel streams 0.5 byte in and 2-4 bytes out per element; 4096
# elements over 4 warps give every thread one 16-byte load of packed bytes and four 16-byte stores.
# Measured on an H200 (CUDA graphs; nested NF4, bf16 out): 8192 x 8192 in 44.6 us, 3.76 TB/s against
# 4.08 for a plain copy of as many bytes (bitsandbytes: 80.5 us); 4096 x 4096 in 11.7 us (24.6 us).
# 2048-8192 elements and 2-4 warps are within 3% of each other; 1024 elements lose up to 18%.
_ELEMENTS_PER_PROGRAM = 4096


def _contiguous_as(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` in ``dtype``, contiguous: itself when it already is (each torch call costs 1-4 us of
    host time; the kernel takes 12 us on a 4096 x 4096 weight, so host time is what limits)."""
    if tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def _dequantize_4bit_triton(
    *,
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
    elements_per_program: int = _ELEMENTS_PER_PROGRAM,
    num_warps: int = 4,
    bf16_by_bits: bool | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    # out: a contiguous [rows, cols] out_dtype tensor to write into (the first rows of a larger
    # buffer, see `dequantize`), 16-byte aligned like a fresh one, so a plan's launch fits it too.
    tensors = (packed, absmax, code, nested_absmax, nested_code, nested_offset)
    plan_key = None
    if _DEQUANTIZE_PLANS.enabled:
        plan_key = _dequantize_plan_key(
            tensors, blocksize, nested_blocksize, rows, cols, out_dtype, elements_per_program, num_warps,
            bf16_by_bits,
        )  # fmt: skip
        plan = _DEQUANTIZE_PLANS.get(plan_key)
        if plan is not None:
            return _run_dequantize_plan(plan, tensors, rows, cols, out_dtype, out)
    out = torch.empty((rows, cols), dtype=out_dtype, device=packed.device) if out is None else out
    numel = rows * cols
    if numel == 0:
        return out
    nested = nested_absmax is not None
    launched = kernel_inputs(tensors)
    num_blocks = cdiv(numel, blocksize)
    blocks_per_program = max(1, elements_per_program // blocksize)
    grid = (cdiv(num_blocks, blocks_per_program),)
    # Triton 3.6's interpreter (the CPU path) casts fp32 to bf16 by truncation, not to nearest even.
    # On a GPU the plain cast (cvt.rn) is right and 10-15% faster than the integer rounding.
    if bf16_by_bits is None:
        bf16_by_bits = packed.device.type != "cuda"
    bound = _dequantize_4bit_kernel[grid](
        *launched, out,
        numel, (numel + 1) // 2, num_blocks,
        BLOCKSIZE=blocksize, NESTED_BLOCKSIZE=nested_blocksize if nested else 1,
        BLOCKS_PER_PROGRAM=blocks_per_program, NESTED=nested,
        BF16_BY_BITS=bf16_by_bits and out_dtype == torch.bfloat16,
        num_warps=num_warps,
        enable_fp_fusion=False,  # bit-exactness: see the nested scale in the kernel
    )  # fmt: skip
    # Planned only when the kernel read the caller's tensors as they were (the usual case: a
    # bitsandbytes state is contiguous and of these dtypes) or, when not nested, `code` in the
    # unused nested slots: a plan then passes the call's own tensors in the same places.
    sources = tuple(_source_index(tensor, tensors) for tensor in launched)
    if plan_key is not None and bound is not None and None not in sources:
        sizes = (numel, (numel + 1) // 2, num_blocks)
        _DEQUANTIZE_PLANS.add(plan_key, _DequantizePlan(bound, packed.device, sources, sizes))
    return out


def kernel_inputs(tensors: tuple) -> tuple[torch.Tensor, ...]:
    """(packed, absmax, code, nested_absmax, nested_code, nested_offset) as the kernel reads them: the
    caller's own tensors where they already are (the usual case, which a launch plan needs), else
    converted copies; without nesting, `code` in the three nested slots (never read)."""
    packed, absmax, code, nested_absmax, nested_code, nested_offset = tensors
    if not packed.is_contiguous():
        packed = packed.contiguous()
    if packed.dtype != torch.uint8:
        packed = packed.view(torch.uint8)  # quant_storage bf16/fp32...: the same bytes
    code = _contiguous_as(code, torch.float32)
    if nested_absmax is None:
        absmax = _contiguous_as(absmax, torch.float32)  # fp16 absmax: exact, as bitsandbytes does
        return packed, absmax, code, code, code, code
    absmax = _contiguous_as(absmax, torch.uint8)
    nested_absmax = _contiguous_as(nested_absmax, torch.float32)
    nested_code = _contiguous_as(nested_code, torch.float32)
    nested_offset = _contiguous_as(nested_offset, torch.float32)
    return packed, absmax, code, nested_absmax, nested_code, nested_offset


def _source_index(tensor: torch.Tensor, inputs: tuple) -> int | None:
    """Which of the caller's tensors `tensor` is, or None for a copy the launcher made."""
    for index, candidate in enumerate(inputs):
        if tensor is candidate:
            return index
    return None


class _DequantizePlan(NamedTuple):
    """What `_dequantize_4bit_triton` derived from its inputs' metadata, to launch the same again."""

    launch: BoundLaunch
    device: torch.device
    sources: tuple[int, ...]  # for each tensor argument, which input of the call it is
    sizes: tuple[int, ...]  # numel, packed bytes, blocks

    def arguments(self, inputs: tuple) -> list[torch.Tensor]:
        return [inputs[index] for index in self.sources]


_DEQUANTIZE_PLANS = LaunchPlans("dequantize_4bit")


# The launcher's defaults of (elements_per_program, num_warps, bf16_by_bits), the op body's launch.
_DEFAULT_LAUNCH = (_ELEMENTS_PER_PROGRAM, 4, None)


def _dequantize_plan_key(tensors: tuple, *settings) -> tuple:
    """The one key of a dequantize plan, so the launcher's and the op body's lookups agree: the six
    tensors, then (blocksize, nested_blocksize, rows, cols, out_dtype, elements_per_program,
    num_warps, bf16_by_bits), the op body's last three `_DEFAULT_LAUNCH`."""
    return _DEQUANTIZE_PLANS.key(*tensors, *settings)


@trace_unit
def _run_dequantize_plan(
    plan: _DequantizePlan,
    tensors: tuple,
    rows: int,
    cols: int,
    out_dtype: torch.dtype,
    out: torch.Tensor | None,
) -> torch.Tensor:
    out = empty_2d(rows, cols, out_dtype, plan.device) if out is None else out
    plan.launch(*plan.arguments(tensors), out, *plan.sizes)
    return out


# ---------------------------------------------------------------------------------------------------
# Public op: checks, dispatch, fake implementation.
# ---------------------------------------------------------------------------------------------------


def _check_dequantize(
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
) -> None:
    op = "dequantize_4bit"
    if rows < 0 or cols < 0:
        raise ValueError(f"{op}: rows and cols must be >= 0, got {rows} x {cols}")
    if blocksize not in _BLOCKSIZES:
        raise ValueError(f"{op}: blocksize must be one of {_BLOCKSIZES}, got {blocksize}")
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"{op}: out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    numel = rows * cols
    num_blocks = -(-numel // blocksize)
    packed_bytes = packed.numel() * packed.element_size()
    if packed_bytes < (numel + 1) // 2:
        raise ValueError(f"{op}: packed holds {packed_bytes} bytes, {rows} x {cols} needs {(numel + 1) // 2}")
    if code.numel() != 16 or code.dtype != torch.float32:
        raise ValueError(f"{op}: code must be [16] float32, got {list(code.shape)} {code.dtype}")
    if absmax.numel() != num_blocks:
        raise ValueError(f"{op}: absmax must hold one value per block ({num_blocks}), got {absmax.numel()}")
    nested = (nested_absmax, nested_code, nested_offset)
    if any(t is None for t in nested) and any(t is not None for t in nested):
        raise ValueError(
            f"{op}: nested_absmax, nested_code and nested_offset are given together or not at all"
        )
    devices = {"packed": packed.device, "absmax": absmax.device, "code": code.device}
    if nested_absmax is None:
        if not absmax.is_floating_point():
            raise ValueError(f"{op}: absmax must be floating point without nesting, got {absmax.dtype}")
    else:
        if absmax.dtype != torch.uint8:
            raise ValueError(f"{op}: nested absmax must be uint8 codes, got {absmax.dtype}")
        if nested_blocksize <= 0:
            raise ValueError(f"{op}: nested_blocksize must be positive, got {nested_blocksize}")
        nested_blocks = -(-num_blocks // nested_blocksize)
        if nested_absmax.numel() != nested_blocks or not nested_absmax.is_floating_point():
            raise ValueError(
                f"{op}: nested_absmax must be [{nested_blocks}] float, got {list(nested_absmax.shape)} "
                f"{nested_absmax.dtype}"
            )
        if nested_code.numel() != _NESTED_CODE_SIZE or not nested_code.is_floating_point():
            raise ValueError(f"{op}: nested_code must be [256] float, got {list(nested_code.shape)}")
        if nested_offset.numel() != 1 or not nested_offset.is_floating_point():
            raise ValueError(f"{op}: nested_offset must be one float, got {list(nested_offset.shape)}")
        devices.update(nested_absmax=nested_absmax.device, nested_code=nested_code.device)
        devices.update(nested_offset=nested_offset.device)
    if len(set(devices.values())) > 1:
        raise ValueError(f"{op}: all inputs must be on one device, got {devices}")


def _dequantize_4bit_eager(
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
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The body of the ops ``dequantize_4bit`` and ``dequantize_4bit_``: checks, then the Triton
    kernel or the reference. out: see `dequantize` (``dequantize_4bit_`` passes it).

    The launch plan is looked up before `_check_dequantize`, and a hit launches without it, as in
    `lora_terms` (`_PLANS_SKIP_CHECKS` there): the checks read only what the plan's key holds (every
    tensor's shape, dtype and device, the sizes and out_dtype), and a plan is made only by a launch
    with the launcher's default settings, which this body reaches after its checks. A given `out`,
    not in the key, is checked either way. A 4-bit q/k/v step dequantizes six times.
    """
    if out is not None:
        _check_out(out, rows, cols, out_dtype, storage_start=True)
    if _DEQUANTIZE_PLANS.serve(packed):
        tensors = (packed, absmax, code, nested_absmax, nested_code, nested_offset)
        key = _dequantize_plan_key(
            tensors, blocksize, nested_blocksize, rows, cols, out_dtype, *_DEFAULT_LAUNCH
        )
        plan = _DEQUANTIZE_PLANS.get(key)
        if plan is not None:
            return _run_dequantize_plan(plan, tensors, rows, cols, out_dtype, out)
    _check_dequantize(
        packed, absmax, code, nested_absmax, nested_code, nested_offset,
        blocksize, nested_blocksize, rows, cols, out_dtype,
    )  # fmt: skip
    if runs_triton(packed):
        return _dequantize_4bit_triton(
            packed=packed, absmax=absmax, code=code,
            nested_absmax=nested_absmax, nested_code=nested_code, nested_offset=nested_offset,
            blocksize=blocksize, nested_blocksize=nested_blocksize, rows=rows, cols=cols, out_dtype=out_dtype,
            out=out,
        )  # fmt: skip
    weight = reference.dequantize_4bit(
        packed, absmax, code, nested_absmax, nested_code, nested_offset,
        blocksize, nested_blocksize, rows, cols, out_dtype,
    )  # fmt: skip
    return weight.contiguous() if out is None else out.copy_(weight)


@torch.library.custom_op(f"{OP_NAMESPACE}::dequantize_4bit", mutates_args=())
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
    """bitsandbytes' 4-bit weight as a dense [rows, cols] out_dtype tensor, contiguous.

    packed: the weight's bytes, ceil(rows * cols / 2) of them in any shape and storage dtype
        (``quant_storage`` uint8, bf16, fp32...: read as raw bytes); two 4-bit codes a byte, high
        nibble first, elements in row-major order.
    absmax: [ceil(rows * cols / blocksize)] float32, one scale per block of ``blocksize`` consecutive
        elements; with double quantization the uint8 codes of those scales instead.
    code: [16] float32, the value of each 4-bit code (``code_for("nf4" | "fp4")``).
    nested_absmax, nested_code, nested_offset: None, or (double quantization) the second level:
        [ceil(blocks / nested_blocksize)] float32 scales, the [256] float32 8-bit code and the one-element
        float32 offset added after dequantizing (a tensor, not a float: no host sync to read it, and
        torch.compile does not specialize on its value).
    out_dtype: float32, bfloat16 or float16. Bit-exact with bitsandbytes when it is the state's dtype.
    """
    return _dequantize_4bit_eager(
        packed, absmax, code, nested_absmax, nested_code, nested_offset,
        blocksize, nested_blocksize, rows, cols, out_dtype,
    )  # fmt: skip


@dequantize_4bit.register_fake
def _(
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
    _check_dequantize(
        packed, absmax, code, nested_absmax, nested_code, nested_offset,
        blocksize, nested_blocksize, rows, cols, out_dtype,
    )  # fmt: skip
    return packed.new_empty((rows, cols), dtype=out_dtype)


@torch.library.custom_op(f"{OP_NAMESPACE}::dequantize_4bit_", mutates_args=("out",))
def dequantize_4bit_(
    out: torch.Tensor,
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
) -> None:
    """`dequantize_4bit` written into ``out`` (contiguous [rows, cols], its dtype the output dtype,
    starting where its storage starts): see `dequantize`."""
    _dequantize_4bit_eager(
        packed, absmax, code, nested_absmax, nested_code, nested_offset,
        blocksize, nested_blocksize, rows, cols, out.dtype, out=out,
    )  # fmt: skip


@dequantize_4bit_.register_fake
def _(
    out,
    packed,
    absmax,
    code,
    nested_absmax,
    nested_code,
    nested_offset,
    blocksize,
    nested_blocksize,
    rows,
    cols,
):
    _check_dequantize(
        packed, absmax, code, nested_absmax, nested_code, nested_offset,
        blocksize, nested_blocksize, rows, cols, out.dtype,
    )  # fmt: skip
    _check_out(out, rows, cols, out.dtype, storage_start=False)


# ---------------------------------------------------------------------------------------------------
# The quantization state, read from bitsandbytes without importing it.
# ---------------------------------------------------------------------------------------------------


@functools.cache
def _cached_code(quant_type: str, device: torch.device) -> torch.Tensor:
    return reference.code_for(quant_type, device)


class Quant4bitState(NamedTuple):
    """What ``dequantize_4bit`` needs besides the packed bytes; tensors on the weight's device.

    absmax: [blocks] float32, or [blocks] uint8 when nested.
    code: [16] float32 values of the 4-bit codes (bitsandbytes' kernel tables for ``quant_type``).
    nested_absmax: [ceil(blocks / nested_blocksize)] float32, or None.
    nested_code: [256] float32, or None.
    nested_offset: one-element float32 tensor, or None.
    blocksize, nested_blocksize (0 when not nested), rows, cols: ints.
    dtype: the dtype bitsandbytes dequantizes to (the original weight's), where results are bit-exact.
    quant_type: "nf4" or "fp4".
    """

    absmax: torch.Tensor
    code: torch.Tensor
    nested_absmax: torch.Tensor | None
    nested_code: torch.Tensor | None
    nested_offset: torch.Tensor | None
    blocksize: int
    nested_blocksize: int
    rows: int
    cols: int
    dtype: torch.dtype
    quant_type: str

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.rows, self.cols))

    @property
    def nested(self) -> bool:
        return self.nested_absmax is not None

    @classmethod
    def from_bnb(cls, source: Any, packed: torch.Tensor | None = None) -> Quant4bitState:
        """Reads a bitsandbytes ``Params4bit`` (its ``.quant_state``) or a ``QuantState`` directly.

        Duck-typed: reads absmax, shape, dtype, blocksize, quant_type, nested, offset and
        state2.{absmax, code, blocksize, dtype}. Shapes of more than two dims are read as
        [prod(shape[:-1]), shape[-1]]. ``packed``, if given (or ``source`` itself when it is the
        parameter), is checked to hold enough bytes. No host sync, so it can run every forward.
        ``quant_state.code`` is not read: bitsandbytes' kernels use fixed tables chosen by quant_type.
        """
        quant_state = getattr(source, "quant_state", source)
        if packed is None and isinstance(source, torch.Tensor):
            packed = source
        if quant_state is None:
            raise ValueError("Quant4bitState.from_bnb: the parameter has no quant_state (not quantized yet?)")
        if getattr(quant_state, "packing_format_for_cpu", False):
            # Set by bitsandbytes' CPU inference path (Linear4bit.forward in eval mode on a CPU with
            # AVX512-BF16): bytes reordered in 32-row tiles, absmax transposed to bf16, nesting undone.
            raise ValueError(
                "Quant4bitState.from_bnb: this weight is in bitsandbytes' CPU-repacked layout "
                "(quant_state.packing_format_for_cpu=True), which fastlora does not read. Undo it first, "
                "e.g. with bitsandbytes.functional._convert_weight_packed_for_cpu_inverse(weight.data, "
                "quant_state) or by moving the parameter to a GPU (Params4bit.cuda() undoes it)."
            )
        quant_type = quant_state.quant_type
        shape = tuple(quant_state.shape)
        rows = 1
        for size in shape[:-1]:
            rows *= int(size)
        cols = int(shape[-1]) if shape else 1
        absmax = quant_state.absmax
        if getattr(quant_state, "nested", False):
            state2 = quant_state.state2
            if getattr(state2, "dtype", None) not in (None, torch.float32):
                raise ValueError(
                    f"Quant4bitState.from_bnb: nested absmax dtype {state2.dtype} is not float32"
                )
            nested_absmax, nested_code = state2.absmax, state2.code.float()
            nested_blocksize = int(state2.blocksize)
            offset = quant_state.offset
            if not isinstance(offset, torch.Tensor):  # a float in states built by hand
                offset = torch.tensor(float(offset), dtype=torch.float32, device=absmax.device)
            nested_offset = offset.reshape(1).float()
        else:
            nested_absmax = nested_code = nested_offset = None
            nested_blocksize = 0
            absmax = absmax.float()  # bitsandbytes reads fp16 absmax as fp32 too (exact)
        state = cls(
            absmax=absmax,
            code=_cached_code(quant_type, absmax.device),
            nested_absmax=nested_absmax,
            nested_code=nested_code,
            nested_offset=nested_offset,
            blocksize=int(quant_state.blocksize),
            nested_blocksize=nested_blocksize,
            rows=rows,
            cols=cols,
            dtype=quant_state.dtype,
            quant_type=quant_type,
        )
        if packed is not None:
            needed = (rows * cols + 1) // 2
            if packed.numel() * packed.element_size() < needed:
                raise ValueError(f"Quant4bitState.from_bnb: packed weight has fewer than {needed} bytes")
        return state


class BnbStateReader:
    """`Quant4bitState.from_bnb(param)` of one layer's parameter, read again only when something that
    reading depends on changed: a fused 4-bit forward asks for its state on every call, and reading it
    makes tensor ops (`.float()`, a reshape) and attribute walks each time (6.5 us a call on the CPU
    machine against 2.3 for this check; a q/k/v step reads three).

    What `from_bnb` reads is compared by identity (the parameter, its quant state, the nested state
    and every tensor of them), by version where `from_bnb` may hand out a converted copy (absmax, the
    nested code, the offset: an in-place change of the original) and by value (every other field).
    The quant state's objects are small (scales, codes) and held, so an id compared is never one of a
    freed object; the parameter (the packed weight) is held only weakly, so the reader never keeps a
    replaced weight alive. bitsandbytes' `QuantState.to` replaces its tensors rather than moving them
    in place, so a moved model reads again.
    """

    __slots__ = ("_param", "_held", "_signature", "_state")

    def __init__(self) -> None:
        self._param: weakref.ref | None = None
        self._held: tuple = ()
        self._signature: tuple | None = None
        self._state: Quant4bitState | None = None

    def __call__(self, param: torch.Tensor) -> Quant4bitState:
        if torch.compiler.is_compiling():
            # Under torch.compile a tensor's `_version` is a data-dependent symbol that dynamo cannot
            # guard on (tests/test_compile.py failed); the graph reads the state once anyway.
            return Quant4bitState.from_bnb(param)
        held, signature = _bnb_signature(param)
        if signature == self._signature and self._param is not None and self._param() is param:
            return self._state
        state = Quant4bitState.from_bnb(param)
        self._param, self._held, self._signature, self._state = weakref.ref(param), held, signature, state
        return state

    def __reduce__(self):
        # Pickled or deep-copied (with its layer) as a new, empty reader: a weak reference does not
        # pickle, and a copy reads its own parameter's state anyway.
        return (BnbStateReader, ())


def _bnb_signature(param: torch.Tensor) -> tuple[tuple, tuple]:
    """(the quant state's objects `from_bnb(param)` reads, what the reader compares): ids, versions
    and plain values only, so comparing two signatures never calls a tensor's `==`."""
    quant_state = getattr(param, "quant_state", None)
    if quant_state is None:
        return (), (id(param), None)
    nested = getattr(quant_state, "nested", False)
    absmax, offset = quant_state.absmax, getattr(quant_state, "offset", None)
    held = (quant_state, absmax, offset)
    values = (
        id(param), quant_state.quant_type, quant_state.shape, quant_state.blocksize, quant_state.dtype,
        nested, getattr(quant_state, "packing_format_for_cpu", False), absmax._version,
        offset._version if isinstance(offset, torch.Tensor) else offset,
    )  # fmt: skip
    if nested:
        state2 = quant_state.state2
        held += (state2, state2.absmax, state2.code)
        values += (
            getattr(state2, "dtype", None),
            state2.blocksize,
            state2.code._version,
        )
    return held, (*map(id, held), *values)


def dequantize(
    state: Quant4bitState,
    packed: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The dense [rows, cols] weight. out_dtype defaults to ``state.dtype``, the bit-exact choice.

    packed: the ``Params4bit`` itself or its data, any quant_storage dtype.
    out: None, or a contiguous [rows, cols] tensor of out_dtype that starts where its storage does (the
    first rows of a larger buffer: the augmented dX weight, `functions/augmented_k.py`) to write the
    weight into (through ``fastlora::dequantize_4bit_`` where the op dispatches).

    Under torch.compile, a dispatch mode (fake tensors, tracing) or a tensor subclass this calls the
    library op ``fastlora::dequantize_4bit``; on plain tensors in eager mode it runs the op's body
    directly, the same code without the op's dispatch. Host time a call on the H200 machine: 31 us
    this way, 56 us through the op (bitsandbytes' dequantize_4bit: 38 us); the kernel takes 12 us on
    a 4096 x 4096 weight, so the op's dispatch would make the host the bottleneck.
    """
    if isinstance(packed, torch.nn.Parameter):
        packed = packed.data  # a plain tensor: Params4bit's __torch_function__ would re-wrap results
    args = (
        packed, state.absmax, state.code, state.nested_absmax, state.nested_code, state.nested_offset,
        state.blocksize, state.nested_blocksize, state.rows, state.cols,
        state.dtype if out_dtype is None else out_dtype,
    )  # fmt: skip
    if skips_op_dispatch(packed, state.absmax, state.nested_absmax, out):
        return _dequantize_4bit_eager(*args, out=out)
    if out is None:
        return dequantize_4bit(*args)
    dequantize_4bit_(out, *args[:-1])
    return out


def _check_out(out: torch.Tensor, rows: int, cols: int, out_dtype: torch.dtype, storage_start: bool) -> None:
    """storage_start: also check that out starts where its storage does (a real tensor: not under
    torch.compile's tracing, where reading the offset would break the graph)."""
    if out.shape != (rows, cols) or out.dtype != out_dtype or not out.is_contiguous():
        raise ValueError(
            f"dequantize: out must be a contiguous [{rows}, {cols}] {out_dtype} tensor, "
            f"got {list(out.shape)} {out.dtype} strides {out.stride()}"
        )
    if storage_start and out.storage_offset() != 0:
        raise ValueError("dequantize: out must start where its storage starts (the kernel's alignment)")
