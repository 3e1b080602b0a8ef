"""How far the engine's decode steps are from this machine's own limits, measured in one process run.

    python -m benchmarks.limits [--model PATH] [--dtype auto] [--batches 1,64] [--steps 30]

1. The machine: streaming read bandwidth (the best of several sums over a 1 GiB tensor) and GEMM throughput
   (the best of several square matmuls of 2048, in the engine's dtype), with the engine's thread count.
2. The floors of one decode step of the model: at batch 1 it must read every weight once (weight bytes /
   bandwidth; the input embedding only one row, a tied head the whole matrix; a matmul kept in GGUF blocks the
   bytes of its blocks); at batch B it must do the
   matmul FLOPs of B tokens (2 x matmul parameters x B, plus attention over the context) / GEMM throughput.
3. The engine: B requests with short prompts decode in this process (EngineCore stepped directly, greedy,
   `ignore_eos`); a step is timed only once all B decode (no prefill in it). The median step time over the
   floor is the distance from the limit (targets of issue 15: batch 1 within 2x of the bandwidth floor,
   batch 64 within 1.4x of the compute floor).

Writes <out>/limits_<stamp>.csv and .png and prints a markdown table; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.report import say, write_csv
from hybridserve.engine import roofline
from hybridserve.engine.fanout import expand
from hybridserve.engine.llm import LLM
from hybridserve.models.layers.linear import NativeLinear
from hybridserve.models.loader import resolve_model
from hybridserve.models.registry import load_config, model_class
from hybridserve.sampling_params import SamplingParams

PROMPT_TOKENS = 16


@dataclass
class Machine:
    threads: int
    dtype: str
    read_gb_s: float
    gemm_gflop_s: float


@dataclass
class StepRow:
    batch: int
    floor: str  # what bounds the step: bandwidth (weights read once) or compute (the step's FLOPs)
    floor_ms: float
    step_ms_median: float
    distance: float  # step / floor
    tokens_per_s: float
    weight_mb: float
    step_gflop: float


def measure_machine(dtype: torch.dtype, repeats: int) -> Machine:
    """Read bandwidth over 1 GiB (far beyond the caches) and 2048-square GEMMs, with the engine's threads."""
    limits = roofline.measure(torch.device("cpu"), dtype, read_mib=1024, gemm_n=2048, repeats=repeats)
    return Machine(torch.get_num_threads(), str(dtype).removeprefix("torch."), limits.read_gb_s, limits.gemm_gflop_s)


def model_costs(hf_dir: Path) -> tuple[roofline.ModelCosts, int, int]:
    """(what a step reads and multiplies, layers, attention width) of the checkpoint's model, counted on the
    meta device."""
    config = load_config(hf_dir)
    with torch.device("meta"):
        model = model_class(config)(config)
    heads = config.num_attention_heads
    width = heads * getattr(config, "head_dim", None) if getattr(config, "head_dim", None) else config.hidden_size
    return roofline.model_costs(model), config.num_hidden_layers, width


def step_times(llm: LLM, batch: int, steps: int, gen: torch.Generator) -> tuple[float, int]:
    """Median seconds of a decode step with `batch` requests decoding; the mean context length over them."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    for k in range(batch):
        prompt = torch.randint(100, 20000, (PROMPT_TOKENS,), generator=gen).tolist()
        for child in expand(f"limits-{batch}-{k}", prompt, params, llm.eos_token_ids, llm.core.max_model_len):
            llm.core.add_request(child)
    started: set[str] = set()
    times: list[float] = []
    while llm.core.has_work():
        start = time.perf_counter()
        outputs = llm.core.step().outputs
        elapsed = time.perf_counter() - start
        decoding = len(started) == batch and len(outputs) == batch
        started.update(out.request_id for out in outputs if out.new_token_ids)
        if decoding:
            times.append(elapsed)
    llm.core.check_integrity()
    return statistics.median(times), PROMPT_TOKENS + steps // 2


def run(args: argparse.Namespace) -> tuple[Machine, list[StepRow]]:
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=max(args.batches), gguf_blocks=args.gguf_blocks)
    runner = llm.core.runner
    machine = measure_machine(runner.dtype, args.repeats)
    say(f"machine: {machine}")
    hf_dir = resolve_model(args.model).hf_dir
    costs, layers, width = model_costs(hf_dir)
    weight_bytes, matmul_params = costs.read_params * runner.dtype.itemsize, costs.matmul_params
    # matmuls summing their weights from GGUF blocks read those, not float32 copies
    packed = [m for m in runner.model.modules() if isinstance(m, NativeLinear) and m.blocks is not None]
    weight_bytes -= sum(m.weight_numel * runner.dtype.itemsize - m.panels.numel() for m in packed)
    rows = []
    gen = torch.Generator().manual_seed(0)
    step_times(llm, 1, 4, gen)  # warm-up
    for batch in args.batches:
        say(f"decode steps at batch {batch}")
        step_s, context = step_times(llm, batch, args.steps, gen)
        flops = batch * (2 * matmul_params + 4 * layers * width * context)  # QK^T and AV over the context
        bandwidth_floor = weight_bytes / (machine.read_gb_s * 1e9)
        compute_floor = flops / (machine.gemm_gflop_s * 1e9)
        bound, floor_s = (
            ("bandwidth", bandwidth_floor) if bandwidth_floor >= compute_floor else ("compute", compute_floor)
        )
        rows.append(
            StepRow(
                batch,
                bound,
                floor_s * 1000,
                step_s * 1000,
                step_s / floor_s,
                batch / step_s,
                weight_bytes / 1e6,
                flops / 1e9,
            )
        )
        say(f"  {rows[-1]}")
    return machine, rows


def markdown(machine: Machine, rows: list[StepRow]) -> str:
    head = (
        f"{machine.threads} threads, {machine.dtype}: read {machine.read_gb_s:.1f} GB/s, "
        f"GEMM {machine.gemm_gflop_s:.0f} GFLOP/s"
    )
    fields = list(asdict(rows[0]))
    lines = [head, "", "| " + " | ".join(fields) + " |", "|" + "---|" * len(fields)]
    for row in rows:
        cells = [f"{v:.3g}" if isinstance(v, float) else str(v) for v in asdict(row).values()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_png(machine: Machine, rows: list[StepRow], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    labels = [f"batch {r.batch}\n({r.floor} floor)" for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r.floor_ms for r in rows], width=0.4, label="floor")
    ax.bar([x + 0.2 for x in xs], [r.step_ms_median for r in rows], width=0.4, label="engine step (median)")
    for x, r in zip(xs, rows, strict=True):
        ax.text(x + 0.2, r.step_ms_median, f"{r.distance:.1f}x", ha="center", va="bottom")
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"{machine.dtype}, {machine.read_gb_s:.0f} GB/s read, {machine.gemm_gflop_s:.0f} GFLOP/s GEMM")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a checkpoint (default: the embedded default model)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 64])
    p.add_argument("--steps", type=int, default=30, help="decode steps per batch size")
    p.add_argument(
        "--gguf-blocks",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="float32 matmuls read a GGUF model's blocks (the engine's default) or float32 copies",
    )
    p.add_argument("--repeats", type=int, default=5, help="runs of each machine measurement (the best counts)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args(argv)
    machine, rows = run(args)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    write_csv([{**asdict(machine), **asdict(r)} for r in rows], args.out / f"limits_{stamp}.csv")
    write_png(machine, rows, args.out / f"limits_{stamp}.png")
    print(markdown(machine, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
