"""Prefill attention: the native kernel against PyTorch's SDPA, one layer and a whole prefill.

    python -m benchmarks.prefill_attention [--dtype float32] [--lengths 128,512,1024,2048] [--repeats 10]
        [--out benchmarks/results]

--dtype: the engine's choice on this CPU by default (bfloat16 with AVX512-BF16, where the bf16 kernel runs; else
float32, whose kernel runs on any CPU). For each prompt length L:
- one layer of the default model's attention (9 query heads, 3 KV heads, head_dim 64, 16-token blocks) over a
  random cache: `PagedAttention.prefill` against `F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)`
  on the same queries, keys and values, the median of `--repeats` calls, with the causal FLOPs per second;
- a whole prefill of L random tokens (one request, `max_tokens=1`) by one engine, the native prefill switched
  off and on in turns (`backend.attention.prefills`), the median of `--repeats` each: the in-process TTFT.
Writes <out>/prefill_attention.csv and .png (prefill_attention_float32.* in float32) and prints a markdown
table; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.report import median_s, say, write_csv
from hybridserve.engine.llm import LLM
from hybridserve.engine.model_runner import choose_dtype
from hybridserve.models.layers.native import load_paged_attention
from hybridserve.sampling_params import SamplingParams

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
SIDES = (("sdpa", False), ("native", True))  # the column name, and whether the native prefill is on


def layer_row(length: int, repeats: int, gen: torch.Generator, dtype: torch.dtype) -> dict[str, object]:
    kernel = load_paged_attention(dtype, HEAD_DIM, BLOCK, Q_HEADS // KV_HEADS)
    blocks = -(-length // BLOCK)
    cache = torch.randn(2, KV_HEADS, blocks, BLOCK, HEAD_DIM, generator=gen).to(dtype)
    table = torch.randperm(blocks, generator=gen)
    q = torch.randn(length, Q_HEADS, HEAD_DIM, generator=gen).to(dtype)
    keys, values = (cache[i][:, table].reshape(KV_HEADS, -1, HEAD_DIM)[:, :length].unsqueeze(0) for i in (0, 1))
    qs = q.transpose(0, 1).unsqueeze(0)
    scale = HEAD_DIM**-0.5
    native = 1000 * median_s(lambda: kernel.prefill(q, cache, table, 0, scale), repeats)
    sdpa = 1000 * median_s(
        lambda: F.scaled_dot_product_attention(qs, keys, values, is_causal=True, scale=scale, enable_gqa=True), repeats
    )
    gflop = Q_HEADS * length * (length + 1) / 2 * HEAD_DIM * 4 / 1e9  # QK^T and PV over the visible keys
    return {
        "length": length,
        "layer_sdpa_ms": round(sdpa, 3),
        "layer_native_ms": round(native, 3),
        "sdpa_gflop_s": round(gflop / sdpa * 1000, 1),
        "native_gflop_s": round(gflop / native * 1000, 1),
    }


def prefill_ms(llm: LLM, length: int, repeats: int, gen: torch.Generator) -> dict[str, float]:
    """The median whole-prefill time with the native prefill off and on, in turns."""
    kernels = llm.core.runner.backend.attention
    assert kernels is not None
    params = SamplingParams(temperature=0.0, max_tokens=1)
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(2 * repeats + 2):
        native = i % 2 == 1
        kernels.prefills = native
        prompt = torch.randint(100, 20000, (length,), generator=gen).tolist()
        start = time.perf_counter()
        llm.generate([prompt], params)
        if i >= 2:  # the first of each is a warm-up
            times[native].append(time.perf_counter() - start)
    kernels.prefills = True
    return {f"prefill_{side}_ms": round(statistics.median(times[on]) * 1000, 1) for side, on in SIDES}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=lambda s: [int(n) for n in s.split(",")], default=[128, 512, 1024, 2048])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], help="default: the engine's choice on this CPU")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args(argv)
    dtype = choose_dtype(args.dtype or "auto", torch.device("cpu"))
    if not load_paged_attention(dtype, HEAD_DIM, BLOCK, Q_HEADS // KV_HEADS).prefills:
        raise SystemExit(f"no native {dtype} prefill kernel on this CPU (bf16 needs AVX512-BF16): nothing to compare")
    gen = torch.Generator().manual_seed(0)
    name = str(dtype).removeprefix("torch.")
    llm = LLM(None, dtype=name, enable_prefix_caching=False, max_model_len=max(args.lengths) + 16)
    rows = []
    for length in args.lengths:
        say(f"prefill attention at {length} tokens ({name})")
        row = layer_row(length, args.repeats, gen, dtype) | prefill_ms(llm, length, args.repeats, gen)
        say(f"  {row}")
        rows.append(row)
    stem = "prefill_attention" if dtype == torch.bfloat16 else f"prefill_attention_{name}"
    write_csv(rows, args.out / f"{stem}.csv")
    plot(rows, args.out / f"{stem}.png", name)
    fields = list(rows[0])
    print("| " + " | ".join(fields) + " |\n|" + "---|" * len(fields))
    for row in rows:
        print("| " + " | ".join(str(v) for v in row.values()) + " |")
    return 0


def plot(rows: list[dict[str, object]], path: Path, dtype: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    lengths = [int(str(r["length"])) for r in rows]
    for side, _ in SIDES:
        left.plot(lengths, [float(str(r[f"{side}_gflop_s"])) for r in rows], marker="o", label=side)
        right.plot(lengths, [float(str(r[f"prefill_{side}_ms"])) for r in rows], marker="o", label=side)
    left.set(xlabel="prompt tokens", ylabel="GFLOP/s", title=f"one layer's causal attention ({dtype})")
    right.set(xlabel="prompt tokens", ylabel="ms", title="whole prefill, in-process (SmolLM2-135M)")
    for ax in (left, right):
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    raise SystemExit(main())
