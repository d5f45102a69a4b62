"""Everything that stays PEFT: save/load, plain-LoRA interchange, merge/disable/unload, adapters,
announced fallbacks and the report, options, and bad input."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import warnings

import pytest
import torch
from conftest import (
    FUSED_BACKWARD_NODE,
    add_second_adapter,
    assert_lora_grads_match,
    autograd_node_names,
    copy_lora,
    count_lora_sublayer_calls,
    randomize_lora,
    rel_err,
    tiny_llama,
)
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import Linear as PeftLoraLinear
from peft.tuners.lora import LoraModel
from safetensors.torch import load_file
from torch import nn

from fastlora_peft import (
    FastLoraConfig,
    FastLoraFallbackWarning,
    FastLoraModel,
    FusedPathError,
    load_plain_lora,
    to_plain_lora,
)
from fastlora_peft.layers.linear import FastLoraLinear

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def input_ids(batch=2, length=5, seed=0):
    return torch.randint(0, 61, (batch, length), generator=torch.Generator().manual_seed(seed))


def fast_and_peft(config_kwargs=None, seed=1):
    config_kwargs = dict(r=4, lora_alpha=8, target_modules=TARGETS, **(config_kwargs or {}))
    base = tiny_llama()
    fast = get_peft_model(copy.deepcopy(base), FastLoraConfig(**config_kwargs))
    peft = get_peft_model(base, LoraConfig(**config_kwargs))
    randomize_lora(fast, seed=seed)
    copy_lora(fast, peft)
    return fast, peft


def logits(model, ids=None):
    return model(input_ids=input_ids() if ids is None else ids).logits


def assert_fused(output):
    assert FUSED_BACKWARD_NODE in autograd_node_names(output), "the fused Function did not run"


def assert_fused_and_matches_peft(fast, peft, ids, seed=None):
    """No fallback warning, no PEFT sub-layer call, the fused Function ran, logits and every adapter
    gradient as PEFT's; `seed` reseeds before each model so dropout draws the same masks."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", FastLoraFallbackWarning)
        with count_lora_sublayer_calls(fast) as calls:
            if seed is not None:
                torch.manual_seed(seed)
            out = logits(fast, ids)
    if seed is not None:
        torch.manual_seed(seed)
    expected = logits(peft, ids)
    assert not calls
    assert_fused(out)
    assert rel_err(out, expected) < 1e-5
    out.square().mean().backward()
    expected.square().mean().backward()
    assert_lora_grads_match(fast, peft, 1e-4)
    assert all(route.path == "fused" for route in fast.fastlora_report())


# -- registration, save and load --------------------------------------------------------------------


def test_save_has_lora_keys_and_loads_back_as_fastlora(tmp_path):
    fast, peft = fast_and_peft()
    fast.save_pretrained(tmp_path / "fast")
    peft.save_pretrained(tmp_path / "lora")

    config = json.loads((tmp_path / "fast" / "adapter_config.json").read_text())
    assert config["peft_type"] == "FASTLORA"
    fast_weights = load_file(tmp_path / "fast" / "adapter_model.safetensors")
    lora_weights = load_file(tmp_path / "lora" / "adapter_model.safetensors")
    assert fast_weights.keys() == lora_weights.keys() and len(fast_weights) == 2 * len(TARGETS)
    for key, value in fast_weights.items():
        assert value.shape == lora_weights[key].shape and value.dtype == lora_weights[key].dtype, key
        torch.testing.assert_close(value, lora_weights[key], rtol=0, atol=0)

    loaded = PeftModel.from_pretrained(tiny_llama(), tmp_path / "fast", is_trainable=True)
    assert isinstance(loaded.base_model, FastLoraModel)
    assert isinstance(loaded.peft_config["default"], FastLoraConfig)
    assert isinstance(loaded.base_model.model.model.layers[0].self_attn.q_proj, FastLoraLinear)
    out = logits(loaded)
    assert_fused(out)
    assert rel_err(out, logits(fast)) < 1e-6


