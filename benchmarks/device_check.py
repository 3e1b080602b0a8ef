"""Check the engine on an accelerator (or any device) in one run: correctness first, then decode speed.

Builds a random-weight model with SmolLM2-135M's architecture (or a smaller one) in Hugging Face layout,
then on the chosen device:
  1. logits parity with transformers at every position, through fresh prefill, prefill on cached context
     and decode (float32);
  2. greedy tokens equal transformers' argmax for 32 steps;
  3. batch invariance: 16 prompts alone, batched, in tiny prefill chunks, under preemption, on prefix hits;
  4. decode throughput (bfloat16) at batch 1, 64 and 256, decode steps replayed from CUDA graphs and launched op
     by op (--no-cuda-graphs), and whether both give the same tokens.

Stages 1-3 run with the engine's defaults, so on CUDA their decode steps replay CUDA graphs.

    python benchmarks/device_check.py --tokenizer DIR [--device cuda] [--out results.json]

DIR holds tokenizer files (tokenizer.json, tokenizer_config.json); the model's vocabulary is sized to it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from hybridserve.config import EngineConfig
from hybridserve.engine.core import EngineCore
from hybridserve.engine.llm import LLM
from hybridserve.engine.parity import chunked_logits
from hybridserve.engine.protocol import EngineCoreRequest
from hybridserve.sampling_params import SamplingParams

SIZES = {
    "smollm2": dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3
    ),
    "tiny": dict(
        hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2
    ),
}


def make_model(tokenizer_dir: Path, out: Path, size: str) -> Path:
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok),
        max_position_embeddings=4096,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        **SIZES[size],
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # a sharper distribution than the default init, so greedy ties are rare
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(out)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out / f.name)
    return out


def parity(model_dir: Path, device: str, report: dict) -> None:
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    llm = LLM(str(model_dir), dtype="float32", device=device, block_size=4, num_kv_blocks=1024)
    prompts = [
        llm.chat_prompt([{"role": "user", "content": t}])
        for t in ("What is the capital of France?", "Write a haiku about the sea.", "def fib(n):")
    ]
    out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    worst, greedy_ok = 0.0, True
    for ids, o in zip(prompts, out, strict=True):
        full = ids + o.outputs[0].token_ids
        with torch.inference_mode():
            logits = ref(torch.tensor([full], device=device)).logits[0].float()
        greedy_ok &= logits[len(ids) - 1 : -1].argmax(-1).tolist() == o.outputs[0].token_ids
        # Our logits at every position of the same sequence, in chunks: prefill, prefill on context, decode.
        n = len(full)
        ours = chunked_logits(llm.core.runner, full, [n // 3, n - 2, n - 1, n])
        worst = max(worst, (ours - logits).abs().max().item())
    report["parity_max_abs_logit_diff_fp32"] = worst
    report["greedy_equals_transformers_argmax_32_steps"] = greedy_ok


def invariance(model_dir: Path, device: str, report: dict) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    base = LLM(str(model_dir), dtype="float32", device=device, enable_prefix_caching=False)
    prompts = [
        base.chat_prompt([{"role": "user", "content": f"Tell me about topic {i}." + " More." * (i % 5)}])
        for i in range(16)
    ]
    alone = [base.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    setups = {
        "batched": dict(enable_prefix_caching=False),
        "tiny_chunks": dict(long_prefill_token_threshold=5, max_num_batched_tokens=24),
        "preemption": dict(block_size=4, num_kv_blocks=40),
        "prefix_hits": dict(block_size=8),
        "no_cuda_graphs": dict(cuda_graphs=False),
    }
    for name, kwargs in setups.items():
        llm = LLM(str(model_dir), dtype="float32", device=device, **kwargs)
        runs = 2 if name == "prefix_hits" else 1
        for _ in range(runs):
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        llm.core.check_integrity()
        report[f"invariant_{name}"] = got == alone
        if name == "preemption":
            report["preemptions"] = llm.core.scheduler.num_preemptions


def decode_speed(model_dir: Path, device: str, report: dict) -> None:
    """bfloat16 decode steps at batch 1, 64 and 256, with CUDA graphs (the default) and without: median step
    times, and whether both give the same greedy tokens."""
    runs: dict[tuple[int, bool], dict[str, list[int]]] = {}
    for graphs in (True, False):
        core = EngineCore(
            EngineConfig.of(
                dtype="bfloat16", device=device, max_num_seqs=256, max_num_batched_tokens=16384, cuda_graphs=graphs
            ),
            model_dir,
        )
        suffix = "" if graphs else "_eager"
        for batch in (1, 64, 256):
            for i in range(batch):
                core.add_request(
                    EngineCoreRequest(
                        f"b{batch}-{i}",
                        list(range(100 + i, 145 + i)),
                        SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True),
                        [],
                        0.0,
                    )
                )
            tokens: dict[str, list[int]] = {}
            times = []
            first = True
            while core.has_work():
                if device == "cuda":
                    torch.cuda.synchronize()
                t = time.perf_counter()
                outputs = core.step().outputs
                if not first:  # the first step is the prefill
                    times.append(time.perf_counter() - t)
                first = False
                for out in outputs:
                    tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            times.sort()
            step = times[len(times) // 2]
            report[f"decode_bf16_batch{batch}{suffix}_step_ms"] = round(step * 1000, 2)
            report[f"decode_bf16_batch{batch}{suffix}_tok_s"] = round(batch / step, 1)
            runs[batch, graphs] = tokens
        captured = core.runner.decode_graphs
        if graphs:
            report["cuda_graphs_captured"] = sorted(captured.graphs) if captured is not None else None
            report["cuda_graphs_disabled"] = captured.disabled if captured is not None else "not used"
    for batch in (1, 64, 256):
        report[f"graph_tokens_equal_eager_batch{batch}"] = runs[batch, True] == runs[batch, False]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, required=True, help="directory with tokenizer files")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", choices=sorted(SIZES), default="smollm2")
    ap.add_argument("--out", type=Path, help="write the report as JSON here too")
    args = ap.parse_args()
    report: dict = {"device": args.device, "torch": torch.__version__, "size": args.size}
    if args.device == "cuda":
        report["gpu"] = torch.cuda.get_device_name()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(args.tokenizer, Path(tmp) / "model", args.size)
        for stage in (parity, invariance, decode_speed):
            t = time.perf_counter()
            stage(model_dir, args.device, report)
            print(f"{stage.__name__}: {time.perf_counter() - t:.1f}s", flush=True)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
