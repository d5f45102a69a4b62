"""Block groups: the q/k/v hand-off under every call pattern, the gated MLP's saved tensors, and
disable/merge/unload/adapter switching with groups installed."""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
from conftest import (
    FUSED_BACKWARD_NODE,
    MLP_BACKWARD_NODE,
    add_second_adapter,
    assert_lora_grads_match,
    autograd_node_names,
    copy_lora,
    count_lora_sublayer_calls,
    randomize_lora,
    rel_err,
    tiny_llama,
)
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.utils.checkpoint import checkpoint

from fastlora_peft import FastLoraConfig, FusedPathError, GroupVerificationWarning
from fastlora_peft import blocks as blocks_module
from fastlora_peft.blocks import GatedMlpGroup, SharedInputGroup

HIDDEN = 40


class ToyAttention(nn.Module):
    """q/k/v of unequal widths (one with a bias) called in a pattern chosen by the test."""

    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, 24, bias=False)
        self.k_proj = nn.Linear(HIDDEN, 12, bias=False)
        self.v_proj = nn.Linear(HIDDEN, 12, bias=True)
        self.pattern = "qkv"

    def forward(self, x, other=None):
        q, k, v = self.q_proj, self.k_proj, self.v_proj
        if self.pattern == "qkv":
            return q(x), k(x), v(x)
        if self.pattern == "kvq":
            key, value = k(x), v(x)
            return q(x), key, value
        if self.pattern == "other_tensor":  # cross-attention: k and v read another tensor
            return q(x), k(other), v(other)
        if self.pattern == "only_q":
            return (q(x),)
        if self.pattern == "twice":
            first = q(x)
            return first + q(x), k(x), v(x)
        if self.pattern == "modified_between":  # x changes in place after q: k and v must see it
            x = x.clone()
            query = q(x)
            x.mul_(2)
            return query, k(x), v(x)
        raise ValueError(self.pattern)


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.attn = ToyAttention()
        self.checkpointed = False

    @property
    def dummy_inputs(self):
        return {"x": torch.randn(2, 3, HIDDEN, generator=torch.Generator().manual_seed(0))}

    def forward(self, x, other=None):
        if self.checkpointed:
            return checkpoint(self.attn, x, other, use_reentrant=False)
        return self.attn(x, other)


def toy_pair(ranks=None, base=None, targets=("q_proj", "k_proj", "v_proj")):
    """(fastlora, PEFT) over copies of `base` (a ToyModel by default), the same random adapters."""
    config = dict(r=3, lora_alpha=5, target_modules=list(targets), rank_pattern=ranks or {})
    base = ToyModel() if base is None else base
    fast = get_peft_model(copy.deepcopy(base), FastLoraConfig(**config))
    peft = get_peft_model(base, LoraConfig(**config))
    randomize_lora(fast, seed=1)
    copy_lora(fast, peft)
    return fast, peft


def assert_step_matches_peft(fast, peft, x):
    """One forward and backward of each on x, PEFT's sub-layers never run in `fast`: outputs, dX
    and adapter gradients alike. Returns fast's outputs (a tuple)."""
    results = {}
    for name, model in (("fast", fast), ("peft", peft)):
        x_leaf = x.clone().requires_grad_()
        with count_lora_sublayer_calls(model) as calls:
            out = model(x_leaf)
        outputs = out if isinstance(out, tuple) else (out,)
        sum((o * torch.linspace(-1, 1, o.shape[-1])).sum() for o in outputs).backward()
        results[name] = (outputs, x_leaf.grad, calls)
    assert not results["fast"][2], results["fast"][2]
    for fast_out, peft_out in zip(results["fast"][0], results["peft"][0]):
        assert rel_err(fast_out, peft_out) < 1e-5
    assert rel_err(results["fast"][1], results["peft"][1]) < 1e-5
    assert_lora_grads_match(fast, peft, 1e-5)
    return results["fast"][0]


