"""What the in-process benchmarks share: progress lines on stderr and a CSV of their rows."""

from __future__ import annotations

import csv
import sys
import time
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
