"""The default model's matmul shapes: the native kernels (linear_f32.c, linear_bf16.c; the column "linear.c")
against oneDNN's, one process, one weight each.

    python -m benchmarks.linear_shapes [--dtype auto] [--rows 1,8,32,64] [--repeats 50] [--out benchmarks/results]

For each linear shape of SmolLM2-135M (K x N: qkv 576x960, o 576x576, gate_up 576x3072, down 1536x576, the tied
head 576x49152) and each row count, both kernels over their packed weights (linear.py's NativeLinear and
PackedLinear on the same random weight), the median of `--repeats` calls after a warm-up. The layers' weights
then sit in the cache, so this is each kernel's best case; a decode step reads them from memory. The step total
is 30 layers x the four layer shapes + the head. Writes <out>/linear_shapes_<dtype>.csv and .png and prints a
markdown table (GFLOP/s in brackets); progress goes to stderr.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn

from benchmarks.report import median_s, say, write_csv
from hybridserve.engine.model_runner import choose_dtype
from hybridserve.models.layers.linear import NativeLinear, PackedLinear
from hybridserve.models.layers.native import load_linear_kernels

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576), "head": (576, 49152)}
LAYERS = 30


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="auto", help="auto: the engine's choice for this CPU")
    p.add_argument("--rows", type=lambda s: [int(r) for r in s.split(",")], default=[1, 8, 32, 64])
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args(argv)
    dtype = choose_dtype(args.dtype, torch.device("cpu"))
    kernels = load_linear_kernels()
    if dtype not in kernels.dtypes:
        raise SystemExit(f"no native {dtype} kernel on this CPU (it has {kernels.dtypes})")
    say(f"{dtype}, {torch.get_num_threads()} threads, {kernels.describe(dtype)}")
    gen = torch.Generator().manual_seed(0)
    rows_out = []
    for name, (k, n) in SHAPES.items():
        linear = nn.Linear(k, n, bias=False).to(dtype)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(n, k, generator=gen))
        sides = {"oneDNN": PackedLinear(linear), "linear.c": NativeLinear(linear, kernels)}
        for m in args.rows:
            x = torch.randn(m, k, generator=gen).to(dtype)
            for side, module in sides.items():
                seconds = median_s(lambda module=module, x=x: module(x), args.repeats)
                rows_out.append(
                    {
                        "dtype": str(dtype).removeprefix("torch."),
                        "shape": name,
                        "k": k,
                        "n": n,
                        "rows": m,
                        "kernel": side,
                        "ms": seconds * 1e3,
                        "gflop_s": 2 * m * k * n / seconds / 1e9,
                    }
                )
            say(f"  {name} {k}x{n} rows {m}: " + ", ".join(f"{r['kernel']} {r['ms']:.3f} ms" for r in rows_out[-2:]))
    stem = f"linear_shapes_{str(dtype).removeprefix('torch.')}"
    write_csv(rows_out, args.out / f"{stem}.csv")
    write_png(rows_out, args.rows, args.out / f"{stem}.png")
    print(markdown(rows_out, args.rows))
    return 0


def _step_ms(rows: list[dict], m: int, side: str) -> float:
    ms = {r["shape"]: r["ms"] for r in rows if r["rows"] == m and r["kernel"] == side}
    return LAYERS * sum(v for s, v in ms.items() if s != "head") + ms["head"]


def markdown(rows: list[dict], row_counts: list[int]) -> str:
    head = "| rows | " + " | ".join(f"{s} {k}×{n}" for s, (k, n) in SHAPES.items()) + " | step total |"
    lines = [head, "|" + "---|" * (len(SHAPES) + 2)]
    for m in row_counts:
        for side in ("oneDNN", "linear.c"):
            cells = [
                f"{r['ms']:.3f} ms ({r['gflop_s']:.0f})"
                for s in SHAPES
                for r in rows
                if r["shape"] == s and r["rows"] == m and r["kernel"] == side
            ]
            lines.append(f"| {m}: {side} | " + " | ".join(cells) + f" | {_step_ms(rows, m, side):.1f} ms |")
    return "\n".join(lines)


def write_png(rows: list[dict], row_counts: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = range(len(row_counts))
    for offset, side in ((-0.2, "oneDNN"), (0.2, "linear.c")):
        ax.bar([x + offset for x in xs], [_step_ms(rows, m, side) for m in row_counts], width=0.4, label=side)
    ax.set_xticks(list(xs), [f"{m} rows" for m in row_counts])
    ax.set_ylabel("ms of matmuls per decode step (weights cached)")
    ax.set_title(f"SmolLM2-135M linear shapes, {rows[0]['dtype']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    raise SystemExit(main())
