"""Which model class serves which checkpoint architecture."""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from hybridserve.models.llama import LlamaForCausalLM

_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def model_class(config: PretrainedConfig) -> type[nn.Module]:
    for arch in config.architectures or []:
        if arch in _ARCHITECTURES:
            return _ARCHITECTURES[arch]
    raise ValueError(f"unsupported architecture {config.architectures!r}; supported: {sorted(_ARCHITECTURES)}")