def run(model, pattern, x, other, checkpointed=False):
    model.base_model.model.attn.pattern = pattern
    model.base_model.model.checkpointed = checkpointed
    x = x.clone().requires_grad_()
    outputs = model(x, other)
    loss = sum((out * torch.linspace(-1, 1, out.shape[-1])).sum() for out in outputs)
    loss.backward()
    return outputs, x.grad


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("pattern", ["qkv", "kvq", "other_tensor", "only_q", "twice"])
def test_shared_input_group_under_any_call_pattern(pattern, checkpointed):
    fast, peft = toy_pair(ranks={"k_proj": 5})
    (group,) = fast.fastlora_groups()
    assert isinstance(group, SharedInputGroup) and group.member_names == ["q_proj", "k_proj", "v_proj"]
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(3, 5, HIDDEN, generator=generator)
    other = torch.randn(3, 5, HIDDEN, generator=generator)

    with count_lora_sublayer_calls(fast) as calls:
        fast_outputs, fast_grad_x = run(fast, pattern, x, other, checkpointed)
    peft_outputs, peft_grad_x = run(peft, pattern, x, other, checkpointed)
    assert not calls
    for fast_out, peft_out in zip(fast_outputs, peft_outputs):
        assert rel_err(fast_out, peft_out) < 1e-5
    assert rel_err(fast_grad_x, peft_grad_x) < 1e-5
    assert_lora_grads_match(fast, peft, 1e-5)
    if pattern == "qkv" and not checkpointed:  # the common case: one fused call for all three
        assert autograd_node_names(*fast_outputs).count(FUSED_BACKWARD_NODE) == 1
    assert group.fused_calls > 0
    # Nothing outlives the parent's forward: no pending outputs, no reference to the input.
    assert not group._pending and group._pending_input is None


class RootAttention(ToyAttention):
    """q/k/v right under the model's root: the root is their parent."""

    @property
    def dummy_inputs(self):
        return {"x": torch.randn(2, 3, HIDDEN, generator=torch.Generator().manual_seed(0))}


def test_layers_under_the_models_root_are_grouped():
    torch.manual_seed(0)
    fast, peft = toy_pair(base=RootAttention())
    (group,) = fast.fastlora_groups()
    assert isinstance(group, SharedInputGroup) and group.parent_name == ""
    assert group.member_names == ["q_proj", "k_proj", "v_proj"]
    outputs = assert_step_matches_peft(fast, peft, torch.randn(4, HIDDEN))
    assert autograd_node_names(*outputs).count(FUSED_BACKWARD_NODE) == 1
    assert "shared_input:" in fast.base_model.format_fastlora_report()


class RootMlp(nn.Module):
    """A gated MLP as the whole model: gate, up and down right under the root."""

    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, 56, bias=False)
        self.up_proj = nn.Linear(HIDDEN, 56, bias=False)
        self.down_proj = nn.Linear(56, HIDDEN, bias=False)
        self.act_fn = nn.SiLU()

    @property
    def dummy_inputs(self):
        return {"x": torch.randn(2, 3, HIDDEN, generator=torch.Generator().manual_seed(0))}

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def test_gated_mlp_under_the_models_root_is_grouped():
    torch.manual_seed(0)
    fast, peft = toy_pair(base=RootMlp(), targets=("gate_proj", "up_proj", "down_proj"))
    (group,) = fast.fastlora_groups()
    assert isinstance(group, GatedMlpGroup) and group.parent_name == "" and group.activation == "silu"
    (out,) = assert_step_matches_peft(fast, peft, torch.randn(4, HIDDEN))
    assert type(out.grad_fn).__name__ == MLP_BACKWARD_NODE


def test_a_group_whose_fused_call_disagrees_is_announced_and_strict_raises(monkeypatch):
    """A gated MLP group whose fused call gives other numbers than the parent's own forward is not
    installed, as before, and no longer quietly: a warning at injection (an error under fused_only),
    since the members then run one by one, slower, and only the report said why. (pyproject.toml
    turns this warning into an error in every other test: a model built in a test never has one.)"""
    real = blocks_module.fused_gated_mlp
    monkeypatch.setattr(blocks_module, "fused_gated_mlp", lambda *args: real(*args) * 1.5)
    config = dict(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"])
    with pytest.warns(GroupVerificationWarning, match=r"model\.layers\.0\.mlp.*verification mismatch"):
        fast = get_peft_model(tiny_llama(), FastLoraConfig(**config))
    assert not fast.fastlora_groups()
    routes = fast.fastlora_report()
    assert routes and all(r.path == "fused" and "verification mismatch" in r.group for r in routes)
    with pytest.raises(FusedPathError, match="verification mismatch"):
        get_peft_model(tiny_llama(), FastLoraConfig(**config, fused_only=True))
    monkeypatch.setattr(blocks_module, "fused_gated_mlp", real)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GroupVerificationWarning)
        assert len(get_peft_model(tiny_llama(), FastLoraConfig(**config)).fastlora_groups()) == 1


