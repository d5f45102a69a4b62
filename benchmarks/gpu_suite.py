"""The test suite on the GPU machine, in parts that each fit one device call.

python -m benchmarks.gpu_suite --part 1|2|3 [--list] [pytest arguments ...]

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

Part 3 is every test file the first two do not name, except `CPU_ONLY`: a new test file lands in
part 3 unless it is added to a part (`tests/test_benchmark_tools.py` checks that the parts cover
every file once). `test_trainers.py` (part 3) needs the extra wheels of `docs/benchmarks.md`,
"Running".
"""

from __future__ import annotations

import argparse
import sys
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


def main(argv: list[str] | None = None) -> int:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--part", type=int, required=True, choices=(1, 2, 3))
    parser.add_argument("--list", action="store_true", help="print the part's files and exit")
    args, pytest_args = parser.parse_known_args(argv)
    files = part_files(args.part)
    if args.list:
        print("\n".join(files))
        return 0
    import pytest

    paths = [str(REPO / name) for name in files]
    return pytest.main(["-q", "-rEf", "-p", "no:cacheprovider", "--durations=15", *paths, *pytest_args])


if __name__ == "__main__":
    sys.exit(main())
