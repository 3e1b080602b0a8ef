"""Make tiny Hugging Face-layout checkpoints for tests and benchmarks: `kimi-linear-tiny` and `kimi-k3-tiny`.

    python scripts/make_tiny_checkpoints.py OUT_DIR [--name kimi-linear-tiny|kimi-k3-tiny|llama-tiny]

`kimi-linear-tiny` is transformers' own KimiLinearForCausalLM at random init, saved by transformers (so its
parameter names are the ones transformers writes: the released checkpoints' names). Parameters that start at
zero or one (norm weights, the router's correction bias) are re-initialised so a parity test that ignored
them would fail. `kimi-k3-tiny` adds the K3 switches (block attention residuals, MLA output gate,
lower-bounded KDA gate) and `model_type: "kimi_k3"`; transformers has no K3, so its extra parameters are
written here. Both carry a byte-level tokenizer with a chat template. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import KimiLinearConfig, KimiLinearForCausalLM, PreTrainedTokenizerFast

K2_SPECIALS = ["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>", "[BOS]", "[PAD]"]
K3_SPECIALS = ["<|open|>", "<|sep|>", "<|close|>", "<|end_of_msg|>", "[BOS]", "[PAD]"]
K2_TEMPLATE = (
    "{% for m in messages %}<|im_{{ m['role'] if m['role'] in ['system', 'user', 'assistant'] else 'system' }}|>"
    "{{ m['role'] }}<|im_middle|>{{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)
K3_TEMPLATE = (
    "{% for m in messages %}<|open|>message role=\"{{ m['role'] }}\"<|sep|>{{ m['content'] }}"
    "<|close|>message<|sep|><|end_of_msg|>{% endfor %}"
    '{% if add_generation_prompt %}<|open|>message role="assistant"<|sep|><|open|>think<|sep|>{% endif %}'
)
# Routed-expert choices are discontinuous: a token whose two best biased router scores tie exactly in fp32 is
# routed by rounding, which batching changes. kimi-k3-tiny at seed 0 has such a tie on the engine tests'
# prompts; seed 1 has none (smallest gap there ~4e-5).
DEFAULT_SEEDS = {"kimi-linear-tiny": 0, "kimi-k3-tiny": 1}


def byte_tokenizer(specials: list[str], eos: str, template: str) -> PreTrainedTokenizerFast:
    """256 byte tokens (GPT-2's byte-to-unicode alphabet, no merges) followed by the special tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="[BOS]", eos_token=eos, pad_token="[PAD]")
    fast.chat_template = template
    return fast


def k3_tokenizer() -> PreTrainedTokenizerFast:
    """The K3 test tokenizer: bytes plus K3's markup tokens (`<|open|>`, `<|sep|>`, `<|close|>`,
    `<|end_of_msg|>`) as single special tokens, `<|end_of_msg|>` ending generation. The server renders K3
    prompts with its own renderer (serving/extensions/kimi_k3.py); the template is for other tools."""
    return byte_tokenizer(K3_SPECIALS, "<|end_of_msg|>", K3_TEMPLATE)


def kimi_config(vocab_size: int, special_ids: dict[str, int], eos: str) -> dict:
    return dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        routed_scaling_factor=2.446,
        first_k_dense_replace=1,
        # 1-based layer numbers, as the released configs: KDA, KDA, MLA, KDA, KDA, MLA
        linear_attn_config={
            "head_dim": 16,
            "num_heads": 4,
            "short_conv_kernel_size": 4,
            "kda_layers": [1, 2, 4, 5],
            "full_attn_layers": [3, 6],
        },
        max_position_embeddings=4096,
        initializer_range=0.06,
        pad_token_id=special_ids["[PAD]"],
        bos_token_id=special_ids["[BOS]"],
        eos_token_id=special_ids[eos],
        tie_word_embeddings=False,
    )


