"""Times launch configurations of the LoRA-term kernels at Llama-3.1-8B shapes on CUDA.

python -m benchmarks.tune_lora_terms [--expand-add | --weight-grad | --weight-grad-unsplit
                                     | --weight-grad-kernels | --gated | --gated-forward
                                     | --split-shrink | --shrink-rows [--tokens=8192] | --high-rank
                                     | --high-rank-grads] [--rank=R ...]

--rank=R (with --gated or --gated-forward, repeatable): the gated kernels at rank R, not 16. Past 16,
--gated-forward times fp32 adapters only, each config with its default rank tile and, past 32 ranks,
32-wide tiles too; --gated times its usual grid at that rank, past 64 ranks a smaller one with 64-
and 128-wide rank tiles.

Per shape: the default, then the fastest configs.

The launchers' defaults in `fastlora_peft/kernels/lora_terms.py`, `lora_expand_add.py` and
`lora_weight_grad.py` cite what this printed on the H200.
"""

from __future__ import annotations

import functools
import itertools
import statistics
import sys

import torch
from triton.testing import do_bench

from fastlora_peft.kernels import lora_expand_add as expand_add_module
from fastlora_peft.kernels import lora_terms as lt
from fastlora_peft.kernels import lora_weight_grad as weight_grad_module

from .kernel_ab import _trace_events

TOKENS = 8192


def _bench(fn) -> float:
    return do_bench(fn, warmup=5, rep=30) * 1e3  # microseconds


def _report(name: str, default_us: float, results: list[tuple[float, dict]], moved_bytes: int) -> None:
    results.sort(key=lambda item: item[0])
    best_us, best = results[0]
    print(
        f"{name}: default {default_us:7.1f}us ({moved_bytes / default_us / 1e6:5.2f} TB/s)  "
        f"best {best_us:7.1f}us ({moved_bytes / best_us / 1e6:5.2f} TB/s) {best}  "
        f"next {[(round(t, 1), c) for t, c in results[1:3]]}",
        flush=True,
    )


