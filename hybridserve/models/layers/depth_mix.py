"""Block attention residuals (Kimi K3): a sublayer's input is a softmax mix over depth instead of a sum.

The stream holds sealed block outputs (the token embedding is block 0) and the running sum of the current
block. Before each sublayer, and once more before the final norm, the input is

    h = sum_i softmax_i(w . RMSNorm(v_i)) v_i      over v = [sealed blocks..., running sum]

with a learned query w (zero at init, so an untrained mix is the plain mean). Mixing is per token: it
carries nothing across tokens, so it needs no cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class DepthMix(nn.Module):
    """One learned query over the depth stream. Checkpoint names: `{name}_proj.weight` [1, hidden] (the
    query) and `{name}_norm.weight` [hidden] (the key norm's weight)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.proj = nn.Parameter(torch.zeros(1, hidden_size))
        self.norm = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, values: torch.Tensor) -> torch.Tensor:
        """values: [N, T, hidden] -> [T, hidden]."""
        keys = F.rms_norm(values.float(), (values.shape[-1],), self.norm.float(), self.eps)
        weights = (keys @ self.proj.float().squeeze(0)).softmax(0)  # [N, T]
        return torch.einsum("nt,nth->th", weights, values.float()).to(values.dtype)


class DepthStream:
    """The blocks and the running sum of one forward pass."""

    def __init__(self, embedding: torch.Tensor) -> None:
        self.blocks = [embedding]
        self.partial: torch.Tensor | None = None

    def values(self) -> torch.Tensor:
        return torch.stack(self.blocks if self.partial is None else [*self.blocks, self.partial])

    def add(self, out: torch.Tensor) -> None:
        self.partial = out if self.partial is None else self.partial + out

    def seal(self) -> None:
        if self.partial is not None:
            self.blocks.append(self.partial)
            self.partial = None
