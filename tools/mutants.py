"""Breaks the code on purpose, one listed mutation at a time, and checks that a test fails.

    python tools/mutants.py [--only ID_PREFIX[,ID_PREFIX...]] [--list]

Each entry of `tools/mutants.json` names a file, an exact piece of it (`old`, found once) and what
replaces it (`new`): a dtype delegated to PEFT, a scale dropped, a blocker removed, a kernel's
derivative bent. For each, the file is rewritten, its tests (`tests`, else `default_tests`) run
under the Triton interpreter with `-x`, and the file is put back as it was read, whatever happens.
A mutation no test notices prints SURVIVED and the exit status is 1. On the CPU machine the first 37
entries took 13 minutes, all 46 took 18 beside a CI run, all 49 about 16 (fiftieth session, also
beside CI; most die within seconds, a survivor runs its whole test list).
`tests/test_mutants_list.py` checks in CI that every entry still applies to the code.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LIST = Path(__file__).with_name("mutants.json")


def load() -> dict:
    return json.loads(LIST.read_text())


def run_one(mutant: dict, default_tests: list[str]) -> tuple[bool, str]:
    """(killed, pytest's last line and first failure) for one mutant; the file is restored after."""
    path = REPO / mutant["file"]
    original = path.read_text()
    if original.count(mutant["old"]) != 1:
        raise SystemExit(f"{mutant['id']}: its `old` text is not in {mutant['file']} exactly once")
    try:
        path.write_text(original.replace(mutant["old"], mutant["new"], 1))
        tests = mutant.get("tests") or default_tests
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
            cwd=REPO,
            env=dict(os.environ, TRITON_INTERPRET="1"),
            capture_output=True,
            text=True,
        )
    finally:
        path.write_text(original)
    lines = result.stdout.strip().splitlines()
    failed = next((line for line in lines if line.startswith(("FAILED", "ERROR"))), "")
    summary = lines[-1] if lines else result.stderr.strip()[-300:]
    return result.returncode != 0, f"{summary} {failed}".strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma list of id prefixes (e.g. M11,K3)")
    parser.add_argument("--list", action="store_true", help="print the mutations and exit")
    args = parser.parse_args(argv)
    listed = load()
    mutants = listed["mutants"]
    if args.only:
        prefixes = tuple(args.only.split(","))
        mutants = [m for m in mutants if m["id"].split()[0] in prefixes]
    if args.list:
        print("\n".join(m["id"] for m in mutants))
        return 0
    survivors = 0
    for mutant in mutants:
        started = time.perf_counter()
        killed, detail = run_one(mutant, listed["default_tests"])
        survivors += not killed
        verdict = "killed" if killed else "SURVIVED"
        print(f"{verdict:8} {mutant['id']} ({time.perf_counter() - started:.0f} s): {detail}", flush=True)
    print(f"{len(mutants) - survivors} of {len(mutants)} killed")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
