"""`lora_addmm_group` (a group's forward GEMMs in one launch, each member's tile starting with its own
LoRA term) and the grouped forward that takes it.

The kernel against float64 under the interpreter (1, 2 and 3 members, ragged tiles, unequal ranks);
the per-member `lora_addmm` it runs where TMA cannot read an operand; checks, opcheck and the
predicate; its launch plan; and, with `LoraAddmmSettings.mode = "always"`, a q/k/v group's forward in
every 16-bit layout against float64 with the ops counted.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import FUNCTION_LAYOUTS, TRITON_INTERPRET, OpCounter, compiles_for_sm90_on_cpu, rel_err
from test_launch_plans import _ENCODED_ADDRESSES, _planned_and_unplanned, recorded_launches  # noqa: F401
from test_lora_addmm_sum import QKV_SHAPES, SIXTEEN_BIT_LAYOUTS, _group, _group_dx

from fastlora_peft.dtypes import plan_projection_dtypes
from fastlora_peft.functions.frozen_base import FrozenBase, materialize_weight
from fastlora_peft.functions.shared_input import fused_lora_projections
from fastlora_peft.kernels import lora_addmm_group as group_module
from fastlora_peft.kernels.lora_addmm import LoraAddmmSettings
from fastlora_peft.kernels.lora_addmm_group import (
    group_fits_tma,
    lora_addmm_group,
    lora_addmm_group_op,
    lora_addmm_group_pays_off,
)
from fastlora_peft.kernels.lora_addmm_sum import MAX_MEMBERS

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
TOLERANCE = {BF16: 1e-2, FP16: 1e-3}  # one rounding of a 16-bit result (the interpreter truncates bf16)
needs_triton = pytest.mark.skipif(
    not (TRITON_INTERPRET or torch.cuda.is_available()), reason="Triton needs CUDA or TRITON_INTERPRET=1"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _operands(m, k, widths, dtype, right_dtype, seed=0, ranks=None):
    """a [m, k]; per member b_i [k, n_i] K-major (a weight's transpose), left_i [m, r_i] (columns of
    one token-major xa, r_i = 3 + i unless `ranks` are given), right_i [n_i, r_i], scale_i. Terms as
    large as the GEMMs'."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    ranks = ranks or [3 + i for i in range(len(widths))]
    a = randn(m, k).to(DEVICE, dtype)
    b = [(randn(n, k) / k**0.5).to(DEVICE, dtype).t() for n in widths]
    xa = randn(sum(ranks), m).T.to(DEVICE)  # token-major, as lora_shrink hands it out
    starts = [sum(ranks[:i]) for i in range(len(ranks))]
    left = [xa[:, start : start + r] for start, r in zip(starts, ranks)]
    right = [(randn(n, r) / r**0.5).to(DEVICE, right_dtype) for n, r in zip(widths, ranks)]
    return a, b, left, right, [0.5 + i for i in range(len(widths))]


def _truths(a, b, left, right, scale):
    return [
        a.double() @ b_i.double() + s * left_i.double() @ right_i.double().T
        for b_i, left_i, right_i, s in zip(b, left, right, scale)
    ]


CASES = [
    pytest.param(dtype, right_dtype, widths, id="-".join([name, "n" + "_".join(map(str, widths))]))
    for (name, dtype, right_dtype), widths in itertools.product(
        [("bf16", BF16, BF16), ("bf16-fp32a", BF16, FP32), ("fp16", FP16, FP16), ("fp16-fp32a", FP16, FP32)],
        # ragged column tiles in every member (the interpreter's tiles are 16 x 32 x 16)
        [(40,), (72, 24), (72, 8, 40)],
    )
]  # fmt: skip


@needs_triton
@pytest.mark.parametrize("dtype, right_dtype, widths", CASES)
def test_kernel_matches_float64(dtype, right_dtype, widths, triton_launches):
    # 37 rows: a ragged row tile; K = 40: a ragged K tile.
    a, b, left, right, scale = _operands(37, 40, widths, dtype, right_dtype)
    assert group_fits_tma(a, b, left)
    outs = lora_addmm_group(a, b, left, right, scale)
    assert triton_launches == {"_lora_addmm_group_tma_kernel": 1}, triton_launches
    truths = _truths(a, b, left, right, scale)
    # Every member's scale differs from 1 (0.5, 1.5, 2.5): each output needs its own member's.
    unscaled = _truths(a, b, left, right, [1.0] * len(widths))
    for out, truth, wrong, width in zip(outs, truths, unscaled, widths):
        assert out.dtype == dtype and out.is_contiguous() and out.shape == (37, width)
        assert rel_err(out, truth) <= TOLERANCE[dtype]
        assert rel_err(out, wrong) > 10 * TOLERANCE[dtype]