def tune_shrink(k: int, rank: int, weight_dtype: torch.dtype) -> None:
    x = torch.randn(TOKENS, k, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(rank, k, device="cuda", dtype=weight_dtype)
    default = _bench(lambda: lt._lora_shrink_triton(x=x, weight=weight))
    results = []
    for block_m, block_k in itertools.product((16, 32, 64), (64, 128, 256)):

        def launch(block_m=block_m, block_k=block_k):
            lt._lora_shrink_triton(x=x, weight=weight, block_m=block_m, block_k=block_k)

        try:
            results.append((_bench(launch), dict(m=block_m, k=block_k)))
        except Exception as error:  # out of shared memory / registers for this config
            print(f"  skip m={block_m} k={block_k}: {type(error).__name__}")
    _report(f"shrink K={k} R={rank} w={str(weight_dtype)[6:]}", default, results, x.numel() * 2)


def tune_split_shrink(rows: int, k: int, rank: int, transposed: bool) -> None:
    """The shrink with a bf16 activation and an fp32 weight (the split dot, PEFT's default adapters):
    the forward's x @ A.T, or (transposed) the backward's dY @ B with lora_B.T read as it is. Prints the
    same shape's time with a bf16 weight first, the speed the split dot is measured against."""
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(k, rank, device="cuda").t() if transposed else torch.randn(rank, k, device="cuda")
    native = _bench(lambda: lt._lora_shrink_triton(x=x, weight=weight.to(torch.bfloat16)))
    default = _bench(lambda: lt._lora_shrink_triton(x=x, weight=weight))
    results = []
    for block_m, block_k, warps, stages in itertools.product((32, 64, 128), (64, 128), (4, 8), (3, 4)):

        def launch(block_m=block_m, block_k=block_k, warps=warps, stages=stages):
            lt._lora_shrink_triton(
                x=x, weight=weight, block_m=block_m, block_k=block_k, num_warps=warps, num_stages=stages
            )

        config = dict(m=block_m, k=block_k, w=warps, s=stages)
        try:
            results.append((_bench(launch), config))
        except Exception as error:  # out of shared memory / registers for this config
            print(f"  skip {config}: {type(error).__name__}")
    name = f"split shrink M={rows} K={k} R={rank}{' B.T' if transposed else ''} (bf16 weight {native:.1f}us)"
    _report(name, default, results, x.numel() * 2)


# (BLOCK_M, BLOCK_K, warps, stages) of `--shrink-rows`: the launcher's tiles (64 x 64 split dot, 32
# x 128 native, the wide split's 128 x 64) and their neighbours, each under several K splits.
_SHRINK_ROWS_CONFIGS = (
    (32, 64, 4, 4), (64, 64, 4, 4), (64, 64, 4, 3), (64, 64, 8, 4),
    (128, 64, 8, 3), (128, 64, 4, 3), (32, 128, 4, 4), (64, 128, 4, 3),
)  # fmt: skip
_SHRINK_SPLITS = (1, 2, 4, 8, 16)


def kernel_times_us(launches: dict, kernel_name: str, calls: int = 20) -> dict:
    """{key: median microseconds of the kernel named `kernel_name`} of each launch in `launches` ({key:
    zero-argument callable launching it once}), read from one profile with L2 flushed before each
    call. At 2048 rows a shrink runs 10-30us, less than an unplanned launch's host time, so do_bench's
    events around each call would time the host for every config but the planned default."""
    working = {}
    for key, launch in launches.items():
        try:
            launch()  # compiles
            working[key] = launch
        except Exception as error:  # out of shared memory / registers for this config
            print(f"  skip {key}: {type(error).__name__}")
    torch.cuda.synchronize()
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for launch in working.values():
            for _ in range(calls):
                flush.zero_()
                launch()
        torch.cuda.synchronize()
    kernels = sorted(
        (e for e in _trace_events(prof) if e.get("cat") == "kernel" and kernel_name in e["name"]),
        key=lambda event: event["ts"],
    )
    if len(kernels) != calls * len(working):
        raise RuntimeError(
            f"{len(kernels)} {kernel_name} kernels for {len(working)} launches x {calls} calls"
        )
    return {
        key: statistics.median(event["dur"] for event in kernels[i * calls : (i + 1) * calls])
        for i, key in enumerate(working)
    }


def tune_shrink_rows(rows: int, k: int, rank: int, transposed: bool, weight_dtype: torch.dtype) -> None:
    """The shrink at few rows (2048: fewer row tiles than SMs, so the launcher splits K): the default
    launch against tiles x K splits, each timed by its kernel alone (`kernel_times_us`). transposed:
    the weight read as `[K, R]` transposed, as dY @ B reads lora_B.T and the forward reads a group's
    stacked A.T."""
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(k, rank, device="cuda").t() if transposed else torch.randn(rank, k, device="cuda")
    weight = weight.to(weight_dtype)
    launches = {"default": lambda: lt._lora_shrink_triton(x=x, weight=weight)}
    for (block_m, block_k, warps, stages), split in itertools.product(_SHRINK_ROWS_CONFIGS, _SHRINK_SPLITS):

        def launch(block_m=block_m, block_k=block_k, warps=warps, stages=stages, split=split):
            lt._lora_shrink_triton(
                x=x, weight=weight, split=split, block_m=block_m, block_k=block_k,
                num_warps=warps, num_stages=stages,
            )  # fmt: skip

        launches[(block_m, block_k, warps, stages, split)] = launch
    times = kernel_times_us(launches, "_lora_shrink_kernel")
    default = times.pop("default")
    results = [(us, dict(zip(("m", "k", "w", "s", "split"), key))) for key, us in times.items()]
    name = f"shrink M={rows} K={k} R={rank}{' T' if transposed else ''} w={str(weight_dtype)[6:]}"
    _report(name, default, results, x.numel() * 2)


# (BLOCK_M, BLOCK_K, warps, stages, BLOCK_R) of `--high-rank`'s shrinks, each unsplit and in two.
_HIGH_RANK_SHRINK_CONFIGS = (
    (64, 64, 8, 4, 128), (128, 64, 8, 3, 128), (128, 32, 8, 3, 128), (64, 128, 8, 3, 128),
    (32, 128, 8, 4, 128), (64, 64, 4, 4, 64), (128, 64, 8, 3, 64), (128, 64, 4, 3, 64),
    (64, 128, 4, 4, 64), (128, 128, 8, 3, 64),
)  # fmt: skip


def tune_high_rank_shrink(rows: int, k: int, rank: int, weight_dtype: torch.dtype) -> None:
    """x @ W.T past 64 ranks, W one contiguous [R, K] weight (q/k/v's stacked A at rank 32 and more;
    the stack kernel, which reads the members' As where they are, takes the same tiles): the default
    launch against tiles x rank tiles x K splits, timed by kernel (`kernel_times_us`)."""
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(rank, k, device="cuda").to(weight_dtype)
    launches = {"default": lambda: lt._lora_shrink_triton(x=x, weight=weight)}
    for (block_m, block_k, warps, stages, block_r), split in itertools.product(
        _HIGH_RANK_SHRINK_CONFIGS, (1, 2)
    ):
        launches[(block_m, block_k, warps, stages, block_r, split)] = functools.partial(
            lt._lora_shrink_triton, x=x, weight=weight, split=split, block_m=block_m, block_k=block_k,
            num_warps=warps, num_stages=stages, block_r=block_r,
        )  # fmt: skip
    times = kernel_times_us(launches, "_lora_shrink_kernel")
    default = times.pop("default")
    results = [(us, dict(zip(("m", "k", "w", "s", "r", "split"), key))) for key, us in times.items()]
    _report(f"shrink M={rows} K={k} R={rank} w={str(weight_dtype)[6:]}", default, results, x.numel() * 2)
    for us, config in results:  # sorted by `_report`
        print(f"    {us:7.1f}us {config}")


def tune_expand_add(n: int, rank: int, right_dtype: torch.dtype) -> None:
    base = torch.randn(TOKENS, n, device="cuda", dtype=torch.bfloat16)
    # Token-major, as the shrink hands it over (the model's expand-adds take it so; row-major was 20%
    # faster at rank 16 on one MLP chunk, forty-seventh session: time what the model runs).
    left = _token_major(TOKENS, rank)
    right = torch.randn(n, rank, device="cuda", dtype=right_dtype)
    default = _bench(
        lambda: expand_add_module._lora_expand_add_triton(
            base=base, left=left, right=right, scale=0.5, out_dtype=base.dtype, out=base
        )
    )
    results = []
    tiles = (
        (32, 64),
        (32, 128),
        (64, 64),
        (64, 128),
        (128, 64),
        (128, 128),
        (32, 256),
        (64, 256),
        (128, 256),
    )
    for (block_m, block_n), warps, stages in itertools.product(tiles, (4, 8), (1, 2, 3)):

        def launch(block_m=block_m, block_n=block_n, warps=warps, stages=stages):
            expand_add_module._lora_expand_add_triton(
                base=base, left=left, right=right, scale=0.5, out_dtype=base.dtype, out=base,
                block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages,
            )  # fmt: skip

        config = dict(m=block_m, n=block_n, w=warps, s=stages)
        try:
            results.append((_bench(launch), config))
        except Exception as error:
            print(f"  skip {config}: {type(error).__name__}")
    _report(f"expand_add_ N={n} R={rank} w={str(right_dtype)[6:]}", default, results, base.numel() * 4)


# (BLOCK_M, BLOCK_K, warps, stages) candidates of lora_weight_grad: with the launcher's token splits,
# and (`--weight-grad-unsplit`) with one program per column tile walking every token row, which
# needs narrower column tiles to give every SM work.
_WEIGHT_GRAD_CONFIGS = tuple(itertools.product((64, 128), (128, 256), (4, 8), (2, 3, 4)))
_UNSPLIT_WEIGHT_GRAD_CONFIGS = tuple(itertools.product((64, 128), (16, 32, 64), (4, 8), (3,)))


def tune_weight_grad(k: int, rank: int, tokens: int = TOKENS, split: int | None = None) -> None:
    """lora_weight_grad's configs against its default launch, timed by kernel (`tune_weight_grad_kernels`):
    split None, the launcher's token splits; split=1, one program per column tile walking every token
    row, no split at all. (These modes timed with do_bench before the thirtieth session, which at
    these sizes times an unplanned launch's host as much as the kernel.)"""
    configs = _WEIGHT_GRAD_CONFIGS if split is None else _UNSPLIT_WEIGHT_GRAD_CONFIGS
    name = "weight_grad" + ("" if split is None else f" split={split}")
    tune_weight_grad_kernels(tokens, (rank,), (k,), name, configs=configs, splits=(split,))


# (BLOCK_M, BLOCK_K, warps, stages) of `--weight-grad-kernels`, each under several token splits.
# Four stages only where they fit beside a 64-rank tile of fp32 lefts.
_WEIGHT_GRAD_KERNEL_CONFIGS = (
    *itertools.product((64, 128), (64, 128, 256), (4, 8), (3,)),
    (64, 64, 4, 4), (64, 128, 4, 4), (64, 128, 8, 4), (128, 64, 8, 4),
)  # fmt: skip
_WEIGHT_GRAD_SPLITS = (1, 2, 4, 8, 16)


def _token_major(tokens: int, rank: int) -> torch.Tensor:
    """An fp32 [tokens, rank] left operand laid out token-major, as the shrinks hand it over."""
    return torch.randn(rank, tokens, device="cuda", dtype=torch.float32).T


def tune_weight_grad_kernels(
    tokens: int,
    ranks: tuple[int, ...],
    widths: tuple[int, ...],
    name: str,
    configs: tuple = _WEIGHT_GRAD_KERNEL_CONFIGS,
    splits: tuple = _WEIGHT_GRAD_SPLITS,
    block_rs: tuple = (None,),
) -> None:
    """One backward's weight gradients as the fused Functions launch them, against `configs` (BLOCK_M,
    BLOCK_K, warps, stages) x token `splits` (None: the launcher's rule), each timed by its kernel
    alone (`kernel_times_us`; these kernels run 20-150 us, about an unplanned launch's host time, so
    do_bench would time the host). One problem: `lora_weight_grad`'s kernel (q/k/v's stacked dA, the
    MLP's gate/up dA); several of one rank: the grouped kernel (o_proj's dA and dB, q/k/v's three dB,
    the MLP's gate, up and down dB). block_rs: rank tiles to try (None: the launcher's), one problem only."""
    lefts = [_token_major(tokens, rank) for rank in ranks]
    xs = [torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16) for width in widths]
    scales = [0.5] * len(xs)
    if len(xs) == 1:
        kernel = "_lora_weight_grad_kernel"

        def run(**config):
            weight_grad_module._lora_weight_grad_triton(left=lefts[0], x=xs[0], scale=0.5, **config)

    else:
        from fastlora_peft.kernels import lora_weight_grad_group as group_module

        kernel = "_lora_weight_grad_group_kernel"
        outs = [torch.empty(rank, width, device="cuda") for rank, width in zip(ranks, widths)]

        def run(**config):
            group_module._launch_group(lefts, xs, scales, outs, **config)

    launches = {"default": run}
    for (block_m, block_k, warps, stages), split, block_r in itertools.product(configs, splits, block_rs):
        config = dict(split=split, block_m=block_m, block_k=block_k, num_warps=warps, num_stages=stages)
        if block_r is not None:
            config["block_r"] = block_r
        launches[(block_m, block_k, warps, stages, split, block_r)] = functools.partial(run, **config)
    times = kernel_times_us(launches, kernel, calls=10)
    default = times.pop("default")
    results = [(us, dict(zip(("m", "k", "w", "s", "split", "r"), key))) for key, us in times.items()]
    moved = sum(x.numel() * x.element_size() for x in xs)
    _report(f"{name} M={tokens} K={widths} R={ranks}", default, results, moved)


