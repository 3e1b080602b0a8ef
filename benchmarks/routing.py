"""Routing policies side by side: a multi-turn, multi-tenant chat workload against two engine workers.

Each tenant has its own long system prompt; each conversation grows turn by turn (the next prompt is the last
one plus the answer and a new question), so the prefix cache pays exactly when a conversation comes back to the
worker that holds its history. For each configuration (two workers under kv_aware, least_load and round_robin,
and one worker as the upper bound on hit rate) the script starts `hybridserve serve --num-workers N --routing P`,
runs the same workload, and reads per-worker counters from /metrics before and after. Reports the prefix-cache
hit rate (prompt tokens served from cache over prompt tokens), TTFT p50/p99, output tokens/s and load balance
(the larger worker's share of computed prompt tokens and of requests over the smaller one's). Writes
<out>/routing_<stamp>.csv and .png, prints a markdown table.

  .venv/bin/python -m benchmarks.routing                        # every configuration, default workload
  .venv/bin/python -m benchmarks.routing --tenants 3 --conversations 4 --turns 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from benchmarks.report import say, write_csv
from benchmarks.serving_compare import REPO, hybridserve_with

CONFIGS = {  # name: (local workers, routing)
    "kv_aware": (2, "kv_aware"),
    "least_load": (2, "least_load"),
    "round_robin": (2, "round_robin"),
    "one_worker": (1, "round_robin"),
}
WORDS = [
    "river",
    "stone",
    "lantern",
    "harbor",
    "meadow",
    "copper",
    "violet",
    "orchard",
    "signal",
    "canyon",
    "ember",
    "glacier",
    "willow",
    "compass",
    "thunder",
    "velvet",
    "marble",
    "falcon",
    "prairie",
    "cobalt",
]


@dataclass
class Row:
    config: str
    workers: int
    routing: str
    requests: int
    hit_rate: float
    ttft_p50_s: float
    ttft_p99_s: float
    output_tokens_per_s: float
    prefill_imbalance: float  # larger worker's computed prompt tokens / smaller's (1.0 = even)
    request_imbalance: float
    wall_s: float


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _conversations(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(system prompt, questions) per conversation; the same for every configuration."""
    rng = random.Random(args.seed)
    systems = [f"You are assistant {t}. Rules: " + _text(rng, args.system_words) for t in range(args.tenants)]
    return [
        (systems[c % args.tenants], [f"Question {k}: " + _text(rng, 12) for k in range(args.turns)])
        for c in range(args.tenants * args.conversations)
    ]


