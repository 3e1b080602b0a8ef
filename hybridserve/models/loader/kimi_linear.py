"""Kimi Linear / K3 checkpoint names → the names `models/kimi_linear.py` uses.

Accepts both spellings in circulation: the released checkpoints' (and what transformers' kimi_linear saves):
`block_sparse_moe.experts.N.w1/w2/w3`, `self_attn.f_a_proj`/`f_b_proj`/`dt_bias`/`A_log`, separate
`q_conv1d`/`k_conv1d`/`v_conv1d`; and transformers' in-memory ones: `mlp.experts.gate_up_proj`/`down_proj`
stacked, `self_attn.forget_gate.*`, one `conv1d`. The q/k/v convolutions and projections are stacked
afterwards by `safetensors.pack`, like every model's fused projections. Routed experts may be an expert-parallel
rank's contiguous range (loader/sharding.py), stacked in index order like a whole checkpoint's 0..E-1.
"""

from __future__ import annotations

import re

import torch

_EXPERT = re.compile(r"(.*)\.experts\.(\d+)\.(w[123])\.weight")
_RENAMES = (
    (".block_sparse_moe.", ".mlp."),
    (".self_attn.forget_gate.", ".self_attn."),
    ("_res_proj.weight", "_res.proj"),
    ("_res_norm.weight", "_res.norm"),
)


def canonical_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, tensor in state.items():
        for old, new in _RENAMES:
            name = name.replace(old, new)
        match = _EXPERT.fullmatch(name)
        if match is not None:
            prefix, index, which = match.groups()
            experts.setdefault(prefix, {}).setdefault(which, {})[int(index)] = tensor
            continue
        if name.endswith(".self_attn.A_log"):
            tensor = tensor.reshape(-1)  # [1, 1, heads, 1] in Kimi Linear checkpoints, [heads] in K3's
        out[name] = tensor
    for prefix, parts in experts.items():
        counts = {which: sorted(by_index) for which, by_index in parts.items()}
        w1_ids = counts.get("w1", [])  # sorted: 0..E-1, or an expert-parallel rank's range
        expected = list(range(w1_ids[0], w1_ids[0] + len(w1_ids))) if w1_ids else []
        if set(counts) != {"w1", "w2", "w3"} or any(ids != expected for ids in counts.values()):
            raise ValueError(f"checkpoint experts under {prefix} are incomplete: {counts}")
        w1, w2, w3 = ([parts[w][i] for i in expected] for w in ("w1", "w2", "w3"))
        out[f"{prefix}.experts.gate_up_proj"] = torch.stack([torch.cat(pair) for pair in zip(w1, w3, strict=True)])
        out[f"{prefix}.experts.down_proj"] = torch.stack(w2)
    return out