@needs_triton
def test_operands_tma_cannot_read_take_lora_addmm_per_member(triton_launches):
    """A ragged K of 19 (38-byte rows): `lora_addmm`'s pointer kernel once per member."""
    a, b, left, right, scale = _operands(37, 19, (40, 24), BF16, FP32)
    assert not group_fits_tma(a, b, left)
    outs = lora_addmm_group(a, b, left, right, scale)
    assert triton_launches == {"_lora_addmm_kernel": 2}, triton_launches
    for out, truth in zip(outs, _truths(a, b, left, right, scale)):
        assert rel_err(out, truth) <= TOLERANCE[BF16]


def test_reference_and_float64():
    a, b, left, right, scale = _operands(9, 16, (8, 24), BF16, FP32)
    cpu = lambda tensors: [t.cpu() for t in tensors]  # noqa: E731
    double = lambda tensors: [t.double() for t in cpu(tensors)]  # noqa: E731
    outs = lora_addmm_group(a.cpu().double(), double(b), double(left), double(right), scale)
    truths = _truths(a.cpu(), cpu(b), cpu(left), cpu(right), scale)
    assert all(rel_err(out, truth) <= 1e-12 for out, truth in zip(outs, truths))


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(b=lambda b: [b[0][:-1], b[1]]), "shapes"),
        (dict(b=lambda b: [b[0], b[1].half()]), "16-bit"),
        (dict(scale=lambda s: s[:1]), "one length"),
        (dict(left=lambda left: [left[0], left[1].to(BF16)]), "left must be float32"),
    ],
    ids=["k-mismatch", "mixed-dtypes", "lengths", "16bit-left"],
)
def test_checks_name_the_problem(bad, match):
    a, b, left, right, scale = _operands(7, 16, (8, 16), BF16, FP32)
    args = dict(
        a=a.cpu(), b=[t.cpu() for t in b], left=[t.cpu() for t in left], right=[t.cpu() for t in right]
    )
    args["scale"] = scale
    for name, change in bad.items():
        args[name] = change(args[name])
    with pytest.raises(ValueError, match=match):
        lora_addmm_group(**args)


def test_opcheck():
    a, b, left, right, scale = _operands(8, 16, (8, 16), BF16, FP32)
    cpu = [a.cpu(), [t.cpu() for t in b], [t.cpu() for t in left], [t.cpu() for t in right], scale]
    torch.library.opcheck(lora_addmm_group_op, cpu)


def test_pays_off_only_where_lora_addmm_would(monkeypatch):
    a, b, left, _, _ = _operands(64, 16, (8, 16), BF16, FP32)
    a, b, left = a.cpu(), [t.cpu() for t in b], [t.cpu() for t in left]
    assert LoraAddmmSettings.mode == "auto" and LoraAddmmSettings.group_forward
    assert not lora_addmm_group_pays_off(a, b, left, BF16)  # CPU tensors
    monkeypatch.setattr(LoraAddmmSettings, "mode", "never")
    assert not lora_addmm_group_pays_off(a, b, left, BF16)
    monkeypatch.setattr(LoraAddmmSettings, "mode", "always")
    assert lora_addmm_group_pays_off(a, b, left, BF16)
    assert not lora_addmm_group_pays_off(a, b, left, FP32)  # an fp32 output
    assert not lora_addmm_group_pays_off(a, [b[0], b[1].t().contiguous()], left, BF16)  # row-major b
    assert not lora_addmm_group_pays_off(a, b, [left[0], left[1].contiguous()], BF16)  # one set of strides
    assert not lora_addmm_group_pays_off(a, [b[0]] * (MAX_MEMBERS + 1), [left[0]] * (MAX_MEMBERS + 1), BF16)
    monkeypatch.setattr(LoraAddmmSettings, "group_forward", False)
    assert not lora_addmm_group_pays_off(a, b, left, BF16)