async def _turn(client: httpx.AsyncClient, url: str, messages: list[dict], max_tokens: int) -> tuple[float, str, int]:
    body = {
        "model": "smollm2",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.monotonic()
    ttft: float | None = None
    text, tokens = [], 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk["choices"]:
                piece = choice["delta"].get("content")
                if piece:
                    ttft = time.monotonic() - start if ttft is None else ttft
                    text.append(piece)
    return (ttft if ttft is not None else time.monotonic() - start), "".join(text), tokens


async def _workload(url: str, args: argparse.Namespace) -> tuple[list[float], int, float]:
    conversations = _conversations(args)
    gate = asyncio.Semaphore(args.concurrency)
    ttfts: list[float] = []
    tokens = 0

    async def converse(system: str, questions: list[str]) -> None:
        nonlocal tokens
        messages = [{"role": "system", "content": system}]
        for question in questions:
            messages.append({"role": "user", "content": question})
            async with gate:
                ttft, answer, n = await _turn(client, url, messages, args.max_tokens)
            ttfts.append(ttft)
            tokens += n
            messages.append({"role": "assistant", "content": answer})

    async with httpx.AsyncClient(timeout=600) as client:
        start = time.monotonic()
        await asyncio.gather(*(converse(s, q) for s, q in conversations))
        return ttfts, tokens, time.monotonic() - start


_SAMPLE = re.compile(r"^hybridserve:(\w+)\{([^}]*)\} (\S+)$")


def _per_worker(url: str) -> dict[str, dict[str, float]]:
    """{worker: {metric: value}} for the prefix-cache counters and routing decisions."""
    out: dict[str, dict[str, float]] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, labels, value = match.groups()
        fields = dict(kv.split("=", 1) for kv in labels.split(","))
        worker = fields.get("worker", "").strip('"')
        if name in ("prefix_cache_queries_total", "prefix_cache_hits_total"):
            out.setdefault(worker, {})[name] = float(value)
        elif name == "router_decisions_total":
            metrics = out.setdefault(worker, {})
            metrics["requests"] = metrics.get("requests", 0.0) + float(value)
    return out


def _imbalance(values: list[float]) -> float:
    return max(values) / min(values) if len(values) > 1 and min(values) > 0 else 1.0


def bench(config: str, args: argparse.Namespace, log: Path) -> Row:
    workers, routing = CONFIGS[config]
    with hybridserve_with(config, ["--num-workers", str(workers), "--routing", routing], args, log) as url:
        before = _per_worker(url)
        ttfts, tokens, wall = asyncio.run(_workload(url, args))
        after = _per_worker(url)
    delta = {w: {k: v - before.get(w, {}).get(k, 0.0) for k, v in m.items()} for w, m in after.items() if w}
    queries = sum(m.get("prefix_cache_queries_total", 0.0) for m in delta.values())
    hits = sum(m.get("prefix_cache_hits_total", 0.0) for m in delta.values())
    computed = [
        m.get("prefix_cache_queries_total", 0.0) - m.get("prefix_cache_hits_total", 0.0) for m in delta.values()
    ]
    ttfts.sort()
    row = Row(
        config,
        workers,
        routing,
        len(ttfts),
        hits / queries if queries else 0.0,
        statistics.median(ttfts),
        ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        tokens / wall,
        _imbalance(computed),
        _imbalance([m.get("requests", 0.0) for m in delta.values()]),
        wall,
    )
    say(f"{config}: {row}")
    return row


def write_png(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("hit_rate", "prefix-cache hit rate"),
        ("ttft_p50_s", "TTFT p50 (s)"),
        ("output_tokens_per_s", "output tokens/s"),
        ("prefill_imbalance", "prefill load max/min"),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.5))
    for ax, (field, title) in zip(axes, panels, strict=True):
        ax.bar([r.config for r in rows], [getattr(r, field) for r in rows], color="#4472c4")
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown_table(rows: list[Row]) -> str:
    lines = [
        "| config | workers | hit rate | TTFT p50 s | TTFT p99 s | out tok/s | prefill max/min | requests max/min |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.config} | {r.workers} | {r.hit_rate:.3f} | {r.ttft_p50_s:.2f} | {r.ttft_p99_s:.2f} | "
            f"{r.output_tokens_per_s:.1f} | {r.prefill_imbalance:.2f} | {r.request_imbalance:.2f} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {list(CONFIGS)}")
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--conversations", type=int, default=4, help="conversations per tenant")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-words", type=int, default=300, help="words in each tenant's system prompt")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=8, help="turns in flight at once")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=8321)
    parser.add_argument("--server-args", default="--dtype auto", help="more `hybridserve serve` flags")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)
    unknown = set(args.configs.split(",")) - set(CONFIGS)
    if unknown:
        parser.error(f"--configs: unknown {sorted(unknown)}; choose from {list(CONFIGS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [bench(c, args, args.out / f"routing_{stamp}_{c}.log") for c in args.configs.split(",")]
    write_csv([asdict(r) for r in rows], args.out / f"routing_{stamp}.csv")
    write_png(rows, args.out / f"routing_{stamp}.png")
    print(markdown_table(rows))
    say(f"wrote {args.out / f'routing_{stamp}.csv'} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