def test_plain_lora_interchange_both_ways(tmp_path):
    fast, peft = fast_and_peft()
    fast.save_pretrained(tmp_path / "fast")
    to_plain_lora(tmp_path / "fast", tmp_path / "plain")
    stock = PeftModel.from_pretrained(tiny_llama(), tmp_path / "plain")
    assert type(stock.base_model) is LoraModel
    assert "fused_only" not in json.loads((tmp_path / "plain" / "adapter_config.json").read_text())
    assert rel_err(logits(stock), logits(fast)) < 1e-6

    peft.save_pretrained(tmp_path / "lora")
    loaded = load_plain_lora(tiny_llama(), tmp_path / "lora", is_trainable=True)
    assert isinstance(loaded.base_model, FastLoraModel)
    out = logits(loaded)
    assert_fused(out)
    assert rel_err(out, logits(peft)) < 1e-6

    assert lora_params_trainable(loaded, "default") == {True}
    frozen = load_plain_lora(tiny_llama(), tmp_path / "lora")  # PEFT's default: for inference
    assert frozen.peft_config["default"].inference_mode
    assert lora_params_trainable(frozen, "default") == {False}

    # Into an existing FastLora model, as a second adapter (for inference, then to train).
    host = get_peft_model(tiny_llama(), FastLoraConfig(r=2, target_modules=TARGETS))
    load_plain_lora(host, tmp_path / "lora", adapter_name="imported")
    assert host.peft_config["imported"].inference_mode
    assert lora_params_trainable(host, "imported") == {False}
    load_plain_lora(host, tmp_path / "lora", adapter_name="trained", is_trainable=True)
    assert not host.peft_config["trained"].inference_mode
    assert lora_params_trainable(host, "trained") == {True}
    host.set_adapter("imported")
    assert rel_err(logits(host), logits(peft)) < 1e-6


def lora_params_trainable(model: nn.Module, adapter_name: str) -> set[bool]:
    """requires_grad of every lora_A/lora_B parameter of `adapter_name` (a set: all alike or not)."""
    return {
        param.requires_grad
        for name, param in model.named_parameters(remove_duplicate=False)
        if ("lora_A" in name or "lora_B" in name) and f".{adapter_name}." in name
    }


def test_loading_fastlora_folder_needs_the_import(tmp_path):
    fast, _ = fast_and_peft()
    fast.save_pretrained(tmp_path)
    script = (
        "import sys\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "from peft import PeftModel\n"
        "import json\n"
        f"base = LlamaForCausalLM(LlamaConfig(**json.loads({json.dumps(fast.config.to_json_string())})))\n"
        "if sys.argv[1] == 'import':\n"
        "    import fastlora_peft\n"
        f"model = PeftModel.from_pretrained(base, {str(tmp_path)!r})\n"
        "print(type(model.base_model).__name__)\n"
    )
    without = subprocess.run([sys.executable, "-c", script, "no"], capture_output=True, text=True)
    assert without.returncode != 0 and "KeyError: 'FASTLORA'" in without.stderr
    with_import = subprocess.run([sys.executable, "-c", script, "import"], capture_output=True, text=True)
    assert with_import.returncode == 0, with_import.stderr[-2000:]
    assert with_import.stdout.strip().endswith("FastLoraModel")


# -- merge, disable, unload, adapters ---------------------------------------------------------------


def test_merge_disable_unload_match_peft():
    fast, peft = fast_and_peft()
    ids = input_ids()
    base_out = logits(tiny_llama(), ids)
    with fast.disable_adapter():
        assert rel_err(logits(fast, ids), base_out) < 1e-6
    adapted = logits(fast, ids)
    fast.merge_adapter()
    assert rel_err(logits(fast, ids), adapted) < 1e-5
    fast.unmerge_adapter()
    assert_fused(logits(fast, ids))

    merged = copy.deepcopy(fast).merge_and_unload()
    peft_merged = peft.merge_and_unload()
    assert type(merged.model.layers[0].self_attn.q_proj) is nn.Linear
    assert rel_err(logits(merged, ids), logits(peft_merged, ids)) < 1e-6
    unloaded = fast.unload()
    assert type(unloaded.model.layers[0].mlp.down_proj) is nn.Linear
    assert rel_err(logits(unloaded, ids), base_out) < 1e-6


def test_second_adapter_and_several_active_adapters_are_fused():
    fast, peft = fast_and_peft()
    add_second_adapter(fast, peft, seed=9, r=3, lora_alpha=5, target_modules=TARGETS)
    ids = input_ids()

    fast.set_adapter("second")
    peft.set_adapter("second")
    out = logits(fast, ids)
    assert_fused(out)
    assert rel_err(out, logits(peft, ids)) < 1e-5

    # Both active: their LoRA terms sum, as one rank-(4 + 3) term inside the same fused calls.
    fast.base_model.set_adapter(["default", "second"])
    peft.base_model.set_adapter(["default", "second"])
    for model in (fast, peft):
        for name, param in model.named_parameters():
            param.requires_grad_("lora_" in name)
    assert_fused_and_matches_peft(fast, peft, ids)


