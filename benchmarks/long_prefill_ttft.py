"""Time to first token of short chat requests that arrive while a long prompt is prefilled, with and without
the prefill share (`--long-prefill-share`).

    python -m benchmarks.long_prefill_ttft [--out benchmarks/results] [--long-tokens 8100] [--shorts 4]

One engine per side, everything else default (the embedded SmolLM2-135M, its 8192-token context, the
device's step budget): `long_prefill_share=1` (before the share: a running prefill takes all the budget it
can) and the default share. On each, a long prompt of random token ids (16 output tokens) is added and the
engine stepped; each time the long prompt has computed another 1/(shorts + 1) of its tokens, one short chat
request (a one-line question in the model's chat template, 16 greedy output tokens) is added between two steps,
as the engine's loop takes in new requests. TTFT is the time from adding a request to the end of the step that
samples its first token; the steps waited are counted too. The long prompt's own TTFT shows what the share
costs it. Writes <out>/long_prefill_ttft.csv and .png, a markdown table on stdout, progress on stderr.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from benchmarks.report import say, write_csv
from hybridserve.engine.fanout import expand
from hybridserve.engine.llm import LLM
from hybridserve.sampling_params import SamplingParams

SIDES = {"share off (1.0)": 1.0, "share 0.25 (default)": 0.25}
PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def run(llm: LLM, long_tokens: int, shorts: int) -> list[dict[str, float | int | str]]:
    """One long prompt and `shorts` short requests arriving during its prefill; a row per request."""
    core = llm.core
    long_prompt = torch.randint(100, core.runner.vocab_size, (long_tokens,), generator=torch.Generator().manual_seed(0))
    prompts = {"long": long_prompt.tolist()}
    for k in range(shorts):
        question = f"Question {k + 1}: in one sentence, why is the sky blue at noon and red at dusk?"
        prompts[f"short-{k + 1}"] = llm.chat_prompt([{"role": "user", "content": question}])
    added: dict[str, tuple[float, int]] = {}  # request id: (time added, engine steps so far)
    first: dict[str, tuple[float, int]] = {}
    done: dict[str, float] = {}
    steps = 0

    def add(rid: str) -> None:
        for child in expand(rid, prompts[rid], PARAMS, llm.eos_token_ids, core.max_model_len):
            core.add_request(child)
        added[rid] = (time.perf_counter(), steps)

    add("long")
    while core.has_work():
        computed = core.scheduler.requests["long"].num_computed_tokens if "long" in core.scheduler.requests else 0
        due = min(shorts, computed * (shorts + 1) // long_tokens)
        for k in range(len(added), due + 1):
            add(f"short-{k}")
        outputs = core.step().outputs
        steps += 1
        now = time.perf_counter()
        for out in outputs:
            if out.error is not None:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = (now, steps)
            if out.finish_reason is not None:
                done[out.request_id] = now
    core.check_integrity()
    rows = []
    for rid, (start, step0) in added.items():
        rows.append(
            {
                "request": rid,
                "prompt_tokens": len(prompts[rid]),
                "arrival_step": step0,
                "ttft_s": round(first[rid][0] - start, 3),
                "steps_to_first_token": first[rid][1] - step0,
                "e2e_s": round(done[rid] - start, 3),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--long-tokens", type=int, default=8100, help="the long prompt's length")
    parser.add_argument("--shorts", type=int, default=4, help="short requests, spread over the long prefill")
    args = parser.parse_args()
    rows = []
    for side, share in SIDES.items():
        llm = LLM(long_prefill_share=share)
        # One-off set-up (kernels built per shape) out of the way: a prompt of two full steps, then a decode.
        llm.generate([list(range(100, 100 + 2 * llm.core.scheduler.max_num_batched_tokens))], PARAMS)
        say(f"{side}: step budget {llm.core.scheduler.max_num_batched_tokens}, {args.long_tokens}-token prompt")
        for row in run(llm, args.long_tokens, args.shorts):
            rows.append({"side": side, "long_prefill_share": share, **row})
            say(f"  {row}")
        del llm
    write_csv(rows, args.out / "long_prefill_ttft.csv")
    plot(rows, args.out / "long_prefill_ttft.png")
    print("| side | short TTFT mean s | short TTFT max s | steps to first token (shorts) | long prompt TTFT s |")
    print("|---|---|---|---|---|")
    for side in SIDES:
        short = [r for r in rows if r["side"] == side and r["request"] != "long"]
        long = next(r for r in rows if r["side"] == side and r["request"] == "long")
        ttft = [float(r["ttft_s"]) for r in short]
        waited = ", ".join(str(r["steps_to_first_token"]) for r in short)
        print(f"| {side} | {statistics.mean(ttft):.2f} | {max(ttft):.2f} | {waited} | {long['ttft_s']:.2f} |")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    requests = list(dict.fromkeys(r["request"] for r in rows))
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.4
    for i, side in enumerate(SIDES):
        ttft = [next(r["ttft_s"] for r in rows if (r["side"], r["request"]) == (side, rid)) for rid in requests]
        ax.bar([j + (i - 0.5) * width for j in range(len(requests))], ttft, width, label=side)
    ax.set_xticks(range(len(requests)), requests)
    ax.set_ylabel("TTFT (s)")
    ax.set_title("SmolLM2-135M: TTFT of short requests during a long prefill")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
