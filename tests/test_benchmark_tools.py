"""The benchmark tools that run on the CPU: what they measure is the GPU machine's business, but
whether they measure the right thing is checked here."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def test_host_ab_times_each_arm_on_its_own_package(tmp_path):
    # An A/B whose two arms import the same package measures noise (it happened: `python -m` puts
    # the working directory ahead of PYTHONPATH). The old arm here is a copy of the package in
    # another directory; the tool checks each process imported its own arm's package.
    old = tmp_path / "old"
    shutil.copytree(
        REPO / "fastlora_peft", old / "fastlora_peft", ignore=shutil.ignore_patterns("__pycache__")
    )
    out = tmp_path / "ab.json"
    command = [sys.executable, "-m", "benchmarks.host_ab", "--smoke", "--old", str(old), "--cases", "o:4"]
    command += ["--rounds", "2", "--steps", "2", "--out", str(out)]
    # The CPU references, not the interpreter: this checks the processes, not the kernels.
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(out.read_text())
    rounds = summary["o:4"]["rounds"]
    assert len(rounds["old"]) == len(rounds["new"]) == 2
    assert all(value > 0 for values in rounds.values() for value in values)
    # Alternating order: old first in round 1, new first in round 2.
    lines = [line for line in done.stdout.splitlines() if line.startswith("round")]
    assert [line.split()[-3] for line in lines] == ["old:", "new:", "new:", "old:"], lines


def test_host_ab_kernel_mode_profiles_each_arm_against_the_floor(tmp_path):
    # `--kernel`: each arm's process profiles the floor and the fused block (kernel_ab's against-floor
    # profile; on the CPU their host ops) and the A/B compares fused over floor, each arm on its own
    # package as above.
    old = tmp_path / "old"
    shutil.copytree(
        REPO / "fastlora_peft", old / "fastlora_peft", ignore=shutil.ignore_patterns("__pycache__")
    )
    out = tmp_path / "ab.json"
    # One round (two rounds' alternating order is the test above's): each process takes about 10 s.
    command = [sys.executable, "-m", "benchmarks.host_ab", "--smoke", "--kernel", "--old", str(old)]
    command += ["--cases", "o:4", "--rounds", "1", "--steps", "2", "--out", str(out)]
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rounds = json.loads(out.read_text())["o:4"]["rounds"]
    assert len(rounds["old"]) == len(rounds["new"]) == 1
    assert all(value > 0 for values in rounds.values() for value in values)
    lines = [line for line in done.stdout.splitlines() if line.startswith("round")]
    assert len(lines) == 2 and all("x floor (" in line for line in lines), lines
    assert "kernel time x floor" in done.stdout


def test_plans_ab_times_both_arms_of_every_switch_beside_the_floor():
    # Every switch in one process (each a process of its own took about 10 s, mostly imports).
    from benchmarks.plans_ab import SWITCHES

    command = [sys.executable, "-m", "benchmarks.plans_ab", "--smoke", "--tokens", "8", "--blocks", "o"]
    command += ["--repeats", "1", "--rounds", "1", "--switch", ",".join(SWITCHES)]
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("o ")]
    assert len(lines) == len(SWITCHES), lines
    for switch, line in zip(SWITCHES, lines):
        assert "floor" in line and f" {switch} " in line and f"no_{switch}" in line, line


def test_gpu_suite_parts_cover_every_test_file_once(capsys):
    """The GPU machine runs the suite in parts (one device call each): together with the files left
    out there, they name every test file once, and only files that exist."""
    from benchmarks import gpu_suite

    parts = [gpu_suite.part_files(part) for part in (1, 2, 3)]
    named = [name for files in parts for name in files] + list(gpu_suite.CPU_ONLY)
    assert sorted(named) == gpu_suite.all_test_files()
    assert "tests/test_gpu.py" in parts[0] and "tests/test_lora_addmm.py" in parts[1]
    assert gpu_suite.main(["--part", "1", "--list"]) == 0
    assert capsys.readouterr().out.split() == parts[0]


def test_gpu_suite_jobs_deal_the_files_and_report_the_first_failure(tmp_path, capsys):
    """`--jobs`: the files dealt out in turn, one pytest process each group, every log printed, the
    status the first failing process's (a process that selected nothing does not fail the run)."""
    from benchmarks import gpu_suite

    names = [f"f{index}" for index in range(5)]
    assert gpu_suite.dealt_files(names, 2) == [["f0", "f2", "f4"], ["f1", "f3"]]
    assert gpu_suite.dealt_files(names[:1], 3) == [["f0"]]
    passing, failing = tmp_path / "test_passing.py", tmp_path / "test_failing.py"
    passing.write_text("def test_ok():\n    assert True\n")
    failing.write_text("def test_bad():\n    assert False\n")
    logs = tmp_path / "logs"
    assert gpu_suite.run_jobs([[str(passing)], [str(failing)]], [], logs, 3) == 1
    out = capsys.readouterr().out
    assert "part3_1.log (exit status 0)" in out and "part3_2.log (exit status 1)" in out
    assert "1 passed" in (logs / "part3_1.log").read_text() and "1 failed" in out
    assert gpu_suite.run_jobs([[str(passing)], [str(failing)]], ["-k", "ok"], logs, 3) == 0
    assert gpu_suite.run_jobs([[str(passing)]], ["-k", "nothing"], logs, 3) == gpu_suite.NO_TESTS_COLLECTED


