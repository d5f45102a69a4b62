"""A GEMM that starts its accumulator with the LoRA term: ``a @ b + scale * left @ right.T``, one rounding.

``lora_addmm(a, b, left, right, scale)`` replaces ``torch.mm`` (or ``F.linear``) followed by
``lora_expand_add_`` in a fused Function's forward and dX, which saves the expand-add's launch and
its extra read and write of the `[M, N]` output. On by default where the TMA kernel below runs (a
Hopper GPU, 16-bit operands, at least `min_tokens` rows, 1024 since the twenty-first session:
`LoraAddmmSettings.mode = "auto"`), since the twentieth session. The pointer kernel came first
(eighth session); timed alone (`python -m benchmarks.gemm_lora_probe`, rank 16, bf16, do_bench
medians in us, `docs/benchmarks/session8/gemm_lora_probe_prologue.log` and `_2048.log`):

| shape (8192 tokens; 2048 in brackets) | cuBLAS | cuBLAS + expand-add | this kernel |
|---|---|---|---|
| q/o dX, [8192, 4096] @ [4096, 4096] | 355.9 (96.4) | 425.2 (106.0) | 376.1 (96.3) |
| gate/up dX, [8192, 14336] @ [14336, 4096] | 1176.7 (318.0) | 1401.4 (339.9) | 1253.5 (303.6) |
| down dX, [8192, 4096] @ [4096, 14336] | 1209.6 (349.2) | 1543.0 (361.5) | 1362.4 (337.1) |
| q/o forward, x @ W.T | 345.1 (90.2) | 390.6 (101.7) | 425.4 (108.5) |

Inside the blocks (`profile_block`, CUDA time per step, 8192 tokens, `session8/profile_*.log`) the
pair it replaces cost as much as it: o_proj 392 us (cuBLAS 344 + expand-add 48) against 390; the
q/k/v group 408 against 404; the MLP with fp32 adapters 2843 against 2854 and with bf16 adapters
2684 against 2685 (the expand-adds' share: those the "never" run made beyond the "auto" run's
forward ones). Block and training-step times did not separate from run-to-run noise
(`session8/blocks_e2e_results_*.md`). Why the probe's gain vanished was not measured; the
power-capped clock of a sustained step (seventh session) would explain part of it.

The term is computed before the K loop and starts the fp32 accumulator. Added after the loop (the
usual epilogue) it cost more than the separate expand-add (431 against 425 us at q/o dX). Our
reading, not profiled: after the loop each tile waits on its `left`/`right` loads, before it they
overlap the loop's own prefetches. `LORA_AT` keeps all three placements so the probe can time them
with this very kernel.

Two kernels compute it. Where TMA can read the operands (a and the output row-major, b either
row-major or K-major, every row 16-byte aligned: `tma_fits`), a persistent kernel reads its tiles
through tensor descriptors (nineteenth session: this GEMM ran at 0.97-1.11x cuBLAS at the blocks'
shapes, and with the term at 0.90-0.95x cuBLAS + expand-add, `docs/benchmarks/session19/
tma_gemm_probe*`); elsewhere the pointer kernel above. Both start the accumulator with the term.
`b` K-major (a weight's transpose, `x @ W.T`) is the forward's layout: `lora_addmm(x, W.t(), xa, B,
s)` is a LoRA projection's output in one GEMM.

Inside the blocks (H200, nineteenth session, `LoraAddmmSettings.mode` "auto" against "never"): the
fused o_proj's kernels took 839 against 893 us per step at 8192 tokens (`python -m
benchmarks.kernel_ab --switch addmm --block o`: the TMA kernel's two calls 738 us against cuBLAS's
two GEMMs and two expand-adds 785), but every block's step took longer (`python -m
benchmarks.plans_ab --switch addmm`: o_proj 1.95x against 1.77x the floor, q/k/v 1.83x against 1.64x
at 8192 tokens): each TMA launch cost more host time than the launch it saved, and these steps are
host-bound. Twentieth session: the TMA launch got a launch plan, and its descriptors are encoded
once per (address, shape, strides) and handed to the compiled kernel's C launch directly
(`_launch.TmaEncoder`). An o_proj forward's `lora_addmm` then took 25 us of host time, against 64 us
with plans off (descriptors built and keyed per call) and 35 us for F.linear + expand-add (`python -m
benchmarks.host_breakdown --adapters fp32 --tokens 2048`,
`docs/benchmarks/session20/host_breakdown_o_2048_fp32.log`). "auto" / "never" in one
process (`plans_ab --switch addmm --bases bf16,nf4`, fp32 adapters, x the floor,
`session20/plans_ab_addmm_*_planned.log`): o_proj 1.73 / 1.89 (bf16) and 1.41 / 1.57 (NF4) at 8192
tokens, 4.62 / 5.56 and 1.78 / 1.93 at 2048; q/k/v 1.75 / 1.91 and 1.40 / 1.37 at 8192, 3.63 / 3.87
and 1.34 / 1.31 at 2048; the MLP 1.10 / 1.09 and 1.05 / 1.08 at 8192, 1.16 / 1.17 and 1.11 / 1.03
at 2048 (spreads 4-79%). The training step, separate processes: 1.023-1.041x the floor with "auto"
against 1.029-1.053x with "never" (`session20/blocks_e2e_sweep.md`, `e2e_never.json`). So "auto"
became the default, from 2048 rows (the fewest measured then).

Twenty-first session: `min_tokens` 2048 -> 1024. "auto" / "never" in one process (`plans_ab --switch
addmm --tokens N`, `--addmm-min-tokens` at or below N, fp32 adapters, x the floor,
`session21/plans_ab_addmm_*.log`): at 1024 tokens o_proj 3.88 / 4.28 (bf16) and 1.77 / 1.92 (NF4),
q/k/v 3.76 / 4.06 and 1.40 / 1.43, the MLP 1.77 / 1.78 and 1.31 / 1.30; at 512 o_proj 4.83 / 4.86
and 1.51 / 1.67, q/k/v 2.98 / 3.15 and 1.46 / 1.48, the MLP 2.69 / 2.86 and 1.39 / 1.39; at 256
(bf16 only) o_proj 4.28 / 4.63, q/k/v 3.03 / 3.18, the MLP 3.24 / 3.23. Spreads 3-105%: each row
alone is within the noise, but "auto" read ahead in 12 of 15, equal in 1, 0.01 behind in 2. These
steps are host-bound, and the planned launch is one launch fewer. In kernel time (`kernel_ab
--switch addmm --base bf16`, auto / never, us per step) the GPU pays for it at 512 rows: o_proj 124
/ 90 (the TMA GEMM's 128 x 256 tiles cover 64 of 132 SMs there); at 1024 o_proj 134 / 145, the MLP
1183 / 1201 and q/k/v 300 / 260, 263 / 258 once k/v's forward took the few-tiles config below (2048:
437 / 424, then 404 / 423). A GPU-bound step (the host ahead, CUDA graphs) would pay the 512-row
cost, so the rule starts at 1024 rows.

A `torch.library` custom op with a fake; the reference (``lora_addmm_reference``) runs on the CPU
outside the Triton interpreter, as for every op here.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from fastlora_peft.call_traces import VersionedSettings, trace_unit
from fastlora_peft.kernels import lora_addmm_reference as reference
from fastlora_peft.kernels._backend import OP_NAMESPACE, runs_triton, skips_op_dispatch
from fastlora_peft.kernels._launch import BoundLaunch, CachedKernel, LaunchPlans, cdiv, empty_2d
from fastlora_peft.kernels._lora_common import _num_sms
from fastlora_peft.kernels.dots import expand_dot_precision
from fastlora_peft.kernels.lora_expand_add import expand_term

# Where the kernel adds the LoRA term (a constexpr; a jit function reads only tl.constexpr globals).
NO_TERM, EPILOGUE, PROLOGUE = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
LORA_AT = {"none": NO_TERM.value, "epilogue": EPILOGUE.value, "prologue": PROLOGUE.value}


class LoraAddmmSettings(metaclass=VersionedSettings):
    """When the fused Functions' GEMMs take `lora_addmm` (read at every call).

    mode: "auto" (the default: on a Hopper GPU, 16-bit operands of one dtype, at least `min_tokens`
    rows, operands the TMA kernel reads; see the module docstring), "never" (cuBLAS +
    `lora_expand_add_` everywhere), or "always" (wherever the dtypes allow it: the tests run it under
    the interpreter). It applies to the forward's base GEMM (`shared_input_forward`: no bias, a new
    output) and to dX's first GEMM. In "auto" a shared-input dX that would take it takes it in place
    of the augmented GEMM (`shared_input_grad_x`; "always" keeps the augmented one out). Where it
    applies, a group of up to three members (q/k/v) takes its forward GEMMs as one launch
    (`lora_addmm_group`, `group_forward`) and its dX as one GEMM (`lora_addmm_sum`, `sum_members`;
    under "auto" for members of K at most `lora_addmm_sum.SUM_MAX_MEMBER_K`).
    """

    mode = "auto"
    min_tokens = 1024
    # A group's dX as one `lora_addmm_sum` (every member's K loop in one GEMM) where lora_addmm would
    # take its first GEMM; False keeps lora_addmm + `addmm_` per member (tests, `plans_ab --switch sum`).
    sum_members = True
    # A group's forward GEMMs as one `lora_addmm_group` launch where lora_addmm would take each; False
    # keeps one lora_addmm per member (tests, `plans_ab --switch group`).
    group_forward = True


def lora_addmm_auto_takes(grad: torch.Tensor, compute_dtype: torch.dtype, out_dtype: torch.dtype) -> bool:
    """Whether "auto" gives a dX of `grad`'s rows, computed in `compute_dtype` into `out_dtype`, to
    `lora_addmm`: everything `lora_addmm_pays_off` checks before the weight is materialized (its
    layout is checked there; a weight TMA cannot read leaves cuBLAS + expand-add)."""
    return (
        LoraAddmmSettings.mode == "auto"
        and compute_dtype == out_dtype
        and compute_dtype in _SIXTEEN_BIT
        and _auto_device_and_rows(grad)
    )


def lora_addmm_may_take(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """What `lora_addmm_pays_off` checks before the TMA fit: 16-bit a and b of the output's dtype,
    and "always", or "auto" on a Hopper GPU from `min_tokens` rows."""
    mode = LoraAddmmSettings.mode
    if mode == "never" or a.dtype != b.dtype or a.dtype != out_dtype:
        return False
    if a.dtype not in _SIXTEEN_BIT:  # fp32 GEMMs stay cuBLAS's (no tf32 here)
        return False
    return mode == "always" or _auto_device_and_rows(a)


def lora_addmm_pays_off(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Whether `a @ b` plus a LoRA term into `out_dtype` should run as one `lora_addmm` call: "always"
    wherever `lora_addmm_may_take` (the pointer kernel where TMA cannot read), "auto" where the TMA
    kernel reads the operands too."""
    if not lora_addmm_may_take(a, b, out_dtype):
        return False
    return LoraAddmmSettings.mode == "always" or tma_fits(a, b)


