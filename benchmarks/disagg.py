"""Disaggregated prefill/decode against aggregated serving on this host, and what one transfer moves and costs.

1. Mixed load (`hybridserve serve`, the default model): a few decode-heavy streams run throughout while long
   prompts arrive every few seconds. Configurations: two aggregated workers (kv_aware), and one prefill + one
   decode worker. Reports decode inter-token latency p50/p99 of the streams, TTFT of the long and the short
   requests, and, from /metrics, per read: KV bytes and time, state bytes and time.
2. Payload per request by model (from each model's cache layout): KV bytes for a prompt of N tokens against the
   fixed recurrent-state bytes: for hybrid models the state is most of what moves at short prompts.
3. Descriptors: the same bytes read over NIXL between two processes as blocks in runs of 1 to 64 consecutive
   blocks (what a read straight between fragmented or fresh pools is) and staged (packed into one region with
   the connector's own `pack`, read as one descriptor, scattered back with `unpack`), each phase timed.

Writes <out>/disagg_<stamp>.csv and .png and prints markdown tables.

  .venv/bin/python -m benchmarks.disagg                  # all three parts
  .venv/bin/python -m benchmarks.disagg --duration 30 --parts load
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import mmap
import multiprocessing as mp
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from benchmarks.report import say, write_csv
from benchmarks.serving_compare import MODEL, REPO, ServerFailed, hybridserve_with

CONFIGS = {
    "aggregated (2 workers)": ["--num-workers", "2", "--routing", "kv_aware"],
    "disaggregated (1 prefill + 1 decode)": ["--num-prefill-workers", "1", "--num-decode-workers", "1"],
}
LONG = "The history of the city spans two thousand years of kings, revolutions, artists and engineers. "


@dataclass
class LoadRow:
    config: str
    itl_p50_ms: float
    itl_p99_ms: float
    long_ttft_p50_s: float
    long_ttft_p99_s: float
    short_ttft_p50_s: float
    long_requests: int
    stream_tokens_per_s: float
    reads: int
    kv_bytes_per_read: float
    kv_ms_per_read: float
    state_bytes_per_read: float
    state_ms_per_read: float


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else math.nan


async def _stream(client: httpx.AsyncClient, url: str, content: str, max_tokens: int) -> tuple[float, list[float]]:
    """(TTFT, inter-token gaps) of one streamed chat completion."""
    body = {
        "model": MODEL,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "messages": [{"role": "user", "content": content}],
    }
    start = time.monotonic()
    stamps: list[float] = []
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            if choices[0].get("delta", {}).get("content"):  # a token's text, not the opening role chunk
                stamps.append(time.monotonic())
    if not stamps:
        raise ServerFailed(f"a stream produced no tokens ({content[:40]!r})")
    return stamps[0] - start, [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


async def _workload(url: str, args: argparse.Namespace) -> tuple[list[float], list[float], list[float], int, float]:
    gaps: list[float] = []
    short_ttft: list[float] = []
    long_ttft: list[float] = []
    tokens = 0
    end = time.monotonic() + args.duration

    async with httpx.AsyncClient(timeout=600) as client:

        async def decode_stream(i: int) -> None:
            nonlocal tokens
            n = 0
            while time.monotonic() < end:
                ttft, g = await _stream(
                    client, url, f"[s{i}-{n}] Tell me a story about a lighthouse.", args.stream_tokens
                )
                short_ttft.append(ttft)
                gaps.extend(g)
                tokens += len(g) + 1
                n += 1

        async def long_prompts() -> None:
            n = 0
            while time.monotonic() < end:
                await asyncio.sleep(args.long_every)
                text = f"[long-{n}] " + LONG * args.long_repeat + "Summarise this in one line."
                long_ttft.append((await _stream(client, url, text, 8))[0])
                n += 1

        start = time.monotonic()
        await asyncio.gather(*(decode_stream(i) for i in range(args.streams)), long_prompts())
        wall = time.monotonic() - start
    return gaps, short_ttft, long_ttft, tokens, wall


def _transfer_counters(url: str) -> dict[str, float]:
    totals: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("hybridserve:kv_transfer_") and "_total{" in line:
            name = line.split("{", 1)[0].removeprefix("hybridserve:kv_transfer_").removesuffix("_total")
            totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def bench_load(config: str, args: argparse.Namespace, log: Path) -> LoadRow:
    with hybridserve_with(config, CONFIGS[config], args, log) as url:
        before = _transfer_counters(url)
        say(f"{config}: mixed load for {args.duration:.0f} s")
        gaps, short_ttft, long_ttft, tokens, wall = asyncio.run(_workload(url, args))
        after = _transfer_counters(url)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    reads = int(delta.get("pulls", 0))

    def per_read(name: str, scale: float = 1.0) -> float:
        return delta.get(name, 0.0) * scale / reads if reads else math.nan

    row = LoadRow(
        config,
        _pct(gaps, 0.5) * 1000,
        _pct(gaps, 0.99) * 1000,
        _pct(long_ttft, 0.5),
        _pct(long_ttft, 0.99),
        _pct(short_ttft, 0.5),
        len(long_ttft),
        tokens / wall,
        reads,
        per_read("kv_bytes"),
        per_read("kv_seconds", 1000),
        per_read("state_bytes"),
        per_read("state_seconds", 1000),
    )
    say(f"{config}: {row}")
    return row


@dataclass
class PayloadRow:
    model: str
    prompt_tokens: int
    kv_bytes: int
    state_bytes: int
    state_share: float


def bench_payload(prompts: list[int]) -> list[PayloadRow]:
    import torch

    from hybridserve.models.cache_specs import CacheLayout
    from hybridserve.models.loader import resolve_model
    from hybridserve.models.registry import load_config, model_class
    from scripts.make_tiny_checkpoints import make

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {"smollm2 (default)": resolve_model(None).hf_dir}
        for name in ("kimi-linear-tiny", "kimi-k3-tiny"):
            make(Path(tmp), name)
            dirs[name] = Path(tmp) / name
        for name, path in dirs.items():
            config = load_config(path)
            with torch.device("meta"):
                model = model_class(config)(config)
            layout = CacheLayout(model.cache_spec(16, torch.float32))
            for n in prompts:
                kv = -(-n // 16) * layout.bytes_per_block
                state = layout.bytes_per_state_slot
                rows.append(PayloadRow(name, n, kv, state, state / (kv + state)))
    # Kimi-Linear-48B-A3B at full scale, by arithmetic on its config (REFERENCE §6), bf16: 7 MLA layers of a
    # 576-wide latent per token; 20 KDA layers of a [32, 128, 128] fp32 state and q/k/v conv tails of 3 inputs.
    kv_per_token = 7 * 576 * 2
    state = 20 * (32 * 128 * 128 * 4 + 3 * 32 * 128 * 3 * 2)
    for n in prompts:
        kv = -(-n // 16) * 16 * kv_per_token
        rows.append(PayloadRow("Kimi-Linear-48B-A3B (arithmetic)", n, kv, state, state / (kv + state)))
    return rows


@dataclass
class DescriptorRow:
    layout: str
    descriptors: int
    total_bytes: int
    read_ms_median: float
    pack_ms_median: float  # staged: gathering the blocks into the prefill side's arena
    unpack_ms_median: float  # staged: scattering the arena into the decode side's blocks

    @property
    def total_ms(self) -> float:
        return self.read_ms_median + self.pack_ms_median + self.unpack_ms_median


def _holder(conn: mp.connection.Connection, nbytes: int) -> None:
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent("bench-holder", nixl_agent_config(backends=["UCX"]))
    tensor = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)
    tensor.fill_(7)
    agent.register_memory(tensor)
    conn.send((agent.get_agent_metadata(), tensor.data_ptr()))
    conn.recv()  # until the reader is done


def _cache_moves(layers: int, shape: tuple[int, ...], blocks: int, repeats: int) -> tuple[float, float]:
    """Median ms of the staging arena's two extra copies (the connector's own `pack` and `unpack`): gathering
    `blocks` scattered blocks of every layer's [2, kv_heads, pool, block, head_dim] cache into one span, and
    scattering them back."""
    import torch

    from hybridserve.engine.kv_transfer.layout import pack, unpack

    # One thread: two threads on two cores shared with the UCX progress thread and other processes spin at
    # every barrier (15x slower here), and an engine would not give a copy more than its step's threads.
    torch.set_num_threads(1)
    caches = [(torch.randn(shape), 2) for _ in range(layers)]
    ids = torch.randperm(shape[2])[:blocks].tolist()
    span = torch.empty(layers * caches[0][0][:, :, :blocks].numel() * 4, dtype=torch.uint8)
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for move, spent in ((pack, times[0]), (unpack, times[1])):
            start = time.perf_counter()
            move(caches, ids, span)
            spent.append(time.perf_counter() - start)
    return statistics.median(times[0]) * 1000, statistics.median(times[1]) * 1000


def bench_descriptors(runs: list[int], repeats: int) -> list[DescriptorRow]:
    """The KV of a 1,024-token prompt of the default model in float32 (64 blocks x 30 layers x 6 planes of
    4 KiB), read over NIXL from another process: straight from the blocks when they lie in runs of each of
    `runs` consecutive blocks on both sides, and staged (gathered into one arena region, read as one
    descriptor, scattered into the reader's blocks), each `repeats` times."""
    import numpy as np
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    layers, planes, row, blocks = 30, 6, 4096, 64
    regions = layers * planes * blocks
    total = regions * row
    span = total * 2  # room to scatter: every other run of a buffer twice the size
    parent, child = mp.get_context("spawn").Pipe()
    holder = mp.get_context("spawn").Process(target=_holder, args=(child, span), daemon=True)
    holder.start()
    try:
        metadata, base = parent.recv()
        agent = nixl_agent("bench-reader", nixl_agent_config(backends=["UCX"]))
        local = torch.frombuffer(mmap.mmap(-1, span), dtype=torch.uint8)
        agent.register_memory(local)
        peer = agent.add_remote_agent(metadata)
        peer = peer.decode() if isinstance(peer, bytes) else peer
        rng = np.random.default_rng(0)

        def scattered(start: int, run: int) -> np.ndarray:
            count, run_bytes = regions // run, row * run
            slots = rng.permutation(span // run_bytes)[:count] * run_bytes
            return np.stack([start + slots, np.full(count, run_bytes), np.zeros(count)], 1)

        layouts = {f"runs of {run} blocks": (scattered(local.data_ptr(), run), scattered(base, run)) for run in runs}
        layouts["staged on both sides: one region"] = (
            np.array([[local.data_ptr(), total, 0]]),
            np.array([[base, total, 0]]),
        )
        # Staged on the prefill side only, read into a reader's fresh pool (runs of 64): the region is cut where
        # the reader's runs end.
        ours = scattered(local.data_ptr(), 64)
        layouts["staged on the prefill side only"] = (ours, ours.copy())
        layouts["staged on the prefill side only"][1][:, 0] = base + np.arange(len(ours)) * ours[0, 1]
        times: dict[str, list[float]] = {name: [] for name in layouts}
        for _ in range(repeats):  # interleaved, so that the machine's drift falls on every layout alike
            for name, (ours, theirs) in layouts.items():
                start = time.perf_counter()
                handle = agent.initialize_xfer(
                    "READ",
                    agent.get_xfer_descs(ours.astype(np.uint64), "DRAM"),
                    agent.get_xfer_descs(theirs.astype(np.uint64), "DRAM"),
                    peer,
                )
                state = agent.transfer(handle)
                while state == "PROC":
                    state = agent.check_xfer_state(handle)
                if state != "DONE":
                    raise ServerFailed(f"NIXL read ({name}) ended {state}")
                times[name].append(time.perf_counter() - start)
                agent.release_xfer_handle(handle)
        pack, unpack = _cache_moves(layers, (2, 3, 2048, 16, 64), blocks, repeats)
        rows = []
        for name, (ours, _) in layouts.items():
            staged = name.startswith("staged")
            moves = (pack, 0.0 if "only" in name else unpack) if staged else (0.0, 0.0)
            rows.append(DescriptorRow(name, len(ours), total, statistics.median(times[name]) * 1000, *moves))
            say(f"descriptors: {rows[-1]} (total {rows[-1].total_ms:.1f} ms)")
        return rows
    finally:
        parent.send(b"done")
        holder.join(10)


def markdown(rows: list) -> str:
    if not rows:
        return ""
    fields = list(asdict(rows[0]))
    lines = ["| " + " | ".join(fields) + " |", "|" + "---|" * len(fields)]
    for row in rows:
        cells = [f"{v:.3g}" if isinstance(v, float) else str(v) for v in asdict(row).values()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_png(rows: list[LoadRow], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    names = [r.config.split(" (")[0] for r in rows]
    axes[0].bar(
        [f"{n}\np50" for n in names] + [f"{n}\np99" for n in names],
        [r.itl_p50_ms for r in rows] + [r.itl_p99_ms for r in rows],
    )
    axes[0].set_ylabel("decode inter-token latency (ms)")
    axes[1].bar(
        [f"{n}\nlong" for n in names] + [f"{n}\nshort" for n in names],
        [r.long_ttft_p50_s for r in rows] + [r.short_ttft_p50_s for r in rows],
    )
    axes[1].set_ylabel("TTFT p50 (s)")
    fig.suptitle("mixed load: decode streams while long prompts arrive")
    fig.tight_layout()
    fig.savefig(path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="load,payload,descriptors")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of mixed load per configuration")
    p.add_argument("--streams", type=int, default=3, help="decode-heavy streams running throughout")
    p.add_argument("--stream-tokens", type=int, default=64)
    p.add_argument("--long-every", type=float, default=4.0, help="seconds between long prompts")
    p.add_argument("--long-repeat", type=int, default=60, help="the long prompt's sentence, this many times")
    p.add_argument("--port", type=int, default=8391)
    # A long prefill step on one of two contended cores can outlast the default 10 s heartbeat deadline.
    p.add_argument("--server-args", default="--dtype float32 --kv-cache-memory-bytes 1GiB --worker-timeout 60")
    p.add_argument("--startup-timeout", type=float, default=600)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    parts = set(args.parts.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    tables = []
    if "payload" in parts:
        payload = bench_payload([128, 1024, 8192])
        write_csv([asdict(r) for r in payload], args.out / f"disagg_payload_{stamp}.csv")
        tables.append(markdown(payload))
    if "descriptors" in parts:
        descriptors = bench_descriptors([1, 2, 4, 8, 16, 64], 15)
        write_csv([asdict(r) for r in descriptors], args.out / f"disagg_descriptors_{stamp}.csv")
        tables.append(markdown(descriptors))
    if "load" in parts:
        rows = [bench_load(c, args, args.out / f"disagg_{i}_{stamp}.log") for i, c in enumerate(CONFIGS)]
        write_csv([asdict(r) for r in rows], args.out / f"disagg_{stamp}.csv")
        write_png(rows, args.out / f"disagg_{stamp}.png")
        tables.append(markdown(rows))
    print("\n\n".join(tables))
    print(json.dumps({"stamp": stamp}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
