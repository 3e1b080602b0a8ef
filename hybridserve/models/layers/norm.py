"""RMSNorm with the residual add folded in, as Hugging Face's Llama computes it (float32 inside, the
normalised value rounded to the model dtype before the weight), in one native pass on CPU when loaded."""

from __future__ import annotations

import torch
from torch import nn

from hybridserve.models.layers.native import FusedOps


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.native: FusedOps | None = None  # set by use_native_ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, dim]. Returns (RMSNorm(x + residual), x + residual); without a residual, x is the stream.
        The native path updates `residual` in place: callers own the stream tensor."""
        stream = x if residual is None else residual
        if self.native is not None and self.native.supports(stream, x, self.weight):
            return self.native.add_rms_norm(stream, None if residual is None else x, self.weight, self.eps), stream
        if residual is not None:
            stream = residual + x
        h = stream.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(stream.dtype), stream
