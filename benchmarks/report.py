"""What the in-process benchmarks share: progress lines on stderr and a CSV of their rows."""

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
