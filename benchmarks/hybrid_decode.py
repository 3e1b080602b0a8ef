"""Decode throughput of a hybrid (KDA + MLA) model vs a Llama of about the same size, at concurrency 1 and 32.

    python -m benchmarks.hybrid_decode [--out benchmarks/results] [--prompt-tokens 16] [--max-tokens 32]

Both models come from benchmarks/random_checkpoints.py (random weights, float32, CPU). For each model and
concurrency N, N random prompts are added to the engine core and stepped directly; the clock starts once
every request has its first token (all prefill is done) and decode tokens/s = tokens produced after that /
time, the median of 2 runs. Writes <out>/hybrid_decode.csv and .png; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.random_checkpoints import make_kimi, make_llama, num_parameters
from benchmarks.report import say, write_csv
from hybridserve.engine.fanout import expand
from hybridserve.engine.llm import LLM
from hybridserve.sampling_params import SamplingParams

CONCURRENCY = (1, 32)
REPEATS = 2


def run_s(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return time.perf_counter() - start


def decode_tok_s(llm: LLM, conc: int, prompt_tokens: int, max_tokens: int, gen: torch.Generator) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    rates = []
    for rep in range(REPEATS):
        # Fresh prompts each time, so no run is served by the prefix cache.
        for k in range(conc):
            prompt = torch.randint(0, 256, (prompt_tokens,), generator=gen).tolist()
            for child in expand(f"bench-{conc}-{rep}-{k}", prompt, params, llm.eos_token_ids, llm.core.max_model_len):
                llm.core.add_request(child)
        started: set[str] = set()
        produced, decode_start = 0, 0.0
        while llm.core.has_work():
            outputs = llm.core.step().outputs
            if decode_start:
                produced += sum(len(out.new_token_ids) for out in outputs)
            else:
                started.update(out.request_id for out in outputs if out.new_token_ids)
                if len(started) == conc:  # every request decodes from the next step on
                    decode_start = time.perf_counter()
        rates.append(produced / (time.perf_counter() - decode_start))
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.gettempdir()) / "hybridserve-bench"
    rows = []
    for name, make in (("kimi-linear", make_kimi), ("llama", make_llama)):
        hf_dir = make(root)
        params = num_parameters(hf_dir)
        llm = LLM(str(hf_dir), dtype="float32", device="cpu", max_num_seqs=max(CONCURRENCY))
        run_s(llm, [[1] * 8], 2)  # warm-up
        for conc in CONCURRENCY:
            say(f"{name} ({params / 1e6:.1f}M parameters): concurrency {conc}")
            rate = decode_tok_s(llm, conc, args.prompt_tokens, args.max_tokens, torch.Generator().manual_seed(conc))
            rows.append({"model": name, "parameters": params, "concurrency": conc, "decode_tok_s": round(rate, 1)})
            say(f"  {rows[-1]}")
        llm.core.check_integrity()
    path = args.out / "hybrid_decode.csv"
    write_csv(rows, path)
    plot(rows, args.out / "hybrid_decode.png")
    print("| model | parameters | concurrency | decode tok/s |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['parameters'] / 1e6:.1f}M | {r['concurrency']} | {r['decode_tok_s']} |")
    say(f"wrote {path}")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.4
    for i, model in enumerate(("kimi-linear", "llama")):
        rates = [
            next(r["decode_tok_s"] for r in rows if r["model"] == model and r["concurrency"] == c) for c in CONCURRENCY
        ]
        ax.bar([j + (i - 0.5) * width for j in range(len(CONCURRENCY))], rates, width, label=model)
    ax.set_xticks(range(len(CONCURRENCY)), [f"concurrency {c}" for c in CONCURRENCY])
    ax.set_ylabel("decode tokens/s")
    ax.set_title("Random-weight models of ~equal size, float32, CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
