"""Splits of a reduction summed inside the kernel that computed them: no separate sum launch.

A kernel that splits its reduction dimension (lora_shrink over K, the weight gradients over tokens,
so every SM gets work at a few thousand tokens) used to write one fp32 slab per split and leave the
sum, and the cast to the result's dtype, to two more torch ops. Each op costs a launch's host time,
and the o_proj and q/k/v blocks are host-bound (docs/benchmarks.md). Here each program stores its
partial tile, then counts itself in with an atomic on the tile's counter; the program that completes
the count sums the partials in split order and writes the result in its final dtype and layout. The
sum's order does not depend on which program came last, so results stay deterministic.

The partials and the counters are scratch kept per (device, stream) (`split_scratch`), grown when a
launch needs more: the counters zeroed once and left at zero by every launch (the last program of a
tile resets its counter), so a launch costs no memset and no allocation. Launches on one stream run
one after another, each done with its partials and counters before the next starts; another stream
gets its own. Two cases get scratch of their own, made per launch and cached nowhere:

* a launch captured into a CUDA graph: a replay may run beside eager launches on another stream,
  so it must not share their scratch (the counters' zeroing is captured with it);
* a launch whose fresh scratch landed in a CUDA graph's private memory pool (torch.compile's
  cudagraph trees warm a graph up with this thread's allocations routed there): the tree may later
  hand that memory to its own tensors, so caching it could corrupt the counters.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


class SplitScratch(NamedTuple):
    partials: torch.Tensor  # fp32, at least (splits x a tile's elements): each launch's own layout
    counters: torch.Tensor  # int32, zeroed, at least one per tile


# Per (device, stream handle): the scratch of the largest launch so far (a few MB at Llama-8B sizes).
_SCRATCH: dict[tuple[torch.device, int], SplitScratch] = {}
_MIN_COUNTERS = 4096


def split_scratch(device: torch.device, partial_elements: int, tiles: int) -> SplitScratch:
    """Partials and zeroed counters for a split launch on the current stream of `device`."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        partials = torch.empty(partial_elements, dtype=torch.float32, device=device)
        return SplitScratch(partials, torch.zeros(tiles, dtype=torch.int32, device=device))
    stream = torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else 0
    key = (device, stream)
    scratch = _SCRATCH.get(key)
    if (
        scratch is not None
        and scratch.partials.numel() >= partial_elements
        and scratch.counters.numel() >= tiles
    ):
        return scratch
    partials, counters = scratch if scratch is not None else (None, None)
    if partials is None or partials.numel() < partial_elements:
        partials = torch.empty(partial_elements, dtype=torch.float32, device=device)
    if counters is None or counters.numel() < tiles:
        counters = torch.zeros(max(tiles, _MIN_COUNTERS), dtype=torch.int32, device=device)
    scratch = SplitScratch(partials, counters)
    if device.type == "cuda" and not (in_default_memory_pool(partials) and in_default_memory_pool(counters)):
        return scratch
    _SCRATCH[key] = scratch
    return scratch


def in_default_memory_pool(tensor: torch.Tensor) -> bool:
    """Whether a CUDA tensor's memory belongs to the caching allocator's default pool, not a graph's.

    Reads the allocator's snapshot (milliseconds with many segments): called once per new buffer.
    """
    address = tensor.data_ptr()
    try:
        segments = torch.cuda.memory_snapshot()
    except RuntimeError:
        # An allocator without snapshots (e.g. `backend:cudaMallocAsync`): nothing to tell pools
        # apart by, so the buffer is cached as it was before this check existed.
        return True
    for segment in segments:
        start = segment["address"]
        if start <= address < start + segment["total_size"]:
            return tuple(segment["segment_pool_id"]) == (0, 0)
    return False  # not among the segments listed: not known to be the default pool's, so not cached


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
