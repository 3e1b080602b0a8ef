"""Decode throughput of Kimi-Linear: hybridserve (native CPU kernels on and off) against transformers'
kimi_linear, on the same random-weight checkpoint, at concurrency 1 and 32.

    python -m benchmarks.kimi_decode [--out benchmarks/results] [--prompt-tokens 16] [--max-tokens 32]

The checkpoint is random_checkpoints.make_kimi's (7.1M parameters, float32, CPU). hybridserve is timed as
in hybrid_decode.py (engine steps once every request has its first token). transformers runs a manual
greedy loop over its own cache (DynamicCache, the model's recurrent-state and MLA caches): one batched
forward of the N prompts (all the same length, so no padding), then one forward per token, timed from the
first decode forward; its KDA runs the reference PyTorch kernels transformers falls back to without
flash-linear-attention. decode tokens/s = N x tokens after the first / time, the median of 2 runs, and the
table's the median of 3 rounds in which the engines take turns. Writes <out>/kimi_decode.csv and .png;
progress goes to stderr.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import DynamicCache, KimiLinearForCausalLM

from benchmarks.hybrid_decode import CONCURRENCY, REPEATS, decode_tok_s, run_s
from benchmarks.random_checkpoints import make_kimi, num_parameters
from benchmarks.report import say, write_csv
from hybridserve.engine.llm import LLM

ENGINES = ("hybridserve, native kernels", "hybridserve, PyTorch ops", "transformers")
ROUNDS = 3


@torch.inference_mode()
def transformers_tok_s(
    model: KimiLinearForCausalLM, conc: int, prompt_tokens: int, max_tokens: int, gen: torch.Generator
) -> float:
    rates = []
    for _ in range(REPEATS):
        ids = torch.randint(0, 256, (conc, prompt_tokens), generator=gen)
        cache = DynamicCache(config=model.config)
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        start = time.perf_counter()
        for _ in range(max_tokens - 1):
            ids = logits[:, -1].argmax(-1, keepdim=True)
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
        rates.append(conc * (max_tokens - 1) / (time.perf_counter() - start))
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    hf_dir = make_kimi(Path(tempfile.gettempdir()) / "hybridserve-bench")
    params = num_parameters(hf_dir)
    llms = {
        engine: LLM(str(hf_dir), dtype="float32", device="cpu", max_num_seqs=max(CONCURRENCY), native_kernels=native)
        for engine, native in zip(ENGINES[:2], (True, False), strict=True)
    }
    for llm in llms.values():
        run_s(llm, [[1] * 8], 2)  # warm-up
    model = KimiLinearForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    transformers_tok_s(model, 1, 8, 3, torch.Generator().manual_seed(0))  # warm-up
    rows = []
    for conc in CONCURRENCY:
        gens = {engine: torch.Generator().manual_seed(conc) for engine in ENGINES}
        rates: dict[str, list[float]] = {engine: [] for engine in ENGINES}
        for round_ in range(ROUNDS):  # engines take turns, so a busy spell of the machine hits them alike
            for engine in ENGINES:
                if engine in llms:
                    rate = decode_tok_s(llms[engine], conc, args.prompt_tokens, args.max_tokens, gens[engine])
                else:
                    rate = transformers_tok_s(model, conc, args.prompt_tokens, args.max_tokens, gens[engine])
                rates[engine].append(rate)
                say(f"{engine}: concurrency {conc}, round {round_ + 1}: {rate:.1f} tok/s")
        for engine in ENGINES:
            rate = round(statistics.median(rates[engine]), 1)
            rows.append({"engine": engine, "parameters": params, "concurrency": conc, "decode_tok_s": rate})
    for llm in llms.values():
        llm.core.check_integrity()
    path = args.out / "kimi_decode.csv"
    write_csv(rows, path)
    plot(rows, args.out / "kimi_decode.png")
    print("| engine | concurrency | decode tok/s |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['engine']} | {r['concurrency']} | {r['decode_tok_s']} |")
    say(f"wrote {path}")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(ENGINES)
    for i, engine in enumerate(ENGINES):
        rates = [
            next(r["decode_tok_s"] for r in rows if r["engine"] == engine and r["concurrency"] == c)
            for c in CONCURRENCY
        ]
        offsets = [j + (i - (len(ENGINES) - 1) / 2) * width for j in range(len(CONCURRENCY))]
        ax.bar(offsets, rates, width, label=engine)
    ax.set_xticks(range(len(CONCURRENCY)), [f"concurrency {c}" for c in CONCURRENCY])
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"Kimi-Linear, random weights ({rows[0]['parameters'] / 1e6:.1f}M), float32, CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
