"""Decode step time of the default model with the native CPU kernels against PyTorch ops only.

    python -m benchmarks.native_kernels [--out benchmarks/results] [--batches 1,8,32,64] [--contexts 128,512]

One engine per side (`native_kernels=True` / `False`, everything else default: SmolLM2-135M, bf16 where the
CPU has it). For each batch size B and context length L, B random prompts of L tokens are added and stepped
until every request has its first token; then the next `--steps` decode steps (all B requests in each) are
timed one by one, the median is kept, and the requests are aborted. The two sides run one after the other
in this process, so compare them within one run.
Writes <out>/native_kernels.csv and .png; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from benchmarks.report import panel_plot, say, write_csv
from hybridserve.engine.fanout import expand
from hybridserve.engine.llm import LLM
from hybridserve.sampling_params import SamplingParams

SIDES = {"native kernels": True, "PyTorch ops": False}


def decode_step_ms(llm: LLM, batch: int, context: int, steps: int, gen: torch.Generator) -> float:
    # Room for every request to keep decoding while the last ones are still prefilled (the step budget
    # spreads a batch of prompts over several steps), then through the timed steps.
    params = SamplingParams(temperature=0.0, max_tokens=llm.core.max_model_len - context, ignore_eos=True)
    vocab = llm.core.runner.vocab_size
    for k in range(batch):
        # Fresh random prompts, so no request is served by the prefix cache.
        prompt = torch.randint(100, vocab, (context,), generator=gen).tolist()
        for child in expand(f"bench-{batch}-{context}-{k}", prompt, params, llm.eos_token_ids, llm.core.max_model_len):
            llm.core.add_request(child)
    started: set[str] = set()
    while len(started) < batch:
        started.update(out.request_id for out in llm.core.step().outputs if out.new_token_ids)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        llm.core.step()
        times.append(time.perf_counter() - start)
    llm.core.abort(sorted(started))
    llm.core.step()  # retire the aborted requests
    assert not llm.core.has_work(), "benchmark requests left in the engine"
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--contexts", default="128,512")
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    rows = []
    for side, native in SIDES.items():
        llm = LLM(native_kernels=native)
        gen = torch.Generator().manual_seed(0)
        for context in contexts:
            for batch in batches:
                ms = decode_step_ms(llm, batch, context, args.steps, gen)
                say(f"{side}: batch {batch}, context {context}: {ms:.1f} ms a decode step")
                rows.append({"side": side, "batch": batch, "context": context, "step_ms": round(ms, 2)})
        del llm
    write_csv(rows, args.out / "native_kernels.csv")
    plot(rows, contexts, args.out / "native_kernels.png")
    print("| batch | context | " + " | ".join(f"{s} ms" for s in SIDES) + " | speed-up |")
    print("|---|---|" + "---|" * (len(SIDES) + 1))
    for context in contexts:
        for batch in batches:
            ms = [
                next(r["step_ms"] for r in rows if (r["side"], r["batch"], r["context"]) == (s, batch, context))
                for s in SIDES
            ]
            print(f"| {batch} | {context} | " + " | ".join(f"{m:.1f}" for m in ms) + f" | {ms[1] / ms[0]:.2f}× |")
    say(f"wrote {args.out / 'native_kernels.csv'} and .png")


def plot(rows: list[dict[str, object]], contexts: list[int], path: Path) -> None:
    panels = {
        f"SmolLM2-135M, {context}-token prompts": {
            side: [(r["batch"], r["step_ms"]) for r in rows if r["side"] == side and r["context"] == context]
            for side in SIDES
        }
        for context in contexts
    }
    panel_plot(panels, "batch (requests decoding)", "decode step, ms (median)", path)


if __name__ == "__main__":
    main()
