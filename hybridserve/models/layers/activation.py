"""The SiLU-gated MLP's activation, shared by every model's MLP and expert layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridserve.models.layers.native import FusedOps


def silu_mul(gate_up: torch.Tensor, native: FusedOps | None) -> torch.Tensor:
    """silu(gate) * up of [rows, 2 * I] (gate first): one native pass when `native` can take it."""
    if native is not None and native.supports(gate_up):
        return native.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