@pytest.mark.parametrize(
    "widths, ranks", [((72, 24), None), ((72, 8, 40), None), ((72, 8, 40), [5, 70, 20])],
    ids=["two", "three", "three-left-copied"],
)  # fmt: skip
def test_plan_launches_what_the_launcher_would(recorded_launches, widths, ranks):  # noqa: F811
    """The plan passes a, each member's weight ([N, K]) and output where the kernel takes descriptors
    (slots past the group repeat the last member), and launches what the launcher would; from 64
    ranks on, with the lefts copied row-major as the launcher copies them (`copies_left`)."""

    def make_inputs(seed):
        a, b, left, right, scale = _operands(33, 40, widths, BF16, FP32, seed=seed, ranks=ranks)
        return dict(a=a, b=b, left=left, right=right, scale=[s + seed for s in scale])

    _ENCODED_ADDRESSES.clear()
    launch = _planned_and_unplanned(recorded_launches, group_module._lora_addmm_group_tma_triton, make_inputs)
    descriptors = [value[5] for value in launch if type(value) is tuple and value[0] == "tma"]
    slots = list(widths) + [widths[-1]] * (MAX_MEMBERS - len(widths))
    assert descriptors == [(33, 40), *((n, 40) for n in slots), *((33, n) for n in slots)]
    floats = [value for value in launch if type(value) is float]
    assert floats[:MAX_MEMBERS] == [0.5 + 1 + min(i, len(widths) - 1) for i in range(MAX_MEMBERS)]


def test_where_it_pays_off_launches_from_its_plan_without_the_fit_check(recorded_launches, monkeypatch):  # noqa: F811
    """`lora_addmm_group_where_it_pays_off` is None wherever `lora_addmm_group_pays_off` says no, and
    elsewhere launches; a call of the first one's metadata launches from its plan without asking
    `group_fits_tma` (a plan is made only by the TMA launch), and a mode that rules the group out
    still does so with a plan made."""
    from test_launch_plans import _THROUGH_CACHE, counted_fit_checks

    fit_checks = counted_fit_checks(monkeypatch, group_module, "group_fits_tma")
    where = group_module.lora_addmm_group_where_it_pays_off
    a, b, left, right, scale = _operands(33, 40, (72, 24), BF16, FP32)
    assert where(a, b, left, right, scale, BF16) is not None
    assert len(recorded_launches) == 1 and fit_checks
    fit_checks.clear()
    a2, b2, left2, right2, scale2 = _operands(33, 40, (72, 24), BF16, FP32, seed=1)
    assert len(where(a2, b2, left2, right2, scale2, BF16)) == 2
    assert not fit_checks and len(recorded_launches) == 2 and len(_THROUGH_CACHE) == 1  # from the plan
    assert where(a, b, left, right, scale, FP32) is None  # an fp32 output
    assert where(a, [b[0], b[1].contiguous()], left, right, scale, BF16) is None  # a row-major b
    monkeypatch.setattr(LoraAddmmSettings, "mode", "never")
    assert where(a2, b2, left2, right2, scale2, BF16) is None
    assert len(recorded_launches) == 2


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs a Hopper GPU"
)
def test_plan_launches_directly_and_computes_the_reference(triton_launches, monkeypatch):
    """On Hopper: the kernel launches through its C launch with seven descriptor encoders, from its
    plan from the second call on, each call computing the reference (new values, same addresses)."""
    monkeypatch.setattr(group_module._GROUP_PLANS, "plans", {})
    generator = torch.Generator(device="cuda").manual_seed(0)
    a, b, left, right, _ = _operands(1000, 512, (384, 128, 128), BF16, FP32)
    for call in range(3):
        for tensor in (a, *b, *left, *right):
            tensor.copy_(torch.randn(tensor.shape, generator=generator, device="cuda") * 0.1)
        scale = [0.5 + call, 1.5, 2.5]
        outs = lora_addmm_group(a, b, left, right, scale)
        for out, truth in zip(outs, _truths(a, b, left, right, scale)):
            assert rel_err(out, truth) < 5e-3, call
    assert triton_launches["_lora_addmm_group_tma_kernel"] == 3
    weights = [b_i.t() for b_i in b]
    plan = group_module._GROUP_PLANS.get(group_module._group_plan_key(a, weights, left, right))
    assert plan is not None and plan.launch.direct is not None and len(plan.launch.direct.encoders) == 7


# ---------------------------------------------------------------------------------------------------
# The fused group's forward (feature sizes multiples of 64: bitsandbytes quantizes only those on CPU).
# ---------------------------------------------------------------------------------------------------
_VIEW_OPS = frozenset(
    {"view", "t", "slice", "alias", "detach", "transpose", "_unsafe_view", "as_strided", "split_with_sizes"}
)


