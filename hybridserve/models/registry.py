"""Which model class serves which checkpoint architecture, and how its config and names are read."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoConfig, KimiLinearConfig, PretrainedConfig

from hybridserve.models.base import CausalLM
from hybridserve.models.kimi_linear import KimiLinearForCausalLM
from hybridserve.models.llama import LlamaForCausalLM
from hybridserve.models.loader.kimi_linear import canonical_state

StateAdapter = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]

_ARCHITECTURES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "KimiLinearForCausalLM": KimiLinearForCausalLM,
}
# Checkpoint names that differ from the model's, mapped at load time (identity when absent).
_ADAPTERS: dict[type[CausalLM], StateAdapter] = {KimiLinearForCausalLM: canonical_state}


def load_config(hf_dir: Path) -> PretrainedConfig:
    """The directory's config. `kimi_k3` (unknown to transformers) is read as a Kimi Linear config: K3's
    extra keys (attn_res_block_size, mla_use_output_gate, ...) stay on it as attributes."""
    raw = json.loads((Path(hf_dir) / "config.json").read_text())
    if raw.get("model_type") == "kimi_k3":
        if "vision_config" in raw or "text_config" in raw:
            raise ValueError(f"{hf_dir}: only flat, text-only Kimi K3 configs are supported")
        raw.pop("model_type")
        return KimiLinearConfig(**raw)
    return AutoConfig.from_pretrained(hf_dir)


def model_class(config: PretrainedConfig) -> type[CausalLM]:
    for arch in config.architectures or []:
        if arch in _ARCHITECTURES:
            return _ARCHITECTURES[arch]
    raise ValueError(f"unsupported architecture {config.architectures!r}; supported: {sorted(_ARCHITECTURES)}")


def state_adapter(cls: type[CausalLM]) -> StateAdapter:
    return _ADAPTERS.get(cls, dict)
