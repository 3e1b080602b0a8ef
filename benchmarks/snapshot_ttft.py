"""Time to first token of a conversation's next turn on a hybrid model, with and without state snapshots.

    python -m benchmarks.snapshot_ttft [--out benchmarks/results] [--lengths 128,512]

For each turn-1 prompt length: turn 1 (random prompt, 16 greedy tokens) runs on an engine with prefix
caching, then turn 2 = turn 1's prompt + output + 32 new tokens is timed with max_tokens=1. With snapshots
(the default budget) turn 2 resumes from the state snapshot turn 1 left at its last block boundary; with
--num-state-snapshots 0 a hybrid model gets no prefix hits and recomputes everything. Turn 1's whole time is
recorded too: with snapshots its prefill is split at the last block boundary (one extra step). The two
engines run interleaved, and times are minimums over the repeats (the median TTFT is kept too): on a
shared machine the minimum is the steadiest estimate. Model:
benchmarks/random_checkpoints.py's dense Kimi-Linear config, random weights, float32 on CPU. Writes
<out>/snapshot_ttft.csv and .png; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.random_checkpoints import make_kimi, num_parameters
from benchmarks.report import say, write_csv
from hybridserve.engine.llm import LLM
from hybridserve.sampling_params import SamplingParams

TURN1 = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
FIRST = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
NEW_TOKENS = 32
REPEATS = 3


def timed(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[float, list[int], int]:
    start = time.perf_counter()
    out = llm.generate([prompt], params)[0]
    return time.perf_counter() - start, out.outputs[0].token_ids, out.num_cached_tokens


def measure(hf_dir: Path, length: int, gen: torch.Generator) -> list[dict[str, float | bool]]:
    """Both engines, repeats interleaved so that load from elsewhere hits both alike; minimum over repeats."""
    engines = {
        on: LLM(str(hf_dir), dtype="float32", device="cpu", num_state_snapshots=None if on else 0)
        for on in (True, False)
    }
    samples: dict[bool, list[tuple[float, float, int]]] = {True: [], False: []}
    for repeat in range(REPEATS + 1):  # the first is a warm-up (oneDNN builds kernels per shape)
        prompt = torch.randint(0, 256, (length,), generator=gen).tolist()
        suffix = torch.randint(0, 256, (NEW_TOKENS,), generator=gen).tolist()
        for on, llm in engines.items():
            t1, out, _ = timed(llm, prompt, TURN1)
            t2, _, hit = timed(llm, prompt + out + suffix, FIRST)
            if repeat:
                samples[on].append((t1, t2, hit))
    rows = []
    for on, llm in engines.items():
        llm.core.check_integrity()
        t1s, t2s, hits = zip(*samples[on], strict=True)
        rows.append(
            {
                "prompt_tokens": length,
                "snapshots": on,
                "turn1_s": min(t1s),
                "turn2_ttft_ms": 1000 * min(t2s),
                "turn2_ttft_median_ms": 1000 * statistics.median(t2s),
                "turn2_cached_tokens": min(hits),
                "snapshot_hits": llm.core.scheduler.stats().state_snapshot_hits,  # warm-up included
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--lengths", default="128,512", help="turn-1 prompt lengths, comma-separated")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    hf_dir = make_kimi(Path(tempfile.gettempdir()) / "hybridserve-bench")
    say(f"model {hf_dir} ({num_parameters(hf_dir) / 1e6:.1f}M parameters, random weights)")
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        say(f"turn-1 prompt {length} tokens")
        for row in measure(hf_dir, length, torch.Generator().manual_seed(length)):
            rows.append(row)
            say(f"  {row}")
    path = args.out / "snapshot_ttft.csv"
    write_csv(rows, path)
    plot(rows, args.out / "snapshot_ttft.png")
    print("| turn-1 prompt | snapshots | turn-2 TTFT ms | turn-2 cached tokens | turn 1 s |")
    print("|---|---|---|---|---|")
    for r in rows:
        on = "on" if r["snapshots"] else "off"
        ttft, cached = r["turn2_ttft_ms"], r["turn2_cached_tokens"]
        print(f"| {r['prompt_tokens']} | {on} | {ttft:.0f} | {cached:.0f} | {r['turn1_s']:.2f} |")
    say(f"wrote {path}")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["prompt_tokens"] for r in rows})
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.4
    for i, snapshots in enumerate((True, False)):
        ttft = [
            next(r["turn2_ttft_ms"] for r in rows if r["prompt_tokens"] == n and r["snapshots"] == snapshots)
            for n in lengths
        ]
        ax.bar(
            [j + (i - 0.5) * width for j in range(len(lengths))],
            ttft,
            width,
            label=f"snapshots {'on' if snapshots else 'off'}",
        )
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_xlabel("turn-1 prompt tokens (turn 2 adds 16 output + 32 new)")
    ax.set_ylabel("turn-2 TTFT (ms, min of repeats)")
    ax.set_title("Kimi-Linear (random, dense, CPU): next-turn TTFT")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
