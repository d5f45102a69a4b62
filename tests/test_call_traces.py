"""Call traces (`fastlora_peft.call_traces`): a fused Function's body, called again with the same
metadata, is replayed from a recording of its torch calls and launches, without its decisions.

The oracle is the same Function with traces off, on the same inputs: outputs and every gradient
must be bit-identical, call after call, with the trace serving (the body function not called). On
the CPU the bodies run the reference and the interpreter's launches, which replay the same way
(`CallTraces.devices` is widened here); on a GPU the same tests replay the real launch plans.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from conftest import FUNCTION_LAYOUTS
from torch.overrides import TorchFunctionMode

from fastlora_peft import call_traces
from fastlora_peft.call_traces import CallTraces, clear_all_traces, trace_unit
from fastlora_peft.dtypes import plan_projection_dtypes
from fastlora_peft.functions import gated_mlp, shared_input
from fastlora_peft.functions.frozen_base import FrozenBase, LoraWeights
from fastlora_peft.kernels.lora_addmm import LoraAddmmSettings

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
HIDDEN, TOKENS, RANK = 64, 7, 4  # 4-bit bases need feature sizes that are multiples of 64 on the CPU


@pytest.fixture(autouse=True)
def traces_everywhere(monkeypatch):
    monkeypatch.setattr(CallTraces, "devices", frozenset({"cpu", "cuda"}))
    monkeypatch.setattr(CallTraces, "enabled", True)
    clear_all_traces()
    yield
    clear_all_traces()


def _projection(in_features, out_features, layout, device, bias, seed):
    generator = torch.Generator().manual_seed(seed)
    dtype, adapter_dtype, quantized = layout
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    # A leaf on its device: `.to("cuda")` of a CPU leaf is a copy whose .grad stays None.
    bias_tensor = None
    if bias:
        bias_tensor = torch.randn(out_features, generator=generator).to(device, dtype).requires_grad_()
    base = FrozenBase(weight.to(device), bias_tensor, None)
    if quantized:
        import bitsandbytes.functional as bnb_functional

        from fastlora_peft.kernels.dequant4bit import Quant4bitState

        packed, state = bnb_functional.quantize_4bit(
            weight, blocksize=64, compress_statistics=True, quant_type="nf4"
        )
        packed = packed.to(device)
        state.to(device)  # (in place)
        base = FrozenBase(packed, base.bias, Quant4bitState.from_bnb(state, packed))
    lora_a = (torch.randn(RANK, in_features, generator=generator) * 0.3).to(device, adapter_dtype)
    lora_b = (torch.randn(out_features, RANK, generator=generator) * 0.3).to(device, adapter_dtype)
    return base, LoraWeights(lora_a.requires_grad_(), lora_b.requires_grad_(), 0.5 + seed)


def _step(bases, loras, layout, device, seed, x_grad=True, dropout=False, transposed=False, mlp=False):
    """Outputs and every gradient of one fused call (projections, or the gated MLP) on inputs drawn
    from `seed`."""
    dtype = layout[0]
    generator = torch.Generator().manual_seed(1000 + seed)
    x = torch.randn(2, TOKENS, HIDDEN, generator=generator).to(device, dtype)
    if transposed:  # a non-contiguous x: another key
        x = x.transpose(0, 1).contiguous().transpose(0, 1)
    x.requires_grad_(x_grad)
    x_lora = None
    if dropout:
        keep = torch.rand(x.shape, generator=generator).to(device) > 0.3
        x_lora = (x * keep.to(dtype)).detach().requires_grad_()
    params = [t for lora in loras for t in (lora.lora_a, lora.lora_b)]
    params += [base.bias for base in bases if base.bias is not None]
    for param in params:
        param.grad = None
    plan = plan_projection_dtypes(dtype, dtype, quantized=layout[2], device_type=device)
    if mlp:
        outputs = (gated_mlp.fused_gated_mlp(x, bases, loras, plan, "silu"),)
    else:
        outputs = shared_input.fused_lora_projections(x, bases, loras, plan, x_lora=x_lora)
    grads = [torch.randn(out.shape, generator=generator).to(device, out.dtype) for out in outputs]
    torch.autograd.backward(outputs, grads)
    extra = [x.grad] + ([] if x_lora is None else [x_lora.grad])
    # Every trainable tensor got its gradient: a missing one would compare None with None.
    assert all(param.grad is not None for param in params)
    assert (x.grad is not None) == x_grad and (x_lora is None or x_lora.grad is not None)
    return [out.detach() for out in outputs] + extra + [param.grad for param in params]


def _assert_identical(actual, expected, what):
    assert len(actual) == len(expected)
    for index, (a, e) in enumerate(zip(actual, expected)):
        if e is None:
            assert a is None, f"{what}: item {index} should be None"
            continue
        assert a is not None, f"{what}: item {index} missing"
        assert a.dtype == e.dtype and a.shape == e.shape and a.stride() == e.stride(), f"{what}: item {index}"
        assert torch.equal(a, e), f"{what}: item {index} differs"


def _count_calls(monkeypatch, module, forward_name: str, backward_name: str) -> dict[str, int]:
    """Counts the calls of a Function's forward and backward math in `module` (what a replay skips)."""
    counts = {"forward": 0, "backward": 0}
    for kind, name in (("forward", forward_name), ("backward", backward_name)):
        original = getattr(module, name)

        def counted(*args, _kind=kind, _original=original, **kwargs):
            counts[_kind] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return counts