def reinit_constants(state: dict[str, torch.Tensor], gen: torch.Generator) -> None:
    """Norm weights start at one and the router's correction bias at zero: give them values that matter."""
    for name, tensor in state.items():
        if name.endswith("norm.weight"):
            tensor.copy_(1.0 + 0.3 * torch.randn(tensor.shape, generator=gen))
        elif name.endswith("e_score_correction_bias"):
            tensor.copy_(0.2 * torch.randn(tensor.shape, generator=gen))


def save_kimi_linear(out: Path, config: dict, tokenizer: PreTrainedTokenizerFast, seed: int) -> None:
    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(KimiLinearConfig(**config)).eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    weights = out / "model.safetensors"
    state = load_file(weights)
    reinit_constants(state, torch.Generator().manual_seed(seed + 1))
    save_file(state, weights, metadata={"format": "pt"})


def add_k3_parameters(out: Path, seed: int) -> None:
    """The K3 parameters transformers' kimi_linear does not have, at non-trivial values (a zero depth-mix
    query is uniform mixing, which would hide a wrong mix; the unit tests cover the zero-query case)."""
    config = json.loads((out / "config.json").read_text())
    gen = torch.Generator().manual_seed(seed)
    hidden = config["hidden_size"]
    weights = out / "model.safetensors"
    state = load_file(weights)
    mla_out = config["num_attention_heads"] * config["v_head_dim"]
    for i, kind in enumerate(config["layer_types"]):
        prefix = f"model.layers.{i}"
        for part in ("self_attention_res", "mlp_res"):
            state[f"{prefix}.{part}_proj.weight"] = 0.5 * torch.randn(1, hidden, generator=gen)
            state[f"{prefix}.{part}_norm.weight"] = 1.0 + 0.3 * torch.randn(hidden, generator=gen)
        if kind == "full_attention":
            state[f"{prefix}.self_attn.g_proj.weight"] = 0.2 * torch.randn(mla_out, hidden, generator=gen)
    state["model.output_res_proj.weight"] = 0.5 * torch.randn(1, hidden, generator=gen)
    state["model.output_res_norm.weight"] = 1.0 + 0.3 * torch.randn(hidden, generator=gen)
    save_file(state, weights, metadata={"format": "pt"})
    config["model_type"] = "kimi_k3"
    config["attn_res_block_size"] = 2  # decoder layers per block: 6 layers close 3 blocks
    config["mla_use_output_gate"] = True
    config["linear_attn_config"]["gate_lower_bound"] = -5.0
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def make(out: Path, name: str, seed: int | None = None) -> Path:
    """Write checkpoint `name` into `out / name`; returns that directory."""
    seed = DEFAULT_SEEDS.get(name, 0) if seed is None else seed
    target = Path(out) / name
    target.mkdir(parents=True, exist_ok=True)
    if name == "kimi-linear-tiny":
        tokenizer = byte_tokenizer(K2_SPECIALS, "<|im_end|>", K2_TEMPLATE)
        ids = {s: tokenizer.convert_tokens_to_ids(s) for s in K2_SPECIALS}
        save_kimi_linear(target, kimi_config(len(tokenizer), ids, "<|im_end|>"), tokenizer, seed)
    elif name == "kimi-k3-tiny":
        tokenizer = k3_tokenizer()
        ids = {s: tokenizer.convert_tokens_to_ids(s) for s in K3_SPECIALS}
        save_kimi_linear(target, kimi_config(len(tokenizer), ids, "<|end_of_msg|>"), tokenizer, seed)
        add_k3_parameters(target, seed + 2)
    else:
        raise ValueError(f"unknown tiny checkpoint {name!r}; known: kimi-linear-tiny, kimi-k3-tiny")
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--name", action="append", choices=["kimi-linear-tiny", "kimi-k3-tiny"])
    parser.add_argument("--seed", type=int, help="default: each checkpoint's entry in DEFAULT_SEEDS")
    args = parser.parse_args()
    for name in args.name or ["kimi-linear-tiny", "kimi-k3-tiny"]:
        print(make(args.out, name, args.seed))


if __name__ == "__main__":
    main()
