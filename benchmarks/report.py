"""What the in-process benchmarks share: progress lines on stderr, a CSV of their rows and a plot of them."""

from __future__ import annotations

import csv
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path


def say(message: str) -> None:
    """A timestamped progress line on stderr, so stdout keeps only the results table."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def write_csv(rows: list[dict], path: Path) -> None:
    """`rows` (dicts with the same keys, in column order) as a CSV with a header line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def median_s(fn: Callable[[], object], repeats: int) -> float:
    """The median seconds of `repeats` calls of fn, after one call to warm it up."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def panel_plot(
    panels: dict[str, dict[str, list[tuple[float, float]]]], xlabel: str, ylabel: str, path: Path, width: float = 5
) -> None:
    """Side-by-side panels (title -> line label -> points), x on a log-2 axis, written as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(width * len(panels), 4), squeeze=False)
    for ax, (title, lines) in zip(axes[0], panels.items(), strict=True):
        for label, points in lines.items():
            ax.plot(*zip(*points, strict=True), marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
