"""Host time of one block's step under two versions of the library, in alternating fresh processes.

python -m benchmarks.host_ab --old REV_OR_DIR [--new DIR] [--cases mlp:2048,o:8192,qkv:8192]
                             [--adapters fp32] [--base bf16] [--rounds 5] [--steps 20]
                             [--kernel] [--smoke]

The o_proj, q/k/v and 2048-token MLP blocks are host-bound (docs/benchmarks.md), so a change to the
library's Python is judged by host time. Two versions cannot share a process (one `fastlora_peft`
per interpreter), and separate processes on the GPU machine differ by up to ~20%; so every round
runs each case once per version, old/new in one round and new/old in the next, each in a fresh
process, and the medians are compared.

Each process starts in a directory holding only its version's `fastlora_peft` (and these
`benchmarks`): `python -m` puts the working directory ahead of PYTHONPATH, which once had both arms
of an A/B import the same package. Each process reports the package it imported, and the tool
checks it against its arm.

`--kernel` compares kernel time instead: each arm's process runs `kernel_ab --against-floor`'s
profile (the floor and the fused block interleaved) and reports the fused block's kernel time over
the floor's; the rounds alternate as for host time. (Thirty-third session: an A/B run as two
`python -m benchmarks.kernel_ab` commands with PYTHONPATH set per arm had both arms import the
working directory's package again.)

`--old` is a git revision (its `fastlora_peft` is exported with `git archive`) or a directory that
contains a `fastlora_peft`; `--new` a directory (default: this checkout). Per process, the step is
`cases.one_layer_block_step`'s; "host" is the time of one step started on an empty launch queue
(synchronize, step, clock), the median over `--steps` steps. `--smoke` runs the tiny CPU geometry,
where host and wall are the same.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_RESULT_PREFIX = "host_ab result: "


def measure(
    block: str, tokens: int, base: str, adapters: str, steps: int, smoke: bool, kernel: bool = False
) -> dict:
    """One arm's process: the host time of `steps` block steps, each on an empty queue; with `kernel`,
    `measure_kernel`'s numbers instead."""
    import torch

    import fastlora_peft

    from . import cases

    geo = cases.SMOKE if smoke else cases.LLAMA_8B
    device = torch.device("cpu" if smoke else "cuda")
    package = str(Path(fastlora_peft.__file__).resolve().parent)
    if kernel:
        return {"package": package, **measure_kernel(geo, block, tokens, base, adapters, steps, device)}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    step = cases.one_layer_block_step(geo, block, "fastlora", base, adapters, tokens, device)

    def run() -> None:
        step.reset()
        step.backward(step.forward())

    for _ in range(2 if smoke else 10):
        run()
    host_us = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        run()
        host_us.append((time.perf_counter() - start) * 1e6)
    sync()
    return {"package": package, "host_us": host_us}


def measure_kernel(geo, block: str, tokens: int, base: str, adapters: str, steps: int, device) -> dict:
    """`kernel_ab --against-floor` in this arm's process: the floor's and the fused block's kernel
    time per step (on the CPU, `--smoke`, their host ops' time), interleaved in one profile."""
    from .kernel_ab import against_floor_arms, profile_arms

    arms = against_floor_arms(geo, block, base, adapters, tokens, device)
    credited, steps_per_arm = profile_arms(arms, steps, device)
    per_step = {arm: sum(micros for _, micros in credited[arm].values()) / steps_per_arm[arm] for arm in arms}
    return {"floor_us": per_step["floor"], "fused_us": per_step["fastlora"],
            "ratio": per_step["fastlora"] / per_step["floor"]}  # fmt: skip