def tune_gated_weight_grad(rows: int = 2048, n: int = 14336, rank: int = 16) -> None:
    """The MLP backward's fused activation-backward + dA_down kernel on one chunk of rows, against the
    three launches it replaces (recompute h, weight grad from h, activation backward)."""
    from fastlora_peft.kernels import gated_act, gated_act_lora

    gate = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    up, grad_h = torch.randn_like(gate), torch.randn_like(gate)
    left = _token_major(rows, rank)  # dY @ B_down's rows, as the MLP hands them over (no copy)

    def unfused():
        hidden = gated_act._gated_act_forward_triton(gate, up, "silu")
        weight_grad_module._lora_weight_grad_triton(left=left, x=hidden, scale=0.5)
        gated_act._gated_act_backward_triton(grad_h, gate, up, "silu", in_place=True)

    moved = gate.numel() * 2 * 5
    default = _bench(
        lambda: gated_act_lora._gated_act_backward_weight_grad_triton(
            grad_h=grad_h, gate=gate, up=up, activation="silu", left=left, scale=0.5
        )
    )
    print(f"gated bwd + dA rows={rows}: unfused three launches {_bench(unfused):7.1f}us", flush=True)
    results = []
    # 3 stages too: the thirty-seventh session found 16 x 128 x 3 stages 9% ahead of the best of 1 and 2.
    grid = itertools.product((16, 32, 64), (64, 128, 256), (4, 8), (1, 2, 3), (2, 4), (None,))
    if rank > 64:
        # Past 64 ranks the default takes a pass over the rows per 64-rank tile; a 128-wide tile takes
        # one. A smaller grid (about 1.5 s of compile a config): 32 configs, not 216.
        grid = itertools.product((16, 32), (64, 128), (4, 8), (2, 3), (2,), (64, 128))
    for block_m, block_i, warps, stages, per_sm, block_r in grid:

        def launch(
            block_m=block_m, block_i=block_i, warps=warps, stages=stages, per_sm=per_sm, block_r=block_r
        ):
            gated_act_lora._gated_act_backward_weight_grad_triton(
                grad_h=grad_h, gate=gate, up=up, activation="silu", left=left, scale=0.5,
                block_m=block_m, block_i=block_i, block_r=block_r, num_warps=warps, num_stages=stages,
                split_per_sm=per_sm,
            )  # fmt: skip

        config = dict(m=block_m, i=block_i, w=warps, s=stages, per_sm=per_sm, r=block_r)
        try:
            results.append((_bench(launch), config))
        except Exception as error:
            print(f"  skip {config}: {type(error).__name__}")
    _report(f"gated bwd + dA rows={rows} I={n} R={rank}", default, results, moved)


