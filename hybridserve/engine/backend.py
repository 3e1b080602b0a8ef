"""The backend a model runner computes with, chosen once at start-up (`choose_backend`) from the device and the
kernel settings, behind one interface: how the model's linear layers are packed, which kernels run attention, the
KDA state step and the element-wise ops, and whether decode-only steps replay CUDA graphs. `BACKENDS` holds them
by name:

- `pytorch`: PyTorch ops (on CPU the linear layers packed for oneDNN): what any device runs.
- `native-cpu`: the C kernels of models/layers/native.py, each falling back to the PyTorch op, with a warning
  naming why, when it cannot be built or does not fit the model.
- `cuda`: PyTorch ops, decode-only steps of a graph-capturable model replayed from CUDA graphs (any backend
  replays them where `decode_graphs.available` says the device captures them: only CUDA).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from hybridserve.config import KernelConfig
from hybridserve.engine import decode_graphs
from hybridserve.models.base import CausalLM
from hybridserve.models.cache_specs import AttentionSpec, CacheLayout
from hybridserve.models.layers.linear import NativeLinear, can_pack, pack_linears
from hybridserve.models.layers.native import (
    FusedOps,
    KDADecode,
    KernelUnavailable,
    LinearKernels,
    PagedAttention,
    load_decoder_stack,
    load_fused_ops,
    load_kda_decode,
    load_linear_kernels,
    load_paged_attention,
    use_native_ops,
)
from hybridserve.models.loader.gguf import gguf_blocks
from hybridserve.models.loader.safetensors import pack
from hybridserve.models.registry import state_adapter

logger = logging.getLogger("hybridserve.engine")


class Backend:
    """PyTorch ops. `prepare` runs once the weights are loaded, before the caches; `load_kernels` once the cache
    layout is known. The kernels a step hands the model (attention, state_kernel, fused_ops) stay None here."""

    name: ClassVar[str] = "pytorch"

    def __init__(self, device: torch.device, dtype: torch.dtype, config: KernelConfig) -> None:
        self.device, self.dtype, self.config = device, dtype, config
        self.attention: PagedAttention | None = None
        self.state_kernel: KDADecode | None = None
        self.fused_ops: FusedOps | None = None

    def prepare(self, model: CausalLM, hf_dir: Path) -> None:
        """Swaps the model's linear layers for this backend's, in place."""
        if can_pack(self.device):
            pack_linears(model)

    def load_kernels(self, model: CausalLM, layout: CacheLayout, hf_config: PretrainedConfig) -> None:
        """Loads the kernels a step runs over this cache layout and hands them to the model's modules."""

    def captures_decode_graphs(self, model: CausalLM, layout: CacheLayout) -> bool:
        """Whether decode-only steps replay CUDA graphs (the KV cache then needs a padding block): where the device
        can capture them (decode_graphs.available), for a graph-capturable model without recurrent state."""
        return (
            self.config.cuda_graphs
            and decode_graphs.available(self.device)
            and model.graph_capturable
            and not layout.state_specs
        )


