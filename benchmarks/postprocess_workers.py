"""Responses API streaming with and without post-processing workers, one server at a time, same load.

For each setting of --num-postprocess-workers: start `hybridserve serve`, then stream `--requests` Responses
(temperature 0, so both settings generate the same tokens) at `--conc` concurrency and measure output
tokens/s (from each response's usage), TTFT (first output_text delta) and the CPU seconds the frontend
process itself spent (the event loop's share of the work). Writes <out>/postprocess_<stamp>.csv and .png and
prints a markdown table; progress goes to stderr.

  .venv/bin/python benchmarks/postprocess_workers.py                 # workers 0 and 2, conc 32
  .venv/bin/python benchmarks/postprocess_workers.py --workers 0,1,2 --conc 8 --requests 32
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import statistics
import sys
import time
from dataclasses import astuple, dataclass, fields
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_compare import MODEL, REPO, running_server, say  # noqa: E402


@dataclass(frozen=True)
class Row:
    workers: int
    conc: int
    requests: int
    errors: int
    output_tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    frontend_cpu_s: float
    wall_s: float


async def one(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> tuple[float, int]:
    """(TTFT seconds, output tokens) of one streamed Response; raises on any error event."""
    body = {"model": MODEL, "input": prompt, "stream": True, "temperature": 0, "max_output_tokens": max_tokens}
    start = time.monotonic()
    ttft = None
    async with client.stream("POST", url + "/v1/responses", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event["type"] == "response.output_text.delta" and ttft is None:
                ttft = time.monotonic() - start
            elif event["type"] in ("response.completed", "response.incomplete"):
                return ttft or 0.0, event["response"]["usage"]["output_tokens"]
            elif event["type"] in ("error", "response.failed"):
                raise RuntimeError(f"server error event: {event}")
    raise RuntimeError("stream ended without a terminal event")


async def load(url: str, conc: int, requests: int, max_tokens: int, tag: str) -> tuple[list[float], int, int, float]:
    prompts = [f"[{tag}-{i}] Write a long story about a lighthouse keeper and a storm." for i in range(requests)]
    queue: asyncio.Queue[str] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    ttfts: list[float] = []
    tokens = errors = 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal tokens, errors
        while not queue.empty():
            prompt = queue.get_nowait()
            try:
                ttft, n = await one(client, url, prompt, max_tokens)
            except Exception as exc:
                errors += 1
                say(f"request failed: {exc!r}")
                continue
            ttfts.append(ttft)
            tokens += n

    start = time.monotonic()
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=conc)) as client:
        await asyncio.gather(*(worker(client) for _ in range(conc)))
    return ttfts, tokens, errors, time.monotonic() - start


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def bench(workers: int, args: argparse.Namespace) -> Row:
    run_args = argparse.Namespace(
        port=args.port,
        hybridserve_args=f"{args.hybridserve_args} --num-postprocess-workers {workers}",
        startup_timeout=args.startup_timeout,
    )
    log = args.out / f"postprocess_w{workers}.log"
    with running_server("hybridserve", run_args, log) as proc:
        frontend = psutil.Process(proc.pid)
        url = f"http://127.0.0.1:{args.port}"
        asyncio.run(load(url, args.conc, args.conc, args.max_tokens, f"warm{workers}"))  # one warm wave
        cpu0 = sum(frontend.cpu_times()[:2])
        say(f"workers={workers}: {args.requests} streamed Responses at concurrency {args.conc}")
        ttfts, tokens, errors, wall = asyncio.run(load(url, args.conc, args.requests, args.max_tokens, f"w{workers}"))
        cpu = sum(frontend.cpu_times()[:2]) - cpu0
    row = Row(
        workers,
        args.conc,
        args.requests,
        errors,
        round(tokens / wall, 1),
        round(percentile(ttfts, 50) * 1000, 1),
        round(percentile(ttfts, 99) * 1000, 1),
        round(cpu, 2),
        round(wall, 1),
    )
    say(f"workers={workers}: {row}")
    return row


def write_outputs(rows: list[Row], out: Path) -> None:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    csv_path = out / f"postprocess_{stamp}.csv"
    with csv_path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([field.name for field in fields(Row)])
        writer.writerows(astuple(row) for row in rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [str(row.workers) for row in rows]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for ax, attr, title in zip(
        axes,
        ("output_tok_s", "ttft_p50_ms", "frontend_cpu_s"),
        ("output tokens/s", "TTFT p50 (ms)", "frontend CPU (s)"),
        strict=True,
    ):
        ax.bar(labels, [getattr(row, attr) for row in rows], color="tab:blue")
        ax.set_title(title)
        ax.set_xlabel("--num-postprocess-workers")
    fig.suptitle(f"Responses API, streamed, concurrency {rows[0].conc}, {rows[0].requests} requests")
    fig.tight_layout()
    fig.savefig(out / f"postprocess_{stamp}.png", dpi=120)
    say(f"wrote {csv_path} and its .png")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="0,2", help="comma-separated --num-postprocess-workers settings")
    parser.add_argument("--conc", type=int, default=32)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--hybridserve-args", default="--dtype bfloat16", help="extra flags for hybridserve serve")
    parser.add_argument("--startup-timeout", type=float, default=300)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [bench(int(w), args) for w in args.workers.split(",")]
    write_outputs(rows, args.out)
    print("| workers | tok/s | TTFT p50 ms | TTFT p99 ms | frontend CPU s | errors |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r.workers} | {r.output_tok_s} | {r.ttft_p50_ms} | {r.ttft_p99_ms} | {r.frontend_cpu_s} | {r.errors} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
