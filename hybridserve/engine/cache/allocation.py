"""The runner's cache memory, allocated once from the model's per-layer cache specs: a paged tensor per attention
layer, and for linear-attention layers the state pool's slots (with snapshots for prefix hits), each layer's
cache in layer order as the model's forward takes them."""

from __future__ import annotations

import functools
import logging
import mmap
import time
from dataclasses import dataclass

import torch

from hybridserve.config import CacheConfig
from hybridserve.engine.cache.state_tensors import StateTensors
from hybridserve.models.base import LayerCache
from hybridserve.models.cache_specs import CacheLayout, LinearStateSpec

logger = logging.getLogger("hybridserve.engine")


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, prefault: bool = False) -> torch.Tensor:
    """A zero-filled tensor. On CPU it is backed by an anonymous mapping, so pages cost memory only once
    written: a large KV cache does not take its full size in RAM until the blocks are used. With `prefault`
    every page is written now instead, so none is faulted in later inside a step."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = dtype.itemsize
    for dim in shape:
        nbytes *= dim
    tensor = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)
    return tensor.zero_() if prefault else tensor


@dataclass
class Caches:
    """Per layer, in layer order, its cache (`kv_caches`), and the state pool's tensors behind the linear-attention
    layers' entries (None for a model without them)."""

    kv_caches: list[LayerCache]
    state_tensors: StateTensors | None
    num_state_snapshots: int


def allocate_caches(
    layout: CacheLayout,
    num_blocks: int,
    config: CacheConfig,
    num_state_slots: int,
    device: torch.device,
    padding_block: bool = False,
    backups: bool = False,
) -> Caches:
    """The caches for `num_blocks` KV blocks (one more with `padding_block`, for the padding rows of captured decode
    graphs) and, where the layout has state specs, `num_state_slots` state slots with the snapshots prefix caching
    keeps (and a backup row per slot with `backups`, for speculative decoding). With config.kv_cache_prefault every
    page is written now."""
    alloc = functools.partial(zeroed, prefault=config.kv_cache_prefault)
    start = time.perf_counter()
    physical = num_blocks + (1 if padding_block else 0)
    paged = iter([alloc(s.shape(physical), s.dtype, device) for s in layout.paged_specs])
    logger.info(
        "KV cache: %d blocks of %d tokens (%.2f GiB)",
        num_blocks,
        config.block_size,
        num_blocks * layout.bytes_per_block / 1024**3,
    )
    state_tensors, snapshots = None, 0
    states = iter([])
    if layout.state_specs:
        if config.enable_prefix_caching:
            snapshots = num_state_slots if config.num_state_snapshots is None else config.num_state_snapshots
        state_tensors = StateTensors(layout.state_specs, num_state_slots, snapshots, device, alloc, backups=backups)
        states = iter(state_tensors.slots)
        logger.info("recurrent state: %d slots of %.2f MiB", num_state_slots, layout.bytes_per_state_slot / 1024**2)
        if snapshots:
            logger.info("recurrent-state snapshots for prefix hits: %d", snapshots)
    if config.kv_cache_prefault and device.type == "cpu":
        logger.info("KV cache and state pool written at start-up in %.1f s", time.perf_counter() - start)
    caches = [next(states) if isinstance(s, LinearStateSpec) else next(paged) for s in layout.layer_specs]
    return Caches(caches, state_tensors, snapshots)