def test_wide_split_probe_is_as_exact_as_the_library_split_shrink():
    """The probe's one-dot split (benchmarks/wide_split_probe.py) under the interpreter, with and
    without K splits: its timings on a GPU mean something only if it computes the same shrink."""
    command = [sys.executable, "-m", "benchmarks.wide_split_probe", "--smoke"]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    errors = [
        float(line.split("error ")[1].split()[0]) for line in done.stdout.splitlines() if "error" in line
    ]
    assert len(errors) == 4, done.stdout
    # The library's split shrink measured ~6e-8 here; a part dropped from the split gives ~1e-5.
    assert max(errors) < 1e-6, done.stdout


def test_term_tiling_probe_computes_every_kernel_with_every_tiling():
    """benchmarks/term_tiling_probe.py under the interpreter: each TMA kernel, bf16 and fp32 adapters,
    two tilings of a 70-rank term, against float64 (its GPU timings mean something only if so)."""
    command = [sys.executable, "-m", "benchmarks.term_tiling_probe", "--smoke"]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if " | " in line]
    errors = [float(cell.split("(")[1].rstrip(")")) for row in rows for cell in row.split(" | ")[1:]]
    assert len(rows) == 12 and len(errors) == 24, done.stdout
    # One bf16 rounding (the interpreter truncates: ~3.4e-3); a term dropped or cut short is ~1.
    assert max(errors) < 1e-2, done.stdout


def test_kernel_ab_credits_each_activity_to_the_step_that_holds_its_start():
    from benchmarks.kernel_ab import Activity, Window, credit_to_arms

    windows = [
        Window("on", 10.0, 20.0),
        Window("off", 25.0, 40.0),
        Window("off", 50.0, 60.0),
        Window("on", 70.0, 75.0),
    ]
    activities = [
        Activity("gemm", 5.0, 3.0),  # before every step (warm-up leftovers): dropped
        Activity("gemm", 12.0, 4.0),
        Activity("gemm", 19.5, 9.0),  # starts inside, ends after its step's range: still that step's
        Activity("add", 22.0, 1.0),  # between two steps: dropped
        Activity("gemm", 30.0, 5.0),
        Activity("gemm", 55.0, 6.0),
        Activity("left", 71.0, 2.0),
        Activity("gemm", 80.0, 1.0),  # after the last step: dropped
    ]
    credited = credit_to_arms(windows, activities)
    assert {arm: dict(names) for arm, names in credited.items()} == {
        "on": {"gemm": [2, 13.0], "left": [1, 2.0]},
        "off": {"gemm": [2, 11.0]},
    }


def test_kernel_ab_interleaves_the_arms_and_credits_both():
    command = [sys.executable, "-m", "benchmarks.kernel_ab", "--smoke", "--block", "o", "--steps", "2"]
    command += ["--rows", "10000"]  # every name: the rows are ordered by a timed difference
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    # Both arms run the same ops at the smoke shapes (the rule's host term keeps them off the
    # augmented dX): equal calls per step, each credited to its own steps.
    (mm,) = [line for line in done.stdout.splitlines() if line.rstrip().endswith(" aten::mm")]
    calls = [float(part.strip("()x")) for part in mm.split() if part.endswith("x)")]
    assert len(calls) == 2 and calls[0] == calls[1] > 0, mm


