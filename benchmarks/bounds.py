"""What a block's target allows at best: the floor's GEMMs with every LoRA term carried for free.

python -m benchmarks.bounds [--blocks o,qkv,mlp] [--tokens 8192] [--rounds 7] [--iters 10]
    [--profile "mlp ideal,mlp floor"] [--smoke]

Beside the blocks suite's own floor and fastlora steps (`cases.one_layer_block_step`, bf16 base,
bf16 and fp32 adapters) it times two steps made of bare ops, no autograd:

* "floor ops": the floor's forward and dX as the ops autograd runs for it (a check that the bare
  ops cost what the suite's floor costs);
* "ideal": the same GEMMs (cuBLAS), whose LoRA terms are taken to ride inside them at no cost,
  plus only the passes LoRA cannot avoid, each at the rate cuBLAS (or, for the gated activation,
  this library's standalone kernel) reaches alone; bf16 adapters, the cheapest layout:
  - o_proj: x A^T (reads x), dY B (reads dY), dA = s (dY B)^T x (x again), dB = s dY^T xa (dY again);
  - q/k/v: one x [A_q; A_k; A_v]^T, dY_i B_i, one stacked dA, dB_i;
  - MLP: the gated activation (forward reads gate and up and writes h; backward reads dh, gate and
    up and writes dgate and dup), one x [A_gate; A_up]^T, dY B_down and dB_down (dY), dgate B_gate,
    dup B_up and dB_gate, dB_up (dgate and dup, twice), one stacked dA (x). Down's x A^T (of h) and
    its dA are taken to come free out of the activation kernels, which hold h.
* "ideal free dgdu" (MLP): the ideal without the two passes over dgate and dup, as if the gated
  backward gave dgate B_gate, dup B_up and their dBs for free.

If the ideal reads at or above a target, no implementation whose GEMMs run at cuBLAS's speed and
whose LoRA passes run at cuBLAS's rates can meet it: going under needs those passes fused into
kernels that already read the same tensors. `ideal_arms(...)[name]()` returns the tensors it
computed (tests/test_benchmark_tools.py checks them against autograd on the CPU).

Every arm is timed as the blocks suite times its rows (`harness.time_side_by_side`: CUDA events
around each step, `--iters` steps back to back a round, the rounds interleaved and reversed every
other round, the median over all steps; spread: the rounds' medians apart). On an H100
the clock moves with the power drawn, so only the interleaved timings compare arms; a profile
(`--profile`) runs its arms one after the other, and its kernel times carry that drift.
`--smoke`: the CPU smoke shapes, the host clock (tests).
"""

from __future__ import annotations

import argparse
from typing import Callable

import torch
import torch.nn.functional as F

from fastlora_peft.kernels.gated_act import gated_act_backward_, gated_act_forward

from . import cases
from .harness import Clock, Step, run_once, time_side_by_side


def block_tensors(
    block: str, geo: cases.Geometry, tokens: int, device: torch.device, dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    """The random inputs, upstream gradients, frozen weights and adapters `ideal_arms` reads (the same
    values on every call: tests rebuild them to check the arms)."""
    generator = torch.Generator().manual_seed(3)

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=generator) * std).to(device, dtype)

    rank = geo.rank
    if block == "o":
        k, n = geo.heads * geo.head_dim, geo.hidden
        return {
            "x": randn(tokens, k), "dy": randn(tokens, n), "w": randn(n, k, std=k**-0.5),
            "a": randn(rank, k, std=k**-0.5), "b": randn(n, rank, std=0.02),
        }  # fmt: skip
    if block == "qkv":
        k = geo.hidden
        widths = (geo.heads * geo.head_dim, geo.kv_heads * geo.head_dim, geo.kv_heads * geo.head_dim)
        tensors = {"x": randn(tokens, k)}
        for name, n in zip("qkv", widths):
            tensors.update({
                f"dy_{name}": randn(tokens, n), f"w_{name}": randn(n, k, std=k**-0.5),
                f"a_{name}": randn(rank, k, std=k**-0.5), f"b_{name}": randn(n, rank, std=0.02),
            })  # fmt: skip
        return tensors
    hidden, inter = geo.hidden, geo.intermediate
    return {
        "x": randn(tokens, hidden), "dy": randn(tokens, hidden),
        "w_gate": randn(inter, hidden, std=hidden**-0.5), "w_up": randn(inter, hidden, std=hidden**-0.5),
        "w_down": randn(hidden, inter, std=inter**-0.5),
        "a_gate": randn(rank, hidden, std=hidden**-0.5), "a_up": randn(rank, hidden, std=hidden**-0.5),
        "a_down": randn(rank, inter, std=inter**-0.5),
        "b_gate": randn(inter, rank, std=0.02), "b_up": randn(inter, rank, std=0.02),
        "b_down": randn(hidden, rank, std=0.02),
    }  # fmt: skip


