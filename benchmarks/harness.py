"""Timing, peak memory and result rows: the measuring half of the benchmarks, with no model code in it.

A `Step` is one training-shaped iteration split in two, so forward and backward get their own times:
`forward()` returns what `backward` needs (the outputs, or a loss), `backward(state)` runs the backward
(and the optimizer, for whole models), and `reset()` drops the last iteration's gradients outside the
timed region, as `zero_grad(set_to_none=True)` would.

On CUDA the times come from CUDA events recorded around each half, read after one synchronize at the
end (no host sync inside the loop: launch gaps show up in the numbers, as they do in training). On the
CPU (`--smoke`) `time.perf_counter` is enough because every op is synchronous there.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

MIB = 2**20


def host_and_wall_us(call: Callable[[], object], calls: int, rounds: int = 5) -> tuple[float, float]:
    """Host and wall time per call of `call` on CUDA, from the round with the least host time.

    For the host-overhead tools (`launch_overhead`, `host_breakdown`): the host clock is read before
    the closing synchronize, so with work too small to fill the launch queue it is what the Python,
    the ops' dispatch and the launches cost. This host's timings are noisy: the best round is kept.
    """
    for _ in range(20):
        call()
    best = (float("inf"), float("inf"))
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        host = time.perf_counter() - start
        torch.cuda.synchronize()
        best = min(best, (host / calls * 1e6, (time.perf_counter() - start) / calls * 1e6))
    return best


@dataclass
class Step:
    forward: Callable[[], Any]
    backward: Callable[[Any], None]
    reset: Callable[[], None] = lambda: None


@dataclass
class Timing:
    fwd_ms: float  # medians over every timed iteration of every round
    bwd_ms: float
    step_ms: float
    step_ms_min: float
    spread_pct: float  # (max - min) of the rounds' step medians over the overall median: the noise floor


class Clock:
    """CUDA events on a GPU, the host clock on the CPU; `ms(a, b)` only after `synchronize()`."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def ms(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3


def run_once(step: Step) -> None:
    step.reset()
    state = step.forward()
    step.backward(state)


def _time_iterations(step: Step, clock: Clock, repeats: int) -> list[tuple[float, float]]:
    marks = []
    for _ in range(repeats):
        step.reset()
        start = clock.mark()
        state = step.forward()
        middle = clock.mark()
        step.backward(state)
        end = clock.mark()
        del state  # frees the graph's leftovers before the next forward, as a training loop does
        marks.append((start, middle, end))
    clock.synchronize()
    return [(clock.ms(a, b), clock.ms(b, c)) for a, b, c in marks]


def time_side_by_side(
    steps: dict[str, Step],
    clock: Clock,
    *,
    warmup: int,
    repeats: int,
    rounds: int,
    order: Callable[[list[str], int], list[str]] | None = None,
) -> dict[str, Timing]:
    """Times every step in turn, `rounds` times over, so a drift of clocks or temperature hits all alike.

    Every other round runs the steps in reverse order. Under sustained load the H200's power cap
    lowers its clock within a second ("The GPU's clock" in docs/benchmarks.md), so in a fixed order
    the first step (the floor, right after the models were built and the GPU idled) ran at a higher
    clock than the fastlora steps that follow PEFT's. Neighbours stay: with the blocks suite's five
    providers each fastlora step follows a PEFT step in both orders. Each step's own iterations stay
    back to back, so a host-bound step still starts on its own launch queue and shows its host time.

    Warm-up is by iterations, not milliseconds: the first calls compile and autotune Triton kernels
    and create cuBLAS handles, which must stay out of the numbers whatever they cost.

    order: the order of round `round_index` (default `round_order`; `balanced_round_order` puts every
    step in every position equally often).
    """
    order = order or round_order
    for step in steps.values():
        for _ in range(warmup):
            run_once(step)
    clock.synchronize()
    samples: dict[str, list[list[tuple[float, float]]]] = {name: [] for name in steps}
    for round_index in range(rounds):
        for name in order(list(steps), round_index):
            samples[name].append(_time_iterations(steps[name], clock, repeats))
    return {name: _summarize(per_round) for name, per_round in samples.items()}


def round_order(names: list[str], round_index: int) -> list[str]:
    """The order the steps are timed in round `round_index`: as given in even rounds, reversed in odd."""
    return names if round_index % 2 == 0 else names[::-1]