def test_kernel_ab_against_the_floor_profiles_both_models():
    command = [sys.executable, "-m", "benchmarks.kernel_ab", "--smoke", "--block", "o", "--steps", "2"]
    command += ["--rows", "10000"]  # every name: the rows are ordered by a timed difference
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run(
        [*command, "--against-floor"], cwd=REPO, capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert "us/step floor" in lines[1] and "us/step fastlora" in lines[1], lines[1]
    # The floor's o_proj is one linear (an aten::mm forward, one for dX); the fused step runs more
    # ops than that, among them the LoRA terms' matmuls on the CPU reference path: more mm calls.
    (mm,) = [line for line in lines if line.rstrip().endswith(" aten::mm")]
    floor_calls, fused_calls = [float(part.strip("()x")) for part in mm.split() if part.endswith("x)")]
    assert 0 < floor_calls < fused_calls, mm
    assert lines[-1].startswith("fastlora / floor: "), lines[-1]


def test_augmented_switch_reaches_the_functions_rules_and_restores_them():
    """On, the augmented K is considered also where "auto" would give dX's first GEMM to lora_addmm
    (else both arms of q/k/v's A/B ran lora_addmm); off, no member is augmented."""
    from benchmarks import plans_ab
    from fastlora_peft.functions import augmented_k, gated_mlp, shared_input
    from fastlora_peft.kernels import lora_addmm

    try:
        plans_ab.set_augmented(False)
        assert shared_input.augmented_member is gated_mlp.augmented_member is plans_ab._no_member
        assert shared_input.lora_addmm_auto_takes is lora_addmm.lora_addmm_auto_takes
        plans_ab.set_augmented(True)
        assert shared_input.augmented_member is gated_mlp.augmented_member is augmented_k.augmented_member
        assert shared_input.lora_addmm_auto_takes is plans_ab._never_takes
    finally:
        plans_ab.library_rules()
    assert shared_input.augmented_member is gated_mlp.augmented_member is augmented_k.augmented_member
    assert shared_input.lora_addmm_auto_takes is lora_addmm.lora_addmm_auto_takes


def test_balanced_rounds_put_every_step_in_every_place_alike():
    from benchmarks.harness import balanced_round_order

    names = ["floor", "on", "off"]
    orders = [balanced_round_order(names, index) for index in range(6)]
    assert all(sorted(order) == sorted(names) for order in orders)
    for place in range(3):
        assert sorted(order[place] for order in orders) == sorted(names * 2), orders
    assert orders[:2] == [names, names[::-1]]


def test_rounds_alternate_the_order_of_the_steps():
    """Odd rounds time the steps in reverse, so no step always runs first (at the idle GPU's higher
    clock); each step's iterations stay together."""
    import torch

    from benchmarks.harness import Clock, time_side_by_side

    order: list[str] = []

    class Recording:
        def __init__(self, name: str) -> None:
            self.name = name

        def reset(self) -> None:
            pass

        def forward(self):
            order.append(self.name)
            return None

        def backward(self, state) -> None:
            pass

    steps = {name: Recording(name) for name in ("floor", "peft", "fastlora")}
    timings = time_side_by_side(steps, Clock(torch.device("cpu")), warmup=1, repeats=2, rounds=3)
    timed = order[3:]  # after one warm-up call each
    assert (
        timed
        == ["floor"] * 2
        + ["peft"] * 2
        + ["fastlora"] * 4
        + ["peft"] * 2
        + ["floor"] * 4
        + ["peft"] * 2
        + ["fastlora"] * 2
    )
    assert set(timings) == set(steps)


def test_sweep_runs_the_adapters_the_run_asks_for():
    from benchmarks.suites import sweep_adapter

    assert sweep_adapter(("fp32", "bf16")) == "fp32"
    assert sweep_adapter(("bf16", "fp32")) == "fp32"
    assert sweep_adapter(("bf16",)) == "bf16"


def test_ab_tools_put_the_library_defaults_back():
    """After a block, plans_ab and kernel_ab restore the switches as they found them: "auto" stays
    "auto" (a reset to "never" made every later block of a command run without lora_addmm)."""
    from benchmarks import plans_ab
    from fastlora_peft.call_traces import CallTraces
    from fastlora_peft.functions import augmented_k, shared_input
    from fastlora_peft.kernels import lora_addmm
    from fastlora_peft.kernels._launch import LaunchPlans
    from fastlora_peft.kernels.dequant4bit_group import DequantizeGroupSettings
    from fastlora_peft.kernels.gated_act_lora import GatedBackwardSettings
    from fastlora_peft.kernels.lora_addmm import LoraAddmmSettings
    from fastlora_peft.kernels.lora_shrink_group import ShrinkGroupSettings
    from fastlora_peft.kernels.lora_weight_grad_group import WeightGradGroupSettings

    assert LoraAddmmSettings.mode == "auto" and CallTraces.enabled
    gated_launches = GatedBackwardSettings.launch, GatedBackwardSettings.few_programs_launch
    assert gated_launches == ((16, 128, 4, 3, 2), (32, 64, 4, 2, 2))
    plans = LaunchPlans.enabled
    restore = plans_ab.library_defaults()
    try:
        for switch in plans_ab.SWITCHES.values():
            switch(False)
        LoraAddmmSettings.min_tokens = 1
        assert LoraAddmmSettings.mode == "never" and shared_input.augmented_member is plans_ab._no_member
        assert not LoraAddmmSettings.sum_members and not LoraAddmmSettings.group_forward
        assert not WeightGradGroupSettings.enabled and not ShrinkGroupSettings.enabled
        assert not DequantizeGroupSettings.enabled and not CallTraces.enabled
        assert GatedBackwardSettings.launch == GatedBackwardSettings.few_programs_launch == (32, 64, 4, 2, 2)
    finally:
        restore()
    assert LoraAddmmSettings.mode == "auto" and LaunchPlans.enabled == plans
    assert LoraAddmmSettings.min_tokens == 1024 and LoraAddmmSettings.sum_members
    assert LoraAddmmSettings.group_forward and WeightGradGroupSettings.enabled and ShrinkGroupSettings.enabled
    assert shared_input.augmented_member is augmented_k.augmented_member
    assert shared_input.lora_addmm_auto_takes is lora_addmm.lora_addmm_auto_takes
    assert (GatedBackwardSettings.launch, GatedBackwardSettings.few_programs_launch) == gated_launches
    assert DequantizeGroupSettings.enabled and CallTraces.enabled


def test_host_vs_gpu_smoke_prints_both_providers_host_columns():
    command = [sys.executable, "-m", "benchmarks.host_vs_gpu", "--smoke", "--cases", "o:4", "--rounds", "1"]
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("o:4")]
    assert [line.split()[3] for line in lines] == ["floor", "fastlora"], lines
    assert all("host alone fwd" in line and "back to back host" in line for line in lines)


