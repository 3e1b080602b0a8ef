"""Interactive TTFT while a batch runs through the online API, against the same interactive load alone.

One `hybridserve serve` (this checkout's code), after an unmeasured warm-up of both loads (--warmup-s), runs
three phases in a row:

1. `interactive`: a closed loop of --interactive-clients clients, each sending a streamed chat completion
   (--interactive-tokens tokens, `ignore_eos`, a unique tag in front of every prompt so no request is served
   from another's prefix cache) as soon as its previous one ended, for --idle-s seconds. TTFT is the time to
   the first chunk with content.
2. `interactive + batch`: a batch of --batch-requests chat completions (--batch-tokens tokens each,
   `ignore_eos`) is uploaded and created, and the same interactive loop runs until the batch has completed.
3. `batch alone`: the same batch again, with no interactive load: the batch's throughput when it has the
   engine to itself.

Batch throughput is its output tokens (from the output file's `usage`) over the time from `create` to
`completed` as this client saw it (polled every 0.25 s). Writes <out>/batch_interference_<stamp>.csv and .png
(the server log beside them) and prints a markdown table; progress goes to stderr.

  PYTHONPATH=. .venv/bin/python benchmarks/batch_interference.py
  PYTHONPATH=. .venv/bin/python benchmarks/batch_interference.py --batch-requests 32 --idle-s 20   # shorter
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import say, write_csv  # noqa: E402
from run_batch import TOPICS, input_lines  # noqa: E402
from serving_compare import MODEL, REPO, started  # noqa: E402


@dataclass(frozen=True)
class Row:
    phase: str
    interactive_requests: int
    interactive_errors: int
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    ttft_max_ms: float | None
    batch_requests: int
    batch_output_tokens: int
    batch_wall_s: float | None
    batch_output_tok_s: float | None


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 1)


class Interactive:
    """Closed-loop streamed chat clients; `ttfts` holds each finished request's TTFT (s)."""

    def __init__(self, client: httpx.AsyncClient, args: argparse.Namespace, tag: str) -> None:
        self.client = client
        self.args = args
        self.tag = tag
        self.ttfts: list[float] = []
        self.errors = 0
        self._sent = 0

    async def run(self, stop: asyncio.Event) -> None:
        await asyncio.gather(*(self._loop(stop) for _ in range(self.args.interactive_clients)))

    async def _loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self._one()

    async def _one(self) -> None:
        i = self._sent
        self._sent += 1
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"[{self.tag}-{i}] Tell me about {TOPICS[i % len(TOPICS)]}."}],
            "max_tokens": self.args.interactive_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        start = time.perf_counter()
        first: float | None = None
        try:
            async with self.client.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    self.errors += 1
                    return
                async for line in r.aiter_lines():
                    if first is None and line.startswith("data: {") and _has_content(json.loads(line[6:])):
                        first = time.perf_counter() - start
        except httpx.HTTPError:
            self.errors += 1
            return
        if first is None:
            self.errors += 1
        else:
            self.ttfts.append(first)


def _has_content(chunk: dict) -> bool:
    return any(choice.get("delta", {}).get("content") for choice in chunk.get("choices", []))


