"""Kimi Linear and Kimi K3 text models over a flat token batch: KDA and MLA layers, dense and MoE MLPs.

A layer's token mixer is KDA (fixed-size recurrent state per request) or MLA (a paged latent per token), as
the config's 1-based `linear_attn_config` lists say. K3 switches, each off unless the config sets it:
`attn_res_block_size` (block attention residuals: a depth mix replaces the residual sum, see
layers/depth_mix.py), `mla_use_output_gate` (sigmoid gate on MLA's output) and
`linear_attn_config.gate_lower_bound` (the bounded KDA decay).

Parameter names follow the checkpoint's after the loader's renames (loader/kimi_linear.py).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from hybridserve.models.base import DECODER_SHARD_PLAN, CausalLM, LayerCache
from hybridserve.models.cache_specs import LayerSpec, LinearStateSpec, MLASpec
from hybridserve.models.layers.attention import AttentionMetadata
from hybridserve.models.layers.depth_mix import DepthMix, DepthStream
from hybridserve.models.layers.kda import KDAConfig, KimiDeltaAttention
from hybridserve.models.layers.mla import MLAConfig, MultiheadLatentAttention
from hybridserve.models.layers.moe import GatedMLP, MoEConfig, SparseMoE
from hybridserve.models.layers.norm import RMSNorm


def _linear_attn(config: PretrainedConfig) -> dict:
    return getattr(config, "linear_attn_config", None) or {}


def kda_config(config: PretrainedConfig) -> KDAConfig:
    return KDAConfig(
        hidden_size=config.hidden_size,
        num_heads=config.linear_num_heads,
        head_dim=config.linear_head_dim,
        conv_kernel=config.linear_conv_kernel_dim,
        rms_norm_eps=config.rms_norm_eps,
        gate_lower_bound=_linear_attn(config).get("gate_lower_bound"),
    )


def mla_config(config: PretrainedConfig) -> MLAConfig:
    if config.num_key_value_heads != config.num_attention_heads:
        raise ValueError("MLA with num_key_value_heads != num_attention_heads is not supported")
    return MLAConfig(
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        q_lora_rank=config.q_lora_rank,
        kv_lora_rank=config.kv_lora_rank,
        qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim,
        rms_norm_eps=config.rms_norm_eps,
        output_gate=bool(getattr(config, "mla_use_output_gate", False)),
    )


def moe_config(config: PretrainedConfig) -> MoEConfig:
    return MoEConfig(
        hidden_size=config.hidden_size,
        intermediate_size=config.moe_intermediate_size,
        num_experts=config.num_local_experts,
        top_k=config.num_experts_per_tok,
        num_shared_experts=config.n_shared_experts,
        n_group=config.n_group or 1,
        topk_group=config.topk_group or 1,
        renormalize=config.norm_topk_prob,
        routed_scaling_factor=config.routed_scaling_factor,
    )


class KimiDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int, depth_mix: bool) -> None:
        super().__init__()
        self.is_kda = config.layer_types[layer_idx] == "linear_attention"
        self.self_attn: nn.Module = (
            KimiDeltaAttention(kda_config(config)) if self.is_kda else MultiheadLatentAttention(mla_config(config))
        )
        self.mlp: nn.Module = (
            SparseMoE(moe_config(config))
            if config.mlp_layer_types[layer_idx] == "sparse"
            else GatedMLP(config.hidden_size, config.intermediate_size)
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if depth_mix:
            self.self_attention_res = DepthMix(config.hidden_size, config.rms_norm_eps)
            self.mlp_res = DepthMix(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, cache: LayerCache, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual-sum form (Kimi Linear), with each residual add folded into the next norm as in
        llama.py. x: the previous layer's MLP output (the embeddings for the first layer, with no residual
        yet); residual: the stream before it. Returns this layer's MLP output and the stream before it."""
        h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, cache, meta), residual)
        return self.mlp(h), residual

    def forward_depth_mix(self, stream: DepthStream, cache: LayerCache, meta: AttentionMetadata) -> None:
        """The block attention residual form (K3): each sublayer reads a depth mix of the stream."""
        stream.add(self.self_attn(self.input_layernorm(self.self_attention_res(stream.values()))[0], cache, meta))
        stream.add(self.mlp(self.post_attention_layernorm(self.mlp_res(stream.values()))[0]))


