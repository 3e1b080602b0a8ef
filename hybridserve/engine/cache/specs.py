"""One cache spec per layer kind: what a layer keeps per token (paged) or per request (fixed-size state).

The scheduler never looks at layers; the cache manager sizes its pools from these specs. MLA layers
(a latent per token) and linear-attention layers (a fixed-size recurrent state per request) add their
own specs next to `AttentionSpec`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionSpec:
    """Full attention: a K and a V vector per token and KV head, stored in fixed-size blocks."""

    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize


@dataclass(frozen=True)
class CacheLayout:
    """The cache of a whole model: which spec each layer uses."""

    layer_specs: tuple[AttentionSpec, ...]

    @property
    def block_size(self) -> int:
        return self.layer_specs[0].block_size

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id costs across every paged layer."""
        return sum(spec.bytes_per_block for spec in self.layer_specs)

    def num_blocks_for(self, memory_bytes: int) -> int:
        return memory_bytes // self.bytes_per_block
