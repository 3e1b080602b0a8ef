"""Decode attention: the native kernel over a whole step's layers, against the machine's read bandwidth.

    python -m benchmarks.decode_attention [--batches 1,8,32,64] [--contexts 116,200,600] [--repeats 20]
        [--dtype auto|bfloat16|float32]

For each batch B and context L, the default model's decode attention (30 layers of 9 query heads over 3 KV
heads, head_dim 64, 16-token blocks, in the engine's dtype: bf16 where the CPU has native bf16 matmuls, else
float32) as a step has it: one cache per layer, each request's blocks
scattered over it (a random permutation), the query rows strided as the QKV projection leaves them. Timed:
- `step_ms`: the 30 layers' `decode` calls, the median of `--repeats`;
- `runs_ms`, `reversed_ms`: the same with each request's blocks in runs of RUN adjacent blocks (the runs
  scattered), ascending as the block pool hands out a run an earlier request freed, and descending as the free
  queue holds it (freed tail first): adjacent blocks read in ascending order are what the memory system streams
  best;
- `hot_ms`: the same calls with every request's table cycling through the same HOT_BLOCKS blocks, so the same
  arithmetic runs on keys and values already in L1/L2: what the kernel costs with no memory traffic;
- `floor_ms`: the keys and values a step reads (B x L x 3 heads x 2 x 64 x 2 or 4 bytes x 30) over the streaming
  read bandwidth measured in the same run (`roofline.measure`), and `distance` = step_ms / floor_ms.
Writes <out>/decode_attention.csv and .png (decode_attention_float32.* in float32) and prints a markdown table;
progress goes to stderr.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks.report import median_s, panel_plot, say, write_csv
from hybridserve.engine import roofline
from hybridserve.engine.model_runner import choose_dtype
from hybridserve.models.layers.native import load_paged_attention

LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16
HOT_BLOCKS = 4  # the blocks every hot table cycles through
RUN = 8  # adjacent blocks per run in the runs_ms and reversed_ms tables


def row(
    batch: int, context: int, repeats: int, read_gb_s: float, gen: torch.Generator, dtype: torch.dtype
) -> dict[str, object]:
    kernel = load_paged_attention(dtype, HEAD_DIM, BLOCK, Q_HEADS // KV_HEADS)
    per_request = -(-context // BLOCK)
    runs = -(-per_request // RUN)
    num_blocks = batch * runs * RUN
    caches = [torch.randn(2, KV_HEADS, num_blocks, BLOCK, HEAD_DIM, generator=gen).to(dtype) for _ in range(LAYERS)]
    tables = torch.randperm(num_blocks, generator=gen)[: batch * per_request].view(batch, per_request)
    starts = torch.randperm(batch * runs, generator=gen).view(batch, runs, 1) * RUN
    in_runs = (starts + torch.arange(RUN)).view(batch, runs * RUN)[:, :per_request].contiguous()
    reversed_runs = (starts + torch.arange(RUN - 1, -1, -1)).view(batch, runs * RUN)[:, :per_request].contiguous()
    hot = (torch.arange(per_request) % HOT_BLOCKS).expand(batch, per_request).contiguous()
    lens = torch.full((batch,), context, dtype=torch.int64)
    qkv = torch.randn(batch, Q_HEADS + 2 * KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    q, scale = qkv[:, :Q_HEADS], HEAD_DIM**-0.5

    def step(table: torch.Tensor) -> None:
        for cache in caches:
            kernel.decode(q, cache, table, lens, scale)

    step_ms = 1000 * median_s(lambda: step(tables), repeats)
    runs_ms = 1000 * median_s(lambda: step(in_runs), repeats)
    reversed_ms = 1000 * median_s(lambda: step(reversed_runs), repeats)
    hot_ms = 1000 * median_s(lambda: step(hot), repeats)
    kv_bytes = batch * context * KV_HEADS * 2 * HEAD_DIM * dtype.itemsize * LAYERS
    floor_ms = kv_bytes / (read_gb_s * 1e9) * 1000
    return {
        "batch": batch,
        "context": context,
        "step_ms": round(step_ms, 3),
        "runs_ms": round(runs_ms, 3),
        "reversed_ms": round(reversed_ms, 3),
        "hot_ms": round(hot_ms, 3),
        "floor_ms": round(floor_ms, 3),
        "distance": round(step_ms / floor_ms, 2),
        "kv_gb_s": round(kv_bytes / step_ms / 1e6, 1),
        "read_gb_s": round(read_gb_s, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=lambda s: [int(n) for n in s.split(",")], default=[1, 8, 32, 64])
    p.add_argument("--contexts", type=lambda s: [int(n) for n in s.split(",")], default=[116, 200, 600])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--dtype", default="auto", help="bfloat16, float32, or auto: what the engine picks on this CPU")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args(argv)
    dtype = choose_dtype(args.dtype, torch.device("cpu"))
    if dtype == torch.bfloat16 and not load_paged_attention(dtype, HEAD_DIM, BLOCK, Q_HEADS // KV_HEADS).bf16_dot:
        raise SystemExit("this CPU has no AVX512-BF16: the bf16 decode kernel takes its portable path here")
    limits = roofline.measure(torch.device("cpu"), dtype, read_mib=1024, gemm_n=512, repeats=5)
    say(f"{dtype}, streaming read {limits.read_gb_s:.1f} GB/s, {torch.get_num_threads()} threads")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for context in args.contexts:
        for batch in args.batches:
            rows.append(row(batch, context, args.repeats, limits.read_gb_s, gen, dtype))
            say(f"  {rows[-1]}")
    name = "decode_attention" if dtype == torch.bfloat16 else "decode_attention_float32"  # bf16 keeps its name
    write_csv(rows, args.out / f"{name}.csv")
    panels = {
        f"context {c}": {
            name: [(int(str(r["batch"])), float(str(r[key]))) for r in rows if r["context"] == c]
            for name, key in (
                ("blocks scattered", "step_ms"),
                (f"runs of {RUN}, ascending", "runs_ms"),
                (f"runs of {RUN}, descending", "reversed_ms"),
                ("blocks in cache", "hot_ms"),
                ("read floor", "floor_ms"),
            )
        }
        for c in args.contexts
    }
    panel_plot(panels, "batch", "ms per step (30 layers)", args.out / f"{name}.png")
    fields = list(rows[0])
    print("| " + " | ".join(fields) + " |\n|" + "---|" * len(fields))
    for r in rows:
        print("| " + " | ".join(str(v) for v in r.values()) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