class KimiLinearModel(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.block_size: int | None = getattr(config, "attn_res_block_size", None)
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"attn_res_block_size must be positive, got {self.block_size}")
        depth_mix = self.block_size is not None
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(KimiDecoderLayer(config, i, depth_mix) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if depth_mix:
            self.output_res = DepthMix(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, caches: list[LayerCache], meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.block_size is None:
            residual = None
            for layer, cache in zip(self.layers, caches, strict=True):
                x, residual = layer(x, residual, cache, meta)
            return self.norm(x, residual)[0]
        stream = DepthStream(x)
        for i, (layer, cache) in enumerate(zip(self.layers, caches, strict=True)):
            layer.forward_depth_mix(stream, cache, meta)
            if (i + 1) % self.block_size == 0:
                stream.seal()
        return self.norm(self.output_res(stream.values()))[0]  # mix, then norm


class KimiLinearForCausalLM(CausalLM):
    # Checkpoint projections computed as one matmul each (see loader.safetensors.pack).
    packed_modules = {
        "in_proj": ("f_a_proj", "g_a_proj", "b_proj", "q_proj", "k_proj", "v_proj"),
        "conv1d": ("q_conv1d", "k_conv1d", "v_conv1d"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }
    # A rank's slice of each checkpoint tensor (loader/sharding.py), on the released checkpoints' names (those
    # transformers saves; its in-memory spellings, with stacked experts and one conv1d, have no rule and refuse
    # to shard). KDA and MLA split by heads; q_proj and o_proj name both layer kinds, so both head counts must
    # divide. Low-rank inputs and latents shared by all heads (f_a/g_a, q_a, kv_a_proj_with_mqa) and norms over
    # head_dim are replicated. A_log is [1, 1, H, 1] in Kimi Linear checkpoints (its heads not on dim 0) and H
    # floats: replicated, a sharded KDA takes its heads' entries. Routed experts split by expert parallelism
    # only (whole experts per rank); shared experts and the dense MLP like a Llama MLP; the router is replicated.
    shard_plan = {
        **DECODER_SHARD_PLAN,
        "model.layers.*.self_attn.q_proj.weight": "colwise:linear_num_heads,num_attention_heads",
        "model.layers.*.self_attn.o_proj.weight": "rowwise:linear_num_heads,num_attention_heads",
        # KDA: q, k, v and their convolutions split by heads, packed per rank into in_proj / conv1d
        "model.layers.*.self_attn.k_proj.weight": "colwise:linear_num_heads",
        "model.layers.*.self_attn.v_proj.weight": "colwise:linear_num_heads",
        "model.layers.*.self_attn.q_conv1d.weight": "colwise:linear_num_heads",
        "model.layers.*.self_attn.k_conv1d.weight": "colwise:linear_num_heads",
        "model.layers.*.self_attn.v_conv1d.weight": "colwise:linear_num_heads",
        "model.layers.*.self_attn.b_proj.weight": "colwise:linear_num_heads",
        "model.layers.*.self_attn.f_a_proj.weight": "replicate",
        "model.layers.*.self_attn.g_a_proj.weight": "replicate",
        "model.layers.*.self_attn.f_b_proj.weight": "colwise:linear_num_heads",
        "model.layers.*.self_attn.g_b_proj.weight": "colwise:linear_num_heads",
        "model.layers.*.self_attn.dt_bias": "colwise:linear_num_heads",
        "model.layers.*.self_attn.A_log": "replicate",
        "model.layers.*.self_attn.o_norm.weight": "replicate",
        # MLA
        "model.layers.*.self_attn.q_a_proj.weight": "replicate",
        "model.layers.*.self_attn.q_a_layernorm.weight": "replicate",
        "model.layers.*.self_attn.q_b_proj.weight": "colwise:num_attention_heads",
        "model.layers.*.self_attn.kv_a_proj_with_mqa.weight": "replicate",
        "model.layers.*.self_attn.kv_a_layernorm.weight": "replicate",
        "model.layers.*.self_attn.kv_b_proj.weight": "colwise:num_attention_heads",
        "model.layers.*.self_attn.g_proj.weight": "colwise:num_attention_heads",  # K3's output gate
        # MLPs
        "model.layers.*.block_sparse_moe.gate_proj.weight": "colwise",
        "model.layers.*.block_sparse_moe.up_proj.weight": "colwise",
        "model.layers.*.block_sparse_moe.down_proj.weight": "rowwise",
        "model.layers.*.block_sparse_moe.shared_experts.gate_proj.weight": "colwise",
        "model.layers.*.block_sparse_moe.shared_experts.up_proj.weight": "colwise",
        "model.layers.*.block_sparse_moe.shared_experts.down_proj.weight": "rowwise",
        "model.layers.*.block_sparse_moe.gate.weight": "replicate",
        "model.layers.*.block_sparse_moe.gate.e_score_correction_bias": "replicate",
        "model.layers.*.block_sparse_moe.experts.*.w1.weight": "expert",
        "model.layers.*.block_sparse_moe.experts.*.w2.weight": "expert",
        "model.layers.*.block_sparse_moe.experts.*.w3.weight": "expert",
        # K3's block attention residuals: per-hidden-channel queries and norms
        "model.layers.*.self_attention_res_proj.weight": "replicate",
        "model.layers.*.self_attention_res_norm.weight": "replicate",
        "model.layers.*.mlp_res_proj.weight": "replicate",
        "model.layers.*.mlp_res_norm.weight": "replicate",
        "model.output_res_proj.weight": "replicate",
        "model.output_res_norm.weight": "replicate",
    }
    # Kept in float32 whatever the model dtype: the decay's parameters and the router.
    fp32_parameters = ("A_log", "dt_bias", ".gate.weight", "e_score_correction_bias")

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.model = KimiLinearModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def cache_spec(self, block_size: int, dtype: torch.dtype) -> tuple[LayerSpec, ...]:
        specs: list[LayerSpec] = []
        for layer in self.model.layers:
            attn = layer.self_attn
            if isinstance(attn, KimiDeltaAttention):
                specs.append(
                    LinearStateSpec(attn.num_heads, attn.head_dim, 3 * attn.dim, attn.conv1d.kernel_size[0], dtype)
                )
            else:
                specs.append(MLASpec(block_size, attn.latent_dim, dtype))
        return tuple(specs)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[LayerCache], meta: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for a flat batch of T tokens. No layer uses
        positions (MLA here is NoPE; KDA is ordered by its state)."""
        return self.model(input_ids, caches, meta)
