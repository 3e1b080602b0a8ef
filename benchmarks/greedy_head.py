"""The greedy head (int8 bounds, the few logits they leave computed exactly) against the full head and its
argmax, on the default model's own hidden states, one process.

    python -m benchmarks.greedy_head [--rows 1,8,32,64] [--repeats 30] [--dtype auto] [--out benchmarks/results]

1. The engine (in --dtype; auto: what it picks on this CPU, bf16 with native bf16 matmuls, else float32)
   generates greedily for 64 chat prompts; every hidden state the head sees is kept.
2. For each row count, the kept states in batches of that many: the full head (float32 logits) followed by the
   sampler's argmax, against NativeLinear.argmax; the tokens must agree on every row (the run stops if not),
   and the median time of each per batch is reported, with the rows the bounds left undecided.

Writes <out>/greedy_head.csv and .png (greedy_head_float32.* in float32) and prints a markdown table; progress
goes to stderr.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks.report import median_s, say, write_csv
from hybridserve.engine.llm import LLM
from hybridserve.models.layers.linear import NativeLinear
from hybridserve.models.loader import resolve_model
from hybridserve.sampling_params import SamplingParams

TOPICS = ["the sea", "a clock", "winter", "a fox", "rain", "bread", "a city at night", "an old map"]


def hidden_states(llm: LLM, prompts: int, tokens: int) -> torch.Tensor:
    """Every row the head sees while the engine generates `tokens` greedy tokens for `prompts` prompts."""
    model = llm.core.runner.model
    seen: list[torch.Tensor] = []
    original = model.greedy_tokens

    def keep(hidden: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        seen.append(hidden.clone())
        return original(hidden, vocab_size)

    model.greedy_tokens = keep
    try:
        ids = [
            llm.chat_prompt([{"role": "user", "content": f"Write a story about {TOPICS[i % len(TOPICS)]}, part {i}."}])
            for i in range(prompts)
        ]
        llm.generate(ids, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    finally:
        model.greedy_tokens = original
    return torch.cat(seen)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=lambda s: [int(r) for r in s.split(",")], default=[1, 8, 32, 64])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--dtype", default="auto", help="bfloat16, float32, or auto: what the engine picks on this CPU")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args(argv)
    llm = LLM(str(resolve_model(None).hf_dir), dtype=args.dtype, device="cpu", enable_prefix_caching=False)
    runner = llm.core.runner
    head = runner.model.lm_head
    if not isinstance(head, NativeLinear) or head.argmax_tables is None:
        raise SystemExit(
            "no greedy head here: it needs native kernels, bf16 with AVX512-VNNI (not on AMX's tiles) or float32 "
            "with AVX2, FMA and F16C"
        )
    say(f"generating {args.tokens} tokens for 64 prompts, {torch.get_num_threads()} threads")
    states = hidden_states(llm, 64, args.tokens)
    vocab = runner.vocab_size
    say(f"{states.shape[0]} hidden states; checking every token")
    full_tokens = runner.sampler.argmax(runner.model.compute_logits(states)[:, :vocab])
    greedy_tokens = head.argmax(states, vocab)
    if not torch.equal(full_tokens, greedy_tokens):
        raise SystemExit(f"the greedy head disagrees on {(full_tokens != greedy_tokens).sum().item()} rows")
    undecided = (head.kernels.argmax(states, *head.argmax_tables, vocab) < 0).sum().item()
    rows_out = []
    for m in args.rows:
        batches = [states[i : i + m].contiguous() for i in range(0, states.shape[0] - m + 1, m)][:16]
        full = [
            median_s(lambda x=x: runner.sampler.argmax(runner.model.compute_logits(x)[:, :vocab]), args.repeats)
            for x in batches
        ]
        greedy = [median_s(lambda x=x: head.argmax(x, vocab), args.repeats) for x in batches]
        full_ms, greedy_ms = 1e3 * sum(full) / len(full), 1e3 * sum(greedy) / len(greedy)
        rows_out.append(
            {"rows": m, "full_head_ms": full_ms, "greedy_head_ms": greedy_ms, "speedup": full_ms / greedy_ms}
        )
        say(f"  {m} rows: full head + argmax {full_ms:.3f} ms, greedy head {greedy_ms:.3f} ms")
    dtype = head.panels.dtype
    name = "greedy_head" if dtype == torch.bfloat16 else "greedy_head_float32"  # the bf16 run keeps its name
    write_csv(rows_out, args.out / f"{name}.csv")
    write_png(rows_out, args.out / f"{name}.png", str(dtype).removeprefix("torch."))
    print(f"{states.shape[0]} hidden states, tokens identical on all; {undecided} left to the full head\n")
    print("| rows | full head + argmax | greedy head | speedup |")
    print("|---|---|---|---|")
    for r in rows_out:
        print(f"| {r['rows']} | {r['full_head_ms']:.3f} ms | {r['greedy_head_ms']:.3f} ms | {r['speedup']:.2f}× |")
    return 0


def write_png(rows: list[dict], path: Path, dtype: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["full_head_ms"] for r in rows], width=0.4, label="full head + argmax")
    ax.bar([x + 0.2 for x in xs], [r["greedy_head_ms"] for r in rows], width=0.4, label="greedy head")
    ax.set_xticks(list(xs), [f"{r['rows']} rows" for r in rows])
    ax.set_ylabel(f"ms per call (SmolLM2-135M head, 576 x 49152, {dtype})")
    ax.set_title("The greedy head on the model's own hidden states")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    raise SystemExit(main())