def _export_revision(revision: str, destination: Path) -> Path:
    """`fastlora_peft` of a git revision of this checkout, written under `destination`."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", revision, "fastlora_peft"],
        check=True,
        capture_output=True,
    ).stdout
    # The "data" filter (refuse links out of the tree, absolute paths) where this Python has it.
    safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(destination, **safe)
    return destination


def _arm_directory(package_root: Path, workspace: Path, name: str) -> Path:
    """A directory holding only links to `package_root/fastlora_peft` and to these benchmarks."""
    arm = workspace / name
    arm.mkdir()
    (arm / "fastlora_peft").symlink_to(package_root / "fastlora_peft", target_is_directory=True)
    (arm / "benchmarks").symlink_to(REPO / "benchmarks", target_is_directory=True)
    return arm


def _run_arm(arm: Path, case: str, args) -> dict:
    block, tokens = case.split(":")
    command = [sys.executable, "-m", "benchmarks.host_ab", "--measure", block, tokens]
    command += ["--base", args.base, "--adapters", args.adapters, "--steps", str(args.steps)]
    command += ["--smoke"] if args.smoke else []
    command += ["--kernel"] if args.kernel else []
    done = subprocess.run(command, cwd=arm, capture_output=True, text=True, env=dict(os.environ))
    lines = [line for line in done.stdout.splitlines() if line.startswith(_RESULT_PREFIX)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{arm.name} {case} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    result = json.loads(lines[-1][len(_RESULT_PREFIX) :])
    expected = (arm / "fastlora_peft").resolve()
    if Path(result["package"]) != expected:
        raise RuntimeError(f"{arm.name} imported {result['package']}, not its own {expected}")
    return result


def compare(args) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        workspace = Path(folder)
        old_given = Path(args.old)
        if (old_given / "fastlora_peft").is_dir():
            old_root = old_given.resolve()
        else:
            old_root = _export_revision(args.old, workspace / "old_package")
        arms = {
            "old": _arm_directory(old_root, workspace, "old"),
            "new": _arm_directory(Path(args.new).resolve(), workspace, "new"),
        }
        results = {case: {"old": [], "new": []} for case in args.cases.split(",")}
        for round_index in range(args.rounds):
            order = ("old", "new") if round_index % 2 == 0 else ("new", "old")
            for case in results:
                for name in order:
                    result = _run_arm(arms[name], case, args)
                    if args.kernel:
                        value = result["ratio"]
                        detail = f"x floor ({result['fused_us']:.1f} / {result['floor_us']:.1f} us)"
                    else:
                        value, detail = statistics.median(result["host_us"]), "us"
                    results[case][name].append(value)
                    print(f"round {round_index + 1} {case:10s} {name}: {value:9.4g} {detail}", flush=True)
    summary = {}
    what = "kernel time x floor" if args.kernel else "host us per step"
    for case, arms_values in results.items():
        old, new = statistics.median(arms_values["old"]), statistics.median(arms_values["new"])
        summary[case] = {"old": old, "new": new, "new_over_old": new / old, "rounds": arms_values}
        print(f"{case:10s} {what}, median of {args.rounds} rounds: old {old:9.4g}  "
              f"new {new:9.4g}  new/old {new / old:5.3f}")  # fmt: skip
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", help="git revision, or a directory containing fastlora_peft")
    parser.add_argument("--new", default=str(REPO), help="a directory containing fastlora_peft")
    parser.add_argument("--cases", default="mlp:2048,o:8192,qkv:8192", help="block:tokens, comma-separated")
    parser.add_argument("--base", default="bf16", choices=("bf16", "nf4"))
    parser.add_argument("--adapters", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per process")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--out", help="write the results as JSON here")
    kernel_help = "compare each arm's kernel time over the floor's (kernel_ab --against-floor), not host time"
    parser.add_argument("--kernel", action="store_true", help=kernel_help)
    parser.add_argument("--measure", nargs=2, metavar=("BLOCK", "TOKENS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        block, tokens = args.measure
        result = measure(block, int(tokens), args.base, args.adapters, args.steps, args.smoke, args.kernel)
        print(_RESULT_PREFIX + json.dumps(result), flush=True)
        return
    if not args.old:
        parser.error("--old is required")
    summary = compare(args)
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
