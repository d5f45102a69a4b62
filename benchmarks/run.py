"""Command-line entry: run the suites, write results.json / results.csv / results.md / results.txt and plots.

    python -m benchmarks.run --cases blocks,e2e,sweep --out bench_out/          # on a CUDA GPU
    python -m benchmarks.run --smoke --out /tmp/bench_smoke                     # tiny shapes on the CPU

Results are rewritten after every suite, so a run cut short (the device tool's 10-minute limit) still
leaves the suites it finished. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from fastlora_peft.kernels.lora_addmm import LoraAddmmSettings

from .cases import LLAMA_8B, SMOKE
from .harness import Row, environment, write_results
from .report import add_ratios, check_targets, format_table, format_targets, markdown_report
from .suites import SUITES, Settings, count_rows, run_suite


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--cases", default=",".join(SUITES), help=f"comma-separated subset of {','.join(SUITES)}"
    )
    parser.add_argument("--out", type=Path, default=Path("bench_out"), help="folder for results and plots")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, one repeat, on the CPU")
    parser.add_argument("--bases", default="bf16,nf4", help="base layouts: bf16, nf4")
    parser.add_argument("--adapters", default="fp32,bf16", help="adapter dtypes: fp32 (PEFT's default), bf16")
    parser.add_argument("--warmup", type=int, help="warm-up steps per provider (blocks, sweeps; default 5)")
    parser.add_argument("--repeats", type=int, help="timed steps per provider per round (default 20)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds over the providers (default 2)")
    parser.add_argument(
        "--e2e-repeats", type=int, help="timed steps per round of the whole model (default 10)"
    )
    parser.add_argument(
        "--autograd-threads",
        default="worker",
        choices=("worker", "caller"),
        help="where every provider's backward runs: autograd's CUDA worker thread (torch's default, "
        "what a Trainer gets) or the calling thread (torch.autograd.set_multithreading_enabled(False))",
    )
    parser.add_argument(
        "--cpus",
        type=_cpu_list,
        help="pin the run to these CPU cores, e.g. 3 or 2,3 (default: all). On the H200 machine's 16 vCPUs "
        "one core cut the fused q/k/v step's host time at 2048 tokens from 2.17-2.30 to 1.34-1.89 ms "
        "(fastest rounds; docs/benchmarks.md, 'CPU pinning')",
    )
    parser.add_argument(
        "--lora-addmm",
        default=None,
        choices=("never", "auto", "always"),
        help="LoraAddmmSettings.mode for fastlora's forward and dX GEMMs (default: the library's, "
        "auto): never (cuBLAS + lora_expand_add_), auto (lora_addmm on Hopper from 2048 rows), always",
    )
    parser.add_argument("--no-plots", action="store_true", help="skip matplotlib")
    parser.add_argument("--redraw", type=Path, help="only draw the plots of this results.json into --out")
    return parser.parse_args(argv)


def _cpu_list(text: str) -> set[int]:
    try:
        return {int(core) for core in text.split(",") if core.strip()}
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of core numbers: {text!r}") from None


def _pick(value: int | None, default: int, smoke: int, is_smoke: bool) -> int:
    return value if value is not None else (smoke if is_smoke else default)


def build_settings(args: argparse.Namespace) -> Settings:
    if args.smoke:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        raise SystemExit("no CUDA device: the measurements need a GPU; --smoke runs the tiny CPU check")
    bases = tuple(args.bases.split(","))
    adapters = tuple(args.adapters.split(","))
    if not set(bases) <= {"bf16", "nf4"} or not set(adapters) <= {"fp32", "bf16"}:
        raise SystemExit(f"unknown base or adapter in {bases} / {adapters}")
    return Settings(
        geo=SMOKE if args.smoke else LLAMA_8B,
        device=device,
        bases=bases,
        adapters=adapters,
        warmup=_pick(args.warmup, 5, 1, args.smoke),
        repeats=_pick(args.repeats, 20, 1, args.smoke),
        rounds=_pick(args.rounds, 2, 1, args.smoke),
        # A whole-model step is ~100 ms at 8B shapes: 3 + 2 x 10 steps keep the e2e suite near 30 s.
        e2e_warmup=_pick(args.warmup, 3, 1, args.smoke),
        e2e_repeats=_pick(args.e2e_repeats, 10, 1, args.smoke),
    )


def _progress(total: int):
    try:
        from tqdm import tqdm
    except ImportError:  # the bar is a convenience; the results do not depend on it
        return None
    # mininterval: the device tool returns only the output's tail; keep the bar's redraws few.
    return tqdm(total=total, unit="row", file=sys.stderr, mininterval=2.0, dynamic_ncols=True)


def save(rows: list[Row], meta: dict[str, Any], out_dir: Path, plots: bool) -> str:
    """Ratios, targets, plots, then every output file; returns the text printed at the end."""
    add_ratios(rows)
    meta["targets"] = check_targets(rows)
    if plots:
        from .plots import draw_all

        env = meta["environment"]
        meta["plots"] = [path.name for path in draw_all(rows, out_dir, _plot_title(env))]
    write_results(out_dir, rows, meta)
    (out_dir / "results.md").write_text(markdown_report(rows, meta))
    text = format_table(rows) + "\n\n" + format_targets(meta["targets"], meta["settings"]["smoke"])
    (out_dir / "results.txt").write_text(text + "\n")
    return text


def _plot_title(env: dict[str, Any]) -> str:
    return f"{env.get('gpu', {}).get('name', env['device'])}, torch {env['versions']['torch']}"


def redraw(results_json: Path, out_dir: Path) -> int:
    """Every output file from a results.json written earlier (the GPU machine's files come back few):
    the plots, results.csv, results.md and results.txt, and the json itself into `out_dir`."""
    data = json.loads(results_json.read_text())
    rows = [Row(**record) for record in data.pop("rows")]
    out_dir.mkdir(parents=True, exist_ok=True)
    print(save(rows, data, out_dir, plots=True))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.redraw is not None:
        return redraw(args.redraw, args.out)
    if args.cpus:
        # Before CUDA and torch start their threads: threads inherit the affinity of their creator.
        os.sched_setaffinity(0, args.cpus)
    # PEFT calls a transformers property deprecated in v5 once per model; it says nothing about the run.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    settings = build_settings(args)
    # Thread-local, so it holds for every backward this (main) thread starts, every provider alike.
    # docs/benchmarks.md ("Where the host time goes") says why it matters for fused Functions.
    torch.autograd.set_multithreading_enabled(args.autograd_threads == "worker")
    if args.lora_addmm is not None:
        LoraAddmmSettings.mode = args.lora_addmm
    suites = [name.strip() for name in args.cases.split(",") if name.strip()]
    unknown = set(suites) - set(SUITES)
    if unknown:
        raise SystemExit(f"unknown cases {sorted(unknown)}; choose from {','.join(SUITES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    meta: dict[str, Any] = {
        "environment": environment(settings.device),
        "settings": {
            "smoke": args.smoke, "cases": suites, "geometry": settings.geo.__dict__,
            "autograd_threads": args.autograd_threads,
            "cpus": sorted(args.cpus) if args.cpus else "all",
            "lora_addmm": LoraAddmmSettings.mode,
            **{k: v for k, v in settings.__dict__.items() if k not in ("geo", "device")},
        },
    }  # fmt: skip
    rows: list[Row] = []
    bar = _progress(sum(count_rows(suite, settings) for suite in suites))
    started = time.perf_counter()
    text, saved = "", 0
    try:
        for suite in suites:
            for event in run_suite(suite, settings):
                if isinstance(event, str):
                    if bar is not None:
                        bar.set_description_str(event[:48])
                    continue
                rows.append(event)
                if bar is not None:
                    bar.update(1)
            meta["seconds"] = round(time.perf_counter() - started, 1)
            text, saved = save(rows, meta, args.out, plots=not args.no_plots), len(rows)
    finally:
        if bar is not None:
            bar.close()
        if len(rows) > saved:  # a suite failed part-way: keep what it measured before the error goes up
            meta["error"] = "a suite failed part-way; see the log"
            try:
                save(rows, meta, args.out, plots=False)
            except Exception as error:  # never hide the suite's own error behind this one
                print(f"could not save the partial results: {error!r}", file=sys.stderr)
    print(text)
    print(f"\n{len(rows)} rows in {meta['seconds']} s; in {args.out}/: results.json .csv .md .txt, *.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