def test_host_proxy_smoke_reaches_the_stubbed_launches_in_both_arms():
    # The CPU proxy's stubs must be what the library launches into (pointers as addresses, the
    # Functions' traces replayed), and an A/B of a setting launches the same kernels in both arms.
    setting = "fastlora_peft.call_traces:CallTraces.enabled=False"
    command = [sys.executable, "-m", "benchmarks.host_proxy", "--smoke", "--ab", setting]
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    rows = [line.split(":")[0].split() + [line.split(", ")[-1]] for line in done.stdout.splitlines()]
    rows = [row for row in rows if row[-1].endswith("launches a step")]
    assert [row[:2] for row in rows] == [[b, arm] for b in ("o", "qkv", "mlp") for arm in ("A", "B")], rows
    for arm_a, arm_b in zip(rows[::2], rows[1::2]):
        assert arm_a[-1] == arm_b[-1] and not arm_a[-1].startswith("0 "), rows
    assert re.search(r"smoke: [1-9]\d* launches, 0 tensors passed,", done.stdout), done.stdout[-2000:]


def test_host_timers_smoke_times_the_fused_functions_of_each_case():
    command = [
        sys.executable,
        "-m",
        "benchmarks.host_timers",
        "--smoke",
        "--cases",
        "o:4,mlp:4",
        "--steps",
        "2",
    ]
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    sections = done.stdout.split("== ")[1:]
    assert [section.split()[0] for section in sections] == ["o:4", "mlp:4"], done.stdout[-3000:]
    functions = ("shared_input.LoraSharedInputFunction", "gated_mlp.LoraGatedMlpFunction")
    for section, function in zip(sections, functions):
        calls = {line.split()[-1]: line.split()[2] for line in section.splitlines()[1:]}
        # Each block's Function ran once a step, forward and backward, under the timers.
        assert calls[f"functions.{function}.forward"] == calls[f"functions.{function}.backward"] == "1.0x"


