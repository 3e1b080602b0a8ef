"""Random-weight checkpoints for engine benchmarks: a dense Kimi-Linear config and a Llama config of about
the same parameter count, both with the byte-level tokenizer of scripts/make_tiny_checkpoints.py.

The weights are random (nothing is downloaded), so the numbers measure the engine, not the text. The Kimi
config keeps the released layer pattern (3 KDA layers, then 1 MLA) but uses dense MLPs everywhere, so the
comparison with Llama is about the token mixers and their caches, not about MoE sparsity.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from scripts.make_tiny_checkpoints import K2_SPECIALS, K2_TEMPLATE, byte_tokenizer, kimi_config, save_kimi_linear

HIDDEN = 256
LAYERS = 8
INTERMEDIATE = 704
MAX_POSITION = 8192


def _tokenizer():
    return byte_tokenizer(K2_SPECIALS, "<|im_end|>", K2_TEMPLATE)


def make_kimi(out: Path) -> Path:
    """8 layers (KDA, KDA, KDA, MLA) x 2, hidden 256, 4 KDA heads of 64, 4 MLA heads over a 128 + 64 latent."""
    target = out / "kimi-linear-bench"
    if (target / "config.json").exists():
        return target
    tokenizer = _tokenizer()
    ids = {s: tokenizer.convert_tokens_to_ids(s) for s in K2_SPECIALS}
    config = kimi_config(len(tokenizer), ids, "<|im_end|>")
    config.update(
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=128,
        qk_rope_head_dim=64,
        qk_nope_head_dim=64,
        v_head_dim=64,
        first_k_dense_replace=LAYERS,
        linear_attn_config={
            "head_dim": 64,
            "num_heads": 4,
            "short_conv_kernel_size": 4,
            "kda_layers": [1, 2, 3, 5, 6, 7],
            "full_attn_layers": [4, 8],
        },
        max_position_embeddings=MAX_POSITION,
        initializer_range=0.02,
    )
    save_kimi_linear(target, config, tokenizer, seed=0)
    return target


def make_llama(out: Path) -> Path:
    """8 layers, hidden 256, 4 query heads and 1 KV head of 64 (GQA), SwiGLU MLP of 704."""
    target = out / "llama-bench"
    if (target / "config.json").exists():
        return target
    tokenizer = _tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=MAX_POSITION,
        bos_token_id=tokenizer.convert_tokens_to_ids("[BOS]"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("[PAD]"),
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).eval().save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def num_parameters(hf_dir: Path) -> int:
    """Parameters in the checkpoint (the engine packs CPU linears into non-parameter weights)."""
    return sum(t.numel() for t in load_file(hf_dir / "model.safetensors").values())
