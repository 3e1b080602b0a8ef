"""`CausalLM`: what the engine's runner, loader and backends need of a served model, declared once.

Every model class of the registry derives from it. Its class attributes tell the loader and the backends how to
treat the model (the runner never probes a model for optional attributes); its methods are what a step calls."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from hybridserve.models.cache_specs import LayerSpec
from hybridserve.models.layers.attention import AttentionMetadata
from hybridserve.models.layers.linear import NativeLinear
from hybridserve.models.layers.native import FusedOps, KernelUnavailable, PagedAttention

# What one layer keeps across steps: its paged KV cache, or a linear-attention layer's (conv tails, states) pair.
LayerCache = torch.Tensor | tuple[torch.Tensor, torch.Tensor]

# The shard-plan rules every decoder checkpoint here shares: the vocabulary's two ends split by rows, the norms
# around each layer and the final one replicated.
DECODER_SHARD_PLAN = {
    "model.embed_tokens.weight": "vocab",
    "lm_head.weight": "vocab",
    "model.norm.weight": "replicate",
    "model.layers.*.input_layernorm.weight": "replicate",
    "model.layers.*.post_attention_layernorm.weight": "replicate",
}


class CausalLM(nn.Module):
    # Checkpoint projections computed as one matmul each, by fused module name (loader.safetensors.pack).
    packed_modules: ClassVar[dict[str, tuple[str, ...]]] = {}
    # Checkpoint-name pattern → how a tensor- or expert-parallel rank reads that tensor: "colwise", "rowwise",
    # "vocab", "replicate" or "expert" (loader/sharding.py). Loading a shard needs a rule for every tensor.
    shard_plan: ClassVar[dict[str, str]] = {}
    # Name fragments of parameters kept in float32 whatever the model dtype.
    fp32_parameters: ClassVar[tuple[str, ...]] = ()
    # Whether a decode-only step is tensor ops over the attention metadata alone, with no host synchronisation,
    # so that a CUDA graph can record it (engine/decode_graphs.py).
    graph_capturable: ClassVar[bool] = False

    lm_head: nn.Module

    def cache_spec(self, block_size: int, dtype: torch.dtype) -> tuple[LayerSpec, ...]:
        """Per layer, in order, what it keeps across steps: a paged KV cache's spec or a recurrent state's."""
        raise NotImplementedError

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[LayerCache], meta: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for a flat batch of T tokens."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits: sampling and logprobs are exact and fast on them whatever the model dtype."""
        return self.lm_head(hidden).float()

    def greedy_tokens(self, hidden: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """compute_logits(hidden)[:, :vocab_size].argmax(-1) from the head's int8 bounds, most logits never
        computed; None where the head has none (NativeLinear.argmax)."""
        return self.lm_head.argmax(hidden, vocab_size) if isinstance(self.lm_head, NativeLinear) else None

    def use_decoder_stack(self, library: Path, ops: FusedOps, attention: PagedAttention) -> None:
        """Run decode-only steps through decoder_stack.c (`library`, native.load_decoder_stack) on these kernels
        and the layers' native matmuls. Raises KernelUnavailable naming what this model lacks for it."""
        raise KernelUnavailable(f"{type(self).__name__} has no native decoder stack")