def _count_bodies(monkeypatch) -> dict[str, int]:
    return _count_calls(monkeypatch, shared_input, "shared_input_forward", "shared_input_backward")


GROUPS = {"o": [(HIDDEN, HIDDEN)], "qkv": [(HIDDEN, HIDDEN), (HIDDEN, 128), (HIDDEN, 64)]}
# The layouts the CPU replays (the interpreter is slow; a GPU runs every layout): one of each kind of
# path (fp32, 16-bit, fp32 adapters on a 16-bit base, 4-bit), and every variant on bf16 alone.
CPU_LAYOUTS = ("fp32", "bf16", "fp32-adapters-on-bf16", "nf4-bf16-adapters")


def _skip_on_cpu(layout_id: str, variant: str, device: str) -> None:
    if device == "cpu" and (layout_id not in CPU_LAYOUTS or (layout_id != "bf16" and variant != "plain")):
        pytest.skip("the CPU runs each variant on bf16 and the plain call on four layouts")


VARIANTS = {
    "plain": {},
    "bias": {"bias": True},
    "no-x-grad": {"x_grad": False},
    "dropout": {"dropout": True},
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("group", list(GROUPS))
@pytest.mark.parametrize("layout_id", list(FUNCTION_LAYOUTS))
def test_replayed_calls_match_the_body_bit_for_bit(layout_id, group, variant, device, monkeypatch):
    _skip_on_cpu(layout_id, variant, device)
    layout = FUNCTION_LAYOUTS[layout_id]
    options = dict(VARIANTS[variant])
    bias = options.pop("bias", False)
    pairs = [_projection(i, o, layout, device, bias, seed) for seed, (i, o) in enumerate(GROUPS[group])]
    bases, loras = [p[0] for p in pairs], [p[1] for p in pairs]
    counts = _count_bodies(monkeypatch)
    steps = 5
    traced = [_step(bases, loras, layout, device, seed, **options) for seed in range(steps)]
    # The first call makes the launchers' plans and the next two are recorded: the last two replay.
    assert counts == {"forward": 3, "backward": 3}, counts
    assert not CallTraces.failures, CallTraces.failures
    monkeypatch.setattr(CallTraces, "enabled", False)
    for seed in range(steps):
        _assert_identical(traced[seed], _step(bases, loras, layout, device, seed, **options), f"call {seed}")
    assert counts == {"forward": 3 + steps, "backward": 3 + steps}


@pytest.mark.parametrize("device", DEVICES)
def test_calls_of_other_metadata_take_their_own_traces(device, monkeypatch):
    """Interleaved calls that differ in one thing each (x's layout, whether x needs a gradient, the
    adapters' dtype) get their own traces: a key missing any of them would replay another's."""
    counts = _count_bodies(monkeypatch)
    runs = []
    for layout_id in ("bf16", "fp32-adapters-on-bf16"):
        layout = FUNCTION_LAYOUTS[layout_id]
        pairs = [_projection(i, o, layout, device, False, seed) for seed, (i, o) in enumerate(GROUPS["qkv"])]
        for options in ({}, {"transposed": True}, {"x_grad": False}):
            runs.append((layout, [p[0] for p in pairs], [p[1] for p in pairs], options))
    results = [[_step(b, lo, la, device, seed, **opt) for la, b, lo, opt in runs] for seed in range(4)]
    assert counts == {"forward": 3 * len(runs), "backward": 3 * len(runs)}, counts
    monkeypatch.setattr(CallTraces, "enabled", False)
    for seed in range(4):
        for index, (layout, bases, loras, options) in enumerate(runs):
            expected = _step(bases, loras, layout, device, seed, **options)
            _assert_identical(results[seed][index], expected, f"run {index} call {seed}")


def test_a_settings_change_is_not_served_an_older_trace(monkeypatch):
    layout = FUNCTION_LAYOUTS["bf16"]
    pairs = [_projection(i, o, layout, "cpu", False, seed) for seed, (i, o) in enumerate(GROUPS["qkv"])]
    bases, loras = [p[0] for p in pairs], [p[1] for p in pairs]
    counts = _count_bodies(monkeypatch)
    for seed in range(4):
        _step(bases, loras, layout, "cpu", seed)
    version = call_traces.settings_version()
    monkeypatch.setattr(LoraAddmmSettings, "mode", "never")
    assert call_traces.settings_version() != version
    _step(bases, loras, layout, "cpu", 9)
    assert counts["forward"] == 4  # 3 before the traces served, then one under the new setting


# Bodies of toy calls: each records, then must replay what it did, or refuse to.
_GLOBAL = torch.ones(3)


def _traced(body, inputs, parts=("toy",), calls=4):
    traces = call_traces.call_traces("toy")
    results = []
    for _ in range(calls):
        key = traces.key(parts, inputs)
        results.append(traces.call(key, inputs, lambda: body(*inputs))[0])
    entry = traces.entries[key]
    return results, entry


def test_a_toy_body_replays_on_new_tensors():
    def body(x, w):
        y = x.reshape(-1) * 2
        return (y + w.t().reshape(-1), x.shape[0])

    x, w = torch.randn(2, 3), torch.randn(3, 2)
    _, entry = _traced(body, (x, w))
    assert entry.trace is not None
    x2, w2 = torch.randn(2, 3), torch.randn(3, 2)
    replayed = entry.trace.replay(x2, w2)
    assert torch.equal(replayed[0], body(x2, w2)[0]) and replayed[1] == 2


def test_only_an_adopted_trace_is_compiled_and_one_source_compiles_once(monkeypatch):
    """The first recording is compared, never replayed: it is not compiled. A key of another shape
    that records the same source reuses the compiled function (a new sequence length)."""
    compiled = []
    real_compile = compile
    monkeypatch.setattr(call_traces, "compile", lambda *args: compiled.append(1) or real_compile(*args),
                        raising=False)  # fmt: skip
    call_traces._replay_function.cache_clear()

    def body(x, w):
        return x @ w.t() + 1

    shapes = [(5, 4), (7, 4), (9, 4)]
    entries = [_traced(body, (torch.randn(*shape), torch.randn(3, 4)))[1] for shape in shapes]
    assert all(entry.trace is not None for entry in entries)
    assert len({entry.trace.source for entry in entries}) == 1
    assert len(compiled) == 1
    x, w = torch.randn(11, 4), torch.randn(3, 4)
    assert torch.equal(entries[2].trace.replay(x, w), body(x, w))


@pytest.mark.parametrize(
    "body, reason",
    [
        (lambda x: x + _GLOBAL, "a tensor that is neither an input nor made by the body"),
        (lambda x: x * x.sum().item(), "answered with a value"),
        (lambda x: x if bool(x.sum() > 0) else -x, "answered with a value"),
        (lambda x: _opaque_unit(x, _Opaque()), "an argument of type _Opaque"),
    ],
    ids=["outside-tensor", "item", "bool", "opaque-argument"],
)
def test_bodies_that_cannot_be_replayed_always_run(body, reason):
    x = torch.randn(3)
    results, entry = _traced(body, (x,))
    assert entry.trace is None and entry.untraceable
    assert reason in CallTraces.failures["toy"]


class _Opaque:
    """An object a trace cannot know to be the same in every call."""


@trace_unit
def _opaque_unit(x: torch.Tensor, _: _Opaque) -> torch.Tensor:
    return x + 1


def test_two_different_recordings_are_not_served():
    flips = iter(range(100))

    def body(x):
        return x + 1 if next(flips) % 2 else x - 1  # decides on something outside the key

    _, entry = _traced(body, (torch.randn(3),))
    assert entry.trace is None and CallTraces.failures["toy"] == "two recordings differ"


def test_a_unit_is_recorded_as_one_call_and_replayed():
    writes = []

    @trace_unit
    def launch(out: torch.Tensor, value: float) -> None:
        # A write torch cannot see (as a kernel launch's): only the unit's own call replays it.
        writes.append(value)
        out.numpy()[:] = value

    def body(x):
        out = torch.empty_like(x)
        launch(out, 3.0)
        return out + x

    _, entry = _traced(body, (torch.zeros(4),))
    assert entry.trace is not None and "empty_like" not in entry.trace.source
    before = len(writes)
    result = entry.trace.replay(torch.ones(4))
    assert len(writes) == before + 1 and torch.equal(result, torch.full((4,), 4.0))


def _misaligned_like(x: torch.Tensor) -> torch.Tensor:
    """A tensor of x's shape, strides, dtype and storage offset (0) whose address is 4 bytes past a
    16-byte boundary: only its alignment differs (a slice of a larger tensor differs in its storage
    offset too, and so tells nothing about the alignment's part of a key)."""
    buffer = torch.empty(x.numel() + 8, dtype=torch.float32)
    raw = memoryview(buffer.numpy()).cast("B")[4 : 4 + 4 * x.numel()]
    misaligned = torch.frombuffer(raw, dtype=torch.float32).view(x.shape)
    assert misaligned.data_ptr() % 16 == 4 and misaligned.storage_offset() == x.storage_offset() == 0
    return misaligned


def test_keys_hold_the_metadata_bodies_decide_on():
    traces = call_traces.call_traces("toy")
    x = torch.randn(4, 6)
    base = traces.key(("p",), (x,))
    others = {
        "dtype": (x.to(torch.float64),),
        "shape": (torch.randn(4, 5),),
        "strides": (x.t().contiguous().t(),),
        "alignment": (_misaligned_like(x),),
        "storage offset": (torch.randn(28)[4:].view(4, 6),),  # 16 bytes in: aligned as x is
        "requires_grad": (x.clone().requires_grad_(),),
        "parts": None,
    }
    for what, tensors in others.items():
        key = traces.key(("q",), (x,)) if tensors is None else traces.key(("p",), tensors)
        assert key != base, what
    assert traces.key(("p",), (x.clone(),)) == base
    # Aliasing: one tensor passed twice against two alike (a pair against a single tensor, as this
    # test had it, differs by its length whatever the key holds).
    assert traces.key(("p",), (x, x)) != traces.key(("p",), (x, x.clone()))
    assert traces.key(("p",), (x, x.clone())) == traces.key(("p",), (x.clone(), x))
    assert traces.key(("p",), (None,)) is None  # nothing to key on


def test_no_trace_under_a_dispatch_mode_or_for_a_subclass():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    traces = call_traces.call_traces("toy")
    x = torch.randn(3)
    with Passthrough():
        assert traces.key(("p",), (x,)) is None

    class Sub(torch.Tensor):
        pass

    assert traces.key(("p",), (x.as_subclass(Sub),)) is None
    assert traces.key(("p",), (x,)) is not None


def _count_mlp_bodies(monkeypatch) -> dict[str, int]:
    return _count_calls(monkeypatch, gated_mlp, "_down_forward", "_down_backward_")


MLP_VARIANTS = {
    "plain": {},
    "several-chunks": {"chunk_bytes": 2 * TOKENS * 128},  # h in chunks of about two rows
    "keep-saved": {"overwrite": False},
    "no-x-grad": {"x_grad": False},
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", list(MLP_VARIANTS))
@pytest.mark.parametrize("layout_id", list(FUNCTION_LAYOUTS))
def test_replayed_gated_mlp_matches_the_body_bit_for_bit(layout_id, variant, device, monkeypatch):
    _skip_on_cpu(layout_id, variant, device)
    monkeypatch.setattr(gated_mlp.GatedMlpSettings, "call_traces", True)
    layout = FUNCTION_LAYOUTS[layout_id]
    options = dict(MLP_VARIANTS[variant])
    if "chunk_bytes" in options:
        monkeypatch.setattr(gated_mlp.GatedMlpSettings, "chunk_bytes", options.pop("chunk_bytes"))
    if "overwrite" in options:
        overwrite = options.pop("overwrite")
        monkeypatch.setattr(gated_mlp.GatedMlpSettings, "overwrite_saved_preactivations", overwrite)
    shapes = [(HIDDEN, 128), (HIDDEN, 128), (128, HIDDEN)]
    pairs = [_projection(i, o, layout, device, False, seed) for seed, (i, o) in enumerate(shapes)]
    bases, loras = [p[0] for p in pairs], [p[1] for p in pairs]
    counts = _count_mlp_bodies(monkeypatch)
    steps = 5
    traced = [_step(bases, loras, layout, device, seed, mlp=True, **options) for seed in range(steps)]
    assert counts == {"forward": 3, "backward": 3}, counts
    assert not CallTraces.failures, CallTraces.failures
    monkeypatch.setattr(CallTraces, "enabled", False)
    for seed in range(steps):
        expected = _step(bases, loras, layout, device, seed, mlp=True, **options)
        _assert_identical(traced[seed], expected, f"call {seed}")
    assert counts == {"forward": 3 + steps, "backward": 3 + steps}


class _LiveBytes(TorchFunctionMode):
    """The most bytes of storage made inside it alive at once, measured after every torch call (the
    replay's own and those inside its units): what a caching allocator's peak follows."""

    def __init__(self) -> None:
        super().__init__()
        self.tensors: list[weakref.ref] = []
        self.peak = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for item in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(item, torch.Tensor):
                self.tensors.append(weakref.ref(item))
        storages = {}
        for ref in self.tensors:
            tensor = ref()
            if tensor is not None:
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        self.peak = max(self.peak, sum(storages.values()))
        return result


@pytest.mark.parametrize("block", ["o", "qkv", "mlp"])
@pytest.mark.parametrize("layout_id", ["bf16", "nf4-bf16-adapters"])
def test_a_replay_holds_no_more_memory_than_the_body(layout_id, block, monkeypatch):
    """A replay drops each intermediate after its last use, as the body does: the most bytes alive at
    once in a step are no more than the body's (the gated MLP's peak rose by 39% on the H200 while
    every variable of the replay lived to its return)."""
    monkeypatch.setattr(gated_mlp.GatedMlpSettings, "chunk_bytes", 2 * TOKENS * 128)  # chunks of h
    monkeypatch.setattr(gated_mlp.GatedMlpSettings, "call_traces", True)
    layout = FUNCTION_LAYOUTS[layout_id]
    shapes = {"o": GROUPS["o"], "qkv": GROUPS["qkv"], "mlp": [(HIDDEN, 128), (HIDDEN, 128), (128, HIDDEN)]}
    pairs = [_projection(i, o, layout, "cpu", False, seed) for seed, (i, o) in enumerate(shapes[block])]
    bases, loras = [p[0] for p in pairs], [p[1] for p in pairs]
    for seed in range(4):
        _step(bases, loras, layout, "cpu", seed, mlp=block == "mlp")
    peaks = {}
    for traced in (True, False):
        monkeypatch.setattr(CallTraces, "enabled", traced)
        with _LiveBytes() as live:
            _step(bases, loras, layout, "cpu", 9, mlp=block == "mlp")
        peaks[traced] = live.peak
    assert 0 < peaks[True] <= peaks[False], peaks


def test_the_gated_mlp_is_traced_by_default(monkeypatch):
    layout = FUNCTION_LAYOUTS["bf16"]
    shapes = [(HIDDEN, 128), (HIDDEN, 128), (128, HIDDEN)]
    pairs = [_projection(i, o, layout, "cpu", False, seed) for seed, (i, o) in enumerate(shapes)]
    counts = _count_mlp_bodies(monkeypatch)
    for seed in range(5):
        _step([p[0] for p in pairs], [p[1] for p in pairs], layout, "cpu", seed, mlp=True)
    assert counts == {"forward": 3, "backward": 3}  # the body runs, then two recordings, then replays
    assert len(gated_mlp._FORWARD_TRACES.entries) == 1 and len(gated_mlp._BACKWARD_TRACES.entries) == 1


def _tiny_fast_llama(layers: int, dtype: torch.dtype):
    from conftest import randomize_lora, tiny_llama
    from peft import get_peft_model

    from fastlora_peft import FastLoraConfig

    model = tiny_llama(dtype, num_hidden_layers=layers, hidden_size=64, intermediate_size=128)
    config = FastLoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    fast = get_peft_model(model, config, autocast_adapter_dtype=False)
    randomize_lora(fast, seed=3, std=0.1)
    return fast


def test_a_model_trains_the_same_with_traces(monkeypatch):
    """Four layers of one shape share each key: after the first three calls the rest replay. Two
    training steps under gradient checkpointing (the forward runs again inside backward), the gated
    MLP traced too, traces on against off: the same logits and every adapter gradient, bit for bit.
    (One test: the interpreter is slow. The function-level tests above cover the plain calls.)"""
    monkeypatch.setattr(gated_mlp.GatedMlpSettings, "call_traces", True)
    model = _tiny_fast_llama(4, torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model.train()
    generator = torch.Generator().manual_seed(4)
    inputs = [torch.randint(0, model.config.vocab_size, (2, 5), generator=generator) for _ in range(2)]
    runs = {}
    for traced in (True, False):
        monkeypatch.setattr(CallTraces, "enabled", traced)
        results = []
        for input_ids in inputs:
            model.zero_grad(set_to_none=True)
            logits = model(input_ids=input_ids).logits
            logits.float().square().mean().backward()
            grads = [p.grad.clone() for n, p in model.named_parameters() if "lora_" in n]
            results.append([logits.detach()] + grads)
        runs[traced] = results
    # Every key was replayed or seen fewer than four times (layer 0's q/k/v: an x that needs no grad).
    for module in (shared_input, gated_mlp):
        for traces in (module._FORWARD_TRACES, module._BACKWARD_TRACES):
            entries = list(traces.entries.values())
            assert any(entry.trace is not None for entry in entries), traces.name
            assert all(entry.trace is not None or entry.calls < 3 for entry in entries), traces.name
    assert not CallTraces.failures, CallTraces.failures
    for step, (traced, untraced) in enumerate(zip(runs[True], runs[False])):
        _assert_identical(traced, untraced, f"step {step}")
