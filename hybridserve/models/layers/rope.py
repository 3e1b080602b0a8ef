"""Rotary position embedding (Hugging Face's rotate-half layout), every rope type transformers knows."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


def _rope_type(config: PretrainedConfig) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return params.get("rope_type", params.get("type", "default"))


class RotaryEmbedding(nn.Module):
    def __init__(self, config: PretrainedConfig, head_dim: int) -> None:
        super().__init__()
        # Real tables even when the model is built on the meta device: they are computed, not loaded.
        with torch.device("cpu"):
            cos, signed_sin = _tables(config, head_dim)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("signed_sin", signed_sin, persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, head_dim] each, in the model dtype, gathered once per step for all layers."""
        return self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x: [T, heads, head_dim], Hugging Face's rotate-half layout."""
        cos, signed_sin = cos_sin
        return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), signed_sin)


def _tables(config: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin for every position: rotate_half(x) * sin == roll(x, half) * [-sin, sin], so the
    sign lives in the table and each layer saves ops."""
    rope_type = _rope_type(config)
    if rope_type == "default":
        params = getattr(config, "rope_parameters", None) or {}
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        scaling = 1.0
    elif rope_type in ROPE_INIT_FUNCTIONS:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    else:
        raise ValueError(f"unsupported rope type {rope_type!r}")
    freqs = torch.outer(torch.arange(config.max_position_embeddings, dtype=torch.float32), inv_freq.float())
    sin = freqs.sin() * scaling
    return torch.cat((freqs, freqs), dim=-1).cos() * scaling, torch.cat((-sin, sin), dim=-1)