async def run_batch(
    client: httpx.AsyncClient, args: argparse.Namespace, tag: str, requests: int | None = None
) -> tuple[int, float]:
    """Uploads and runs one batch (of --batch-requests unless `requests`) to completion: (output tokens,
    seconds from create to completed)."""
    data = "".join(input_lines(requests or args.batch_requests, args.batch_tokens, tag)).encode()
    r = await client.post("/v1/files", files={"file": ("batch.jsonl", data)}, data={"purpose": "batch"})
    r.raise_for_status()
    body = {"input_file_id": r.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    start = time.perf_counter()
    r = await client.post("/v1/batches", json=body)
    r.raise_for_status()
    batch_id = r.json()["id"]
    last = start
    while (batch := (await client.get(f"/v1/batches/{batch_id}")).json())["status"] not in (
        "completed",
        "failed",
        "expired",
        "cancelled",
    ):
        if time.perf_counter() - last >= 15:
            counts = batch["request_counts"]
            say(f"batch {batch_id}: {batch['status']}, {counts['completed']}/{counts['total']} done")
            last = time.perf_counter()
        await asyncio.sleep(0.25)
    wall = time.perf_counter() - start
    if batch["status"] != "completed" or batch["request_counts"]["failed"]:
        raise RuntimeError(f"batch {batch_id} ended {batch['status']}: {batch['request_counts']}, {batch['errors']}")
    content = await client.get(f"/v1/files/{batch['output_file_id']}/content")
    tokens = sum(json.loads(x)["response"]["body"]["usage"]["completion_tokens"] for x in content.text.splitlines())
    return tokens, wall


async def phases(url: str, args: argparse.Namespace) -> list[Row]:
    rows = []
    timeout = httpx.Timeout(600.0)
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:
        say(f"warm-up (not measured): interactive load and a 4-request batch for at least {args.warmup_s:.0f} s")
        warm = Interactive(client, args, f"{args.stamp}-warm")
        stop = asyncio.Event()
        loop = asyncio.create_task(warm.run(stop))
        await asyncio.gather(asyncio.sleep(args.warmup_s), run_batch(client, args, f"{args.stamp}-b0", 4))
        stop.set()
        await loop

        say(f"interactive alone: {args.interactive_clients} clients for {args.idle_s:.0f} s")
        alone = Interactive(client, args, f"{args.stamp}-idle")
        stop = asyncio.Event()
        loop = asyncio.create_task(alone.run(stop))
        await asyncio.sleep(args.idle_s)
        stop.set()
        await loop
        rows.append(_row("interactive alone", alone, 0, 0, None))

        say(f"interactive + batch: {args.batch_requests} batch requests of {args.batch_tokens} tokens")
        beside = Interactive(client, args, f"{args.stamp}-beside")
        stop = asyncio.Event()
        loop = asyncio.create_task(beside.run(stop))
        tokens, wall = await run_batch(client, args, f"{args.stamp}-b1")
        stop.set()
        await loop
        rows.append(_row("interactive + batch", beside, args.batch_requests, tokens, wall))

        say("batch alone")
        tokens, wall = await run_batch(client, args, f"{args.stamp}-b2")
        rows.append(_row("batch alone", None, args.batch_requests, tokens, wall))
    for row in rows:
        say(f"{row.phase}: {row}")
    return rows


def _row(phase: str, load: Interactive | None, requests: int, tokens: int, wall: float | None) -> Row:
    ttfts = [] if load is None else load.ttfts
    return Row(
        phase=phase,
        interactive_requests=len(ttfts),
        interactive_errors=0 if load is None else load.errors,
        ttft_p50_ms=None if not ttfts else round(statistics.median(ttfts) * 1000, 1),
        ttft_p99_ms=_percentile(ttfts, 0.99),
        ttft_max_ms=None if not ttfts else round(max(ttfts) * 1000, 1),
        batch_requests=requests,
        batch_output_tokens=tokens,
        batch_wall_s=None if wall is None else round(wall, 1),
        batch_output_tok_s=None if wall is None else round(tokens / wall, 1),
    )


def write_png(rows: list[Row], path: Path, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ttft, batch) = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
    timed = [row for row in rows if row.ttft_p50_ms is not None]
    names = [row.phase for row in timed]
    x = range(len(timed))
    ttft.bar([i - 0.2 for i in x], [row.ttft_p50_ms for row in timed], width=0.4, label="p50")
    ttft.bar([i + 0.2 for i in x], [row.ttft_p99_ms for row in timed], width=0.4, label="p99")
    ttft.set_xticks(list(x), names)
    ttft.set_title("Interactive TTFT (ms)")
    ttft.legend()
    ttft.grid(True, axis="y", alpha=0.3)
    ran = [row for row in rows if row.batch_output_tok_s is not None]
    batch.bar([row.phase for row in ran], [row.batch_output_tok_s for row in ran], color="C2")
    batch.set_title("Batch output tokens/s")
    batch.grid(True, axis="y", alpha=0.3)
    fig.suptitle(
        f"{MODEL} on CPU ({os.cpu_count()} cores): {args.interactive_clients} interactive clients "
        f"({args.interactive_tokens} tokens), batch of {args.batch_requests} x {args.batch_tokens} tokens"
    )
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown_table(rows: list[Row]) -> str:
    head = ["phase", "interactive requests", "TTFT p50 ms", "TTFT p99 ms", "TTFT max ms", "batch tok/s", "batch s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row.phase, row.interactive_requests, row.ttft_p50_ms, row.ttft_p99_ms, row.ttft_max_ms]
        cells += [row.batch_output_tok_s, row.batch_wall_s]
        lines.append("| " + " | ".join("-" if c is None else str(c) for c in cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--interactive-clients", type=int, default=2, help="closed-loop interactive clients")
    p.add_argument("--interactive-tokens", type=int, default=16, help="output tokens per interactive request")
    p.add_argument("--warmup-s", type=float, default=10.0, help="unmeasured seconds of both loads first")
    p.add_argument("--idle-s", type=float, default=30.0, help="seconds of interactive load with no batch")
    p.add_argument("--batch-requests", type=int, default=48, help="requests in the batch")
    p.add_argument("--batch-tokens", type=int, default=32, help="output tokens per batch request")
    p.add_argument("--port", type=int, default=8331)
    p.add_argument("--server-args", default="", help="more `hybridserve serve` flags, one string")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results", help="results folder")
    args = p.parse_args(argv)
    for name in ("interactive_clients", "interactive_tokens", "batch_requests", "batch_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.idle_s <= 0 or args.warmup_s < 0:
        p.error(f"--idle-s must be positive and --warmup-s not negative, got {args.idle_s} and {args.warmup_s}")
    args.stamp = time.strftime("%Y%m%d-%H%M%S")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / f"batch_interference_{args.stamp}.log"
    data_dir = args.out / "tmp" / f"batch_interference_{args.stamp}"
    command = [sys.executable, "-m", "hybridserve.serving.cli", "serve", "--port", str(args.port)]
    command += ["--data-dir", str(data_dir), *shlex.split(args.server_args)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # this checkout's code, whatever the interpreter has installed
    with started("hybridserve", command, env, args, log):
        rows = asyncio.run(phases(f"http://127.0.0.1:{args.port}", args))
    csv_path, png_path = (
        args.out / f"batch_interference_{args.stamp}.csv",
        args.out / f"batch_interference_{args.stamp}.png",
    )
    write_csv([asdict(row) for row in rows], csv_path)
    write_png(rows, png_path, args)
    say(f"wrote {csv_path} and {png_path}")
    print(markdown_table(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