class NativeCPUBackend(Backend):
    name = "native-cpu"

    def prepare(self, model: CausalLM, hf_dir: Path) -> None:
        if not can_pack(self.device):  # a PyTorch built without oneDNN: the linear layers stay as they are
            return
        kernels = self._linear_kernels()
        blocks: dict[str, tuple[str, torch.Tensor]] = {}
        if kernels is not None and self.config.gguf_blocks and self.dtype == torch.float32:
            for kind, named in gguf_blocks(hf_dir).items():
                named = pack(state_adapter(type(model))(named), model.packed_modules, partial=True)
                blocks |= {name: (kind, tensor) for name, tensor in named.items()}
        pack_linears(model, kernels, blocks)
        _log_blocks(model, blocks)

    def _linear_kernels(self) -> LinearKernels | None:
        """The native matmuls for the linear layers, or None (oneDNN's then) with a log line naming why."""
        try:
            kernels = load_linear_kernels()
        except KernelUnavailable as exc:
            logger.warning("linear layers use oneDNN: %s", exc)
            return None
        if self.dtype not in kernels.dtypes:
            logger.info("linear layers use oneDNN: no native %s kernel on this CPU (needs AVX512-BF16)", self.dtype)
            return None
        logger.info("linear layers: %s", kernels.describe(self.dtype))
        return kernels

    def load_kernels(self, model: CausalLM, layout: CacheLayout, hf_config: PretrainedConfig) -> None:
        """Paged attention (decode, rotary + cache write) for the attention layers, the KDA decode step for the
        linear-attention layers, the fused element-wise ops and argmax, and the one-call decoder stack where the
        model has one."""
        try:
            self.fused_ops = load_fused_ops()
            use_native_ops(model, self.fused_ops)
        except KernelUnavailable as exc:
            logger.warning("element-wise ops stay PyTorch ops: %s", exc)
        head_dims = {s.head_dim for s in layout.state_specs}
        if len(head_dims) == 1:
            try:
                self.state_kernel = load_kda_decode(head_dims.pop())
            except KernelUnavailable as exc:
                logger.warning("KDA decode falls back to PyTorch ops: %s", exc)
        specs = {s for s in layout.paged_specs if isinstance(s, AttentionSpec)}
        if len(specs) != 1:
            return
        spec = specs.pop()
        heads = hf_config.num_attention_heads
        group = heads // (getattr(hf_config, "num_key_value_heads", None) or heads)
        try:
            self.attention = load_paged_attention(spec.dtype, spec.head_dim, spec.block_size, group)
        except KernelUnavailable as exc:
            logger.warning("paged attention falls back to PyTorch ops: %s", exc)
            return
        logger.info(
            "paged attention: native kernels (head_dim %d, %d query heads per KV head, %s%s%s)",
            spec.head_dim,
            group,
            spec.dtype,
            ", bf16 dot-product instructions" if self.attention.bf16_dot else "",
            ", prefills too" if self.attention.prefills else "",
        )
        if self.fused_ops is not None:
            try:
                model.use_decoder_stack(load_decoder_stack(), self.fused_ops, self.attention)
                logger.info("decode-only steps: every decoder layer in one native call")
            except KernelUnavailable as exc:
                logger.info("decode-only steps go layer by layer: %s", exc)


class CUDABackend(Backend):
    """PyTorch ops on CUDA, where decode_graphs.available lets decode-only steps replay CUDA graphs."""

    name = "cuda"


BACKENDS: dict[str, type[Backend]] = {b.name: b for b in (Backend, NativeCPUBackend, CUDABackend)}


def choose_backend(device: torch.device, dtype: torch.dtype, config: KernelConfig) -> Backend:
    """cuda on a CUDA device; native-cpu on CPU unless --no-native-kernels; else pytorch."""
    if device.type == "cuda":
        name = "cuda"
    elif device.type == "cpu" and config.native_kernels:
        name = "native-cpu"
    else:
        name = "pytorch"
    return BACKENDS[name](device, dtype, config)


def _log_blocks(model: nn.Module, blocks: dict[str, tuple[str, torch.Tensor]]) -> None:
    """Says how many matmuls sum their weights from GGUF blocks, and the bytes that saves."""
    native = [m for m in model.modules() if isinstance(m, NativeLinear)]
    packed = [m for m in native if m.blocks is not None]
    if packed:
        kinds = sorted({str(m.blocks) for m in packed})
        logger.info(
            "%d of %d matmuls sum their weights from GGUF blocks (%s), bitwise as float32: %.0f MiB read instead "
            "of %.0f MiB",
            len(packed),
            len(native),
            ", ".join(kinds),
            sum(m.panels.numel() for m in packed) / 1024**2,
            sum(m.weight_numel * 4 for m in packed) / 1024**2,
        )
    elif blocks:
        logger.warning("the model's GGUF blocks went unused: no matmul could be packed from them")
