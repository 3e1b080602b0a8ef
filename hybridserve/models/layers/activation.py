"""The SiLU-gated MLP's activation, shared by every model's MLP and expert layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.models.layers.native import FusedOps


def silu_mul(gate_up: torch.Tensor, native: FusedOps | None) -> torch.Tensor:
    """silu(gate) * up of [rows, 2 * I] (gate first): one native pass when `native` can take it."""
    if native is not None and native.supports(gate_up):
        return native.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_gated(gate_up: nn.Module, x: torch.Tensor, native: FusedOps | None) -> torch.Tensor:
    """silu(gate) * up of the projection gate_up(x) ([..., 2 * I], gate first): in the matmul's own tiles where
    gate_up is a gated NativeLinear (linear.pack_linears, `gated_projections`), else silu_mul after it."""
    if getattr(gate_up, "gated", False):
        return gate_up(x)
    return silu_mul(gate_up(x), native)
