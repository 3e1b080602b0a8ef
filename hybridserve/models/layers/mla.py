"""Multi-head latent attention (MLA) without rotary embedding (NoPE), over a paged latent cache.

Each token caches one latent: the normalised compressed KV (kv_lora_rank) followed by the shared key part
(qk_rope_head_dim, used as is: no rotation is applied). The cache is [num_blocks, block_size, latent_dim].
Prefill expands the latents into per-head keys and values; decode absorbs the up-projection into the
query and the output instead (scores = [q_nope W_k, q_rope] . latent), so it reads only latents.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.models.layers.attention import AttentionMetadata


@dataclass
class MLAConfig:
    hidden_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float
    output_gate: bool  # K3: attention output * sigmoid(g_proj(x)) before o_proj


class LatentUpProjection(nn.Module):
    """kv_b_proj: latent -> per-head [k_nope, v]. A plain weight (not nn.Linear): decode reads it split per
    head, so it is never swapped for a packed CPU matmul."""

    def __init__(self, kv_lora_rank: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, kv_lora_rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class MultiheadLatentAttention(nn.Module):
    def __init__(self, c: MLAConfig) -> None:
        super().__init__()
        self.num_heads = c.num_heads
        self.nope, self.rope, self.v_dim, self.kv_lora_rank = (
            c.qk_nope_head_dim,
            c.qk_rope_head_dim,
            c.v_head_dim,
            c.kv_lora_rank,
        )
        self.qk_dim = self.nope + self.rope
        self.latent_dim = c.kv_lora_rank + c.qk_rope_head_dim
        self.scale = self.qk_dim**-0.5
        self.q_lora = c.q_lora_rank is not None
        if not self.q_lora:
            self.q_proj = nn.Linear(c.hidden_size, c.num_heads * self.qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False)
            self.q_a_layernorm = nn.RMSNorm(c.q_lora_rank, eps=c.rms_norm_eps)
            self.q_b_proj = nn.Linear(c.q_lora_rank, c.num_heads * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, self.latent_dim, bias=False)
        self.kv_a_layernorm = nn.RMSNorm(c.kv_lora_rank, eps=c.rms_norm_eps)
        self.kv_b_proj = LatentUpProjection(c.kv_lora_rank, c.num_heads * (self.nope + self.v_dim))
        self.g_proj = nn.Linear(c.hidden_size, c.num_heads * self.v_dim, bias=False) if c.output_gate else None
        self.o_proj = nn.Linear(c.num_heads * self.v_dim, c.hidden_size, bias=False)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        return q.view(x.shape[0], self.num_heads, self.qk_dim)

    def _expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[L, latent_dim] -> keys [H, L, qk_dim], values [H, L, v_dim]."""
        kv = self.kv_b_proj(latent[:, : self.kv_lora_rank]).view(-1, self.num_heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_rope = latent[:, None, self.kv_lora_rank :].expand(-1, self.num_heads, -1)
        return torch.cat((k_nope, k_rope), dim=-1).transpose(0, 1), v.transpose(0, 1)

    def _decode(self, q: torch.Tensor, latents: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """q: [B, H, qk_dim]; latents: [B, L, latent_dim]; bias: [B, 1, L]. Returns [B, H, v_dim]."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
        q_latent = torch.einsum("bhn,hnc->bhc", q[..., : self.nope], w[:, : self.nope])
        q_cat = torch.cat((q_latent, q[..., self.nope :]), dim=-1)  # [B, H, latent_dim]
        scores = torch.matmul(q_cat, latents.transpose(1, 2)).mul_(self.scale).add_(bias)
        probs = scores.softmax(-1, dtype=torch.float32).to(latents.dtype)
        o_latent = torch.matmul(probs, latents[..., : self.kv_lora_rank])  # [B, H, kv_lora_rank]
        return torch.einsum("bhc,hvc->bhv", o_latent, w[:, self.nope :])

    def forward(self, x: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q = self._queries(x)
        kv_a = self.kv_a_proj_with_mqa(x)
        latent = torch.cat((self.kv_a_layernorm(kv_a[:, : self.kv_lora_rank]), kv_a[:, self.kv_lora_rank :]), -1)
        blocks, block_size, _ = cache.shape
        flat = cache.view(blocks * block_size, self.latent_dim)
        flat.index_copy_(0, meta.slot_mapping, latent)
        out = x.new_empty(t, self.num_heads, self.v_dim)
        d = meta.decode
        if d is not None:
            assert d.bias is not None, "MLA layers always get the decode bias (no native kernel reads latents)"
            b = d.block_tables.shape[0]
            latents = cache.index_select(0, d.flat_tables).view(b, -1, self.latent_dim)
            out.index_copy_(0, d.token_index, self._decode(q.index_select(0, d.token_index), latents, d.bias))
        for p in meta.prefills:
            qp = q[p.start : p.end].transpose(0, 1)  # [H, n, qk_dim]
            if p.block_table is None:
                k, v = self._expand(latent[p.start : p.end])
                o = F.scaled_dot_product_attention(qp, k, v, is_causal=True, scale=self.scale)
            else:
                length = p.mask.shape[-1]
                k, v = self._expand(cache.index_select(0, p.block_table).view(-1, self.latent_dim)[:length])
                o = F.scaled_dot_product_attention(qp, k, v, attn_mask=p.mask[0], scale=self.scale)
            out[p.start : p.end] = o.transpose(0, 1)
        o = out.reshape(t, self.num_heads * self.v_dim)
        if self.g_proj is not None:
            o = o * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o)
