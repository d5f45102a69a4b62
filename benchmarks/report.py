"""From rows to ratios, a printed table, the GPU.md targets and the Markdown tables of docs/benchmarks.md.

Ratios are taken only inside a group (the rows timed side by side in one process): times move from run
to run and machine to machine, ratios to a baseline measured beside them carry.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from .harness import Row


def add_ratios(rows: list[Row]) -> None:
    """x_floor: step time over the floor's; speedup_vs_peft: PEFT's time (same adapter dtype) over this
    row's; *_vs_peft_fp32: against PEFT's default (fp32 adapters), the baseline of the e2e targets."""
    groups: dict[str, list[Row]] = defaultdict(list)
    for row in rows:
        groups[row.group].append(row)
    for members in groups.values():
        floor = next((row for row in members if row.provider == "floor"), None)
        peft = {row.adapter: row for row in members if row.provider == "peft"}
        for row in members:
            row.ratios.clear()
            if floor is not None and row is not floor:
                row.ratios["x_floor"] = row.step_ms / floor.step_ms
            same, default = peft.get(row.adapter), peft.get("fp32")
            if row.provider == "fastlora" and same is not None:
                row.ratios["speedup_vs_peft"] = same.step_ms / row.step_ms
            if row.provider != "peft" and default is not None:
                row.ratios["speedup_vs_peft_fp32"] = default.step_ms / row.step_ms
                if row.peak_mib is not None and default.peak_mib:
                    row.ratios["peak_vs_peft_fp32"] = row.peak_mib / default.peak_mib


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def format_table(rows: list[Row]) -> str:
    header = (
        f"{'suite':12} {'case':5} {'base':4} {'adapt':5} {'provider':8} {'tokens':>6} {'r':>3} "
        f"{'fwd ms':>8} {'bwd ms':>8} {'step ms':>8} {'spread%':>7} {'xfloor':>6} {'xPEFT':>6} "
        f"{'peak MiB':>8} {'tok/s':>8} {'err dX':>7} {'nodes':>7} note"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        tokens_per_s = _fmt(row.tokens_per_s / 1e3, ".1f") + "k" if row.suite == "e2e" else "-"
        lines.append(
            f"{row.suite:12} {row.case:5} {row.base:4} {row.adapter:5} {row.provider:8} {row.tokens:>6} "
            f"{row.rank:>3} {row.fwd_ms:>8.3f} {row.bwd_ms:>8.3f} {row.step_ms:>8.3f} {row.spread_pct:>7.1f} "
            f"{_fmt(row.ratios.get('x_floor')):>6} {_fmt(row.ratios.get('speedup_vs_peft')):>6} "
            f"{_fmt(row.peak_mib, '.0f'):>8} {tokens_per_s:>8} {_fmt(row.rel_err_dx, '.1e'):>7} "
            f"{f'{row.custom_fn_nodes}/{row.graph_nodes}':>7} {row.note}"
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class Target:
    """A GPU.md target, checked on every fastlora row it applies to."""

    name: str
    suite: str
    cases: tuple[str, ...]
    metric: str  # a ratio name or a Row field
    limit: float
    at_most: bool = True
    tokens: int | None = None  # only rows of this size (sweeps)

    def value(self, row: Row) -> float | None:
        return row.ratios.get(self.metric, getattr(row, self.metric, None))


TARGETS = (
    Target("MLP step <= 1.0x floor", "blocks", ("mlp",), "x_floor", 1.00),
    Target("QKV step <= 1.15x floor", "blocks", ("qkv",), "x_floor", 1.15),
    Target("O step <= 1.15x floor", "blocks", ("o",), "x_floor", 1.15),
    Target("MLP peak <= 700 MiB", "blocks", ("mlp",), "peak_mib", 700.0),
    Target(
        "e2e tokens/s >= 1.40x PEFT default", "e2e", ("model",), "speedup_vs_peft_fp32", 1.40, at_most=False
    ),
    # "within 8% of the floor", read in time (the stricter reading: 8% in tokens/s would allow 1.087x).
    Target("e2e step <= 1.08x floor", "e2e", ("model",), "x_floor", 1.08),
    Target("e2e peak <= 0.6x PEFT default", "e2e", ("model",), "peak_vs_peft_fp32", 0.60),
    Target("2048 tokens MLP <= 1.15x floor", "sweep-tokens", ("mlp",), "x_floor", 1.15, tokens=2048),
    Target("2048 tokens QKV <= 1.6x floor", "sweep-tokens", ("qkv",), "x_floor", 1.60, tokens=2048),
)


def check_targets(rows: list[Row]) -> list[dict[str, Any]]:
    results = []
    for target in TARGETS:
        for row in rows:
            if row.provider != "fastlora" or row.suite != target.suite or row.case not in target.cases:
                continue
            if target.tokens is not None and row.tokens != target.tokens:
                continue
            value = target.value(row)
            met = (
                None
                if value is None
                else (value <= target.limit if target.at_most else value >= target.limit)
            )
            label = f"{row.case} {row.base} {row.adapter}-adapters"
            results.append(
                {"target": target.name, "row": label, "value": value, "limit": target.limit, "met": met}
            )
    return results


def format_targets(checks: list[dict[str, Any]], smoke: bool) -> str:
    lines = ["Targets (GPU.md)" + (": smoke run on the CPU, the verdicts mean nothing" if smoke else "")]
    for check in checks:
        verdict = {True: "met", False: "MISSED", None: "n/a"}[check["met"]]
        lines.append(f"  {verdict:6} {check['target']:38} {check['row']:28} {_fmt(check['value'], '.3f')}")
    return "\n".join(lines)


def markdown_report(rows: list[Row], meta: dict[str, Any]) -> str:
    """The tables docs/benchmarks.md shows, ready to paste (results.md)."""
    env = meta["environment"]
    versions = ", ".join(f"{name} {version}" for name, version in env["versions"].items() if version)
    gpu = env.get("gpu", {}).get("name", env["device"])
    settings = meta.get("settings", {})
    shown = ("repeats", "rounds", "autograd_threads", "cpus", "lora_addmm")
    run = ", ".join(f"{name} {settings[name]}" for name in shown if name in settings)
    out = [f"Machine: {gpu}; {versions}; git {env.get('git')}; {env['time_utc']}.", f"Run: {run}.", ""]
    out += _blocks_table(rows) + _e2e_table(rows) + _sweep_table(rows, "sweep-tokens", "tokens")
    out += _sweep_table(rows, "sweep-rank", "rank")
    out += ["| target | row | value | met |", "|---|---|---|---|"]
    for check in meta.get("targets", []):
        out.append(f"| {check['target']} | {check['row']} | {_fmt(check['value'], '.3f')} | {check['met']} |")
    return "\n".join(out) + "\n"


def _by_group(rows: list[Row], suite: str) -> dict[str, list[Row]]:
    groups: dict[str, list[Row]] = defaultdict(list)
    for row in rows:
        if row.suite == suite:
            groups[row.group].append(row)
    return groups


def _blocks_table(rows: list[Row]) -> list[str]:
    out = [
        "| block | base | adapters | floor ms | PEFT ms | fastlora ms | fastlora x floor | vs PEFT "
        "| PEFT peak MiB | fastlora peak MiB | rel. err. dX |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for members in _by_group(rows, "blocks").values():
        floor = next((row for row in members if row.provider == "floor"), None)
        for fast in (row for row in members if row.provider == "fastlora"):
            peft = next((r for r in members if r.provider == "peft" and r.adapter == fast.adapter), None)
            if floor is None or peft is None:  # a group cut short by an error: nothing to compare with
                continue
            ratios = fast.ratios
            out.append(
                f"| {fast.case} | {fast.base} | {fast.adapter} | {floor.step_ms:.2f} | {peft.step_ms:.2f} "
                f"| {fast.step_ms:.2f} | {ratios['x_floor']:.2f}x | {ratios['speedup_vs_peft']:.2f}x "
                f"| {_fmt(peft.peak_mib, '.0f')} | {_fmt(fast.peak_mib, '.0f')} "
                f"| {_fmt(fast.rel_err_dx, '.1e')} |"
            )
    return out + [""]


def _e2e_table(rows: list[Row]) -> list[str]:
    out = [
        "| base | adapters | provider | ms / step | tokens/s | peak activation MiB | x floor "
        "| vs PEFT default |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for members in _by_group(rows, "e2e").values():
        for row in members:
            out.append(
                f"| {row.base} | {row.adapter} | {row.provider} | {row.step_ms:.1f} "
                f"| {_fmt(row.tokens_per_s / 1e3, '.1f')}k | {_fmt(row.peak_mib, '.0f')} "
                f"| {_fmt(row.ratios.get('x_floor'))} | {_fmt(row.ratios.get('speedup_vs_peft_fp32'))} |"
            )
    return out + [""]


def _sweep_table(rows: list[Row], suite: str, axis: str) -> list[str]:
    out = [
        f"| block | {axis} | floor ms | PEFT x floor | fastlora x floor | fastlora vs PEFT |",
        "|---|---|---|---|---|---|",
    ]
    for members in _by_group(rows, suite).values():
        by_provider = {row.provider: row for row in members}
        if len(by_provider) < 3:  # a group cut short by an error
            continue
        floor, peft, fast = by_provider["floor"], by_provider["peft"], by_provider["fastlora"]
        point = fast.tokens if axis == "tokens" else fast.rank
        # The sweep runs fp32 adapters unless the run left them out (`suites.sweep_adapter`).
        block = fast.case if fast.adapter == "fp32" else f"{fast.case} ({fast.adapter} adapters)"
        out.append(
            f"| {block} | {point} | {floor.step_ms:.3f} | {peft.ratios['x_floor']:.2f}x "
            f"| {fast.ratios['x_floor']:.2f}x | {fast.ratios['speedup_vs_peft']:.2f}x |"
        )
    return out + [""]