def _group_forward(shapes, layout, bias=False):
    dtype, _, quantized = layout
    bases, loras = _group(shapes, layout)
    if bias:
        bases = [
            FrozenBase(base.weight, torch.randn(out).to(dtype), base.quant)
            for base, (_, out) in zip(bases, shapes)
        ]
    x = torch.randn(3, 7, shapes[0][0], generator=torch.Generator().manual_seed(1)).to(dtype)
    plan = plan_projection_dtypes(dtype, dtype, quantized=quantized, device_type="cpu")
    with OpCounter(_VIEW_OPS) as ops:
        outputs = fused_lora_projections(x, bases, loras, plan)
    truths = []
    for base, lora in zip(bases, loras):
        weight = materialize_weight(base, FP32).double()
        delta = lora.scale * lora.lora_b.detach().double() @ lora.lora_a.detach().double()
        truth = x.reshape(21, -1).double() @ (weight + delta).T
        truths.append(truth if base.bias is None else truth + base.bias.double())
    return [out.reshape(21, -1) for out in outputs], truths, dict(ops.ops)


@pytest.mark.parametrize("layout_id", list(SIXTEEN_BIT_LAYOUTS))
def test_group_forward_is_one_launch(layout_id, monkeypatch, triton_launches):
    """Every 16-bit layout: each output within one rounding of float64, from one `lora_addmm_group`
    and no other GEMM or expand-add; without it, one lora_addmm per member."""
    layout = SIXTEEN_BIT_LAYOUTS[layout_id]
    monkeypatch.setattr(LoraAddmmSettings, "mode", "always")
    outputs, truths, ops = _group_forward(QKV_SHAPES, layout)
    assert ops.get("fastlora.lora_addmm_group") == 1, ops
    assert not {"mm", "addmm", "fastlora.lora_addmm", "fastlora.lora_expand_add_"} & set(ops), ops
    if TRITON_INTERPRET:
        assert triton_launches.get("_lora_addmm_group_tma_kernel") == 1, triton_launches
    for out, truth in zip(outputs, truths):
        assert rel_err(out, truth) <= TOLERANCE[layout[0]]
    monkeypatch.setattr(LoraAddmmSettings, "group_forward", False)
    _, _, ops = _group_forward(QKV_SHAPES, layout)
    assert "fastlora.lora_addmm_group" not in ops and ops.get("fastlora.lora_addmm") == 3, ops


@pytest.mark.parametrize(
    "layout_id", [name for name, layout in FUNCTION_LAYOUTS.items() if layout[0] == FP32]
)
def test_fp32_groups_keep_cublas(layout_id, monkeypatch):
    """fp32 operands (no tf32 here) take neither the grouped forward nor the summed dX, even "always"."""
    monkeypatch.setattr(LoraAddmmSettings, "mode", "always")
    layout = FUNCTION_LAYOUTS[layout_id]
    outputs, truths, ops = _group_forward(QKV_SHAPES, layout)
    assert not {"fastlora.lora_addmm_group", "fastlora.lora_addmm"} & set(ops) and ops.get("mm") == 3, ops
    assert all(rel_err(out, truth) <= 1e-5 for out, truth in zip(outputs, truths))
    _, _, backward_ops = _group_dx(QKV_SHAPES, layout)
    assert "fastlora.lora_addmm_sum" not in backward_ops and backward_ops.get("addmm_") == 2, backward_ops


def test_a_bias_keeps_the_members_apart(monkeypatch):
    """A bias (no lora_addmm either) leaves the forward to cuBLAS and the expand-add per member."""
    monkeypatch.setattr(LoraAddmmSettings, "mode", "always")
    outputs, truths, ops = _group_forward(QKV_SHAPES, FUNCTION_LAYOUTS["bf16"], bias=True)
    assert "fastlora.lora_addmm_group" not in ops and ops.get("fastlora.lora_expand_add_") == 3, ops
    assert all(rel_err(out, truth) <= TOLERANCE[BF16] for out, truth in zip(outputs, truths))


# Compiles the TMA kernels (one projection's, the group's and the sum's) for an H100/H200 (sm_90) with
# the tiles and descriptors the launchers use there, three members, and prints their shared memory
# and how many cp.async copies their TTGIR holds (Triton's ptxas runs on the CPU; a subprocess,
# because under TRITON_INTERPRET=1 `triton.jit` makes no compilable kernel). The group kernel's first
# version, one K loop per member, asked for 295-361 KB on the H200. The K loops read through TMA, so
# a cp.async copy can only be the term's loads, pipelined by its rank loop (`_tile_with_term`).
_SM90_COMPILE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fastlora_peft.kernels import lora_addmm, lora_addmm_group, lora_addmm_sum