@pytest.mark.parametrize(
    "case, reason",
    [
        ("dtypes", "several active adapters of different dtypes"),
        ("dropout", "several active adapters with lora_dropout while training"),
    ],
)
def test_several_active_adapters_that_one_fused_call_cannot_hold_fall_back_announced(case, reason):
    """Active adapters summed into one fused call share one adapter dtype and read one x: with a bf16
    adapter beside an fp32 one, or with lora_dropout while training (each adapter draws its own mask),
    each layer runs PEFT's forward, announced and reported, with PEFT's numbers. With the two
    blockers removed the fused call ran both cases silently: the logits 1.2 relative error away
    from PEFT's with dropout (no input dropped at all), 8.5e-3 with the mixed dtypes (the bf16
    adapter's term taken in fp32, where PEFT computes it in bf16)."""
    config = {"lora_dropout": 0.3} if case == "dropout" else {}
    fast, peft = fast_and_peft(config)
    add_second_adapter(fast, peft, seed=9, r=3, lora_alpha=5, target_modules=TARGETS, **config)
    for model in (fast, peft):
        model.base_model.set_adapter(["default", "second"])
        if case == "dtypes":
            for name, param in model.named_parameters():
                if ".second." in name:
                    param.data = param.data.to(torch.bfloat16)
        model.train(case == "dropout")
    ids = input_ids()
    with pytest.warns(FastLoraFallbackWarning, match=reason):
        with count_lora_sublayer_calls(fast) as calls:
            torch.manual_seed(11)
            out = logits(fast, ids)
    torch.manual_seed(11)
    expected = logits(peft, ids)
    assert calls, "the layers must have run PEFT's forward"
    assert rel_err(out, expected) < 1e-5
    routes = fast.fastlora_report()
    assert len(routes) == len(TARGETS)
    assert all(route.path == "peft" and any(reason in r for r in route.reasons) for route in routes), routes


def test_adapter_names_batch_falls_back_announced():
    fast, peft = fast_and_peft()
    add_second_adapter(fast, peft, seed=9, r=3, lora_alpha=5, target_modules=TARGETS)
    ids = input_ids()
    names = ["default", "second"]
    fast.eval()  # PEFT accepts adapter_names only in eval mode
    peft.eval()
    with pytest.warns(FastLoraFallbackWarning, match="adapter_names"):
        out = fast(input_ids=ids, adapter_names=names).logits
    assert rel_err(out, peft(input_ids=ids, adapter_names=names).logits) < 1e-5
    report = {route.name: route for route in fast.fastlora_report()}
    assert report["model.layers.0.mlp.down_proj"].path == "peft"


# -- announced fallbacks ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "option, reason",
    [({"use_dora": True}, "use_dora"), ({"lora_bias": True}, "lora_bias")],
    ids=["dora", "lora_bias"],
)
def test_static_fallback_warns_once_with_count_and_strict_raises(option, reason):
    with pytest.warns(FastLoraFallbackWarning, match=rf"{len(TARGETS)} module\(s\).*{reason}") as record:
        fast, peft = fast_and_peft(option)
    assert sum(issubclass(w.category, FastLoraFallbackWarning) for w in record) == 1
    routes = fast.fastlora_report()
    assert len(routes) == len(TARGETS) and all(r.path == "peft" and reason in r.reasons[0] for r in routes)
    with count_lora_sublayer_calls(fast) as calls:
        out = logits(fast)
    assert calls, "a fallback module must run PEFT's forward"
    assert rel_err(out, logits(peft)) < 1e-5
    with pytest.raises(FusedPathError, match=reason):
        get_peft_model(tiny_llama(), FastLoraConfig(target_modules=TARGETS, fused_only=True, **option))


def test_dropout_is_fused_with_peft_masks():
    """lora_dropout runs through PEFT's own dropout modules in PEFT's order: same masks, same numbers."""
    fast, peft = fast_and_peft({"lora_dropout": 0.3})
    fast.train()
    peft.train()
    assert_fused_and_matches_peft(fast, peft, input_ids(), seed=11)


