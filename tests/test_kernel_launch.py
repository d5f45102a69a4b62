"""`CachedKernel`: the key it reuses compiled kernels by, and (on CUDA) that the compiled kernel it
reuses is the one Triton's own ``kernel[grid]`` would launch, for every kernel of the package.

A key that merged two argument lists Triton specializes apart would launch a kernel compiled for
other strides or alignment (wrong results, or memory errors), so the key tests name each property.
"""

from __future__ import annotations

import pytest
import torch
from conftest import _kernel_objects

from fastlora_peft.kernels import lora_terms
from fastlora_peft.kernels._launch import CachedKernel, LaunchPlans, _argument_key

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_every_kernel_of_the_package_launches_through_the_cache():
    names = set(_kernel_objects())
    assert {
        "_lora_shrink_kernel",
        "_lora_expand_add_kernel",
        "_lora_weight_grad_kernel",
        "_gated_act_forward_kernel",
        "_gated_act_backward_kernel",
        "_dequantize_4bit_kernel",
    } <= names


@pytest.mark.parametrize(
    "first, second",
    [
        (1, 2),  # Triton makes 1 a constant
        (0, 16),
        (16, 17),  # multiples of 16 are marked
        (32, 48 + 1),
        (2**31 - 16, 2**31),  # i32 against i64
        (16, 2**32),
        (0.5, None),
    ],
)
def test_key_tells_apart_what_triton_specializes_on(first, second):
    assert _argument_key(first) != _argument_key(second)


def test_key_merges_only_what_triton_merges():
    assert _argument_key(32) == _argument_key(4096)  # both multiples of 16, both i32
    assert _argument_key(17) == _argument_key(4097)
    assert _argument_key(0.5) == _argument_key(3.0)  # floats are never specialized


def test_key_of_tensors_holds_dtype_and_16_byte_alignment():
    storage = torch.zeros(64, dtype=torch.float32)
    assert _argument_key(storage) == _argument_key(storage[4:])  # 16 bytes further: still aligned
    assert _argument_key(storage) != _argument_key(storage[1:])  # 4 bytes further: not aligned
    assert _argument_key(storage) != _argument_key(storage.to(torch.bfloat16))


def test_key_of_tma_descriptors_holds_dtype_alignment_block_and_ints():
    from triton.tools.tensor_descriptor import TensorDescriptor

    storage = torch.zeros(64 * 96, dtype=torch.bfloat16)

    def descriptor(offset=0, rows=64, row_stride=64, block=(16, 32), dtype=torch.bfloat16):
        tensor = storage.to(dtype)[offset : offset + rows * row_stride].view(rows, row_stride)
        return TensorDescriptor.from_tensor(tensor, list(block))

    key = _argument_key(descriptor())
    assert key == _argument_key(descriptor(rows=32))  # both multiples of 16
    assert key == _argument_key(descriptor(offset=64))  # 128 bytes on: still aligned
    assert key != _argument_key(descriptor(rows=33))  # a row count off the multiples of 16
    assert key != _argument_key(descriptor(row_stride=72, rows=48))  # a stride off them
    assert key != _argument_key(descriptor(block=(32, 32)))
    assert key != _argument_key(descriptor(dtype=torch.float16))
    # 8 bytes on is no TMA base at all (TensorDescriptor refuses it), so alignment is not probed here.


def test_key_holds_constexpr_values_and_options():
    kernel = lora_terms._lora_shrink_kernel
    args = (torch.zeros(4), 8)
    keys = {
        kernel.key(args, dict(BLOCK_M=32, num_warps=4), 0),
        kernel.key(args, dict(BLOCK_M=64, num_warps=4), 0),
        kernel.key(args, dict(BLOCK_M=32, num_warps=8), 0),
        kernel.key(args, dict(BLOCK_M=32, num_warps=4), 1),
    }
    assert len(keys) == 4
    assert kernel.key(args, dict(BLOCK_M=32, num_warps=4), 0) in keys


def test_constexprs_must_be_keywords():
    kernel = lora_terms._lora_shrink_kernel
    runtime_arguments = [None] * kernel.positional_limit
    assert kernel.arg_names[kernel.positional_limit] == "BLOCK_M"
    with pytest.raises(TypeError, match="as keywords"):
        kernel[(1,)](*runtime_arguments, 32)


