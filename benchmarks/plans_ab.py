"""A library switch on and off in one process: each fused block's step, alternating, beside the floor.

python -m benchmarks.plans_ab [--switch plans|traces|augmented|addmm|sum|group|wgrad|shrink|dequant|gated]
    [--tokens 8192] [--blocks o,qkv,mlp] [--bases bf16,nf4] [--adapters fp32] [--addmm-min-tokens 512]

`--switch a,b,...` runs each switch's A/B in turn, in one process.

The host-bound blocks (o_proj, q/k/v, anything at 2048 tokens) move by tens of percent between
processes and machines, so a before/after of a switch is only readable inside one process: the same
fused model runs with the switch on and off, interleaved round by round with the floor by
`harness.time_side_by_side`, each step in each position of a round equally often over 6 rounds
(`harness.balanced_round_order`). Host-bound rows spread by 20-70% between rounds on the H200
machine: with both arms on the same path they still read up to 12% apart, so a smaller difference
there is not a result (`docs/benchmarks/session16/`).

Switches: `plans`, `LaunchPlans.enabled` ("plans" / "no_plans"); `augmented`, dX's LoRA term inside
a base GEMM's K where `augmented_member` picks one (also where "auto" gives dX's first GEMM to
lora_addmm), against no augmented K anywhere: lora_addmm where "auto" takes the GEMM, the
expand-add elsewhere ("augmented" / "no_augmented"; `functions/augmented_k.py`); `addmm`,
`LoraAddmmSettings.mode` "auto" against "never" (the forward's and dX's GEMMs with the term inside,
`kernels/lora_addmm.py`); `sum`, `LoraAddmmSettings.sum_members`: a group's dX as one
`lora_addmm_sum` against lora_addmm + `addmm_` per further member (`kernels/lora_addmm_sum.py`);
`group`, `LoraAddmmSettings.group_forward`: a group's forward GEMMs as one `lora_addmm_group` launch
against one lora_addmm per member (`kernels/lora_addmm_group.py`); `dequant`,
`DequantizeGroupSettings.enabled`: a 4-bit group's weights by one dequantize launch against one per
weight (`kernels/dequant4bit_group.py`; only a 4-bit base, `--bases nf4`, has any); `gated`,
`GatedBackwardSettings`: the MLP's gated backward kernel in the library's launches against the
32 x 64 tiles, 2 stages it had before the thirty-seventh session (`kernels/gated_act_lora.py`; only
`--blocks mlp` runs that kernel).
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable

import torch

from fastlora_peft.call_traces import CallTraces
from fastlora_peft.functions import augmented_k, gated_mlp, shared_input
from fastlora_peft.kernels import lora_addmm
from fastlora_peft.kernels._launch import LaunchPlans
from fastlora_peft.kernels.dequant4bit_group import DequantizeGroupSettings
from fastlora_peft.kernels.gated_act_lora import GatedBackwardSettings
from fastlora_peft.kernels.lora_addmm import LoraAddmmSettings
from fastlora_peft.kernels.lora_shrink_group import ShrinkGroupSettings
from fastlora_peft.kernels.lora_weight_grad_group import WeightGradGroupSettings

from . import cases
from .harness import Clock, Step, balanced_round_order, time_side_by_side


def set_plans(enabled: bool) -> None:
    LaunchPlans.enabled = enabled


def _no_member(*args) -> None:
    return None


def _never_takes(*args) -> bool:
    return False


def set_augmented(enabled: bool) -> None:
    """The Functions' own names for the rules, so the backward they run next reads the switch. On:
    dX's LoRA term inside a base GEMM's K wherever `augmented_member` picks one, also where "auto"
    hands the first dX GEMM to lora_addmm instead (q/k/v, o: `lora_addmm_auto_takes`; left in place,
    both arms would run that path and the A/B would compare it with itself). Off: never augmented."""
    rule = augmented_k.augmented_member if enabled else _no_member
    shared_input.augmented_member = gated_mlp.augmented_member = rule
    shared_input.lora_addmm_auto_takes = _never_takes if enabled else lora_addmm.lora_addmm_auto_takes


def library_rules() -> None:
    """The rules `set_augmented` replaces, back as the library defines them."""
    shared_input.augmented_member = gated_mlp.augmented_member = augmented_k.augmented_member
    shared_input.lora_addmm_auto_takes = lora_addmm.lora_addmm_auto_takes


def set_addmm(enabled: bool) -> None:
    LoraAddmmSettings.mode = "auto" if enabled else "never"


def set_sum(enabled: bool) -> None:
    """On: a group's dX as one `lora_addmm_sum` where lora_addmm takes dX; off: lora_addmm + addmm_."""
    LoraAddmmSettings.sum_members = enabled


def set_group(enabled: bool) -> None:
    """On: a group's forward GEMMs as one `lora_addmm_group` launch where lora_addmm takes them; off:
    one lora_addmm per member."""
    LoraAddmmSettings.group_forward = enabled


def set_wgrad(enabled: bool) -> None:
    """On: a Function's weight gradients that `lora_weight_grad` tiles alike in one launch
    (`lora_weight_grads`); off: one `lora_weight_grad` launch per gradient."""
    WeightGradGroupSettings.enabled = enabled


def set_dequant(enabled: bool) -> None:
    """On: a 4-bit group's weights (q/k/v) dequantized by one launch (`dequantize_group`); off: one
    launch per weight."""
    DequantizeGroupSettings.enabled = enabled


def set_shrink(enabled: bool) -> None:
    """On: a group's backward shrinks (`lora_shrink_stacked`) in one launch; off: one per member."""
    ShrinkGroupSettings.enabled = enabled