def ideal_arms(
    block: str, geo: cases.Geometry, tokens: int, device: torch.device, dtype: torch.dtype = torch.bfloat16
) -> dict[str, Callable[[], dict[str, torch.Tensor]]]:
    """The block's "floor ops" and "ideal" steps (and the MLP's "ideal free dgdu") on `block_tensors`.

    Each call runs one step and returns what it computed, by name: `out` (the base outputs; q/k/v's
    a list of three: a cat in the step would cost a pass over them), `dx`
    (dX without its LoRA term), and the adapters' gradients it makes (`dA`, `dB`, `dA_gate_up`, ...,
    each in the layout of its parameter; q/k/v's stacked by rows).
    """
    t = block_tensors(block, geo, tokens, device, dtype)
    rank, scale = geo.rank, geo.alpha / geo.rank
    # The scale rides in A and B (made once, outside the steps), so no step spends a launch on it:
    # dA = (dY (s B))^T x, dB = dY^T (x (s A)^T).
    x = t["x"]

    if block == "o":
        dy, w = t["dy"], t["w"]
        a_scaled, b_scaled = scale * t["a"], scale * t["b"]

        def floor():
            return {"out": x @ w.T, "dx": dy @ w}

        def ideal():
            out, xa = x @ w.T, x @ a_scaled.T
            dx, dyb = dy @ w, dy @ b_scaled
            return {"out": out, "dx": dx, "dA": dyb.T @ x, "dB": dy.T @ xa}

        return {"o floor ops": floor, "o ideal": ideal}

    if block == "qkv":
        dys = [t[f"dy_{name}"] for name in "qkv"]
        ws = [t[f"w_{name}"] for name in "qkv"]
        a_scaled = scale * torch.cat([t[f"a_{name}"] for name in "qkv"])
        b_scaled = [scale * t[f"b_{name}"] for name in "qkv"]

        def floor():
            outs = [x @ w.T for w in ws]
            dx = dys[0] @ ws[0]
            dx.addmm_(dys[1], ws[1]).addmm_(dys[2], ws[2])
            return {"out": outs, "dx": dx}

        def ideal():
            outs = [x @ w.T for w in ws]
            xa = x @ a_scaled.T
            dx = dys[0] @ ws[0]
            dx.addmm_(dys[1], ws[1]).addmm_(dys[2], ws[2])
            dyb = torch.cat([dy @ b for dy, b in zip(dys, b_scaled)], 1)
            d_b = [dy.T @ xa[:, i * rank : (i + 1) * rank] for i, dy in enumerate(dys)]
            return {"out": outs, "dx": dx, "dA": dyb.T @ x, "dB": torch.cat(d_b, 0)}

        return {"qkv floor ops": floor, "qkv ideal": ideal}

    dy, w_gate, w_up, w_down = t["dy"], t["w_gate"], t["w_up"], t["w_down"]
    a_scaled = scale * torch.cat([t["a_gate"], t["a_up"]])
    b_gate_scaled, b_up_scaled, b_down_scaled = scale * t["b_gate"], scale * t["b_up"], scale * t["b_down"]
    # Down's x A^T is h A_down^T, which the ideal takes from the activation kernel for free: made
    # here, outside the step, from the same inputs.
    xa_down = (F.silu(x @ w_gate.T) * (x @ w_up.T)) @ (scale * t["a_down"]).T

    def floor():  # the ops autograd runs for silu(x Wg^T) * (x Wu^T) @ Wd^T, forward and dX
        gate, up = x @ w_gate.T, x @ w_up.T
        act = F.silu(gate)
        out = (act * up) @ w_down.T
        dh = dy @ w_down
        d_up, d_act = dh * act, dh * up
        d_gate = torch.ops.aten.silu_backward(d_act, gate)
        return {"out": out, "dx": d_gate @ w_gate + d_up @ w_up}

    def ideal_step(dgdu_passes: bool) -> Callable[[], dict[str, torch.Tensor]]:
        def ideal():
            gate, up = x @ w_gate.T, x @ w_up.T
            xa = x @ a_scaled.T
            out = gated_act_forward(gate, up, "silu") @ w_down.T
            dh = dy @ w_down
            grads = {"dyB_down": dy @ b_down_scaled, "dB_down": dy.T @ xa_down}
            gated_act_backward_(dh, gate, up, "silu")  # gate and up now hold dgate and dup
            dx = gate @ w_gate
            dx.addmm_(up, w_up)
            if dgdu_passes:
                left = torch.cat([gate @ b_gate_scaled, up @ b_up_scaled], 1)
                grads["dB_gate"] = gate.T @ xa[:, :rank]
                grads["dB_up"] = up.T @ xa[:, rank:]
            else:
                left = xa  # the same bytes as dgate B_gate | dup B_up, made for free
            grads["dA_gate_up"] = left.T @ x
            return {"out": out, "dx": dx, **grads}

        return ideal

    return {"mlp floor ops": floor, "mlp ideal": ideal_step(True), "mlp ideal free dgdu": ideal_step(False)}