@pytest.mark.parametrize("pattern", ["qkv", "modified_between"])
def test_shared_input_group_without_grad(pattern):
    fast, peft = toy_pair()
    fast.base_model.model.attn.pattern = peft.base_model.model.attn.pattern = pattern
    x = torch.randn(4, HIDDEN)
    with torch.no_grad():  # (an in-place change of x between calls is only legal without autograd)
        fast_outputs = fast(x)
        peft_outputs = peft(x)
    assert all(out.grad_fn is None for out in fast_outputs)
    for fast_out, peft_out in zip(fast_outputs, peft_outputs):
        assert rel_err(fast_out, peft_out) < 1e-5


def llama_pair():
    base = tiny_llama()
    config = dict(r=4, lora_alpha=8, target_modules="all-linear")
    fast = get_peft_model(copy.deepcopy(base), FastLoraConfig(**config))
    peft = get_peft_model(base, LoraConfig(**config))
    randomize_lora(fast, seed=3)
    copy_lora(fast, peft)
    return fast, peft


def test_gated_mlp_saves_only_x_and_the_preactivations():
    fast, _ = llama_pair()
    mlp = fast.base_model.model.model.layers[0].mlp
    assert isinstance(mlp.forward, GatedMlpGroup) and mlp.forward.activation == "silu"
    x = torch.randn(2, 5, 48, requires_grad=True)
    out = mlp(x)
    assert type(out.grad_fn).__name__ == MLP_BACKWARD_NODE
    saved = out.grad_fn.saved_tensors
    activations = [
        t for t in saved if t.dim() >= 2 and t.shape[0] in (2, 10) and not isinstance(t, nn.Parameter)
    ]
    shapes = sorted(tuple(t.shape) for t in activations)
    # x, gate and up pre-activations, and the rank-sized x @ [Ag; Au].T and h @ Ad.T: never h itself.
    assert shapes == sorted([(2, 5, 48), (10, 88), (10, 88), (10, 8), (10, 4)]), shapes


def test_members_of_other_adapters_or_dtypes_run_one_by_one():
    """A group fuses only members that share their active adapters and their dtype plan; otherwise
    each member runs its own fused projection, and the group counts why."""
    x = torch.randn(2, 5, HIDDEN, generator=torch.Generator().manual_seed(6))
    # Several active adapters, one of them on q and v only: k's active adapters differ from q's.
    fast, peft = toy_pair()
    add_second_adapter(fast, peft, seed=3, r=2, lora_alpha=3, target_modules=["q_proj", "v_proj"])
    for model in (fast, peft):
        model.base_model.set_adapter(["default", "second"])
    (group,) = fast.fastlora_groups()
    assert_step_matches_peft(fast, peft, x)
    assert group.fused_calls == 0
    assert group.unfused_calls == {"members have different active adapters": 3}  # one a member call

    # k's base weight cast to bf16 after injection, q's and v's fp32: the members plan x differently.
    fast, peft = toy_pair()
    (group,) = fast.fastlora_groups()
    fast.base_model.model.attn.k_proj.base_layer.to(torch.bfloat16)
    with count_lora_sublayer_calls(fast) as calls:
        outputs = fast(x)
    assert not calls
    assert group.fused_calls == 0 and group.unfused_calls == {"members' dtype plans differ": 3}
    assert autograd_node_names(*outputs).count(FUSED_BACKWARD_NODE) == 3
    expected = peft(x)
    for index in (0, 2):  # q and v as PEFT has them; k's own projection ran in bf16
        assert rel_err(outputs[index], expected[index]) < 1e-5
    assert outputs[1].dtype == torch.float32 and rel_err(outputs[1], expected[1]) < 2e-2