def lora_addmm_where_it_pays_off(
    a: torch.Tensor,
    b: torch.Tensor,
    left: torch.Tensor,
    right: torch.Tensor,
    scale: float,
    out_dtype: torch.dtype,
) -> Optional[torch.Tensor]:
    """`lora_addmm(a, b, left, right, scale)` where `lora_addmm_pays_off`, else None.

    As `lora_addmm_group_where_it_pays_off`: an eager call that launch plans serve looks its TMA plan
    up first, and a hit needs no fit check (a plan is made only by the TMA launch, which only inputs
    that fit reach, and its key holds all that `tma_fits` reads). Asking `lora_addmm_pays_off` and
    then the op made the fit check (9.3 us of the H200 machine's host in the twenty-sixth session's
    `host_breakdown`; 14 us each by the thirty-second session's timers, their overhead included)
    and then the key, twice in an o_proj step (its forward and its dX).
    """
    if not lora_addmm_may_take(a, b, out_dtype):
        return None
    if _TMA_PLANS.serve(a) and skips_op_dispatch(a, b, left, right):
        plan = _TMA_PLANS.get(_tma_plan_key(a, b, left, right))
        if plan is not None:
            return _run_tma_plan(plan, a, b, left, right, scale)
    if not lora_addmm_pays_off(a, b, out_dtype):  # a miss: the whole rule, fit included
        return None
    return lora_addmm(a, b, left, right, scale)


_SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def _auto_device_and_rows(a: torch.Tensor) -> bool:
    """ "auto"'s device and size rule: a Hopper GPU, at least `min_tokens` rows."""
    return a.is_cuda and a.shape[0] >= LoraAddmmSettings.min_tokens and _is_hopper(a.device)


_HOPPER: dict[torch.device, bool] = {}


def _is_hopper(device: torch.device) -> bool:
    """Compute capability 9.x, asked once per device (a few microseconds per call otherwise)."""
    hopper = _HOPPER.get(device)
    if hopper is None:
        hopper = _HOPPER[device] = torch.cuda.get_device_capability(device)[0] == 9
    return hopper


# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages). H200: 128 x 256 x 64, 8 warps, 4 stages was the fastest
# of 8 common Hopper configs at 8192 tokens for q/o and gate/up dX (the probe's log above; 128 x 256 x
# 32 won down dX); at 2048 tokens the same tiles with 3 stages were the fastest at dX. The
# interpreter runs small tiles.
GPU_CONFIG = (128, 256, 64, 8, 4)
INTERPRETER_CONFIG = (32, 32, 32, 4, 1)
# Ranks per tile of the term, looped over the rank. Its tiles get shared-memory buffers of their own
# beside the K loop's stages: a 64-wide tile (a q/k/v group's rank 48) asked for 416 KB of the H200's
# 227 (OutOfResources). `tests/test_lora_addmm.py` compiles the GPU kernel for sm_90 to check the fit.
RANK_TILE = 16


