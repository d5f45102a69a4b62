"""Host time of each piece of a fused o_proj step, at a size where the GPU never makes the host wait.

python -m benchmarks.host_breakdown [--adapters bf16|fp32] [--base bf16|nf4] [--tokens 256]

(`LoraAddmmSettings.mode` "auto" takes the TMA GEMM from `min_tokens` rows on, 1024: `--tokens 2048`
for its lines.)

`profile_block` showed the o_proj and QKV blocks host-bound: host time per step about equal to wall
time and well above the GPU's kernel time. This splits that host time into the module's own Python,
the autograd Function and each kernel op, with the frozen base's step (F.linear and its backward)
and a do-nothing autograd Function as yardsticks. Each line is the host time per call; "wall" is
printed beside it so a line the GPU slowed down shows itself.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch
import torch.nn.functional as F
from triton.tools.tensor_descriptor import TensorDescriptor

from fastlora_peft.functions.frozen_base import FrozenBase, LoraWeights
from fastlora_peft.functions.shared_input import (
    fused_lora_projections,
    hoisted_grad_xa,
    shared_input_backward,
    shared_input_grad_x,
    shared_input_weight_grads,
)
from fastlora_peft.functions.tensor_groups import flatten_tensors
from fastlora_peft.kernels import lora_terms as ops
from fastlora_peft.kernels._launch import LaunchPlans
from fastlora_peft.kernels.lora_addmm import LoraAddmmSettings, lora_addmm, lora_addmm_pays_off, tma_fits
from fastlora_peft.kernels.lora_weight_grad_group import lora_weight_grads

from . import cases
from .harness import host_and_wall_us


def step_split_us(forward: Callable[[], torch.Tensor], grad: torch.Tensor, calls: int, rounds: int = 5):
    """(forward, backward) host time per step inside whole steps, from the fastest round."""
    for _ in range(20):
        forward().backward(grad)
    best = (float("inf"), float("inf"))
    for _ in range(rounds):
        torch.cuda.synchronize()
        forward_s = backward_s = 0.0
        for _ in range(calls):
            start = time.perf_counter()
            out = forward()
            middle = time.perf_counter()
            out.backward(grad)
            backward_s += time.perf_counter() - middle
            forward_s += middle - start
            del out
        best = min(best, (forward_s / calls * 1e6, backward_s / calls * 1e6), key=sum)
    return best


def _with_addmm_mode(mode: str, call: Callable[[], object]) -> Callable[[], object]:
    """`call` with `LoraAddmmSettings.mode` set to `mode` for its duration."""

    def wrapped():
        previous, LoraAddmmSettings.mode = LoraAddmmSettings.mode, mode
        try:
            return call()
        finally:
            LoraAddmmSettings.mode = previous

    return wrapped


def _with_plans_off(call: Callable[[], object]) -> Callable[[], object]:
    """`call` with `LaunchPlans.enabled` False for its duration."""

    def wrapped():
        previous, LaunchPlans.enabled = LaunchPlans.enabled, False
        try:
            return call()
        finally:
            LaunchPlans.enabled = previous

    return wrapped


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def backward_split(layer, x: torch.Tensor, grad_out: torch.Tensor, calls: int) -> None:
    """The backward alone (one graph, replayed), and how much of it runs inside the Function's backward
    and inside `shared_input_backward`: the rest is the autograd engine's."""
    from fastlora_peft.functions import shared_input

    spent = {"Function.backward": 0.0, "shared_input_backward": 0.0}

    def timed(name: str, fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start

        return wrapper

    function_cls = shared_input.LoraSharedInputFunction
    original_backward, original_body = function_cls.backward, shared_input.shared_input_backward
    function_cls.backward = staticmethod(timed("Function.backward", original_backward))
    shared_input.shared_input_backward = timed("shared_input_backward", original_body)
    try:
        out = layer(x)
        replay = lambda: torch.autograd.backward(out, grad_out, retain_graph=True)  # noqa: E731
        host_and_wall_us(replay, calls, rounds=1)  # first calls compile kernels: not counted below
        spent.update(dict.fromkeys(spent, 0.0))
        host, wall = host_and_wall_us(replay, calls, rounds=1)
        replays = calls + 20  # host_and_wall_us warms up with 20 calls
        inside = {name: seconds / replays * 1e6 for name, seconds in spent.items()}
    finally:
        function_cls.backward = staticmethod(original_backward)
        shared_input.shared_input_backward = original_body
    x.grad = None
    print(f"  {'backward alone (one graph replayed)':42s} host {host:8.1f}  wall {wall:8.1f}")
    for name, micros in inside.items():
        print(f"    inside {name:35s} host {micros:8.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="bf16", choices=("bf16", "nf4"))
    parser.add_argument("--adapters", default="bf16", choices=tuple(cases.ADAPTER_DTYPES))
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()

    geo, device = cases.LLAMA_8B, torch.device("cuda")
    model = cases.build_llama(geo, layers=1, vocab=256, base=args.base, device=device)
    model = cases.adapt(model, "fastlora", args.adapters, geo.rank, geo.alpha)
    layer = cases.decoder_layer(model).self_attn.o_proj
    x, (grad_out,) = cases.block_inputs(geo, "o", 1, args.tokens, device)
    x_2d, grad_2d = x.detach().reshape(args.tokens, -1), grad_out.reshape(args.tokens, -1)

    active = layer.present_active_adapters()
    base, lora, plan = layer.frozen_base(), layer.lora_weights(active), layer.dtype_plan(x)
    weight = base.weight if base.quant is None else None
    out = torch.empty(args.tokens, geo.hidden, device=device, dtype=torch.bfloat16)
    grad_x = torch.empty_like(x_2d)
    xa = ops.lora_shrink(x_2d, lora.lora_a)
    a_t, b_dtype = lora.lora_a.t(), lora.lora_b.dtype

    def step(forward: Callable[[], torch.Tensor]) -> Callable[[], None]:
        return lambda: forward().backward(grad_out)

    def single_threaded_step() -> None:
        with torch.autograd.set_multithreading_enabled(False):
            layer(x).backward(grad_out)

    needs_lora, needs_base = LoraWeights(True, True, None), FrozenBase(False, False, False)
    backward_args = ([base], [lora], plan, [grad_2d])

    calls: dict[str, Callable[[], object]] = {
        "module step (forward + backward)": step(lambda: layer(x)),
        "module forward": lambda: layer(x),
        "Function step, called directly": step(lambda: fused_lora_projections(x, [base], [lora], plan)[0]),
        "Function forward, called directly": lambda: fused_lora_projections(x, [base], [lora], plan),
        "module step, autograd multithreading off": single_threaded_step,
        "shared_input_backward, on this thread": lambda: shared_input_backward(
            x_2d, xa, *backward_args, True, [needs_lora], [needs_base]
        ),
        "  hoisted_grad_xa": lambda: hoisted_grad_xa([grad_2d], [lora]),
        "  shared_input_grad_x": lambda: shared_input_grad_x(
            [grad_2d], xa, 2.0, [base], [lora], plan, x_2d.dtype
        ),
        "  shared_input_weight_grads": lambda: shared_input_weight_grads(
            x_2d, xa, [grad_2d], xa, 2.0, [base], [lora], [needs_lora], [needs_base]
        ),
        "module: fused_blocker": lambda: layer.fused_blocker({}),
        "module: dtype_plan": lambda: layer.dtype_plan(x),
        "module: frozen_base + lora_weights": lambda: (layer.frozen_base(), layer.lora_weights(active)),
        "flatten_tensors": lambda: flatten_tensors(((base,), (lora,))),
        "op lora_shrink(x, A)": lambda: ops.lora_shrink(x_2d, lora.lora_a),
        "op lora_expand_add_(out, xa, B)": lambda: ops.lora_expand_add_(out, xa, lora.lora_b, 2.0),
        "op lora_shrink(g, B.T)": lambda: ops.lora_shrink(grad_2d, lora.lora_b.t()),
        "op lora_expand_add_(dx, gxa, A.T)": lambda: ops.lora_expand_add_(grad_x, xa, a_t, 2.0),
        "op lora_weight_grad(gxa, x)": lambda: ops.lora_weight_grad(xa, x_2d, 2.0),
        "op lora_weight_grad(xa, g).t.to": lambda: ops.lora_weight_grad(xa, grad_2d, 2).t().to(b_dtype),
        "op lora_weight_grads(dA, dB: one launch)": lambda: lora_weight_grads(
            [xa, xa], [x_2d, grad_2d], [2.0, 2.0], [False, True], b_dtype
        ),
        "yardstick: identity Function step": step(lambda: _Identity.apply(x)),
        "yardstick: torch.mm(x, x[:16].T)": lambda: torch.mm(x_2d, x_2d[:16].t()),
    }  # fmt: skip
    if weight is not None:
        calls["yardstick: floor step (F.linear + backward)"] = step(lambda: F.linear(x, weight))
        calls["yardstick: F.linear"] = lambda: F.linear(x_2d, weight)
        # The forward's term inside the GEMM (lora_addmm's TMA kernel) against the pair it replaces,
        # and the pieces of its host time (nineteenth session: the blocks' steps were slower with it).
        weight_t = weight.t()
        calls["op lora_addmm(x, W.T, xa, B) (TMA kernel)"] = lambda: lora_addmm(
            x_2d, weight_t, xa, lora.lora_b, 2.0
        )
        calls["  the same, launch plans off (descriptors built and keyed)"] = _with_plans_off(
            lambda: lora_addmm(x_2d, weight_t, xa, lora.lora_b, 2.0)
        )
        calls["  F.linear + lora_expand_add_ (replaced)"] = lambda: ops.lora_expand_add_(
            F.linear(x_2d, weight), xa, lora.lora_b, 2.0
        )
        calls["  tma_fits"] = lambda: tma_fits(x_2d, weight_t)
        calls["  lora_addmm_pays_off (mode auto)"] = _with_addmm_mode(
            "auto", lambda: lora_addmm_pays_off(x_2d, weight_t, x_2d.dtype)
        )
        calls["  three TensorDescriptor.from_tensor"] = lambda: [
            TensorDescriptor.from_tensor(t, [64, 64]) for t in (x_2d, weight, out)
        ]
        calls["module step, LoraAddmmSettings.mode auto"] = _with_addmm_mode("auto", step(lambda: layer(x)))
    print(f"o_proj {args.base}/{args.adapters}, {args.tokens} tokens: host and wall us per call")
    backward_split(layer, x, grad_out, args.calls)
    in_steps = {"module": lambda: layer(x), "identity Function": lambda: _Identity.apply(x)}
    if weight is not None:
        in_steps["floor (F.linear)"] = lambda: F.linear(x, weight)
    for name, forward in in_steps.items():
        for threads in (True, False):
            with torch.autograd.set_multithreading_enabled(threads):
                forward_us, backward_us = step_split_us(forward, grad_out, args.calls)
            label = f"{name} step, {'autograd thread' if threads else 'this thread'}"
            print(f"  {label:42s} forward {forward_us:8.1f}  backward {backward_us:8.1f}")
    for name, call in calls.items():
        host, wall = host_and_wall_us(call, args.calls)
        x.grad = None
        print(f"  {name:42s} host {host:8.1f}  wall {wall:8.1f}", flush=True)


if __name__ == "__main__":
    main()
