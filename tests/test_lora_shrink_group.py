"""`lora_shrink_stacked` in one launch (`lora_shrink_group`): a group's backward shrinks `g_i @ B_i`.

The grouped kernel against float64 under the interpreter (2 and 3 members, ragged columns, split
columns, each dot mode); which stacked shrinks it takes; that it computes bit for bit what one
`lora_shrink` launch per member does; the split rule; its launch plan; an sm_90 compile against
`lora_shrink`'s kernel; and the fused q/k/v backward, which makes its `g_i @ B_i` in one launch.
"""

from __future__ import annotations

import pytest
import torch
from conftest import (
    FUNCTION_LAYOUTS,
    TRITON_INTERPRET,
    compiles_for_sm90_on_cpu,
    rel_err,
    requires_interpreter,
)
from test_launch_plans import _THROUGH_CACHE, _same_launch, recorded_launches  # noqa: F401

from fastlora_peft.dtypes import plan_projection_dtypes
from fastlora_peft.functions.shared_input import fused_lora_projections
from fastlora_peft.kernels import _launch, lora_terms
from fastlora_peft.kernels.dots import dot_precision
from fastlora_peft.kernels.lora_shrink_group import (
    ShrinkGroupSettings,
    group_k_per_split,
    launch_shrink_group,
)

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
needs_triton = pytest.mark.skipif(
    not (TRITON_INTERPRET or torch.cuda.is_available()), reason="Triton needs CUDA or TRITON_INTERPRET=1"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TEST_BLOCK_M = 8 if DEVICE == "cpu" else 16  # a GPU's tl.dot wants at least 16 rows


def _members(m, widths, x_dtype, weight_dtype, rank=5, seed=0, device=DEVICE):
    """Per member: x [m, K_i] (a dY) and weight = B_i.T ([rank, K_i], strides (1, rank)), a scale each."""
    generator = torch.Generator().manual_seed(seed)
    xs = [torch.randn(m, k, generator=generator).to(device, x_dtype) for k in widths]
    weights = [torch.randn(k, rank, generator=generator).to(device, weight_dtype).t() for k in widths]
    return xs, weights, [0.5 + i for i in range(len(widths))]


def _truth(xs, weights, scales):
    return torch.cat([s * (x.double() @ w.double().T) for x, w, s in zip(xs, weights, scales)], dim=1)


@needs_triton
@pytest.mark.parametrize("k_per_split", [None, 16], ids=["by_rule", "split"])
@pytest.mark.parametrize("x_dtype, weight_dtype", [(BF16, FP32), (BF16, BF16), (FP16, FP16), (FP32, BF16)])
@pytest.mark.parametrize("widths", [(40, 17, 130), (33, 64)], ids=str)
def test_grouped_kernel_matches_float64(widths, x_dtype, weight_dtype, k_per_split):
    m = 37
    xs, weights, scales = _members(m, widths, x_dtype, weight_dtype)
    config = lora_terms._shrink_config(xs[0], weights[0])
    out = torch.empty(5 * len(widths), m, device=DEVICE).T  # token-major, as the op makes it
    # Short row blocks, 16-column steps: several row blocks, steps and (split: 3, 2 and 9) splits.
    launch_shrink_group(
        xs, weights, scales, out, block_m=TEST_BLOCK_M, block_k=16, block_r=config.block_r, num_warps=4,
        num_stages=2,
        dot_mode=config.mode, dot_precision=dot_precision(x_dtype, weight_dtype), sms=1,
        k_per_split=k_per_split,
    )  # fmt: skip
    assert rel_err(out, _truth(xs, weights, scales)) < 1e-5


@needs_triton
def test_each_member_keeps_its_split_partials_apart():
    """On a GPU the programs of all members run at once, so each member's fp32 split partials must have
    memory of their own: member i's split s at (splits_0 + ... + splits_{i-1} + s) * M * R, laid out
    [M, R]. (The interpreter runs the programs one after another, so results alone cannot show two
    members sharing partials.)"""
    from fastlora_peft.kernels.split_sum import split_scratch

    m, widths, rank = 37, (40, 17, 130), 5
    xs, weights, scales = _members(m, widths, BF16, FP32, rank=rank)
    config = lora_terms._shrink_config(xs[0], weights[0])
    out = torch.empty(rank * 3, m, device=DEVICE).T
    launch_shrink_group(
        xs, weights, scales, out, block_m=TEST_BLOCK_M, block_k=16, block_r=config.block_r, num_warps=4,
        num_stages=2,
        dot_mode=config.mode, dot_precision="tf32x3", sms=1, k_per_split=16,
    )  # fmt: skip
    splits = [-(-k // 16) for k in widths]  # 3, 2 and 9
    partials = split_scratch(xs[0].device, sum(splits) * m * rank, 1).partials  # the launch's scratch
    slab = 0
    for x, weight, count in zip(xs, weights, splits):
        for split in range(count):
            columns = slice(16 * split, 16 * (split + 1))
            got = partials[(slab + split) * m * rank : (slab + split + 1) * m * rank].view(m, rank)
            assert rel_err(got, x[:, columns].double() @ weight[:, columns].double().T) < 1e-5
        slab += count


def test_split_length_rule():
    # 8192 tokens, q/k/v with fp32 weights (64-column steps: 64, 16 and 16 of them, 128 row blocks):
    # unsplit, 384 programs fall short of three per SM and q's run four times as long as k's and
    # v's; q in two makes 512 programs of at most twice k's length.
    assert group_k_per_split([4096, 1024, 1024], tiles=128, block_k=64, sms=132) == 2048
    # bf16 weights (128-column steps, 256 row blocks): 768 programs, but q's four times k's length.
    assert group_k_per_split([4096, 1024, 1024], tiles=256, block_k=128, sms=132) == 2048
    # The MLP's gate/up (224 steps each): 128 row blocks want two splits a member (512 programs) ...
    assert group_k_per_split([14336, 14336], tiles=128, block_k=64, sms=132) == 7168
    # ... 256 row blocks (bf16 weights, 8192 tokens) are 512 programs unsplit.
    assert group_k_per_split([14336, 14336], tiles=256, block_k=128, sms=132) == 14336
    # 2048 tokens, q/k/v: q in ten splits of 7 steps, k and v in three: 32 x 16 = 512 programs
    # (splits of 8 steps, q in eight, would make 384, short of 396).
    assert group_k_per_split([4096, 1024, 1024], tiles=32, block_k=64, sms=132) == 448
    # At least four column steps a split, however few the programs.
    assert group_k_per_split([512, 512], tiles=2, block_k=64, sms=132) == 256
    # A widest member under eight steps stays whole (four steps a split at the least).
    assert group_k_per_split([96, 64], tiles=1, block_k=16, sms=1) == 96


def test_single_shrink_split_rule():
    # bf16 weights over a rank tile of 16: unsplit from one row block per SM; below, about two
    # programs per SM.
    assert lora_terms.shrink_splits(256, 32, False, 132, 4) == 1
    assert lora_terms.shrink_splits(64, 112, False, 132, 4) == 5
    # Over a wide rank tile (one program per SM): 2048 tokens of 64 rows in four, 4096 in two, 8192
    # (128 row blocks) and 16384 unsplit.
    splits = [lora_terms.shrink_splits(blocks, 32, True, 132, 1) for blocks in (32, 64, 128, 256)]
    assert splits == [4, 2, 1, 1]
    # The split dot fills one wave of what the SMs hold, and no more: rank 16 (four per SM, 528
    # places) at 16384 tokens in two (512 programs; three made 768, a second wave) ...
    assert lora_terms.shrink_splits(256, 224, True, 132, 4) == 2
    # ... rank 32 (three per SM) at 8192 tokens in three (384 programs, where four made 512) ...
    assert lora_terms.shrink_splits(128, 64, True, 132, 3) == 3
    # ... and unsplit at 16384 (256 programs; two made 512).
    assert lora_terms.shrink_splits(256, 64, True, 132, 3) == 1
    # The wide rank tile (two per SM): 64 row blocks in four (256 programs of 264 places), 128 in two.
    assert lora_terms.shrink_splits(64, 64, True, 132, 2) == 4
    assert lora_terms.shrink_splits(128, 64, True, 132, 2) == 2
    # More row blocks than places: one split.
    assert lora_terms.shrink_splits(600, 64, True, 132, 4) == 1
    # Splits of about four K steps at the least.
    assert lora_terms.shrink_splits(16, 64, True, 132, 4) == 16
    assert lora_terms.shrink_splits(1, 5, False, 132, 4) == 2


def test_shrink_programs_per_sm_from_the_tiles():
    """The split dot's places per SM come from the tiles' shared memory: on an H200 (233,472 bytes
    an SM) four programs of the rank-16 tile, three of rank 32's, two of the wide tile's."""
    h200 = 233_472
    for rank, per_sm in ((16, 4), (32, 3), (48, 2)):
        x = torch.empty(8, 64, dtype=BF16)
        config = lora_terms._shrink_config(x, torch.empty(rank, 64, dtype=FP32))
        assert config.mode == lora_terms.SPLIT_DOT
        shared = lora_terms.shrink_shared_bytes(
            config.block_m, config.block_k, config.block_r, config.num_stages, 2, 4
        )
        assert h200 // shared == per_sm, (rank, shared)


@needs_triton
def test_stacked_shrink_takes_its_split_from_the_rules(monkeypatch):
    """The grouped launch asks `group_k_per_split` (widths, row blocks, column step, SMs) and splits as
    it answers; a lone shrink asks `shrink_splits` (row blocks, column steps, dot mode, SMs, and the
    programs an SM holds by its tiles' shared memory): the rules' own tests alone would pass with a
    launch that kept an old formula."""
    from fastlora_peft.kernels import lora_shrink_group as group_module
    from fastlora_peft.kernels import split_sum

    m, widths = 37, (40, 17, 130)
    xs, weights, scales = _members(m, widths, BF16, FP32)
    # Plans off (the class holds the one switch: `LaunchPlans`), so every launch asks its rule.
    monkeypatch.setattr(_launch.LaunchPlans, "enabled", False)
    asked, scratch_sizes = [], []
    monkeypatch.setattr(group_module, "group_k_per_split", lambda *args: asked.append(args) or 48)
    monkeypatch.setattr(lora_terms, "shrink_splits", lambda *args: asked.append(args) or 2)
    # The places per SM a lone shrink asks for, by shared memory: 7 stands for the answer.
    shared_asked = []
    monkeypatch.setattr(
        lora_terms, "_programs_per_sm", lambda device, shared: shared_asked.append(shared) or 7
    )

    def shared_bytes(config, x_bytes, weight_bytes):
        return lora_terms.shrink_shared_bytes(
            config.block_m, config.block_k, config.block_r, config.num_stages, x_bytes, weight_bytes
        )

    real_scratch = split_sum.split_scratch

    def recorded_scratch(device, *sizes):
        scratch_sizes.append(sizes)
        return real_scratch(device, *sizes)

    for module in (group_module, lora_terms):
        monkeypatch.setattr(module, "split_scratch", recorded_scratch)
    got = lora_terms.lora_shrink_stacked(xs, weights, scales)
    config = lora_terms._shrink_config(xs[0], weights[0])
    sms = lora_terms._num_sms(xs[0].device)
    row_blocks = -(-m // config.block_m)
    assert asked == [(list(widths), row_blocks, config.block_k, sms)]
    assert scratch_sizes == [((1 + 1 + 3) * m * 5, 3 * row_blocks)]  # 48 columns: 1, 1 and 3 splits
    assert rel_err(got, _truth(xs, weights, scales)) < 1e-5
    # Members of rank 70 (two 64-wide rank tiles each): the rule is told every rank tile's programs.
    asked.clear(), scratch_sizes.clear()
    wide_xs, wide_weights, _ = _members(m, widths, BF16, FP32, rank=70)
    got = lora_terms.lora_shrink_stacked(wide_xs, wide_weights, scales)
    wide_config = lora_terms._shrink_config(wide_xs[0], wide_weights[0], grouped=True)
    assert wide_config.block_r == 64
    assert asked == [(list(widths), 2 * -(-m // wide_config.block_m), wide_config.block_k, sms)]
    assert rel_err(got, _truth(wide_xs, wide_weights, scales)) < 1e-5
    asked.clear(), scratch_sizes.clear()
    got = lora_terms.lora_shrink(xs[2], weights[2], scales[2])
    assert asked == [(row_blocks, -(-130 // config.block_k), True, sms, 7)]
    assert shared_asked == [shared_bytes(config, 2, 4)]
    assert scratch_sizes == [(2 * m * 5, row_blocks)]
    assert rel_err(got, scales[2] * (xs[2].double() @ weights[2].double().T)) < 1e-5
    # 16-bit weights over a rank tile of 16: the rule is told they fill no wave.
    asked.clear(), shared_asked.clear()
    bf16_weight = weights[2].to(BF16)
    native = lora_terms._shrink_config(xs[2], bf16_weight)
    assert native.mode != config.mode
    lora_terms.lora_shrink(xs[2], bf16_weight)
    steps = -(-130 // native.block_k)
    assert asked == [(-(-m // native.block_m), steps, False, sms, 7)]
    assert shared_asked == [shared_bytes(native, 2, 2)]
    # A q/k/v group's stacked A (rank 48): the places asked for are its wide tile's.
    asked.clear(), shared_asked.clear()
    wide = torch.randn(48, 40, device=DEVICE)
    got = lora_terms.lora_shrink(xs[0], wide)
    wide_config = lora_terms._shrink_config(xs[0], wide)
    assert (wide_config.block_m, wide_config.block_r) == (128, 64)
    assert asked == [(-(-m // 128), -(-40 // 64), True, sms, 7)]
    assert shared_asked == [shared_bytes(wide_config, 2, 4)]
    assert rel_err(got, xs[0].double() @ wide.double().T) < 1e-5
    # The same with bf16 adapters: the wide 16-bit tile fills one wave of one program per SM, whatever
    # its shared memory would allow (so the places are not asked for).
    asked.clear(), shared_asked.clear()
    wide_bf16 = wide.to(BF16)
    got = lora_terms.lora_shrink(xs[0], wide_bf16)
    native_wide = lora_terms._shrink_config(xs[0], wide_bf16)
    assert (native_wide.block_m, native_wide.block_k, native_wide.block_r) == (64, 128, 64)
    assert asked == [(-(-m // 64), 1, True, sms, 1)]
    assert shared_asked == []
    assert rel_err(got, xs[0].double() @ wide_bf16.double().T) < 1e-5
    # Past 64 ranks (a q/k/v group's stacked A at rank 64): 64-wide rank tiles, and the rule is told
    # the programs of every rank tile.
    asked.clear(), shared_asked.clear()
    wider = torch.randn(130, 40, device=DEVICE)
    got = lora_terms.lora_shrink(xs[0], wider)
    wider_config = lora_terms._shrink_config(xs[0], wider)
    assert (wider_config.block_m, wider_config.block_r) == (128, 64)
    assert asked == [(-(-m // 128) * 3, -(-40 // 64), True, sms, 7)]
    assert rel_err(got, xs[0].double() @ wider.double().T) < 1e-5


@pytest.mark.parametrize(
    "change, groups",
    [
        (lambda xs, ws: (xs, ws), True),
        (lambda xs, ws: (xs[:1], ws[:1]), False),  # one member: lora_shrink's launch
        (lambda xs, ws: ([*xs, xs[0]], [*ws, ws[0]]), False),  # four members
        (lambda xs, ws: (xs, [ws[0], ws[1][:4], ws[2]]), False),  # ranks differ
        (lambda xs, ws: ([xs[0], xs[1].to(FP16), xs[2]], ws), False),  # activation dtypes differ
        (lambda xs, ws: ([xs[0], xs[1].T.contiguous().T, xs[2]], ws), False),  # columns not contiguous
        (lambda xs, ws: ([xs[0], xs[1][:, :1], xs[2]], [ws[0], ws[1][:, :1], ws[2]]), False),  # one column
        (lambda xs, ws: (xs, [ws[0], ws[1].contiguous(), ws[2]]), False),  # weights of other strides
    ],
)
def test_which_stacked_shrinks_take_one_launch(change, groups, monkeypatch):
    xs, weights, _ = _members(9, (40, 17, 30), BF16, BF16)
    assert lora_terms._shrinks_group(*change(xs, weights)) == groups
    monkeypatch.setattr(ShrinkGroupSettings, "enabled", False)
    assert not lora_terms._shrinks_group(xs, weights)


def test_fp32_weights_copied_for_fp32_dots_stay_apart():
    # fp32 activations against fp32 weights take tf32x3 dots, for which lora_shrink copies a
    # transposed weight contiguous: each member's own launch.
    xs, weights, _ = _members(9, (40, 17, 30), FP32, FP32)
    assert not lora_terms._shrinks_group(xs, weights)


@needs_triton
@pytest.mark.parametrize("x_dtype, weight_dtype", [(BF16, FP32), (BF16, BF16), (FP16, FP16)])
def test_grouped_launch_computes_what_lora_shrink_does(x_dtype, weight_dtype, triton_launches, monkeypatch):
    xs, weights, scales = _members(45, (40, 17, 30), x_dtype, weight_dtype)
    grouped = lora_terms.lora_shrink_stacked(xs, weights, scales)
    assert dict(triton_launches) == {"_lora_shrink_group_kernel": 1}
    triton_launches.clear()
    monkeypatch.setattr(ShrinkGroupSettings, "enabled", False)
    alone = lora_terms.lora_shrink_stacked(xs, weights, scales)
    assert dict(triton_launches) == {"_lora_shrink_kernel": 3}
    assert grouped.stride() == alone.stride() == (1, 45)
    # The interpreter (one SM) splits neither; on a GPU each splits its columns its own way, so the
    # fp32 sums may differ in their last bits.
    assert torch.equal(grouped, alone) if DEVICE == "cpu" else rel_err(grouped, alone) < 1e-6
    assert rel_err(grouped, _truth(xs, weights, scales)) < 1e-5


def test_group_plan_launches_what_the_launcher_would(recorded_launches, monkeypatch):  # noqa: F811
    """Call 1 makes the plan, call 2 launches from it with its own tensors and scales, call 3 (plans
    off) must launch the same arguments. (The op body, whose plan it is: on CPU tensors it is told
    they run Triton.)"""
    monkeypatch.setattr(lora_terms, "runs_triton", lambda tensor: True)

    def make_inputs(seed):
        # CPU tensors stand in for CUDA ones (recorded_launches), on any machine.
        xs, weights, scales = _members(600, (64, 32, 32), BF16, FP32, rank=16, seed=seed, device="cpu")
        return xs, weights, [scale + seed for scale in scales]

    lora_terms._lora_shrink_stacked_body(*make_inputs(0))
    assert len(recorded_launches) == 1 and len(_THROUGH_CACHE) == 1
    second = make_inputs(1)
    lora_terms._lora_shrink_stacked_body(*second)
    assert len(recorded_launches) == 2 and len(_THROUGH_CACHE) == 1, "call 2 did not launch from its plan"
    _launch.LaunchPlans.enabled = False
    try:
        lora_terms._lora_shrink_stacked_body(*second)
    finally:
        _launch.LaunchPlans.enabled = True
    _same_launch(recorded_launches[1], recorded_launches[2], [*second[0], *second[1]])
    assert [value for value in recorded_launches[1] if type(value) is float] == [1.5, 2.5, 3.5]


@requires_interpreter  # CPU tensors: on a GPU machine without the interpreter they take the reference
@pytest.mark.parametrize("layout_id", list(FUNCTION_LAYOUTS))
def test_fused_qkv_backward_makes_its_shrinks_in_one_launch(layout_id, triton_launches, monkeypatch):
    """q/k/v's `g_i @ B_i` in one launch where the layout allows it (not fp32 adapters on fp16 or fp32
    activations, whose fp32 dots take a copied weight per member), and every gradient bit for bit
    what one launch per member gives."""
    from test_lora_weight_grads import _projections

    layout = FUNCTION_LAYOUTS[layout_id]
    plan = plan_projection_dtypes(layout[0], layout[0], quantized=layout[2], device_type="cpu")
    copied = layout[1] == FP32 and layout[0] in (FP16, FP32)
    results = {}
    for grouped in (True, False):
        monkeypatch.setattr(ShrinkGroupSettings, "enabled", grouped)
        bases, loras = _projections([(64, 64), (64, 128), (64, 128)], layout)
        x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(1)).to(layout[0]).requires_grad_()
        outputs = fused_lora_projections(x, bases, loras, plan)
        grads = [
            torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out.dtype)
            for out in outputs
        ]
        triton_launches.clear()
        torch.autograd.backward(outputs, grads)
        shrinks = {k: v for k, v in triton_launches.items() if "shrink" in k}
        one_launch = grouped and not copied
        assert shrinks == ({"_lora_shrink_group_kernel": 1} if one_launch else {"_lora_shrink_kernel": 3}), (
            shrinks
        )
        results[grouped] = [x.grad] + [g for lora in loras for g in (lora.lora_a.grad, lora.lora_b.grad)]
    for got, want in zip(results[True], results[False]):
        assert torch.equal(got, want)


# Compiles `lora_shrink`'s kernel and the grouped kernel for an H100/H200 (sm_90) as launches at Llama
# sizes specialize them (16-byte aligned pointers, sizes and strides multiples of 16; B.T's rank
# stride and the token-major output's row stride 1), the split dot (fp32 B) and the native one (bf16
# B), with and without splits, and prints each one's shared memory and its memory and MMA
# instructions by kind. A subprocess: under TRITON_INTERPRET=1 `triton.jit` makes no compilable kernel.
_SM90_COMPILE = r"""
import collections
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fastlora_peft.kernels import lora_shrink_group, lora_terms
from fastlora_peft.kernels.dots import NATIVE_DOT, SPLIT_DOT

kernels = {
    "single": lora_terms._lora_shrink_kernel.kernel,
    "group": lora_shrink_group._lora_shrink_group_kernel.kernel,
}
for mode, weight_type in ((SPLIT_DOT, "fp32"), (NATIVE_DOT, "bf16")):
    block_m, block_k = lora_terms._SHRINK_TILES[mode]
    for split in (False, True):
        for name, fn in kernels.items():
            constexprs = dict(
                BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_R=16, DOT_PRECISION="tf32x3", DOT_MODE=mode,
                SPLIT=split, stride_wr=1, stride_om=1,
            )
            single = dict(stride_xk=1, STORE_WEIGHT_T=False)  # the shrink alone, as launched for a group
            constexprs.update(MEMBERS=3) if name == "group" else constexprs.update(single)
            names = fn.arg_names
            def kind(arg):
                if arg in constexprs:
                    return "constexpr"
                if arg.startswith("X"):
                    return "*bf16"
                if arg.startswith("W"):
                    return "*" + weight_type
                if arg.startswith("Counter"):
                    return "*i32"
                return "*fp32" if arg.endswith("_ptr") else "fp32" if arg.startswith("scale") else "i32"
            signature = {arg: kind(arg) for arg in names}
            divisible = [
                i for i, arg in enumerate(names)
                if signature[arg] not in ("constexpr", "fp32") and not arg.startswith(("n_splits", "splits"))
            ]
            source = ASTSource(
                fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in constexprs.items()},
                attrs={(i,): [["tt.divisibility", 16]] for i in divisible},
            )
            options = dict(num_warps=4, num_stages=4)  # lora_shrink's launch at rank 16
            kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
            ops = collections.Counter()
            for line in kernel.asm["ptx"].split("\n"):
                words = line.strip().rstrip(";").split()
                words = words[1:] if words and words[0].startswith("@") else words
                if words and words[0].startswith(("cp.async", "ld.global", "wgmma.mma_async", "mma.sync")):
                    operands = " ".join(words[1:]).split(",")
                    copies = words[0].startswith(("cp.async.ca.", "cp.async.cg."))
                    size = operands[2].strip() if copies else ""
                    ops[f"{words[0]} {size}".strip()] += 1
            print(name, mode, int(split), kernel.metadata.shared, dict(sorted(ops.items())))
"""


@compiles_for_sm90_on_cpu
def test_grouped_kernel_compiles_to_lora_shrinks_loads_and_dots_on_hopper():
    """The grouped kernel's pick of a member must not cost its loop anything on the GPU: for sm_90 it
    compiles to the same shared memory and the same asynchronous copies (16-byte for x), loads and
    dots as `lora_shrink`'s kernel (stores aside: a member of one split stores without the sum)."""
    import os
    import subprocess
    import sys

    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", _SM90_COMPILE], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    compiled = {}
    for line in result.stdout.strip().split("\n"):
        name, mode, split, rest = line.split(" ", 3)
        compiled[name, mode, split] = rest
    assert len(compiled) == 8, compiled
    for name, mode, split in compiled:
        if name == "group":
            assert compiled["group", mode, split] == compiled["single", mode, split]
            assert "cp.async.cg.shared.global 0x10" in compiled["group", mode, split]