def test_unsupported_module_type_is_announced():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50, n_positions=16))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model = get_peft_model(gpt2, FastLoraConfig(target_modules=["c_attn"], fan_in_fan_out=True))
    messages = [str(w.message) for w in record if issubclass(w.category, FastLoraFallbackWarning)]
    assert len(messages) == 1 and "1 module(s)" in messages[0] and "Conv1D" in messages[0]
    (route,) = model.fastlora_report()
    assert route.path == "peft" and route.base == "Conv1D"


# -- options that stay fused ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {"use_rslora": True},
        {"rank_pattern": {"q_proj": 2, "down_proj": 7}, "alpha_pattern": {"v_proj": 3}},
        # gate and up with their own ranks and scales inside the gated MLP's one call
        {"rank_pattern": {"gate_proj": 3}, "alpha_pattern": {"up_proj": 5}},
    ],
    ids=["rslora", "rank-alpha-pattern", "gate-up-patterns"],
)
def test_scaling_options_are_fused_and_match_peft(options):
    fast, peft = fast_and_peft(options)
    assert all(route.path == "fused" for route in fast.fastlora_report())
    ids = input_ids()
    with count_lora_sublayer_calls(fast) as calls:
        out = logits(fast, ids)
    assert not calls
    assert_fused(out)
    expected = logits(peft, ids)
    assert rel_err(out, expected) < 1e-5
    out.sum().backward()
    expected.sum().backward()
    fast_params = dict(fast.named_parameters())
    for name, param in peft.named_parameters():
        if param.grad is not None:
            assert rel_err(fast_params[name].grad, param.grad) < 1e-4, name


# -- bad input --------------------------------------------------------------------------------------


@pytest.fixture
def one_layer():
    fast, _ = fast_and_peft()
    layer = fast.base_model.model.model.layers[0].mlp.down_proj
    return layer


def test_wrong_feature_size_raises_value_error(one_layer):
    with pytest.raises(ValueError, match=r"\[\.\.\., 88\].*\(3, 87\)"):
        one_layer(torch.randn(3, 87))


def test_zero_tokens_forward_and_backward(one_layer):
    x = torch.randn(0, 88, requires_grad=True)
    out = one_layer(x)
    assert out.shape == (0, 48)
    out.sum().backward()
    assert x.grad.shape == (0, 88)
    assert torch.count_nonzero(one_layer.lora_A["default"].weight.grad) == 0


@pytest.mark.parametrize("shape", ["2d", "3d", "transposed", "sliced"])
def test_input_layouts(one_layer, shape):
    generator = torch.Generator().manual_seed(3)
    if shape == "2d":
        x = torch.randn(7, 88, generator=generator)
    elif shape == "3d":
        x = torch.randn(2, 3, 88, generator=generator)
    elif shape == "transposed":
        x = torch.randn(88, 7, generator=generator).t()
    else:
        x = torch.randn(7, 130, generator=generator)[:, 5:93]
    assert shape in ("2d", "3d") or not x.is_contiguous()
    x.requires_grad_()
    out = one_layer(x)
    expected_layer = copy.deepcopy(one_layer)
    lora_out = (
        expected_layer.lora_B["default"](expected_layer.lora_A["default"](x))
        * expected_layer.scaling["default"]
    )
    expected = expected_layer.base_layer(x) + lora_out
    assert_fused(out)
    assert rel_err(out, expected) < 1e-6
    out.sum().backward()
    x_grad = x.grad.clone()
    x.grad = None
    expected.sum().backward()
    assert rel_err(x_grad, x.grad) < 1e-6


def test_nan_stays_in_its_token(one_layer):
    x = torch.randn(5, 88)
    x[2, 10] = float("nan")
    out = one_layer(x)
    assert torch.isnan(out[2]).all()
    assert torch.isfinite(out[[0, 1, 3, 4]]).all()


def test_reason_arising_after_injection_is_announced():
    """A base weight unfrozen after get_peft_model was not there to announce at injection: the first
    call that falls back for it warns."""
    fast, _ = fast_and_peft()
    fast.base_model.model.model.layers[0].mlp.down_proj.base_layer.weight.requires_grad_(True)
    with pytest.warns(FastLoraFallbackWarning, match="trainable base weight"):
        logits(fast)
    report = {route.name: route for route in fast.fastlora_report()}
    assert report["model.layers.0.mlp.down_proj"].path == "peft"


