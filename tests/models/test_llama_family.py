"""Every architecture the Llama model class serves matches transformers on the same (random) weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from hybridserve.config import EngineConfig
from hybridserve.engine.model_runner import ModelRunner
from hybridserve.engine.parity import chunked_logits

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
CONFIGS = {
    "llama": lambda: LlamaConfig(**TINY),
    "llama-bias": lambda: LlamaConfig(**TINY, attention_bias=True, mlp_bias=True),
    "llama3-rope": lambda: LlamaConfig(
        **TINY,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "mistral": lambda: MistralConfig(**TINY, sliding_window=None),
    "qwen2": lambda: Qwen2Config(**TINY),
    "qwen3": lambda: Qwen3Config(**TINY, head_dim=16),
}


def save_random(config, path: Path) -> Path:
    """A transformers checkpoint of `config` with every parameter random, saved under `path`."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # biases and norms start at 0 and 1: randomise them so a dropped one shows
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("native", [True, False], ids=["native-kernels", "pytorch-ops"])
@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_logits_match_transformers(arch: str, native: bool, tmp_path: Path) -> None:
    path = save_random(CONFIGS[arch](), tmp_path / arch)
    ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = EngineConfig.of(
        dtype="float32", device="cpu", block_size=4, num_kv_blocks=64, native_kernels=native, kv_cache_prefault=False
    )
    runner = ModelRunner(config, path)
    ids = torch.randint(0, 256, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        ref = ref_model(torch.tensor([ids])).logits[0]
    ours = chunked_logits(runner, ids, [12, 30, 35, 36, 37])
    assert (ours - ref).abs().max().item() < 1e-4


def test_sliding_window_caps_the_context(tmp_path: Path) -> None:
    """Full attention equals sliding-window attention only inside the window: the context stops there."""
    path = save_random(MistralConfig(**TINY, sliding_window=64), tmp_path / "mistral-sw")
    runner = ModelRunner(EngineConfig.of(dtype="float32", device="cpu", num_kv_blocks=8, kv_cache_prefault=False), path)
    assert runner.max_position == 64
    qwen = save_random(Qwen2Config(**TINY, sliding_window=64, use_sliding_window=False), tmp_path / "qwen2-no-sw")
    assert (
        ModelRunner(
            EngineConfig.of(dtype="float32", device="cpu", num_kv_blocks=8, kv_cache_prefault=False), qwen
        ).max_position
        == 512
    )


def test_unknown_architecture_is_named(tmp_path: Path) -> None:
    config = LlamaConfig(**TINY)
    path = save_random(config, tmp_path / "odd")
    cfg = (path / "config.json").read_text().replace('"LlamaForCausalLM"', '"GPT2LMHeadModel"')
    (path / "config.json").write_text(cfg)
    with pytest.raises(ValueError, match=r"unsupported architecture \['GPT2LMHeadModel'\]"):
        ModelRunner(EngineConfig.of(dtype="float32", device="cpu", num_kv_blocks=8, kv_cache_prefault=False), path)