# From this many ranks on (four rank tiles), a TMA kernel's term pipelines its rank loop,
# RANK_STAGES_MANY deep. H200, 8192 tokens, do_bench with L2 flushed, two rounds (`python -m
# benchmarks.term_tiling_probe`, forty-sixth session, docs/benchmarks/session46/term_tiling_probe_*):
# the q/k/v dX sum at rank 64 (192 ranks, twelve trips) 718-743 -> 668-684 us, at rank 128 846-884 ->
# 720-767; the q/k/v forward group at rank 64 671-693 -> 649-661; down's dX at rank 128 1676-1726 ->
# 1595-1634; at 2048 tokens the sum at rank 128 207-218 -> 173-186. At two trips (rank 32 of one
# projection) 3 stages read up to 8% slower, at one trip up to 12%, as the thirty-third session
# found (`_tile_with_term`). 32-wide tiles and 4 stages were no better than 16 x 3 overall.
PIPELINED_TERM_RANKS = 64
RANK_STAGES_MANY = 3


def term_tiling(ranks: int) -> tuple[int, int]:
    """(ranks per tile, software-pipelining stages) of a TMA kernel's term over `ranks` ranks (the
    most of any member): `_tile_with_term`'s BLOCK_R and RANK_STAGES. Compiled for sm_90, the three
    kernels asked for the same shared memory (213-214 KB) with every tiling the probe times; the
    fit is checked in `tests/test_lora_addmm_group.py`."""
    return RANK_TILE, RANK_STAGES_MANY if ranks >= PIPELINED_TERM_RANKS else 1


def copies_left(ranks: int, left: torch.Tensor) -> bool:
    """Whether a TMA kernel's launch copies its term's left operand (`[M, R]` fp32, `ranks` the most
    of any member) row-major first: from `PIPELINED_TERM_RANKS` on, where it is not row-major already.

    The term's dot takes left as its first operand, which wants the rank dim contiguous; the shrinks
    write token-major. H200, 8192 x 4096 x 4096 (o_proj's forward and dX), do_bench, two runs each
    (forty-seventh session, `docs/benchmarks/session47/left_layout_probe.log`), us row-major against
    token-major: rank 64 372-404 against 389-422, rank 128 416-443 against 455-480 (each adapter
    dtype); rank 16 355-390 either way, so below 64 ranks nothing is copied (a [8192, 64] fp32 copy
    is 4 MB of traffic)."""
    return ranks >= PIPELINED_TERM_RANKS and left.stride(1) != 1


