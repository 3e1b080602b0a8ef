"""The Llama family (Llama, Mistral, Qwen2 with QKV bias, Qwen3 with per-head QK norm) over a flat token batch.

Parameter names follow Hugging Face's, except that Q/K/V and gate/up projections are fused into one
matmul each (`packed_modules`), packed by the loader.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig

from hybridserve.models.base import DECODER_SHARD_PLAN, CausalLM
from hybridserve.models.cache_specs import AttentionSpec
from hybridserve.models.layers.activation import silu_gated
from hybridserve.models.layers.attention import AttentionMetadata, paged_attention, rope_and_cache
from hybridserve.models.layers.linear import NativeLinear
from hybridserve.models.layers.native import DecoderStack, FusedOps, KernelUnavailable, PagedAttention, StackLayer
from hybridserve.models.layers.norm import RMSNorm
from hybridserve.models.layers.rope import RotaryEmbedding


class LlamaAttention(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scale = self.head_dim**-0.5
        attention_bias = getattr(config, "attention_bias", False)
        qkv_bias = attention_bias or config.model_type == "qwen2"
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=attention_bias)
        self.qk_norm = config.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = nn.RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x).view(t, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = qkv[:, : self.num_heads], qkv[:, self.num_heads : self.num_heads + self.num_kv_heads]
            qkv = torch.cat((self.q_norm(q), self.k_norm(k), qkv[:, self.num_heads + self.num_kv_heads :]), dim=1)
        q, k, v = rope_and_cache(qkv, self.num_heads, cos_sin, cache, meta)
        o = paged_attention(q, k, v, cache, meta, self.scale)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    gated_projections = ("gate_up_proj",)  # activated in the matmul's tiles where native float32 (pack_linears)

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        mlp_bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=mlp_bias)
        self.native: FusedOps | None = None  # set by use_native_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_gated(self.gate_up_proj, x, self.native))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output (the embeddings for the first layer, with no residual yet);
        residual: the stream before it. Returns this layer's MLP output and the stream before it."""
        h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, cos_sin, cache, meta), residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(CausalLM):
    # Checkpoint projections computed as one matmul each (see loader.safetensors.pack).
    packed_modules = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    # A tensor-parallel rank's slice of each checkpoint tensor (loader/sharding.py): attention by heads, the MLP
    # by intermediate rows; `.*` covers weight and bias (a colwise bias splits with its rows, a rowwise one is
    # replicated). Per-head QK norms (Qwen3) act on head_dim, the same for every head: replicated.
    shard_plan = {
        **DECODER_SHARD_PLAN,
        "model.layers.*.self_attn.q_proj.*": "colwise:num_attention_heads",
        "model.layers.*.self_attn.k_proj.*": "colwise:num_key_value_heads",
        "model.layers.*.self_attn.v_proj.*": "colwise:num_key_value_heads",
        "model.layers.*.self_attn.o_proj.*": "rowwise:num_attention_heads",
        "model.layers.*.self_attn.q_norm.weight": "replicate",
        "model.layers.*.self_attn.k_norm.weight": "replicate",
        "model.layers.*.self_attn.rotary_emb.inv_freq": "replicate",  # old checkpoints' table, dropped by load_model
        "model.layers.*.mlp.gate_proj.*": "colwise",
        "model.layers.*.mlp.up_proj.*": "colwise",
        "model.layers.*.mlp.down_proj.*": "rowwise",
    }
    # A decode-only step is tensor ops over the attention metadata alone, with no host synchronisation, so a CUDA
    # graph can record it (engine/decode_graphs.py).
    graph_capturable = True

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        attn = self.model.layers[0].self_attn
        self.rope = RotaryEmbedding(config, attn.head_dim)
        self.decoder_stack: DecoderStack | None = None  # set by use_decoder_stack

    def use_decoder_stack(self, library: Path, ops: FusedOps, attention: PagedAttention) -> None:
        layers = list(self.model.layers)
        attn = layers[0].self_attn
        if attn.qk_norm:
            raise KernelUnavailable("the stack has no per-head QK norm (Qwen3)")
        linears = [
            m
            for layer in layers
            for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        ]
        if not all(isinstance(m, NativeLinear) and m.kernels is linears[0].kernels for m in linears):
            raise KernelUnavailable("the decoder layers' matmuls are not all native")
        self.decoder_stack = DecoderStack(
            library,
            ops,
            attention,
            linears[0].kernels,
            [
                StackLayer(
                    layer.input_layernorm.weight.detach(),
                    layer.post_attention_layernorm.weight.detach(),
                    *(
                        (m.panels, m.bias, m.blocks)
                        for m in (
                            layer.self_attn.qkv_proj,
                            layer.self_attn.o_proj,
                            layer.mlp.gate_up_proj,
                            layer.mlp.down_proj,
                        )
                    ),
                    gated=getattr(layer.mlp.gate_up_proj, "gated", False),
                )
                for layer in layers
            ],
            self.model.norm.weight.detach(),
            q_heads=attn.num_heads,
            kv_heads=attn.num_kv_heads,
            intermediate=layers[0].mlp.down_proj.in_features,
            eps=layers[0].input_layernorm.eps,
            scale=attn.scale,
        )

    def cache_spec(self, block_size: int, dtype: torch.dtype) -> tuple[AttentionSpec, ...]:
        attn = self.model.layers[0].self_attn
        spec = AttentionSpec(block_size, attn.num_kv_heads, attn.head_dim, dtype)
        return (spec,) * len(self.model.layers)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for a flat batch of T tokens."""
        x = self.model.embed_tokens(input_ids)
        cos_sin = self.rope.cos_sin(positions)
        d = meta.decode
        if self.decoder_stack is not None and d is not None and not meta.prefills and meta.kernels is not None:
            return self.decoder_stack(x, cos_sin, caches, meta.slot_mapping, d.block_tables, d.context_lens)
        residual = None
        for layer, cache in zip(self.model.layers, caches, strict=True):
            x, residual = layer(x, residual, cos_sin, cache, meta)
        return self.model.norm(x, residual)[0]