def test_host_timers_put_every_function_back():
    from benchmarks import host_timers

    def snapshot():
        names = {}
        for module in host_timers._library_modules():
            for name, value in vars(module).items():
                names[(module.__name__, name)] = value
                if isinstance(value, type) and value.__module__ == module.__name__:
                    for attribute, member in vars(value).items():
                        names[(module.__name__, name, attribute)] = member
        names["torch.empty"], names["torch.cat"] = torch.empty, torch.cat
        names["contiguous"] = torch.Tensor.contiguous
        return names

    before = snapshot()
    timers = host_timers.Timers()
    with host_timers.timed_library(timers) as wrapped:
        from fastlora_peft.functions import shared_input

        assert wrapped > 100 and torch.empty is not before["torch.empty"]
        assert shared_input.rank_blocks is not before[("fastlora_peft.functions.shared_input", "rank_blocks")]
        stacked = torch.zeros(2)
        timers.on = True
        shared_input.rank_blocks(stacked, [None], 0)  # one projection: the tensor itself
        torch.empty(1)
        timers.on = False
        assert timers.calls == {"functions.shared_input.rank_blocks": 1, "torch.empty": 1}
    after = snapshot()
    assert after.keys() == before.keys()
    assert [key for key in before if after[key] is not before[key]] == []


def test_host_vs_gpu_prefills_the_queue_ahead_of_every_step_only_when_asked(monkeypatch):
    """The prefilled reading is the events' reading with a sleep kernel queued before each step's
    first event: the recorded order of calls shows it (CUDA replaced by recorders)."""
    import torch

    from benchmarks import host_vs_gpu
    from benchmarks.harness import Clock, Step

    calls = []

    class Event:
        def __init__(self, enable_timing):
            self.index = len([c for c in calls if c[0] == "event"])
            calls.append(("event", self.index))

        def record(self):
            calls.append(("record", self.index))

        def elapsed_time(self, other):
            return float(other.index - self.index)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: calls.append(("sleep", cycles)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls.append(("sync",)))
    step = Step(
        forward=lambda: calls.append(("forward",)), backward=lambda state: calls.append(("backward",))
    )
    clock = Clock(torch.device("cuda"))
    reading = host_vs_gpu.event_times(step, 2, clock, prefill_cycles=123)
    kinds = [call[0] for call in calls if call[0] != "event"]
    assert kinds == ["sleep", "record", "forward", "record", "backward", "record"] * 2 + ["sync"]
    assert all(call[1] == 123 for call in calls if call[0] == "sleep")
    assert reading == host_vs_gpu.Reading(1.0, 1.0)
    calls.clear()
    host_vs_gpu.event_times(step, 2, clock)
    assert not [call for call in calls if call[0] == "sleep"]


def _zero_valued_lora_term(v, lora_a, lora_b, scale):
    """s (v A^T) B^T minus itself detached: adds 0 to the output, passes A's and B's gradients, and
    none to v (v comes in detached): the LoRA pieces at the base's own activations and gradients."""
    term = scale * (v @ lora_a.T) @ lora_b.T
    return term - term.detach()