def _profile(name: str, step: Callable[[], object], rows: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    events = sorted(
        (e for e in prof.key_averages() if e.self_device_time_total > 0),
        key=lambda e: -e.self_device_time_total,
    )
    total = sum(e.self_device_time_total for e in events) / 5
    print(f"== profile: {name}: {total:.1f} us of kernels a step (5 steps)")
    for e in events[:rows]:
        print(f"  {e.self_device_time_total / 5:9.1f} us/step  {e.count / 5:5.1f}x  {e.key[:90]}")
    print(flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", default="o,qkv,mlp")
    parser.add_argument("--tokens", type=int, default=cases.LLAMA_8B.tokens, help="batch 1 of this many")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=10, help="steps a round, back to back")
    parser.add_argument("--profile", default="", help="arm names, comma-separated: 5 steps of each profiled")
    parser.add_argument("--rows", type=int, default=30, help="kernels listed per profile")
    parser.add_argument("--smoke", action="store_true", help="the CPU smoke shapes, the host clock")
    args = parser.parse_args(argv)
    cuda = not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    geo = cases.LLAMA_8B if cuda else cases.SMOKE
    tokens = args.tokens if cuda else geo.sweep_rank_tokens
    print(torch.cuda.get_device_name() if cuda else "cpu", f"{tokens} tokens, rank {geo.rank}", flush=True)
    for block in args.blocks.split(","):
        steps: dict[str, Step] = {}
        for provider, adapters in (("floor", "bf16"), ("fastlora", "bf16"), ("fastlora", "fp32")):
            name = f"{block} {provider}" + ("" if provider == "floor" else f" {adapters}-adapters")
            steps[name] = cases.one_layer_block_step(geo, block, provider, "bf16", adapters, tokens, device)
        for name, bare in ideal_arms(block, geo, tokens, device).items():
            steps[name] = Step(forward=bare, backward=lambda _: None)
        for name in (n for n in args.profile.split(",") if n in steps and cuda):
            _profile(name, lambda step=steps[name]: run_once(step), args.rows)
        # The blocks suite's timing: events around each step's halves, rounds interleaved and reversed
        # every other round, the median over every step of every round.
        timings = time_side_by_side(steps, Clock(device), warmup=3, repeats=args.iters, rounds=args.rounds)
        floor = timings[f"{block} floor"].step_ms
        rounds = f"{args.rounds} rounds of {args.iters}"
        print(f"-- {block}, {tokens} tokens: ms a step ({rounds}; median, spread), x the floor")
        for name, timing in timings.items():
            spread = f"{timing.spread_pct:5.1f}%"
            print(f"{name:28s} {timing.step_ms:8.3f}  {spread}  {timing.step_ms / floor:6.3f}x", flush=True)
        del steps, timings
        cases.free_memory()


if __name__ == "__main__":
    main()