# The gated backward kernel's launches before the thirty-seventh session: 32 x 64 tiles, 2 stages.
_GATED_LAUNCH_BEFORE = (32, 64, 4, 2, 2)
_GATED_LAUNCHES = GatedBackwardSettings.launch, GatedBackwardSettings.few_programs_launch


def set_gated(enabled: bool) -> None:
    """On: the MLP's gated backward + dA_down kernel in the library's launches (16 x 128 tiles, 3
    stages, where they give every SM two programs); off: 32 x 64 tiles, 2 stages everywhere, as before
    the thirty-seventh session. Launch plans are keyed on the settings: each arm keeps its own."""
    launch, few = _GATED_LAUNCHES if enabled else (_GATED_LAUNCH_BEFORE, _GATED_LAUNCH_BEFORE)
    GatedBackwardSettings.launch, GatedBackwardSettings.few_programs_launch = launch, few


def set_traces(enabled: bool) -> None:
    """Call traces (`fastlora_peft.call_traces`) on or off: a Function body's decisions, or its replay."""
    CallTraces.enabled = enabled


SWITCHES: dict[str, Callable[[bool], None]] = {
    "plans": set_plans,
    "traces": set_traces,
    "augmented": set_augmented,
    "addmm": set_addmm,
    "sum": set_sum,
    "group": set_group,
    "wgrad": set_wgrad,
    "shrink": set_shrink,
    "dequant": set_dequant,
    "gated": set_gated,
}


def library_defaults() -> Callable[[], None]:
    """What puts the switches back as the library had them when this was called: launch plans on or
    off (off under the interpreter), call traces, the augmented rule, `LoraAddmmSettings.mode` ("auto"
    by default since the twentieth session: a reset to "never" after one block would run every later
    block of the command without lora_addmm)."""
    plans, addmm_mode, min_tokens = LaunchPlans.enabled, LoraAddmmSettings.mode, LoraAddmmSettings.min_tokens
    sum_members, group_forward = LoraAddmmSettings.sum_members, LoraAddmmSettings.group_forward
    grouped_weight_grads, grouped_shrinks = WeightGradGroupSettings.enabled, ShrinkGroupSettings.enabled
    grouped_dequantize = DequantizeGroupSettings.enabled
    gated_launches = GatedBackwardSettings.launch, GatedBackwardSettings.few_programs_launch
    traces = CallTraces.enabled

    def restore() -> None:
        LaunchPlans.enabled, CallTraces.enabled = plans, traces
        library_rules()
        LoraAddmmSettings.mode, LoraAddmmSettings.min_tokens = addmm_mode, min_tokens
        LoraAddmmSettings.sum_members, LoraAddmmSettings.group_forward = sum_members, group_forward
        WeightGradGroupSettings.enabled, ShrinkGroupSettings.enabled = grouped_weight_grads, grouped_shrinks
        DequantizeGroupSettings.enabled = grouped_dequantize
        GatedBackwardSettings.launch, GatedBackwardSettings.few_programs_launch = gated_launches

    return restore


def with_switch(step: Step, switch: Callable[[bool], None], enabled: bool) -> Step:
    """The same step, with the switch set for its forward and the backward that follows it."""

    def forward():
        switch(enabled)
        return step.forward()

    return Step(forward=forward, backward=step.backward, reset=step.reset)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--switch", default="plans",
        help=f"one of {','.join(SWITCHES)}, or several comma-separated: each one's A/B in turn",
    )  # fmt: skip
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--blocks", default="o,qkv,mlp")
    parser.add_argument("--bases", default="bf16")
    parser.add_argument("--adapters", default="fp32", choices=sorted(cases.ADAPTER_DTYPES))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=6, help="6 puts each arm in each place twice")
    parser.add_argument(
        "--addmm-min-tokens", type=int, default=None,
        help="LoraAddmmSettings.min_tokens for the whole command (default: the library's)",
    )  # fmt: skip
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (proves it runs)")
    args = parser.parse_args()
    if args.addmm_min_tokens is not None:  # before library_defaults, which then keeps it per block
        LoraAddmmSettings.min_tokens = args.addmm_min_tokens
    device = torch.device("cpu" if args.smoke else "cuda")
    geo = cases.SMOKE if args.smoke else cases.LLAMA_8B
    arms = args.switch.split(",")
    unknown = [arm for arm in arms if arm not in SWITCHES]
    if unknown:
        parser.error(f"unknown switch {', '.join(unknown)}; choose from {', '.join(SWITCHES)}")
    restore_defaults = library_defaults()
    for arm, base, block in itertools.product(arms, args.bases.split(","), args.blocks.split(",")):
        switch = SWITCHES[arm]
        layout = (base, args.adapters, args.tokens, device)
        floor = cases.one_layer_block_step(geo, block, "floor", *layout)
        fused = cases.one_layer_block_step(geo, block, "fastlora", *layout)
        steps = {
            "floor": floor,
            arm: with_switch(fused, switch, True),
            f"no_{arm}": with_switch(fused, switch, False),
        }
        timings = time_side_by_side(
            steps, Clock(device), warmup=5, repeats=args.repeats, rounds=args.rounds,
            order=balanced_round_order,
        )  # fmt: skip
        restore_defaults()
        floor_ms = timings["floor"].step_ms
        columns = [
            f"{name} {t.step_ms:.3f} ms ({t.step_ms / floor_ms:.2f}x, spread {t.spread_pct:.0f}%)"
            for name, t in timings.items()
        ]
        print(f"{block:4s} {base} {args.tokens}: " + "  ".join(columns), flush=True)
        del floor, fused, steps
        cases.free_memory()


if __name__ == "__main__":
    main()
