"""CPU matmuls with weights packed once at start-up, swapped in for nn.Linear. CUDA keeps nn.Linear.

Same math as nn.Linear, the weight laid out once for the kernel instead of on every call:
- the native kernels of the linear library (linear_f32.c, linear_bf16.c, linear_amx.c; panels of output
  columns summed in registers, or in AMX tiles): float32
  on every CPU, 1.2-1.9x oneDNN's float32 GEMM on an AVX2 CPU at decode batch sizes; bfloat16 on CPUs with
  AVX512-BF16, 1.3-2x oneDNN's bf16 GEMM at 1-64 rows on a CPU with AMX (benchmarks/native_kernels.py).
  Every output element is summed in one fixed order, so a row's result does not depend on its batch.
  A float32 weight that came from a GGUF's Q4_0, Q4_1 or Q8_0 blocks can be packed from them instead (19% or 28% of
  the bytes, dequantized in the cache as the sums need it): the same sums bit for bit, checked weight by
  weight at packing.
- otherwise (no C compiler, native kernels off, bf16 without AVX512-BF16): weights pre-packed for oneDNN,
  which is worth ~2x at batch 1 and 10-20% at batch 64 over nn.Linear; bf16 on a CPU whose oneDNN has no bf16
  matmul (no AVX512, no AVX-NE-CONVERT) keeps nn.Linear.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
from torch import nn

from hybridserve.models.layers.native import LinearKernels

logger = logging.getLogger("hybridserve.engine")

# A typical decode batch; the packed layout works for every batch size, this only tunes it.
_BATCH_HINT = 64


class PackedLinear(nn.Module):
    """oneDNN's matmul over a weight reordered for it."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.out_features = linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), _BATCH_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class NativeLinear(nn.Module):
    """The native kernel over the weight's panels (float32 or bfloat16); inputs of any leading shape."""

    def __init__(
        self,
        linear: nn.Linear,
        kernels: LinearKernels,
        float_out: bool = False,
        argmax: bool = False,
        blocks: tuple[str, torch.Tensor] | None = None,
        gated: bool = False,
    ) -> None:
        """argmax: keep what argmax() needs, where the kernels can take it (a head without bias, in bf16 on a CPU
        with AVX512-VNNI): the weight row-major too, and its int8 copy. blocks: the float32 weight's GGUF blocks
        (kind, tensor), to pack from if they give it bitwise (else the float32 weight is packed, with a warning).
        gated: a SiLU-gated MLP's [gate; up] projection in float32, whose forward() returns silu(gate) * up
        ([..., out_features / 2]), summed and activated in the same tiles."""
        super().__init__()
        self.gated = gated
        if gated and linear.weight.dtype != torch.float32:
            raise ValueError(f"a gated native matmul is float32, got a {linear.weight.dtype} weight")
        self.in_features = linear.in_features
        self.out_features = linear.out_features // 2 if gated else linear.out_features
        self.weight_numel = linear.weight.numel()  # the checkpoint's weight, whatever the output
        self.kernels, self.float_out = kernels, float_out
        weight = linear.weight.detach()
        bias = None if linear.bias is None else linear.bias.detach()
        if gated:  # rows in the order of the gated panels: a panel's gate columns, then its up columns
            weight = kernels.pack_gated(weight)
            bias = None if bias is None else kernels.pack_gated(bias)
            blocks = None if blocks is None else (blocks[0], kernels.pack_gated(blocks[1]))
        panels = None if blocks is None else kernels.pack_blocks(weight, blocks[1], blocks[0])
        if blocks is not None and panels is None:
            logger.warning(
                "%s blocks of a %s weight do not give its float32 values bitwise: packing the float32 values",
                blocks[0],
                tuple(weight.shape),
            )
        self.blocks = None if panels is None or blocks is None else blocks[0]  # the panels' GGUF block kind
        self.panels = kernels.pack(weight) if panels is None else panels
        self.bias = None if bias is None else bias.float().contiguous()
        # argmax(): the weight row-major (a tied head's is the embedding's: no copy) and its int8 copy
        self.argmax_tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        if argmax and self.bias is None and kernels.can_argmax(weight):
            weight = weight.contiguous()
            self.argmax_tables = (weight, *kernels.pack_argmax(weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        y = self.kernels.linear(
            rows, self.panels, self.out_features, self.bias, self.float_out, self.blocks, gated=self.gated
        )
        return y.view(*x.shape[:-1], self.out_features)

    def argmax(self, x: torch.Tensor, n: int) -> torch.Tensor | None:
        """forward(x)[:, :n].float().argmax(-1) for x [M, in_features], the same tokens, without most of the
        outputs (LinearKernels.argmax; a row it cannot tell so gets its outputs computed); None without the int8
        copy."""
        if self.argmax_tables is None:
            return None
        n = min(n, self.out_features)
        tokens = self.kernels.argmax(x, *self.argmax_tables, n)
        undecided = (tokens < 0).nonzero().flatten()
        if undecided.numel():
            logits = self.kernels.linear(x[undecided], self.panels, self.out_features, self.bias, True, self.blocks)
            tokens[undecided] = logits[:, :n].argmax(-1)
        return tokens


def can_pack(device: torch.device) -> bool:
    return device.type == "cpu" and torch.backends.mkldnn.is_available()


def pack_linears(
    model: nn.Module,
    kernels: LinearKernels | None = None,
    blocks: Mapping[str, tuple[str, torch.Tensor]] | None = None,
    prefix: str = "",
) -> None:
    """Replace every nn.Linear in `model`, in place: by a NativeLinear where `kernels` are given and take the
    weight's dtype, else by a PackedLinear where oneDNN takes it (bf16 needs AVX512 or AVX-NE-CONVERT; without
    them a bf16 layer stays an nn.Linear, PyTorch's own bf16 matmul). A native head (`lm_head`) returns float32
    logits, its sums unrounded: in bf16, logits a step apart (0.125 at 25) are near ties that rounding makes
    exact, and the argmax would then pick the lower token id, not the larger logit. It keeps an int8 copy for
    argmax() too. blocks: GGUF blocks (kind, tensor) by parameter name (`<module>.weight`), which native float32
    layers are packed from. A module's projections named in its `gated_projections` (a SiLU-gated MLP's [gate;
    up]) become gated NativeLinears in float32: their forward() is the activated output (activation.silu_gated)."""
    blocks = blocks or {}
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            if kernels is not None and child.weight.dtype in kernels.dtypes:
                head = name == "lm_head"
                float32 = child.weight.dtype == torch.float32
                own = blocks.get(f"{prefix}{name}.weight") if float32 else None
                gated = float32 and name in getattr(model, "gated_projections", ())
                setattr(model, name, NativeLinear(child, kernels, head, argmax=head, blocks=own, gated=gated))
            elif child.weight.dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported():
                setattr(model, name, PackedLinear(child))
        else:
            pack_linears(child, kernels, blocks, f"{prefix}{name}.")
