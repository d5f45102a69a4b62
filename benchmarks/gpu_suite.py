"""The test suite on the GPU machine, in parts that each fit one device call.

python -m benchmarks.gpu_suite --part 1|2|3 [--list] [--jobs N [--log-dir DIR]] [pytest arguments ...]

One device call runs for at most 10 minutes, and the whole suite takes longer there. Pytest's own
times on the H200 in the thirty-sixth session: part 1 130 s, part 2 432 s, part 3 90 s (part 2's
call, the wheels' install included, ran 441 s of its 600). Each part runs pytest with `-q -rEf`
(every error's and failure's report in the log) and `--durations=15`, in one process, in the order
listed, so a part's log reads the same from session to session. Pass no further `-q`: at `-qq`
pytest drops its count line (a forty-third session log read as cut short for that). On a fresh
machine part 1 took 150 s in the forty-third session: give it 240 s. Part 2 has grown: 524 s in the
forty-sixth session (535 s of the call's 600), so a test file more goes to part 3, and its four sm_90
compile checks (101 s of it) now skip where CUDA is (`conftest.compiles_for_sm90_on_cpu`; CI runs
them on the CPU).

`--jobs N` runs the part's files in N pytest processes at once, dealt out in turn (file i to
process i mod N), each logging to `DIR/part{P}_{j}.log` (DIR: a temporary folder unless given); each
log is printed when all have finished, and the exit status is the first failing process's. The
processes share the GPU and the host's cores (16 on the H200 machine). Fiftieth session: part 3 in
three processes took 134 s beside part 1 (158 s), where part 3 in one process had been cut at
170-200 s after about 85% of its tests; part 2 in two, 281 and 175 s at once against 433 s one after
the other the session before (`docs/benchmarks/session50/`, `docs/gpu-results.md`). What a process
spends its time on there (Triton's compiles, the tests' own work) was not measured.

Part 3 is every test file the first two do not name, except `CPU_ONLY`: a new test file lands in
part 3 unless it is added to a part (`tests/test_benchmark_tools.py` checks that the parts cover
every file once). `test_trainers.py` (part 3) needs the extra wheels of `docs/benchmarks.md`,
"Running".
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# The GPU-only files: Llama-3.1-8B sizes, CUDA graphs and torch.compile's reduce-overhead.
GPU_FILES = ["tests/test_gpu.py", "tests/test_cuda_graphs.py"]
# The files whose tests launch the Triton kernels on CUDA (the CUDA twins of the interpreter's cases).
KERNEL_FILES = [
    "tests/test_augmented_k.py",
    "tests/test_kernels_gated_act.py",
    "tests/test_kernels_gated_act_lora.py",
    "tests/test_kernels_gated_act_lora_forward.py",
    "tests/test_kernels_dequant4bit.py",
    "tests/test_kernels_dequant4bit_group.py",
    "tests/test_kernels_lora_terms.py",
    "tests/test_kernels_inplace.py",
    "tests/test_lora_addmm.py",
    "tests/test_lora_addmm_group.py",
    "tests/test_lora_addmm_sum.py",
    "tests/test_lora_shrink_group.py",
    "tests/test_lora_weight_grads.py",
    "tests/test_kernel_launch.py",
    "tests/test_launch_plans.py",
    "tests/test_mlp_chunks.py",
]
# Files left out on the GPU machine, and why (CI runs them on the CPU).
CPU_ONLY = {
    "tests/test_benchmark_tools.py": "checks the benchmark tools on the CPU through about thirty "
    "subprocesses; on the GPU machine it ran 42 tests in 300 s (thirty-fifth session)",
}


def all_test_files() -> list[str]:
    return sorted(str(path.relative_to(REPO)) for path in (REPO / "tests").glob("test_*.py"))


def part_files(part: int) -> list[str]:
    """The test files of `part` (1, 2 or 3), in the order they run."""
    if part == 1:
        return list(GPU_FILES)
    if part == 2:
        return list(KERNEL_FILES)
    if part == 3:
        named = set(GPU_FILES) | set(KERNEL_FILES) | set(CPU_ONLY)
        return [name for name in all_test_files() if name not in named]
    raise ValueError(f"no part {part}: the parts are 1, 2 and 3")


# Every part's pytest options (see the module docstring).
PYTEST_OPTIONS = ["-q", "-rEf", "-p", "no:cacheprovider", "--durations=15"]
# pytest's exit status when it selected no test (a -k filter can leave one process none).
NO_TESTS_COLLECTED = 5


def dealt_files(files: list[str], jobs: int) -> list[list[str]]:
    """`files` dealt out in turn to at most `jobs` processes (none left empty), each keeping their order."""
    return [group for group in (files[index::jobs] for index in range(jobs)) if group]


def run_jobs(groups: list[list[str]], pytest_args: list[str], log_dir: Path, part: int) -> int:
    """One pytest process per group of files, all at once; prints their logs when all have ended.
    Returns 0 when every process passed (or selected nothing, as long as one ran tests), else the
    first failing process's status."""
    log_dir.mkdir(parents=True, exist_ok=True)
    running = []
    for index, group in enumerate(groups, start=1):
        log_path = log_dir / f"part{part}_{index}.log"
        paths = [str(REPO / name) for name in group]
        command = [sys.executable, "-m", "pytest", *PYTEST_OPTIONS, *paths, *pytest_args]
        with open(log_path, "w") as log:  # the child holds its own copy of the file
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        running.append((process, log_path))
    statuses = []
    for process, log_path in running:
        statuses.append(process.wait())
        print(f"===== {log_path} (exit status {statuses[-1]})")
        print(log_path.read_text(), flush=True)
    failed = [status for status in statuses if status not in (0, NO_TESTS_COLLECTED)]
    if failed:
        return failed[0]
    return NO_TESTS_COLLECTED if all(status == NO_TESTS_COLLECTED for status in statuses) else 0


def main(argv: list[str] | None = None) -> int:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--part", type=int, required=True, choices=(1, 2, 3))
    parser.add_argument("--list", action="store_true", help="print the part's files and exit")
    parser.add_argument("--jobs", type=int, default=1, help="pytest processes at once (default 1)")
    parser.add_argument("--log-dir", type=Path, help="with --jobs: where each process logs")
    args, pytest_args = parser.parse_known_args(argv)
    files = part_files(args.part)
    if args.list:
        print("\n".join(files))
        return 0
    if args.jobs > 1:
        log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="gpu_suite_"))
        return run_jobs(dealt_files(files, args.jobs), pytest_args, log_dir, args.part)
    import pytest

    paths = [str(REPO / name) for name in files]
    return pytest.main([*PYTEST_OPTIONS, *paths, *pytest_args])


if __name__ == "__main__":
    sys.exit(main())
