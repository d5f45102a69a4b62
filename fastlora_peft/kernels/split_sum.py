"""Splits of a reduction summed inside the kernel that computed them: no separate sum launch.

A kernel that splits its reduction dimension (lora_shrink over K, the weight gradients over tokens,
so every SM gets work at a few thousand tokens) used to write one fp32 slab per split and leave the
sum, and the cast to the result's dtype, to two more torch ops. Each op costs a launch's host time,
and the o_proj and q/k/v blocks are host-bound (docs/benchmarks.md). Here each program stores its
partial tile, then counts itself in with an atomic on the tile's counter; the program that completes
the count sums the partials in split order and writes the result in its final dtype and layout. The
sum's order does not depend on which program came last, so results stay deterministic.

The counters live in one int32 buffer per (device, stream), zeroed once and left at zero by every
launch (the last program of a tile resets its counter), so a launch costs no memset. Launches on
one stream run one after another and never share a counter while running; another stream gets its
own buffer. Two cases get counters of their own, zeroed per launch and cached nowhere:

* a launch captured into a CUDA graph: a replay may run beside eager launches on another stream,
  so it must not share their buffer (the zeroing is captured with it);
* a launch whose fresh buffer landed in a CUDA graph's private memory pool (torch.compile's
  cudagraph trees warm a graph up with this thread's allocations routed there): the tree may later
  hand that memory to its own tensors, so caching it could corrupt the counters.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Counters per (device, stream handle); grown (and the old buffer dropped) when a launch needs more.
_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}
_MIN_COUNTERS = 4096


def split_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """A zeroed int32 buffer of at least `tiles` counters for launches on the current stream of `device`."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(tiles, dtype=torch.int32, device=device)
    stream = torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else 0
    key = (device, stream)
    counters = _COUNTERS.get(key)
    if counters is None or counters.numel() < tiles:
        counters = torch.zeros(max(tiles, _MIN_COUNTERS), dtype=torch.int32, device=device)
        if device.type == "cuda" and not in_default_memory_pool(counters):
            return counters
        _COUNTERS[key] = counters
    return counters


def in_default_memory_pool(tensor: torch.Tensor) -> bool:
    """Whether a CUDA tensor's memory belongs to the caching allocator's default pool, not a graph's.

    Reads the allocator's snapshot (milliseconds with many segments): called once per new buffer.
    """
    address = tensor.data_ptr()
    for segment in torch.cuda.memory_snapshot():
        start = segment["address"]
        if start <= address < start + segment["total_size"]:
            return tuple(segment["segment_pool_id"]) == (0, 0)
    return False  # not found: treat as not ours to cache


@triton.jit
def split_total(acc, Partial_ptr, offsets, mask, split, n_splits, stride_split, Counter_ptr):
    """(is_last, total) for this program's tile of split `split` out of `n_splits`.

    Stores acc (fp32) as the split's partial at Partial_ptr + split * stride_split + offsets, then
    counts in at Counter_ptr. The program whose count completes the tile gets is_last and the sum of
    every split's partial in split order (and resets the counter); the others get is_last False.
    """
    tl.store(Partial_ptr + split * stride_split + offsets, acc, mask=mask)
    # Every thread's store is issued before the counting atomic, whose release (acq_rel, GPU scope)
    # then publishes them; the last program's acquire orders its loads after all of them, and the
    # loads bypass L1 (".cg"), which is not coherent across SMs.
    tl.debug_barrier()
    arrived = tl.atomic_add(Counter_ptr, 1, sem="acq_rel", scope="gpu")
    is_last = arrived == n_splits - 1
    total = tl.zeros_like(acc)
    if is_last:
        for other in range(0, n_splits):
            partial_ptrs = Partial_ptr + other * stride_split + offsets
            total += tl.load(partial_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(Counter_ptr, 0, sem="relaxed", scope="gpu")
    return is_last, total
