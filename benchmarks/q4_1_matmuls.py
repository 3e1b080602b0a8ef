"""A decode step's matmuls over the default model's own weights: float32 panels against its GGUF Q4_1 blocks.

    python -m benchmarks.q4_1_matmuls [--rows 1,2,4,8,16,32,64,512] [--repeats 7] [--out benchmarks/results]

The 30 layers' four projections (qkv 576x960, o 576x576, gate_up 576x3072, down 1536x576), packed the two ways the
engine packs them (linear.py's NativeLinear: float32 panels, or panels of the GGUF's Q4_1 blocks, which sum bitwise
the same), run one after another as a step runs them, so every weight comes from memory as in a decode step
(405 MiB of float32, 76 MiB of blocks; the caches hold a few MiB). Per row count, the best of `--repeats` walks,
the two layouts alternating; the outputs of both are checked equal. Writes <out>/q4_1_matmuls_<stamp>.csv and .png
and prints a markdown table; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch import nn

from benchmarks.report import panel_plot, say, write_csv
from hybridserve.models.layers.linear import NativeLinear
from hybridserve.models.layers.native import LinearKernels, load_linear_kernels
from hybridserve.models.llama import LlamaForCausalLM
from hybridserve.models.loader import resolve_model
from hybridserve.models.loader.gguf import gguf_blocks
from hybridserve.models.loader.safetensors import load_config, load_state_dict, pack

PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def layers(kernels: LinearKernels) -> dict[str, list[NativeLinear]]:
    """The default model's projections in step order, packed from float32 and from Q4_1 blocks."""
    hf_dir = resolve_model(None).hf_dir
    fused = LlamaForCausalLM.packed_modules
    weights = pack(load_state_dict(hf_dir, torch.float32, torch.device("cpu")), fused)
    blocks = pack(gguf_blocks(hf_dir).get("Q4_1", {}), fused)
    if not blocks:
        raise SystemExit(f"{hf_dir} keeps no Q4_1 blocks")
    layer_count = load_config(hf_dir)["num_hidden_layers"]
    names = [f"model.layers.{i}.{p}.weight" for i in range(layer_count) for p in PROJECTIONS]
    sides: dict[str, list[NativeLinear]] = {"float32": [], "q4_1": []}
    for name in names:
        w = weights[name]
        linear = nn.Linear(w.shape[1], w.shape[0], bias=False)
        linear.weight.data = w
        sides["float32"].append(NativeLinear(linear, kernels))
        sides["q4_1"].append(NativeLinear(linear, kernels, blocks=("Q4_1", blocks[name])))
    assert all(m.blocks == "Q4_1" for m in sides["q4_1"]), "blocks that do not give the weights"
    return sides


def walk(modules: list[NativeLinear], inputs: dict[int, torch.Tensor]) -> list[torch.Tensor]:
    return [m(inputs[m.in_features]) for m in modules]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=lambda s: [int(r) for r in s.split(",")], default=[1, 2, 4, 8, 16, 32, 64, 512])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args(argv)
    kernels = load_linear_kernels()
    say(f"{torch.get_num_threads()} threads, {kernels.describe(torch.float32)}")
    sides = layers(kernels)
    mib = {s: sum(m.panels.numel() * m.panels.element_size() for m in ms) / 2**20 for s, ms in sides.items()}
    say(f"weights read per step: float32 panels {mib['float32']:.0f} MiB, Q4_1 panels {mib['q4_1']:.0f} MiB")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for m in args.rows:
        inputs = {k: torch.randn(m, k, generator=gen) for k in (576, 1536)}
        if not all(map(torch.equal, walk(sides["float32"], inputs), walk(sides["q4_1"], inputs))):
            raise SystemExit(f"Q4_1 panels summed other values than float32 ones at {m} rows")
        best = {side: float("inf") for side in sides}
        for _ in range(args.repeats):
            for side, modules in sides.items():
                start = time.perf_counter()
                walk(modules, inputs)
                best[side] = min(best[side], time.perf_counter() - start)
        rows.append({"rows": m, **{f"{s}_ms": best[s] * 1e3 for s in sides}, "speedup": best["float32"] / best["q4_1"]})
        say(f"  {m} rows: float32 {best['float32'] * 1e3:.2f} ms, q4_1 {best['q4_1'] * 1e3:.2f} ms")
    path = args.out / f"q4_1_matmuls_{time.strftime('%Y%m%d-%H%M%S')}"
    write_csv(rows, path.with_suffix(".csv"))
    lines = {f"{side} panels": [(r["rows"], r[f"{side}_ms"]) for r in rows] for side in ("float32", "q4_1")}
    title = "SmolLM2-135M projections from memory, float32"
    panel_plot({title: lines}, "rows", "ms, 30 layers", path.with_suffix(".png"))
    print("| rows | float32 panels | Q4_1 panels | float32 / Q4_1 |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['rows']} | {r['float32_ms']:.2f} ms | {r['q4_1_ms']:.2f} ms | {r['speedup']:.2f}× |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