@triton.jit
def _grouped_tile(tile, blocks_m, blocks_n, GROUP_M: tl.constexpr):
    """(row block, column block) of output tile `tile`: tiles go GROUP_M row blocks per column block,
    so neighbouring tiles share B's tiles in L2."""
    per_group = GROUP_M * blocks_n
    first_m = (tile // per_group) * GROUP_M
    group_rows = tl.minimum(blocks_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % group_rows, (tile % per_group) // group_rows


@triton.jit
def _tile_with_term(
    Left_ptr, Right_ptr, tile, blocks_m, blocks_n, M, N, R, scale,
    stride_lm, stride_lr, stride_rn, stride_rr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr, RANK_STAGES: tl.constexpr,
):  # fmt: skip
    """(first row, first column, fp32 accumulator holding scale * Left @ Right^T there) of output
    tile `tile` in grouped order: how each TMA kernel (here, `lora_addmm_sum`, `lora_addmm_group`)
    starts a tile, the term ahead of the K loop.

    RANK_STAGES is `term_tiling`'s: 1 (plain loads) below `PIPELINED_TERM_RANKS`. Pipelined with
    the kernel's stages, the rank loop's one trip at rank 16 turned the term's loads into cp.async
    copies and waits ahead of every tile's K loop. H200, thirty-third session, do_bench against the
    same kernel with the loads plain (`docs/benchmarks/session33/term_latency_probe*.log`): the
    pipelined term cost 8-22 us more per o_proj-sized GEMM (8192 x 4096 x 4096), 67 at down's dX
    (N = 14336) and 3 at 2048 tokens; the term with plain loads costs 0-2% over the same GEMM
    without a term.
    """
    pid_m, pid_n = _grouped_tile(tile, blocks_m, blocks_n, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = scale * expand_term(
        Left_ptr, Right_ptr, offs_m.to(tl.int64), offs_m < M, offs_n, offs_n < N, R,
        stride_lm, stride_lr, stride_rn, stride_rr,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=BLOCK_R, DOT_PRECISION=DOT_PRECISION,
        RANK_STAGES=RANK_STAGES,
    )  # fmt: skip
    return pid_m * BLOCK_M, pid_n * BLOCK_N, acc


@CachedKernel
@triton.jit
def _lora_addmm_kernel(
    A_ptr, B_ptr, Left_ptr, Right_ptr, Out_ptr,
    M, N, K, R, scale,
    stride_am, stride_ak, stride_bk, stride_bn, stride_lm, stride_lr, stride_rn, stride_rr,
    stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, LORA_AT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FP32_DOT: tl.constexpr,
):  # fmt: skip
    """Out[M, N] = A[M, K] @ B[K, N] + scale * Left[M, R] @ Right[N, R]^T, summed in fp32, rounded once."""
    pid_m, pid_n = _grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    rows = offs_m.to(tl.int64)
    # Edge rows and columns load a valid (wrapped) row or column and are masked only at the store:
    # no masks in the K loop unless K itself is ragged.
    a_ptrs = A_ptr + (rows % M)[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = B_ptr + offs_k[:, None] * stride_bk + (offs_n % N).to(tl.int64)[None, :] * stride_bn
    if LORA_AT == PROLOGUE:
        acc = scale * expand_term(
            Left_ptr, Right_ptr, rows, mask_m, offs_n, mask_n, R,
            stride_lm, stride_lr, stride_rn, stride_rr,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=BLOCK_R, DOT_PRECISION=DOT_PRECISION,
        )  # fmt: skip
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            mask_k = offs_k + k0 < K
            a = tl.load(a_ptrs, mask=mask_k[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=mask_k[:, None], other=0.0)
        if FP32_DOT:  # the interpreter computes 16-bit dots wrongly; 16-bit products are exact in fp32
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="tf32")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if LORA_AT == EPILOGUE:
        acc += scale * expand_term(
            Left_ptr, Right_ptr, rows, mask_m, offs_n, mask_n, R,
            stride_lm, stride_lr, stride_rn, stride_rr,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=BLOCK_R, DOT_PRECISION=DOT_PRECISION,
        )  # fmt: skip
    out_ptrs = Out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(Out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _lora_addmm_triton(
    *,
    a: torch.Tensor,
    b: torch.Tensor,
    left: torch.Tensor,
    right: torch.Tensor,
    scale: float,
    config: tuple[int, int, int, int, int] | None = None,
    lora_at: str = "prologue",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    M, K = a.shape
    N = b.shape[1]
    out = torch.empty((M, N), dtype=a.dtype, device=a.device) if out is None else out
    if out.numel() == 0:
        return out
    # As in lora_expand_add: the rank dim of `right` contiguous (lora_a.T is copied, [N, R] is small).
    right = right if right.stride(1) == 1 else right.contiguous()
    block_m, block_n, block_k, warps, stages = config or (GPU_CONFIG if a.is_cuda else INTERPRETER_CONFIG)
    grid = (cdiv(M, block_m) * cdiv(N, block_n),)
    _lora_addmm_kernel[grid](
        a, b, left, right, out,
        M, N, K, left.shape[1], float(scale),
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), left.stride(0), left.stride(1),
        right.stride(0), right.stride(1), out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_R=RANK_TILE,
        GROUP_M=8, EVEN_K=K % block_k == 0, LORA_AT=LORA_AT[lora_at],
        DOT_PRECISION=expand_dot_precision(a.dtype, right.dtype), FP32_DOT=not a.is_cuda,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


# The TMA kernel's tiles (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): on the H200 128 x 256 x 64, 8
# warps, 3 stages was the fastest of 12 configs at five of the six block shapes probed (4 stages do
# not fit its shared memory with descriptors). The interpreter takes small tiles and few programs,
# so each program walks several tiles.
TMA_GPU_CONFIG = (128, 256, 64, 8, 3)
# Where those tiles would cover half the SMs or fewer (k/v's forward, 1024 columns, at up to 2048
# rows): 128 x 128 x 64, 4 warps, 4 stages. H200, kernel time with L2 flushed, x @ W.T + the term at
# N=1024, K=4096: 31.2 against 44.8 us at 2048 rows (cuBLAS's F.linear alone 24.3) and 27.8 against
# 43.0 at 1024 (64 and 32 wide tiles); with 128 or more wide tiles the wide ones stayed fastest
# (1024 x 4096: 49.1 against 57.6; 2048 x 4096: 95.9 against 110.0), `session21/addmm_narrow_probe.log`.
# Between 67 and 127 wide tiles nothing was timed: the wide tiles stay there.
TMA_FEW_TILES_CONFIG = (128, 128, 64, 4, 4)
TMA_INTERPRETER_CONFIG = (16, 32, 16, 4, 1)
_TMA_INTERPRETER_PROGRAMS = 3


def tma_gpu_config(rows: int, columns: int, device: torch.device) -> tuple[int, int, int, int, int]:
    """The TMA kernel's tiles for an `[rows, columns]` output on a GPU: the wide ones, unless they
    would leave more than half the SMs without a tile."""
    wide_tiles = cdiv(rows, TMA_GPU_CONFIG[0]) * cdiv(columns, TMA_GPU_CONFIG[1])
    return TMA_FEW_TILES_CONFIG if 2 * wide_tiles <= _num_sms(device) else TMA_GPU_CONFIG


def tma_config(rows: int, columns: int, device: torch.device) -> tuple[int, int, int, int, int]:
    """The tiles of a TMA kernel here (this one, `lora_addmm_sum`'s, `lora_addmm_group`'s) for
    `[rows, columns]` of output: `tma_gpu_config` on a GPU, small ones under the interpreter."""
    return tma_gpu_config(rows, columns, device) if device.type == "cuda" else TMA_INTERPRETER_CONFIG


def tma_programs(tiles: int, device: torch.device) -> int:
    """How many persistent programs walk `tiles` output tiles: one per SM at most (a few under the
    interpreter, so each walks several)."""
    return min(tiles, _num_sms(device) if device.type == "cuda" else _TMA_INTERPRETER_PROGRAMS)


@CachedKernel
@triton.jit
def _lora_addmm_tma_kernel(
    a_desc, b_desc, out_desc, Left_ptr, Right_ptr,
    M, N, K, R, scale, stride_lm, stride_lr, stride_rn, stride_rr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr, B_K_MAJOR: tl.constexpr, PROGRAMS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FP32_DOT: tl.constexpr, RANK_STAGES: tl.constexpr,
):  # fmt: skip
    """Out = A @ B + scale * Left @ Right^T as `_lora_addmm_kernel`, persistent: PROGRAMS programs walk
    the output tiles in grouped order, reading A, B (K-major: its [N, K] transpose) and writing Out
    through TMA descriptors (out-of-range rows and columns read as zeros and are not written)."""
    blocks_m = tl.cdiv(M, BLOCK_M)
    blocks_n = tl.cdiv(N, BLOCK_N)
    # Not `flatten=True`: with a dot ahead of the K loop the flattened pipeline took twice as long.
    for tile in tl.range(tl.program_id(0), blocks_m * blocks_n, PROGRAMS):
        off_m, off_n, acc = _tile_with_term(
            Left_ptr, Right_ptr, tile, blocks_m, blocks_n, M, N, R, scale,
            stride_lm, stride_lr, stride_rn, stride_rr,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=BLOCK_R, GROUP_M=GROUP_M, DOT_PRECISION=DOT_PRECISION,
            RANK_STAGES=RANK_STAGES,
        )  # fmt: skip
        for k0 in range(0, K, BLOCK_K):
            a = a_desc.load([off_m, k0])
            if B_K_MAJOR:
                b = b_desc.load([off_n, k0]).T
            else:
                b = b_desc.load([k0, off_n])
            if FP32_DOT:  # the interpreter computes 16-bit dots wrongly; 16-bit products are exact in fp32
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="tf32")
            else:
                acc = tl.dot(a, b, acc)
        out_desc.store([off_m, off_n], acc.to(out_desc.dtype))


def _rows_fit_tma(tensor: torch.Tensor) -> bool:
    """A 2-D tensor TMA can read: unit last stride, 16-byte aligned start and row stride."""
    return _fits_tma(tensor, rows_dim=0)


def _transpose_fits_tma(tensor: torch.Tensor) -> bool:
    """`_rows_fit_tma(tensor.t())` without making the view: an op dispatched on the host each time,
    and the checks run on every fused call (the group's three weights at each q/k/v forward)."""
    return _fits_tma(tensor, rows_dim=1)


def _fits_tma(tensor: torch.Tensor, rows_dim: int) -> bool:
    """Whether TMA can read `tensor` as rows along `rows_dim` (0: as it is; 1: its transpose)."""
    size, unit_dim = tensor.element_size(), 1 - rows_dim
    return (
        tensor.stride(unit_dim) == 1
        and (tensor.stride(rows_dim) * size) % 16 == 0
        and tensor.data_ptr() % 16 == 0
        and (tensor.shape[unit_dim] * size) % 16 == 0
    )


def _k_major(b: torch.Tensor) -> bool:
    """b [K, N] is the transpose of a row-major [N, K] (a weight in `x @ W.T`)."""
    return b.stride(0) == 1 and b.stride(1) != 1


def tma_fits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `lora_addmm(a, b, ...)` takes the TMA kernel: a row-major, b row-major or K-major
    (a [N, K] tensor's transpose), the output's rows (N) 16-byte aligned, every row 16-byte aligned."""
    if a.dtype not in (torch.bfloat16, torch.float16) or a.numel() == 0 or b.numel() == 0:
        return False  # a descriptor needs every dimension > 0
    b_fits = _transpose_fits_tma(b) if _k_major(b) else _rows_fit_tma(b)
    return _rows_fit_tma(a) and b_fits and (b.shape[1] * a.element_size()) % 16 == 0


def _lora_addmm_tma_triton(
    *,
    a: torch.Tensor,
    b: torch.Tensor,
    left: torch.Tensor,
    right: torch.Tensor,
    scale: float,
    config: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:
    plan_key = None
    if config is None and _TMA_PLANS.enabled:
        plan_key = _tma_plan_key(a, b, left, right)
        plan = _TMA_PLANS.get(plan_key)
        if plan is not None:
            return _run_tma_plan(plan, a, b, left, right, scale)
    M, K = a.shape
    N = b.shape[1]
    out = torch.empty((M, N), dtype=a.dtype, device=a.device)
    # lora_a.T (rank dim strided) is copied first: the kernel reading it through its strides measured
    # slower on the H200 than the copy and the kernel together (o_proj's dX 104.0 against 102.9 us at
    # 2048 tokens, down's dh 1526 against 1498 at 8192; docs/benchmarks.md, twenty-seventh session),
    # though the copy is an op and an allocation more on the host.
    right_copied = right.stride(1) != 1
    right = right.contiguous() if right_copied else right
    left_copied = copies_left(left.shape[1], left)
    left = left.contiguous() if left_copied else left
    block_m, block_n, block_k, warps, stages = config or tma_config(M, N, a.device)
    b_k_major = _k_major(b)
    b_desc = (
        TensorDescriptor.from_tensor(b.t(), [block_n, block_k])
        if b_k_major
        else TensorDescriptor.from_tensor(b, [block_k, block_n])
    )
    tiles = cdiv(M, block_m) * cdiv(N, block_n)
    programs = tma_programs(tiles, a.device)
    rank_tile, rank_stages = term_tiling(left.shape[1])
    sizes = (M, N, K, left.shape[1])
    strides = (left.stride(0), left.stride(1), right.stride(0), right.stride(1))
    bound = _lora_addmm_tma_kernel[(programs,)](
        TensorDescriptor.from_tensor(a, [block_m, block_k]), b_desc,
        TensorDescriptor.from_tensor(out, [block_m, block_n]), left, right,
        *sizes, float(scale), *strides,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_R=rank_tile, GROUP_M=8,
        B_K_MAJOR=b_k_major, PROGRAMS=programs, DOT_PRECISION=expand_dot_precision(a.dtype, right.dtype),
        FP32_DOT=not a.is_cuda, RANK_STAGES=rank_stages, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if plan_key is not None and bound is not None:
        _TMA_PLANS.add(
            plan_key, _TmaPlan(bound, right_copied, left_copied, b_k_major, (M, N), sizes, strides)
        )
    return out


class _TmaPlan(NamedTuple):
    """What `_lora_addmm_tma_triton` derived from its inputs' metadata, to launch the same again. The
    launch takes a, b (its [N, K] transpose when K-major) and the output where the kernel reads
    descriptors: `BoundLaunch` encodes them (once per address and shape, `_launch.TmaEncoder`)."""

    launch: BoundLaunch
    copy_right: bool  # right was copied to a contiguous one first (its strides below are the copy's)
    copy_left: bool  # left likewise (`copies_left`)
    b_k_major: bool
    out_shape: tuple[int, int]
    sizes: tuple[int, int, int, int]  # M, N, K, R
    strides: tuple[int, int, int, int]  # left's and right's


_TMA_PLANS = LaunchPlans("lora_addmm_tma")


def _tma_plan_key(a, b, left, right) -> tuple:
    """The one key of a TMA plan: the launcher's and the op body's lookups must agree."""
    return _TMA_PLANS.key(a, b, left, right)


@trace_unit
def _run_tma_plan(plan: _TmaPlan, a, b, left, right, scale) -> torch.Tensor:
    right = right.contiguous() if plan.copy_right else right
    left = left.contiguous() if plan.copy_left else left
    out = empty_2d(*plan.out_shape, a.dtype, a.device)
    plan.launch(a, b.t() if plan.b_k_major else b, out, left, right, *plan.sizes, float(scale), *plan.strides)
    return out


def _check_lora_addmm(a: torch.Tensor, b: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> None:
    op = "lora_addmm"
    for name, tensor, layout in (("a", a, "[M, K]"), ("b", b, "[K, N]"), ("left", left, "[M, R]")):
        if tensor.dim() != 2:
            raise ValueError(f"{op}: {name} must be 2-D {layout}, got shape {list(tensor.shape)}")
    if right.dim() != 2:
        raise ValueError(f"{op}: right must be 2-D [N, R], got shape {list(right.shape)}")
    if a.dtype != b.dtype or a.dtype not in (torch.bfloat16, torch.float16, torch.float64):
        raise ValueError(f"{op}: a and b must share one 16-bit dtype, got {a.dtype} and {b.dtype}")
    if left.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{op}: left must be float32 (the output of lora_shrink), got {left.dtype}")
    M, K = a.shape
    N, R = b.shape[1], left.shape[1]
    if b.shape[0] != K or left.shape[0] != M or tuple(right.shape) != (N, R):
        raise ValueError(
            f"{op}: shapes must be a [M, K], b [K, N], left [M, R], right [N, R], got "
            f"{list(a.shape)}, {list(b.shape)}, {list(left.shape)}, {list(right.shape)}"
        )
    if not (a.device == b.device == left.device == right.device):
        raise ValueError(f"{op}: all inputs must be on one device")


def lora_addmm(
    a: torch.Tensor, b: torch.Tensor, left: torch.Tensor, right: torch.Tensor, scale: float
) -> torch.Tensor:
    """``a @ b + scale * left @ right.T``: `fastlora::lora_addmm` (see `_lora_addmm_body`)."""
    if skips_op_dispatch(a, b, left, right):
        return _lora_addmm_body(a, b, left, right, scale)
    return lora_addmm_op(a, b, left, right, scale)


def _lora_addmm_body(
    a: torch.Tensor, b: torch.Tensor, left: torch.Tensor, right: torch.Tensor, scale: float
) -> torch.Tensor:
    """``a @ b + scale * left @ right.T``, summed in fp32 and rounded once to a's dtype.

    a: [M, K] and b: [K, N] of one 16-bit dtype, any strides (dX: a = grad_out, b = the weight
    [out, in]); left: [M, R] float32 (`g @ B`), right: [N, R] any float dtype and strides (lora_a.T).
    Returns [M, N] contiguous, a's dtype.
    """
    if _TMA_PLANS.serve(a):  # a hit skips the checks and `tma_fits`: see lora_terms' `_PLANS_SKIP_CHECKS`
        plan = _TMA_PLANS.get(_tma_plan_key(a, b, left, right))
        if plan is not None:
            return _run_tma_plan(plan, a, b, left, right, scale)
    _check_lora_addmm(a, b, left, right)
    if runs_triton(a):
        if tma_fits(a, b):
            return _lora_addmm_tma_triton(a=a, b=b, left=left, right=right, scale=scale)
        return _lora_addmm_triton(a=a, b=b, left=left, right=right, scale=scale)
    return reference.lora_addmm(a, b, left, right, scale).contiguous()


lora_addmm_op = torch.library.custom_op(f"{OP_NAMESPACE}::lora_addmm", _lora_addmm_body, mutates_args=())


@lora_addmm_op.register_fake
def _(
    a: torch.Tensor, b: torch.Tensor, left: torch.Tensor, right: torch.Tensor, scale: float
) -> torch.Tensor:
    _check_lora_addmm(a, b, left, right)
    return a.new_empty((a.shape[0], b.shape[1]))