def tune_gated_lora_forward(
    right_dtype: torch.dtype, rows: int = 2048, n: int = 14336, rank: int = 16
) -> None:
    """The MLP forward's gated activation with gate's and up's LoRA terms on one chunk of rows (the
    halves of one [rows, 2I] bf16 buffer, as the MLP has them), against the three launches it
    replaces (two in-place expand-adds, then the activation)."""
    from fastlora_peft.kernels import gated_act, gated_act_lora_forward

    gate_up = torch.randn(rows, 2 * n, device="cuda", dtype=torch.bfloat16)
    gate, up = gate_up[:, :n], gate_up[:, n:]
    left = torch.randn(rows, 2 * rank, device="cuda", dtype=torch.float32)
    gate_left, up_left = left[:, :rank], left[:, rank:]
    gate_right = 0.01 * torch.randn(n, rank, device="cuda", dtype=right_dtype)
    up_right = 0.01 * torch.randn(n, rank, device="cuda", dtype=right_dtype)

    def unfused():
        expand_add_module._lora_expand_add_triton(
            base=gate, left=gate_left, right=gate_right, scale=0.5, out_dtype=gate.dtype, out=gate
        )
        expand_add_module._lora_expand_add_triton(
            base=up, left=up_left, right=up_right, scale=0.5, out_dtype=up.dtype, out=up
        )
        gated_act._gated_act_forward_triton(gate, up, "silu")

    def fused(**launch):
        gated_act_lora_forward._gated_act_lora_forward_triton(
            gate=gate, up=up, activation="silu", gate_left=gate_left, gate_right=gate_right, gate_scale=0.5,
            up_left=up_left, up_right=up_right, up_scale=0.5, **launch,
        )  # fmt: skip

    moved = gate.numel() * 2 * 5  # read gate, up; write gate, up, h
    name = f"gated fwd + LoRA rows={rows} I={n} R={rank} w={str(right_dtype)[6:]}"
    print(f"{name}: unfused three launches {_bench(unfused):7.1f}us", flush=True)
    default = _bench(fused)
    results = []
    tiles = ((16, 256), (32, 128), (32, 256), (64, 64), (64, 128), (128, 32), (128, 64), (256, 32))
    block_rs = (None, 32) if rank > 32 else (None,)
    for (block_m, block_i), warps, stages, block_r in itertools.product(tiles, (4, 8), (1, 2, 3), block_rs):
        config = dict(m=block_m, i=block_i, w=warps, s=stages, r=block_r)
        launch = dict(block_m=block_m, block_i=block_i, num_warps=warps, num_stages=stages, block_r=block_r)
        try:
            timed = _bench(lambda launch=launch: fused(**launch))
            results.append((timed, config))
        except Exception as error:
            print(f"  skip {config}: {type(error).__name__}")
    _report(name, default, results, moved)


