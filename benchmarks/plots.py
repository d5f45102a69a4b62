"""PNG plots of the rows (matplotlib, no display): what docs/benchmarks.md shows next to the tables.

Times are drawn as multiples of the floor measured beside them, so plots from different runs compare.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from .harness import Row

COLORS = {"floor": "#9e9e9e", "peft": "#e07b39", "fastlora": "#3a6ea5"}
# GPU.md's targets for a block, as a multiple of the floor: drawn as a short line over each block's bars.
BLOCK_TARGETS = {"mlp": 1.0, "qkv": 1.15, "o": 1.15}


def draw_all(rows: list[Row], out_dir: Path, title: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only: the device machine has no display
    paths = []
    suites = {row.suite for row in rows}
    if "blocks" in suites:
        paths += [_blocks_time(rows, out_dir, title), _blocks_memory(rows, out_dir, title)]
    if "e2e" in suites:
        paths.append(_e2e(rows, out_dir, title))
    for suite, axis in (("sweep-tokens", "tokens"), ("sweep-rank", "rank")):
        if suite in suites:
            paths.append(_sweep(rows, suite, axis, out_dir, title))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def _say_if_empty(ax, values) -> None:
    if not any(values):  # the CPU smoke run has no CUDA memory statistics
        ax.text(0.5, 0.5, "no memory statistics (CPU run)", ha="center", transform=ax.transAxes)


def _block_labels(rows: list[Row]) -> list[tuple[str, str, str]]:
    """(case, base, adapter) of every fastlora block row, in run order."""
    return [(r.case, r.base, r.adapter) for r in rows if r.suite == "blocks" and r.provider == "fastlora"]


def _find(rows: list[Row], **fields) -> Row | None:
    return next((r for r in rows if all(getattr(r, k) == v for k, v in fields.items())), None)


def _blocks_time(rows: list[Row], out_dir: Path, title: str) -> Path:
    import matplotlib.pyplot as plt

    labels = _block_labels(rows)
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(labels)), 4))
    width = 0.38
    for offset, provider in ((-width / 2, "peft"), (width / 2, "fastlora")):
        values = []
        for case, base, adapter in labels:
            row = _find(rows, suite="blocks", case=case, base=base, adapter=adapter, provider=provider)
            values.append(row.ratios.get("x_floor", 0.0) if row else 0.0)
        ax.bar(
            [i + offset for i in range(len(labels))], values, width, label=provider, color=COLORS[provider]
        )
    for i, (case, _, _) in enumerate(labels):
        ax.hlines(BLOCK_TARGETS[case], i - 0.45, i + 0.45, colors="black", linestyles="dotted")
    ax.axhline(1.0, color=COLORS["floor"], linewidth=1)
    ax.set_xticks(range(len(labels)), [f"{c}\n{b}/{a}" for c, b, a in labels], fontsize=8)
    ax.set_ylabel("forward + backward time / floor")
    ax.set_title(f"Blocks: time over the frozen floor (dotted: target)\n{title}", fontsize=9)
    ax.legend()
    return _save(fig, out_dir / "blocks_time.png")


def _blocks_memory(rows: list[Row], out_dir: Path, title: str) -> Path:
    import matplotlib.pyplot as plt

    labels = _block_labels(rows)
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(labels)), 4))
    width = 0.27
    for offset, provider in ((-width, "floor"), (0.0, "peft"), (width, "fastlora")):
        values = []
        for case, base, adapter in labels:
            wanted_adapter = "none" if provider == "floor" else adapter
            row = _find(rows, suite="blocks", case=case, base=base, adapter=wanted_adapter, provider=provider)
            values.append((row.peak_mib or 0.0) if row else 0.0)
        ax.bar(
            [i + offset for i in range(len(labels))], values, width, label=provider, color=COLORS[provider]
        )
    ax.set_xticks(range(len(labels)), [f"{c}\n{b}/{a}" for c, b, a in labels], fontsize=8)
    ax.set_ylabel("peak MiB above the inputs and weights")
    _say_if_empty(ax, values)
    ax.set_title(f"Blocks: peak memory of one step\n{title}", fontsize=9)
    ax.legend()
    return _save(fig, out_dir / "blocks_memory.png")


def _e2e(rows: list[Row], out_dir: Path, title: str) -> Path:
    import matplotlib.pyplot as plt

    e2e = [row for row in rows if row.suite == "e2e"]
    labels = [f"{r.base}\n{r.provider}\n{r.adapter}" for r in e2e]
    colors = [COLORS[r.provider] for r in e2e]
    fig, (left, right) = plt.subplots(1, 2, figsize=(max(8, 1.4 * len(e2e)), 4))
    left.bar(range(len(e2e)), [(r.tokens_per_s or 0.0) / 1e3 for r in e2e], color=colors)
    left.set_ylabel("thousand tokens / s")
    right.bar(range(len(e2e)), [r.peak_mib or 0.0 for r in e2e], color=colors)
    right.set_ylabel("peak activation MiB")
    _say_if_empty(right, [r.peak_mib for r in e2e])
    for ax in (left, right):
        ax.set_xticks(range(len(e2e)), labels, fontsize=7)
    fig.suptitle(f"Training step of the whole model (forward, backward, AdamW)\n{title}", fontsize=9)
    return _save(fig, out_dir / "e2e.png")


def _sweep(rows: list[Row], suite: str, axis: str, out_dir: Path, title: str) -> Path:
    import matplotlib.pyplot as plt

    series: dict[tuple[str, str], list[tuple[int, float]]] = defaultdict(list)
    for row in rows:
        if row.suite == suite and row.provider != "floor" and "x_floor" in row.ratios:
            series[(row.case, row.provider)].append(
                (row.tokens if axis == "tokens" else row.rank, row.ratios["x_floor"])
            )
    cases = sorted({case for case, _ in series})
    fig, axes = plt.subplots(1, len(cases), figsize=(5 * len(cases), 4), squeeze=False)
    for ax, case in zip(axes[0], cases):
        for provider in ("peft", "fastlora"):
            points = sorted(series.get((case, provider), []))
            if points:
                ax.plot(*zip(*points), marker="o", label=provider, color=COLORS[provider])
        ax.axhline(1.0, color=COLORS["floor"], linewidth=1)
        ax.set_xscale("log", base=2)
        points = sorted({x for provider in ("peft", "fastlora") for x, _ in series.get((case, provider), [])})
        ax.set_xticks(points, [str(x) for x in points])
        ax.set_xlabel("tokens (batch 1)" if axis == "tokens" else "rank")
        ax.set_ylabel("time / floor")
        ax.set_title(case)
        ax.legend()
    fig.suptitle(f"How cost grows with {axis} (bf16 base, fp32 adapters)\n{title}", fontsize=9)
    return _save(fig, out_dir / f"{suite.replace('-', '_')}.png")
