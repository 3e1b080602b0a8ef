"""`load_model`: a checkpoint directory's model, built on the meta device and given its weights in place.

It loads the whole checkpoint. One tensor- / expert-parallel rank's part (`load_state_dict` with a `Shard`,
loader/sharding.py) waits for the sharded layers that would compute with it."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PretrainedConfig

from hybridserve.models.base import CausalLM
from hybridserve.models.layers.rope import RotaryEmbedding
from hybridserve.models.loader.safetensors import load_state_dict, pack
from hybridserve.models.registry import model_class, state_adapter


def load_model(hf_dir: Path, hf_config: PretrainedConfig, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """The registry's model for `hf_config` with the weights of `hf_dir` in `dtype` on `device` (its
    fp32_parameters in float32), projections packed as its packed_modules say. Raises ValueError naming the
    parameters the checkpoint has and the model does not use, or lacks."""
    cls = model_class(hf_config)
    with torch.device("meta"):
        model = cls(hf_config)
    state = load_state_dict(hf_dir, dtype, device, cls.fp32_parameters)
    # Old Llama checkpoints carry the rotary table; the model computes its own.
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    state = pack(state_adapter(cls)(state), cls.packed_modules)
    unexpected = model.load_state_dict(state, strict=False, assign=True).unexpected_keys
    if unexpected:
        raise ValueError(f"checkpoint {hf_dir} has parameters the model does not use: {unexpected[:5]}")
    if hf_config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"checkpoint {hf_dir} lacks parameters {missing[:5]}{'...' if len(missing) > 5 else ''}")
    # Rotary tables were computed on the CPU while the rest was built on meta.
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.to(device, dtype)
    return model.eval()