@needs_cuda
def test_reused_kernel_is_the_one_triton_launches():
    """Shrink launches differing in every property Triton specializes on: for each, the compiled
    kernel the cache holds under its key is the very object Triton's own launch path picks for the
    same arguments, and the cached launch computes 0.5 * x @ weight.T."""
    cached: CachedKernel = lora_terms._lora_shrink_kernel
    device = torch.device("cuda")
    storage = torch.randn(80 * 300, device=device, dtype=torch.bfloat16)
    weight_storage = torch.randn(16 * 300 + 1, device=device, dtype=torch.bfloat16)
    meta = dict(
        BLOCK_M=32, BLOCK_K=64, BLOCK_R=16, DOT_PRECISION="tf32", DOT_MODE=1, SPLIT=False,
        num_warps=4, num_stages=2,
    )  # fmt: skip
    cases = [
        (storage[: 64 * 256].view(64, 256), weight_storage[: 16 * 256].view(16, 256)),
        (storage[1 : 1 + 64 * 256].view(64, 256), weight_storage[: 16 * 256].view(16, 256)),  # x misaligned
        (storage[: 64 * 256].view(64, 256), weight_storage[1 : 1 + 16 * 256].view(16, 256)),  # w misaligned
        (storage[: 63 * 255].view(63, 255), weight_storage[: 16 * 255].view(16, 255)),  # odd sizes
        (storage[: 80 * 256].view(256, 80).t(), weight_storage[: 16 * 256].view(16, 256)),  # x column-major
        (storage[:256].view(1, 256), weight_storage[: 16 * 256].view(16, 256)),  # one row
    ]
    for round_ in range(2):  # the second round launches from the cache
        for x, weight in cases:
            rows, k = x.shape
            out = torch.empty(rows, 16, device=device, dtype=torch.float32)
            args = (
                x, weight, out, out, out,  # one split: no partials, no counters
                rows, k, 16, k, 1, 0.5,
                x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
            )  # fmt: skip
            grid = (triton_cdiv(rows, 32), 1, 1)
            cached[grid](*args, **meta)
            torch.testing.assert_close(out, 0.5 * (x.float() @ weight.float().T), rtol=1e-5, atol=1e-3)
            own = cached.kernel[grid](*args, **meta)  # Triton's own path, bypassing the cache
            assert cached.compiled[cached.key(args, meta, torch.cuda.current_device())] is own, (
                round_,
                tuple(x.shape),
                x.stride(),
            )


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


@needs_cuda
def test_cache_hits_call_the_c_launcher_directly_unless_a_launch_hook_is_registered(monkeypatch):
    """A hit launches through the compiled kernel's C launch function (no Python wrapper), with the
    same result as Triton's own path; once a launch hook is registered, hits go through Triton's
    wrapper again, so the hook sees every launch."""
    from triton import knobs

    device = torch.device("cuda")
    x = torch.randn(96, 320, device=device, dtype=torch.bfloat16)
    weight = torch.randn(16, 320, device=device, dtype=torch.bfloat16)
    expected = x.float() @ weight.float().T
    cached: CachedKernel = lora_terms._lora_shrink_kernel
    monkeypatch.setattr(LaunchPlans, "enabled", False)  # every launch through the cache, none from a plan
    monkeypatch.setattr(cached, "compiled", {})
    monkeypatch.setattr(cached, "direct", {})
    lora_terms.lora_shrink(x, weight)  # a miss: Triton's own path compiles (or loads) the kernel
    ((key, direct),) = cached.direct.items()
    assert direct is not None
    calls = []
    spy = direct._replace(launch=lambda *args: calls.append(args) or direct.launch(*args))
    monkeypatch.setitem(cached.direct, key, spy)
    torch.testing.assert_close(lora_terms.lora_shrink(x, weight), expected, rtol=1e-5, atol=1e-3)
    assert len(calls) == 1
    seen = []
    hook = lambda metadata: seen.append(metadata)  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        torch.testing.assert_close(lora_terms.lora_shrink(x, weight), expected, rtol=1e-5, atol=1e-3)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(calls) == 1 and len(seen) == 1