def test_groups_follow_disable_merge_switch_and_unload():
    fast, peft = llama_pair()
    ids = torch.randint(0, 61, (2, 6), generator=torch.Generator().manual_seed(1))
    base_logits = tiny_llama()(input_ids=ids).logits
    adapted = peft(input_ids=ids).logits

    with fast.disable_adapter():
        assert rel_err(fast(input_ids=ids).logits, base_logits) < 1e-6
    assert rel_err(fast(input_ids=ids).logits, adapted) < 1e-5
    fast.merge_adapter()
    merged = fast(input_ids=ids).logits
    assert MLP_BACKWARD_NODE not in autograd_node_names(merged)
    assert rel_err(merged, adapted) < 1e-5
    fast.unmerge_adapter()

    add_second_adapter(fast, peft, seed=8, r=2, lora_alpha=3, target_modules="all-linear")
    fast.set_adapter("second")
    peft.set_adapter("second")
    logits = fast(input_ids=ids).logits
    assert autograd_node_names(logits).count(MLP_BACKWARD_NODE) == 1
    assert rel_err(logits, peft(input_ids=ids).logits) < 1e-5

    parents = [group.parent for group in fast.fastlora_groups()]
    unloaded = fast.unload()
    assert all("forward" not in parent.__dict__ for parent in parents)
    assert rel_err(unloaded(input_ids=ids).logits, base_logits) < 1e-6


def test_fuse_blocks_false_keeps_one_call_per_projection():
    model = get_peft_model(tiny_llama(), FastLoraConfig(target_modules="all-linear", fuse_blocks=False))
    randomize_lora(model)
    assert model.fastlora_groups() == []
    logits = model(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert autograd_node_names(logits).count(FUSED_BACKWARD_NODE) == 7


def test_trainable_base_bias_is_fused():
    """`bias="all"` makes the base biases trainable: the fused Functions return their gradients."""
    config = dict(r=3, lora_alpha=5, target_modules=["q_proj", "k_proj", "v_proj"], bias="all")
    base = ToyModel()
    fast = get_peft_model(copy.deepcopy(base), FastLoraConfig(**config))
    peft = get_peft_model(base, LoraConfig(**config))
    randomize_lora(fast, seed=1)
    copy_lora(fast, peft)
    x = torch.randn(3, 4, HIDDEN, generator=torch.Generator().manual_seed(5))
    with count_lora_sublayer_calls(fast) as calls:
        fast_outputs, _ = run(fast, "qkv", x, None)
    peft_outputs, _ = run(peft, "qkv", x, None)
    assert not calls and autograd_node_names(*fast_outputs).count(FUSED_BACKWARD_NODE) == 1
    fast_bias = fast.base_model.model.attn.v_proj.base_layer.bias
    peft_bias = peft.base_model.model.attn.v_proj.base_layer.bias
    assert fast_bias.requires_grad and rel_err(fast_bias.grad, peft_bias.grad) < 1e-6


def test_down_plans_h_as_every_member_planned_x():
    """`GatedMlpGroup` asks only that gate, up and down plan x alike. down then plans h (of that
    plan's output dtype) alike too, by `plan_projection_dtypes`' rules: an output dtype other than
    x's is the autocast dtype of dense layers, for which a dense down plans (amp, amp) again, and a
    4-bit layer returns x's dtype. Over every input dtype, autocast dtype, base dtype (a 4-bit
    layer's compute dtype, None: the input's) and dense/4-bit mix, so a rule change that breaks this
    fails here rather than fusing down under the wrong plan."""
    import itertools

    from fastlora_peft.dtypes import plan_projection_dtypes

    floats = (torch.float32, torch.bfloat16, torch.float16)

    def plan(x_dtype, base_dtype, quantized):
        compute = x_dtype if base_dtype is None else base_dtype
        return plan_projection_dtypes(x_dtype, compute, quantized=quantized, device_type="cpu")

    checked = 0
    for amp in (None, torch.bfloat16, torch.float16):
        context = torch.autocast("cpu", dtype=amp) if amp else contextlib.nullcontext()
        with context:
            for x_dtype, gate_base, down_base in itertools.product(floats, (*floats, None), (*floats, None)):
                for gate_quantized, down_quantized in itertools.product((False, True), repeat=2):
                    if (gate_base is None and not gate_quantized) or (
                        down_base is None and not down_quantized
                    ):
                        continue  # only a 4-bit layer may leave its compute dtype to the input
                    members_plan = plan(x_dtype, gate_base, gate_quantized)
                    if plan(x_dtype, down_base, down_quantized) != members_plan:
                        continue  # the group runs member by member
                    assert plan(members_plan.out_dtype, down_base, down_quantized) == members_plan
                    checked += 1
    assert checked > 50, checked