def test_report_shows_group_calls_that_ran_member_by_member():
    fast, _ = fast_and_peft({"lora_dropout": 0.1})
    fast.train()
    logits(fast)
    report = {route.name: route for route in fast.fastlora_report()}
    assert "members ran one by one: lora_dropout" in report["model.layers.0.mlp.gate_proj"].group


def test_get_base_layer_finds_what_peft_finds():
    """The layer's faster `get_base_layer` walks to the same module as PEFT's own, through a nested
    wrapper, and stops where `hasattr` says no (a property that raises) as PEFT's does."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    fast, _ = fast_and_peft()
    layers = [module for module in fast.modules() if isinstance(module, FastLoraLinear)]
    assert layers
    for layer in layers:
        assert layer.get_base_layer() is BaseTunerLayer.get_base_layer(layer)
        assert isinstance(layer.get_base_layer(), nn.Linear)

    class Wrapper(nn.Module):  # a base layer that itself wraps one, as nested tuners do
        def __init__(self, inner):
            super().__init__()
            self.base_layer = inner

    class RaisingProperty(nn.Linear):
        @property
        def base_layer(self):
            raise AttributeError("no base layer here")

    layer = layers[0]
    inner = RaisingProperty(3, 3)
    layer._modules["base_layer"] = Wrapper(inner)
    assert layer.get_base_layer() is BaseTunerLayer.get_base_layer(layer) is inner


def test_get_base_layer_follows_a_replaced_or_wrapped_base_layer():
    """`get_base_layer` remembers a one-level chain (a group asks each member three times a call), and
    answers anew once the chain changes: the base layer replaced, or wrapped in place (a submodule
    `base_layer` registered on it). A stale answer would run the fused path on the old weight."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    fast, _ = fast_and_peft()
    layer = next(module for module in fast.modules() if isinstance(module, FastLoraLinear))
    first = layer.get_base_layer()
    assert layer.get_base_layer() is first  # the remembered answer
    replacement = nn.Linear(first.in_features, first.out_features, bias=first.bias is not None)
    replacement.requires_grad_(False)
    layer.base_layer = replacement
    assert layer.get_base_layer() is replacement is BaseTunerLayer.get_base_layer(layer)
    # The fused path reads the new weight: its output is PEFT's own forward over the replacement.
    x = torch.randn(2, 3, first.in_features, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FastLoraFallbackWarning)
        fused = layer(x)
    assert_fused(fused)
    torch.testing.assert_close(fused, PeftLoraLinear.forward(layer, x), rtol=1e-5, atol=1e-5)
    inner = nn.Linear(first.in_features, first.out_features)
    replacement.base_layer = inner  # the base layer now wraps another, as a nested tuner's does
    assert layer.get_base_layer() is inner is BaseTunerLayer.get_base_layer(layer)
    del replacement.base_layer
    assert layer.get_base_layer() is replacement

    class PropertyWrapper(nn.Linear):  # names what it wraps through a class property, not a submodule
        @property
        def base_layer(self):
            return inner

    layer.base_layer = PropertyWrapper(3, 3)
    assert layer.get_base_layer() is inner is BaseTunerLayer.get_base_layer(layer)


def test_module_attribute_is_getattr():
    """`module_attribute` (the layers' hot-path getattr) answers as `getattr` does: a class property
    before the instance's value, parameters (a None bias too), buffers, submodules, a default, and
    torch's own AttributeError for a missing name."""
    from fastlora_peft.layers.fused_projection import module_attribute

    class Shadowing(nn.Linear):
        @property
        def weight_alias(self):
            return "from the property"

    module = Shadowing(4, 3, bias=False)
    module.__dict__["weight_alias"] = "from the instance"  # a data descriptor wins over this
    module.register_buffer("running", torch.zeros(2))
    module.child = nn.Identity()
    for name in ("weight_alias", "weight", "bias", "running", "child", "in_features", "forward"):
        assert module_attribute(module, name) is getattr(module, name) or name == "forward", name
        found = module_attribute(module, name, "missing")  # with a default: no getattr to fall back on
        assert found is getattr(module, name) or name == "forward", name
    assert module_attribute(module, "forward") == module.forward  # a new bound method each time
    assert module_attribute(module, "bias") is None
    assert module_attribute(module, "nothing", 7) == 7
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        module_attribute(module, "nothing")
