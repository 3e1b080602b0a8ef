"""Per-request cache bytes of Kimi-Linear-48B-A3B as context grows: KDA state (fixed) vs MLA latents (per token).

    python -m benchmarks.hybrid_state_bytes [--out benchmarks/results]

Sizes come from the engine's own cache specs (the model is built on the meta device from the published
config, so no weights are needed). For scale, an all-MLA model of the same depth is shown too.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import torch
from transformers import KimiLinearConfig

from hybridserve.models.cache_specs import CacheLayout, MLASpec
from hybridserve.models.kimi_linear import KimiLinearForCausalLM

# Kimi-Linear-48B-A3B (docs: REFERENCE §6): 27 layers, 3 KDA then 1 MLA, 1-based layer numbers.
CONFIG = dict(
    hidden_size=2304,
    num_hidden_layers=27,
    num_attention_heads=32,
    num_key_value_heads=32,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    linear_attn_config={
        "head_dim": 128,
        "num_heads": 32,
        "short_conv_kernel_size": 4,
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
        "kda_layers": [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)],
    },
)
CONTEXTS = [256, 1024, 4096, 16384, 65536, 262144, 1048576]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    with torch.device("meta"):
        model = KimiLinearForCausalLM(KimiLinearConfig(**CONFIG))
    layout = CacheLayout(model.cache_spec(block_size=1, dtype=torch.bfloat16))
    state = layout.bytes_per_state_slot
    per_token = layout.bytes_per_block
    all_mla = len(layout.layer_specs) * MLASpec(1, layout.paged_specs[0].latent_dim, torch.bfloat16).bytes_per_block
    rows = [(n, state, n * per_token, all_mla * n) for n in CONTEXTS]
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "hybrid_state_bytes.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["context_tokens", "kda_state_bytes", "mla_latent_bytes", "all_mla_latent_bytes"])
        writer.writerows(rows)
    for n, s, kv, full in rows:
        mib = [b / 2**20 for b in (s, kv, full)]
        print(f"{n:>8} tokens: KDA state {mib[0]:8.1f} MiB, MLA latents {mib[1]:8.1f} MiB (all-MLA {mib[2]:8.1f} MiB)")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(CONTEXTS, [r[1] / 2**20 for r in rows], label="KDA state (20 layers, fixed)")
    ax.plot(CONTEXTS, [r[2] / 2**20 for r in rows], label="MLA latents (7 layers)")
    ax.plot(CONTEXTS, [r[3] / 2**20 for r in rows], "--", label="all-MLA, 27 layers (for scale)")
    ax.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="MiB per request (bf16 latents)")
    ax.set_title("Kimi-Linear-48B-A3B: per-request cache bytes")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "hybrid_state_bytes.png", dpi=120)


if __name__ == "__main__":
    main()