def main() -> None:
    torch.manual_seed(0)
    bf16, fp32 = torch.bfloat16, torch.float32
    expand_add_shapes = (
        (4096, 16, fp32),
        (14336, 16, fp32),
        (14336, 16, bf16),
        (4096, 16, bf16),
        (4096, 64, bf16),
    )
    if "--split-shrink" in sys.argv:
        # The shrinks of an 8B training step with fp32 adapters: x @ A.T of q/k/v, gate/up and o, dY @ B
        # of q (and o, down), of k/v, and of one 2048-row chunk of the MLP (down's x @ A.T, gate's dY @ B).
        for rows, k, rank, transposed in (
            (8192, 4096, 48, False), (8192, 4096, 32, False), (8192, 4096, 16, False),
            (8192, 4096, 16, True), (8192, 1024, 16, True),
            (2048, 14336, 16, False), (2048, 14336, 16, True),
        ):  # fmt: skip
            tune_split_shrink(rows, k, rank, transposed)
        return
    if "--shrink-rows" in sys.argv and "--tokens=8192" in sys.argv:
        # The single shrinks of an 8192-token step: q/k/v's x @ [A_q | A_k | A_v].T, the MLP's x @
        # [A_gate | A_up].T, o's x @ A.T and dY @ B (a group's dY_i @ B_i run as one grouped launch).
        for dtype in (torch.float32, bf16):
            for rank, transposed in ((48, True), (32, True), (16, False), (16, True)):
                tune_shrink_rows(8192, 4096, rank, transposed, dtype)
        return
    if "--shrink-rows" in sys.argv:
        # The shrinks of one 2048-token step: the MLP's x @ [A_gate | A_up].T, h @ A_down.T, dY @ B_down
        # and dgate @ B_gate (dup @ B_up alike); q/k/v's x @ [A_q | A_k | A_v].T and dY @ B of k (v
        # alike); o's x @ A.T (its dY @ B is the MLP's dY @ B_down shape).
        for dtype in (torch.float32, bf16):
            for k, rank, transposed in (
                (4096, 32, True), (14336, 16, False), (4096, 16, True), (14336, 16, True),
                (4096, 48, True), (1024, 16, True), (4096, 16, False),
            ):  # fmt: skip
                tune_shrink_rows(2048, k, rank, transposed, dtype)
        return
    if "--high-rank-grads" in sys.argv:
        # Rank 64 and 128 (the rank sweep, fp32 adapters): q/k/v's stacked dA and three dB.
        for r in (64, 128):
            tune_weight_grad_kernels(8192, (3 * r,), (4096,), f"q/k/v dA r={r}", block_rs=(64, 128))
            tune_weight_grad_kernels(8192, (r, r, r), (4096, 1024, 1024), f"q/k/v dB r={r}")
        return
    if "--high-rank" in sys.argv:
        # Shrinks past 64 ranks: q/k/v's stacked x @ A.T at rank 32 / 64 / 128 (3r ranks); 128 ranks
        # are gate/up's at rank 64 or one rank-128 adapter.
        shrinks = ((96, torch.float32), (96, bf16), (128, torch.float32), (128, bf16), (192, torch.float32))
        for rank, dtype in (*shrinks, (192, bf16), (384, torch.float32)):
            tune_high_rank_shrink(8192, 4096, rank, dtype)
        return
    # --rank=R (repeatable) times the gated kernels at those ranks instead of 16 (the rank sweep's).
    ranks = [int(arg.split("=", 1)[1]) for arg in sys.argv if arg.startswith("--rank=")] or [16]
    if "--gated-forward" in sys.argv:
        for rank in ranks:
            for dtype in (bf16, fp32) if rank == 16 else (fp32,):
                tune_gated_lora_forward(dtype, rank=rank)
        return
    if "--gated" in sys.argv:
        for rank in ranks:
            tune_gated_weight_grad(rank=rank)
        return
    if "--weight-grad-kernels" in sys.argv:
        # A backward's weight gradients at 8192 and 2048 tokens: q/k/v's stacked dA (rank 3 x 16) and
        # its three dB, o_proj's dA and dB, the MLP's gate/up dA (rank 2 x 16) and its three dB.
        for tokens in (8192, 2048):
            tune_weight_grad_kernels(tokens, (48,), (4096,), "q/k/v dA")
            tune_weight_grad_kernels(tokens, (16, 16, 16), (4096, 1024, 1024), "q/k/v dB")
            tune_weight_grad_kernels(tokens, (16, 16), (4096, 4096), "o dA+dB")
            tune_weight_grad_kernels(tokens, (32,), (4096,), "MLP gate/up dA")
            tune_weight_grad_kernels(tokens, (16, 16, 16), (14336, 14336, 4096), "MLP dB")
        return
    if "--weight-grad-unsplit" in sys.argv:
        for tokens, k, rank in itertools.product((8192, 2048), (4096, 14336), (16, 48)):
            tune_weight_grad(k, rank, tokens, split=1)
        return
    if "--weight-grad" in sys.argv:
        for k in (14336, 4096):
            tune_weight_grad(k, 16)
        return
    if "--expand-add" in sys.argv:
        for n, rank, dtype in expand_add_shapes:
            tune_expand_add(n, rank, dtype)
        return
    for k, rank, dtype in ((4096, 16, bf16), (4096, 16, fp32), (14336, 16, fp32), (4096, 48, fp32)):
        tune_shrink(k, rank, dtype)
    for n, rank, dtype in expand_add_shapes:
        tune_expand_add(n, rank, dtype)
    for k, rank in itertools.product((4096, 14336), (16, 32)):
        tune_weight_grad(k, rank)


if __name__ == "__main__":
    main()