BM, BN, BK, WARPS, STAGES = lora_addmm.TMA_GPU_CONFIG
kernels = {
    "single": (lora_addmm._lora_addmm_tma_kernel.kernel, [BN, BK]),  # the forward's K-major weight
    "group": (lora_addmm_group._lora_addmm_group_tma_kernel.kernel, [BN, BK]),  # weights K-major
    "sum": (lora_addmm_sum._lora_addmm_sum_tma_kernel.kernel, [BK, BN]),  # weights row-major
}
# bf16 operands with fp32 adapters take a plain tf32 term, with bf16 adapters a bf16 one, fp16 ones
# 3xTF32 (`dots.expand_dot_precision`): (name, operands' dtype, term precision, adapters' dtype).
layouts = (
    ("bf16", "bf16", "tf32", "fp32"), ("bf16a", "bf16", "bf16", "bf16"), ("fp16", "fp16", "tf32x3", "fp32")
)
# The term's tiling at rank 16 (one trip, plain loads) and at 192 ranks (a q/k/v sum at rank 64,
# pipelined), as `term_tiling` hands them out.
terms = {"few": lora_addmm.term_tiling(16), "many": lora_addmm.term_tiling(192)}
for (name, (fn, b_block)), (layout, dtype, precision, right), (ranks, (rank_tile, rank_stages)) in (
    (k, l, t) for k in kernels.items() for l in layouts for t in terms.items()
):
    names = fn.arg_names
    all_constexprs = dict(
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, BLOCK_R=rank_tile, GROUP_M=8, MEMBERS=3, PROGRAMS=132,
        DOT_PRECISION=precision, FP32_DOT=False, B_K_MAJOR=True, RANK_STAGES=rank_stages,
    )
    constexprs = {key: value for key, value in all_constexprs.items() if key in names}
    def kind(arg):
        if arg in constexprs:
            return "constexpr"
        if arg.endswith("_desc"):
            block = [BM, BK] if arg[0] == "a" else b_block if arg[0] == "b" else [BM, BN]
            return f"tensordesc<{dtype}[{block[0]},{block[1]}]>"
        if arg.startswith("Right"):
            return "*" + right
        return "*fp32" if arg.endswith("_ptr") else "fp32" if arg.startswith("scale") else "i32"
    signature = {arg: kind(arg) for arg in names}
    fixed = {(names.index(k),): v for k, v in constexprs.items()}
    source = ASTSource(fn=fn, signature=signature, constexprs=fixed)
    options = dict(num_warps=WARPS, num_stages=STAGES)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    copies = kernel.asm["ttgir"].count("ttg.async_copy_global_to_local")
    print(f"{name}-{layout}-{ranks}", kernel.metadata.shared, copies)
"""
H100_SHARED_MEMORY = 232448  # bytes a block may use on sm_90 (227 KB)


@compiles_for_sm90_on_cpu
def test_tma_kernels_fit_hopper_shared_memory_and_load_the_term_plainly():
    import os
    import subprocess
    import sys

    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", _SM90_COMPILE], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split() for line in result.stdout.split("\n") if line]
    shared = {row[0]: int(row[1]) for row in rows}
    async_copies = {row[0]: int(row[2]) for row in rows}
    names = {
        f"{kernel}-{dtype}-{ranks}"
        for kernel in ("single", "group", "sum")
        for dtype in ("bf16", "bf16a", "fp16")
        for ranks in ("few", "many")
    }
    assert set(shared) == names, result.stdout
    assert all(size <= H100_SHARED_MEMORY for size in shared.values()), shared
    # At rank 16 the term's loads stay plain loads ahead of the K loop: pipelined by the rank loop
    # (one trip), they cost these GEMMs 8-67 us more per call on the H200 (thirty-third session,
    # `docs/benchmarks/session33/term_latency_probe*.log`). Past 64 ranks the loop pipelines them
    # (cp.async copies): 12 trips at a q/k/v sum of rank 64 each waiting on its loads took 9-16% more
    # (forty-sixth session, `docs/benchmarks/session46/`).
    few = {name for name in names if name.endswith("-few")}
    assert {name: async_copies[name] for name in few} == dict.fromkeys(few, 0), async_copies
    assert all(async_copies[name] > 0 for name in names - few), async_copies