def balanced_round_order(names: list[str], round_index: int) -> list[str]:
    """Rounds 2k and 2k + 1: the names rotated left by k, then that reversed. Over 2 * len(names)
    rounds every name takes every position twice.

    For A/B tools comparing arms of one model (`plans_ab`): with `round_order` the middle one of
    three steps is always in the middle. Balancing did not remove what looked like a position effect
    there: with both arms on the same path, host-bound o_proj and q/k/v rows still read 5-7% apart
    with it, up to 12% without (`docs/benchmarks/session16/augmented_ab_*`), inside their 20-70%
    spreads: such rows cannot show a difference that small.
    """
    shift = (round_index // 2) % max(len(names), 1)
    rotated = names[shift:] + names[:shift]
    return rotated if round_index % 2 == 0 else rotated[::-1]


def _summarize(per_round: list[list[tuple[float, float]]]) -> Timing:
    flat = [sample for round_samples in per_round for sample in round_samples]
    totals = [fwd + bwd for fwd, bwd in flat]
    median = statistics.median(totals)
    round_medians = [statistics.median(fwd + bwd for fwd, bwd in samples) for samples in per_round]
    return Timing(
        fwd_ms=statistics.median(fwd for fwd, _ in flat),
        bwd_ms=statistics.median(bwd for _, bwd in flat),
        step_ms=median,
        step_ms_min=min(totals),
        spread_pct=100.0 * (max(round_medians) - min(round_medians)) / median if median > 0 else 0.0,
    )


def peak_memory_mib(step: Step, device: torch.device) -> float | None:
    """Peak memory of one step above what was allocated before it (activations, gradients, temporaries).

    The weights, the inputs, the upstream gradients and the optimizer state already exist before the
    step and are not counted: the anchors' `peak_mib` / `peak_act_mib` mean the same. None on the CPU.
    """
    if device.type != "cuda":
        return None
    step.reset()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    state = step.forward()
    step.backward(state)
    del state
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / MIB


def graph_stats(step: Step) -> tuple[int, int]:
    """(autograd nodes, custom-Function nodes) of one forward: a launch-count and Python-overhead proxy.

    A grouped block shows as one custom node; three ungrouped projections as three.
    """
    step.reset()
    state = step.forward()
    roots = [t for t in (state if isinstance(state, (list, tuple)) else [state]) if t.grad_fn is not None]
    seen, stack, custom = set(), [t.grad_fn for t in roots], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        custom += isinstance(node, torch.autograd.function.BackwardCFunction)
        stack.extend(next_node for next_node, _ in node.next_functions)
    del state  # dropping the outputs frees the graph without running backward
    return len(seen), custom


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64; a NaN or inf anywhere gives inf."""
    actual, expected = actual.double(), expected.double()
    if not (torch.isfinite(actual).all() and torch.isfinite(expected).all()):
        return float("inf")
    denominator = expected.norm().item()
    difference = (actual - expected).norm().item()
    return difference / denominator if denominator > 0 else difference


@dataclass
class Row:
    """One measured configuration. `group` names the set timed side by side; ratios stay inside it."""

    suite: str  # blocks, e2e, sweep-tokens, sweep-rank
    group: str
    case: str  # o, qkv, mlp, model
    base: str  # bf16, nf4
    adapter: str  # none (floor), fp32, bf16
    provider: str  # floor, peft, fastlora
    tokens: int  # tokens per step (batch x sequence)
    rank: int  # 0 for the floor
    fwd_ms: float
    bwd_ms: float  # e2e: backward + optimizer step + zero_grad
    step_ms: float
    step_ms_min: float
    spread_pct: float
    peak_mib: float | None  # e2e: peak activation memory
    tokens_per_s: float | None = None
    graph_nodes: int | None = None
    custom_fn_nodes: int | None = None
    rel_err_out: float | None = None  # fastlora against PEFT, same weights, inputs and adapter dtype
    rel_err_dx: float | None = None
    rel_err_dparams: float | None = None
    ratios: dict[str, float] = field(default_factory=dict)  # filled by report.add_ratios
    note: str = ""

    @classmethod
    def timed(cls, timing: Timing, **fields: Any) -> Row:
        tokens_per_s = fields["tokens"] / (timing.step_ms / 1e3) if timing.step_ms > 0 else None
        return cls(**dataclasses.asdict(timing), tokens_per_s=tokens_per_s, **fields)


def environment(device: torch.device) -> dict[str, Any]:
    """Machine and versions, recorded with the results: ratios carry from run to run, times do not."""
    from importlib import metadata

    versions = {}
    for package in ("torch", "triton", "peft", "transformers", "accelerate", "bitsandbytes", "fastlora-peft"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    info: dict[str, Any] = {
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": __import__("os").cpu_count(),
        "device": str(device),
        "versions": versions,
        "cuda": torch.version.cuda,
        "git": _git_revision(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1)}
        info["gpu"]["multiprocessors"] = props.multi_processor_count
    return info


def _git_revision() -> str | None:
    """HEAD, with "+dirty" when the tree has changes; None where there is no git (the device copy)."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
        )
        status = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True)
    except OSError:
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+dirty" if status.stdout.strip() else "")


def write_results(out_dir: Path, rows: list[Row], meta: dict[str, Any]) -> tuple[Path, Path]:
    """results.json (environment, settings, rows) and results.csv (one line a row, ratios as columns)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    records = [dataclasses.asdict(row) for row in rows]
    json_path = out_dir / "results.json"
    json_path.write_text(json.dumps({**meta, "rows": records}, indent=1, default=str))
    ratio_names = sorted({name for row in rows for name in row.ratios})
    columns = [f.name for f in dataclasses.fields(Row) if f.name != "ratios"] + ratio_names
    csv_path = out_dir / "results.csv"
    with csv_path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        for record in records:
            ratios = record.pop("ratios")
            writer.writerow({**record, **ratios})
    return json_path, csv_path
