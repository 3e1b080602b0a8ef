"""Mixture of experts with a sigmoid router (DeepSeek-V3 / Kimi style) and shared experts.

Routing: sigmoid scores; a per-expert correction bias is added only to choose the top-k (optionally within
the best `topk_group` of `n_group` expert groups); the chosen experts' unbiased scores are renormalised and
scaled by `routed_scaling_factor`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.models.layers.activation import silu_gated, silu_mul
from hybridserve.models.layers.native import FusedOps


@dataclass
class MoEConfig:
    hidden_size: int
    intermediate_size: int  # per expert
    num_experts: int
    top_k: int
    num_shared_experts: int
    n_group: int
    topk_group: int
    renormalize: bool
    routed_scaling_factor: float


class GatedMLP(nn.Module):
    """SiLU-gated MLP; gate and up projections are one matmul (`gate_up_proj`, packed by the loader)."""

    gated_projections = ("gate_up_proj",)  # activated in the matmul's tiles where native float32 (pack_linears)

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.native: FusedOps | None = None  # set by use_native_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_gated(self.gate_up_proj, x, self.native))


class Router(nn.Module):
    def __init__(self, c: MoEConfig) -> None:
        super().__init__()
        self.c = c
        self.weight = nn.Parameter(torch.empty(c.num_experts, c.hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.empty(c.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ids [T, k] and their weights [T, k] (float32)."""
        c = self.c
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        if c.n_group > 1:
            grouped = choice.view(-1, c.n_group, c.num_experts // c.n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(c.topk_group, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)
        ids = choice.topk(c.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if c.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return ids, weights * c.routed_scaling_factor


class Experts(nn.Module):
    """All routed experts' weights as [E, 2I, H] (gate rows, then up rows) and [E, H, I]."""

    def __init__(self, c: MoEConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(c.num_experts, 2 * c.intermediate_size, c.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(c.num_experts, c.hidden_size, c.intermediate_size))
        self.native: FusedOps | None = None  # set by use_native_ops

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each token's k experts, weighted; tokens are grouped by expert so each expert runs one matmul."""
        out = torch.zeros_like(x)
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()
        tokens = order // ids.shape[1]
        routed_weights = weights.flatten()[order].unsqueeze(-1)
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            rows = tokens[start : start + n]
            y = F.linear(silu_mul(F.linear(x[rows], self.gate_up_proj[expert]), self.native), self.down_proj[expert])
            out.index_add_(0, rows, (y.float() * routed_weights[start : start + n]).to(x.dtype))
            start += n
        return out


class SparseMoE(nn.Module):
    def __init__(self, c: MoEConfig) -> None:
        super().__init__()
        self.gate = Router(c)
        self.experts = Experts(c)
        self.shared_experts = GatedMLP(c.hidden_size, c.intermediate_size * c.num_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)
        return self.experts(x, ids, weights) + self.shared_experts(x)
