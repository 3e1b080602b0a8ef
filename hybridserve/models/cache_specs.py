"""One cache spec per layer kind: what a layer keeps per token (paged) or per request (fixed-size state).

The scheduler never looks at layers; the cache manager sizes its pools from these specs. Paged specs
(`AttentionSpec`, `MLASpec`) cost memory per block of tokens; `LinearStateSpec` costs a fixed-size slot per
running request, whatever its length.
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

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return (2, self.num_kv_heads, num_blocks, self.block_size, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention: one latent (compressed KV + shared key part) per token, in blocks."""

    block_size: int
    latent_dim: int
    dtype: torch.dtype

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.block_size, self.latent_dim)

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.latent_dim * self.dtype.itemsize


@dataclass(frozen=True)
class LinearStateSpec:
    """Linear attention (KDA): per request, the short convolution's last `conv_kernel - 1` inputs and a
    [num_heads, head_dim, head_dim] float32 recurrent state."""

    num_heads: int
    head_dim: int
    conv_dim: int
    conv_kernel: int
    dtype: torch.dtype  # of the convolution tail; the recurrent state is always float32

    def conv_shape(self, num_slots: int) -> tuple[int, ...]:
        return (num_slots, self.conv_dim, self.conv_kernel - 1)

    def state_shape(self, num_slots: int) -> tuple[int, ...]:
        return (num_slots, self.num_heads, self.head_dim, self.head_dim)

    @property
    def bytes_per_slot(self) -> int:
        conv = self.conv_dim * (self.conv_kernel - 1) * self.dtype.itemsize
        return conv + self.num_heads * self.head_dim * self.head_dim * torch.float32.itemsize


PagedSpec = AttentionSpec | MLASpec
LayerSpec = AttentionSpec | MLASpec | LinearStateSpec


@dataclass(frozen=True)
class CacheLayout:
    """The cache of a whole model: which spec each layer uses."""

    layer_specs: tuple[LayerSpec, ...]

    @property
    def paged_specs(self) -> tuple[PagedSpec, ...]:
        return tuple(s for s in self.layer_specs if not isinstance(s, LinearStateSpec))

    @property
    def state_specs(self) -> tuple[LinearStateSpec, ...]:
        return tuple(s for s in self.layer_specs if isinstance(s, LinearStateSpec))

    @property
    def block_size(self) -> int:
        return self.paged_specs[0].block_size

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id costs across every paged layer."""
        return sum(spec.bytes_per_block for spec in self.paged_specs)

    @property
    def bytes_per_state_slot(self) -> int:
        """Bytes one request's recurrent state costs across every linear-attention layer (0: none)."""
        return sum(spec.bytes_per_slot for spec in self.state_specs)

    def num_blocks_for(self, memory_bytes: int) -> int:
        return memory_bytes // self.bytes_per_block
