"""The bfloat16 element-wise kernels of a decode step: their AVX512-BF16 loops against the same C built portable.

    python -m benchmarks.elementwise_ops [--rows 1,8,32,64] [--repeats 200] [--out benchmarks/results]

At the default model's shapes (hidden 576, intermediate 1536, 9 query and 3 KV heads of 64): `silu_mul`,
`add_rms_norm` and `rope_write_kv` (the rotary and the cache write, into a 2 GiB-sized layer cache at random
slots, as a decode step writes it), each from fused_ops.c / rope_write_kv.c built twice in this process: as
the engine builds it, and with `-DPORTABLE` (plain C, the rounding in integer steps). Both give the same bits
(tests/models/layers/test_native_attention.py); this measures what the vector loops are worth. The median of
`--repeats` calls (each through its Python wrapper) after a warm-up; the step column is 30 layers' worth (two
norms a layer). Needs a CPU with AVX512-BF16. Writes <out>/elementwise_ops.csv and .png and prints a markdown
table; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.report import median_s, panel_plot, say, write_csv
from hybridserve.models.layers.native import load_fused_ops, load_paged_attention

HIDDEN, INTERMEDIATE, Q_HEADS, KV_HEADS, HEAD_DIM, LAYERS = 576, 1536, 9, 3, 64, 30
CACHE_BLOCKS = 5600  # one layer's share of a 2 GiB cache: the rows written are misses, as in a step
PER_LAYER = {"silu_mul": 1, "add_rms_norm": 2, "rope_write_kv": 1}
SIDES = ("AVX512-BF16", "portable C")


def kernels(rows: int, gen: torch.Generator) -> dict[str, dict[str, Callable[[], object]]]:
    """Per kernel, per side, a call on fresh inputs of `rows` tokens."""
    gate_up = torch.randn(rows, 2 * INTERMEDIATE, generator=gen).bfloat16()
    x, delta = (torch.randn(rows, HIDDEN, generator=gen).bfloat16() for _ in range(2))
    weight = torch.randn(HIDDEN, generator=gen).bfloat16()
    qkv = torch.randn(rows, Q_HEADS + 2 * KV_HEADS, HEAD_DIM, generator=gen).bfloat16()
    angles = torch.rand(rows, 1, HEAD_DIM // 2, generator=gen) * 1000
    cos = torch.cat([angles.cos()] * 2, -1).bfloat16()
    sin = torch.cat([-angles.sin(), angles.sin()], -1).bfloat16()
    cache = torch.zeros(2, KV_HEADS, CACHE_BLOCKS, 16, HEAD_DIM, dtype=torch.bfloat16)
    slots = itertools.cycle([torch.randperm(CACHE_BLOCKS * 16, generator=gen)[:rows] for _ in range(256)])
    calls: dict[str, dict[str, Callable[[], object]]] = {name: {} for name in PER_LAYER}
    for side, portable in zip(SIDES, (False, True), strict=True):
        ops = load_fused_ops(portable=portable)
        attention = load_paged_attention(torch.bfloat16, HEAD_DIM, 16, Q_HEADS // KV_HEADS, portable=portable)

        def rope(attention=attention) -> None:
            attention.rope_write_kv(qkv, Q_HEADS, (cos, sin), cache, next(slots))

        calls["silu_mul"][side] = lambda ops=ops: ops.silu_mul(gate_up)
        calls["add_rms_norm"][side] = lambda ops=ops: ops.add_rms_norm(x, delta, weight, 1e-5)
        calls["rope_write_kv"][side] = rope
    return calls


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=lambda s: [int(r) for r in s.split(",")], default=[1, 8, 32, 64])
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args(argv)
    if not load_paged_attention(torch.bfloat16, HEAD_DIM, 16, Q_HEADS // KV_HEADS).bf16_dot:
        raise SystemExit("this CPU has no AVX512-BF16: both builds would be the portable C")
    gen = torch.Generator().manual_seed(0)
    rows_out = []
    for rows in args.rows:
        for name, sides in kernels(rows, gen).items():
            for side, call in sides.items():
                us = median_s(call, args.repeats) * 1e6
                rows_out.append({"kernel": name, "rows": rows, "side": side, "us": round(us, 2)})
            say(f"{name} at {rows} rows: " + ", ".join(f"{r['side']} {r['us']} us" for r in rows_out[-2:]))
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(rows_out, args.out / "elementwise_ops.csv")
    plot(rows_out, args.out / "elementwise_ops.png")
    us = {(r["kernel"], r["rows"], r["side"]): r["us"] for r in rows_out}
    print("| rows | " + " | ".join(f"{k} µs (portable → AVX512-BF16)" for k in PER_LAYER) + " | a step's 30 layers |")
    print("|---|" + "---|" * (len(PER_LAYER) + 1))
    for rows in args.rows:
        cells = [f"{us[k, rows, SIDES[1]]:.1f} → {us[k, rows, SIDES[0]]:.1f}" for k in PER_LAYER]
        step = [LAYERS * sum(n * us[k, rows, side] for k, n in PER_LAYER.items()) / 1000 for side in SIDES[::-1]]
        print(f"| {rows} | " + " | ".join(cells) + f" | {step[0]:.2f} → {step[1]:.2f} ms |")
    say(f"wrote {args.out / 'elementwise_ops.csv'} and .png")
    return 0


def plot(rows: list[dict[str, object]], path: Path) -> None:
    panels = {
        name: {side: [(r["rows"], r["us"]) for r in rows if (r["kernel"], r["side"]) == (name, side)] for side in SIDES}
        for name in PER_LAYER
    }
    panel_plot(panels, "rows (tokens in the step)", "µs a call (median)", path, width=4.5)


if __name__ == "__main__":
    raise SystemExit(main())