def _mm_count(step) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountMatmuls(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
                CountMatmuls.count += 1
            return func(*args, **(kwargs or {}))

    with CountMatmuls():
        step()
    return CountMatmuls.count


def _bound_reference(block: str, t: dict, scale: float) -> dict:
    """Autograd of the block with its LoRA terms at value zero: the base's outputs and dX (the terms
    add nothing to either), the adapters' gradients, by the names `bounds.ideal_arms` gives them."""
    x = t["x"]
    if block == "o":
        outs = [x @ t["w"].T + _zero_valued_lora_term(x.detach(), t["a"], t["b"], scale)]
        torch.autograd.backward(outs, [t["dy"]])
        pieces = {"dA": t["a"].grad, "dB": t["b"].grad}
    elif block == "qkv":
        outs = [
            x @ t[f"w_{n}"].T + _zero_valued_lora_term(x.detach(), t[f"a_{n}"], t[f"b_{n}"], scale)
            for n in "qkv"
        ]
        torch.autograd.backward(outs, [t[f"dy_{n}"] for n in "qkv"])
        pieces = {
            "dA": torch.cat([t[f"a_{n}"].grad for n in "qkv"]),
            "dB": torch.cat([t[f"b_{n}"].grad for n in "qkv"]),
        }
    else:
        gate = x @ t["w_gate"].T + _zero_valued_lora_term(x.detach(), t["a_gate"], t["b_gate"], scale)
        up = x @ t["w_up"].T + _zero_valued_lora_term(x.detach(), t["a_up"], t["b_up"], scale)
        hidden = torch.nn.functional.silu(gate) * up
        down_term = _zero_valued_lora_term(hidden.detach(), t["a_down"], t["b_down"], scale)
        outs = [hidden @ t["w_down"].T + down_term]
        torch.autograd.backward(outs, [t["dy"]])
        pieces = {
            "dA_gate_up": torch.cat([t["a_gate"].grad, t["a_up"].grad]),
            "dB_gate": t["b_gate"].grad,
            "dB_up": t["b_up"].grad,
            "dB_down": t["b_down"].grad,
            "dyB_down": scale * t["dy"] @ t["b_down"].detach(),
        }
    return {"out": torch.cat([out.detach() for out in outs], 1), "dx": x.grad, **pieces}


def test_bounds_ideal_arms_compute_the_lora_gradients_they_stand_for():
    # The bound is only as good as its arms: each "ideal" must compute every adapter gradient its
    # block needs (one skipped would understate the bound) and no GEMM beyond the floor's and
    # LoRA's own passes (one more would overstate it). Checked in float64 against autograd of the
    # block with its LoRA terms at value zero: the ideal carries the terms for free.
    from benchmarks import bounds, cases

    geo, tokens, cpu = cases.SMOKE, 37, torch.device("cpu")
    expected_matmuls = {
        "o floor ops": 2, "o ideal": 6, "qkv floor ops": 6, "qkv ideal": 14,
        "mlp floor ops": 6, "mlp ideal": 14, "mlp ideal free dgdu": 10,
    }  # fmt: skip
    for block in cases.BLOCKS:
        tensors = bounds.block_tensors(block, geo, tokens, cpu, torch.float64)
        tensors = {
            k: v.requires_grad_(k.startswith(("x", "a_", "b_")) or k in ("a", "b"))
            for k, v in tensors.items()
        }
        reference = _bound_reference(block, tensors, geo.alpha / geo.rank)
        for name, step in bounds.ideal_arms(block, geo, tokens, cpu, torch.float64).items():
            computed = step()
            if isinstance(computed["out"], list):
                computed["out"] = torch.cat(computed["out"], 1)
            if "floor" in name:
                wanted = ("out", "dx")
            elif "free dgdu" in name:  # its dA reads the forward's xa where dgate B | dup B would be
                wanted = ("out", "dx", "dB_down", "dyB_down")
            else:
                wanted = tuple(reference)
            for key in wanted:
                torch.testing.assert_close(computed[key], reference[key], rtol=1e-9, atol=1e-12, msg=key)
            assert _mm_count(step) == expected_matmuls[name], name


def test_bounds_smoke_times_every_arm_beside_the_floor():
    command = [sys.executable, "-m", "benchmarks.bounds", "--smoke", "--rounds", "1", "--iters", "1"]
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    names = [line[:28].strip() for line in done.stdout.splitlines() if line.endswith("x")]
    for block in ("o", "qkv", "mlp"):
        arms = ["floor", "fastlora bf16-adapters", "fastlora fp32-adapters", "floor ops", "ideal"]
        arms += ["ideal free dgdu"] if block == "mlp" else []
        assert [n for n in names if n.split()[0] == block] == [f"{block} {arm}" for arm in arms], names
