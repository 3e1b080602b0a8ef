"""Decode-only steps replayed from CUDA graphs.

On a GPU a small model's decode step is bound by kernel launches, not by the GPU: SmolLM2-135M launches a few
dozen kernels a layer, and an H200 spent 11 ms a step at batch 1 launching them op by op. A CUDA graph records a
step's launches once and replays them all with one call. A graph fixes the shapes and addresses of its tensors,
so one is captured per padded shape, over static input buffers that each step's inputs are copied into:

- the batch is padded to 1, 2, 4 or a multiple of 8 requests, up to max_num_seqs (5 requests replay the graph
  of 8);
- the block tables are padded to a power-of-two width, up to the longest context (a step whose longest request
  holds 20 blocks replays the graph of 32; keys past each request's length are masked, as in an eager step).

A padding row decodes token 0 at position 0 with a context of one key, writes its key and value into a scratch
block that no request owns (the runner allocates it past the pool's blocks), and its output is dropped. Graphs
are captured the first time a step needs their shape, share one memory pool and keep their outputs alive, so
they may replay in any order. Steps with prefills or draft tokens, and models with recurrent state, run eagerly.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from hybridserve.models.layers.attention import AttentionMetadata, DecodeGroup, decode_bias

logger = logging.getLogger("hybridserve.engine")

Step = Callable[[], torch.Tensor]


def available(device: torch.device) -> bool:
    """Whether steps on `device` can be captured: CUDA only."""
    return device.type == "cuda"


def batch_sizes(max_num_seqs: int) -> list[int]:
    """The padded batch sizes: 1, 2, 4, then multiples of 8, the last one max_num_seqs itself."""
    sizes = [n for n in (1, 2, 4) if n < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return [*sizes, max_num_seqs]


def table_widths(max_blocks: int) -> list[int]:
    """The padded block-table widths: powers of two, the last one max_blocks itself."""
    widths = []
    width = 1
    while width < max_blocks:
        widths.append(width)
        width *= 2
    return [*widths, max_blocks]


def _bucket(sizes: list[int], n: int) -> int | None:
    """The smallest of `sizes` that holds n, None past the largest."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


class _Graph:
    """One captured shape: its static inputs (one int64 buffer, so a step's inputs are one host-to-device copy)
    and the step that reads them."""

    def __init__(self, batch: int, width: int, device: torch.device) -> None:
        self.batch, self.width = batch, width
        self.inputs = torch.zeros(4 * batch + batch * width, dtype=torch.long, device=device)
        self.token_ids, self.positions, self.slots, self.context_lens = self.inputs[: 4 * batch].view(4, batch)
        self.block_tables = self.inputs[4 * batch :].view(batch, width)
        self.replay: Step  # set once captured


class DecodeGraphs:
    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_num_seqs: int,
        max_blocks: int,
        scratch_block: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """`scratch_block`: a block of every paged cache that no request owns, for the padding rows' writes."""
        self.model, self.kv_caches = model, kv_caches
        self.block_size, self.dtype, self.device = block_size, dtype, device
        self.sizes = batch_sizes(max_num_seqs)
        self.widths = table_widths(max_blocks)
        self.scratch_slot = scratch_block * block_size
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.disabled: str | None = None  # why graphs are off for good, after a capture failed

    def run(
        self, token_ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]], lens: list[int]
    ) -> torch.Tensor | None:
        """Hidden states [B, hidden] of a decode-only step of B requests (one token each: its id, position, cache
        slot, block table and context length), from the graph of its padded shape; valid until the next call.
        None if graphs are off (a capture failed) or the step is larger than any graph (more requests than
        max_num_seqs, or a table past max_model_len): the caller runs the step eagerly."""
        b = len(token_ids)
        batch, width = _bucket(self.sizes, b), _bucket(self.widths, max(len(t) for t in tables))
        if self.disabled is not None or batch is None or width is None:
            return None
        graph = self._graph(batch, width)
        if graph is None:
            return None
        pad = graph.batch - b
        host = np.zeros(graph.inputs.shape[0], dtype=np.int64)
        head = host[: 4 * graph.batch].reshape(4, graph.batch)
        head[0, :b], head[1, :b], head[2, :b], head[3, :b] = token_ids, positions, slots, lens
        if pad:
            head[2, b:], head[3, b:] = self.scratch_slot, 1
        table = host[4 * graph.batch :].reshape(graph.batch, graph.width)
        for row, blocks in zip(table, tables, strict=False):
            row[: len(blocks)] = blocks
        graph.inputs.copy_(torch.from_numpy(host))
        return graph.replay()[:b]

    def _graph(self, batch: int, width: int) -> _Graph | None:
        graph = self.graphs.get((batch, width))
        if graph is not None:
            return graph
        graph = _Graph(batch, width, self.device)
        # All rows are padding while capturing: the warm-up run before the capture writes the scratch block only.
        graph.slots.fill_(self.scratch_slot)
        graph.context_lens.fill_(1)
        try:
            graph.replay = _record(self._step(graph), self.device, self.pool)
        except RuntimeError as exc:  # torch.OutOfMemoryError too
            self.disabled = f"capturing the decode step for batch {batch}, {width} blocks failed: {exc}"
            logger.warning("%s; decode steps run eagerly from now on", self.disabled)
            return None
        self.graphs[batch, width] = graph
        logger.info("captured the decode step for batch %d, %d blocks (%d graphs)", batch, width, len(self.graphs))
        return graph

    def _step(self, graph: _Graph) -> Step:
        """The decode step over `graph`'s static inputs, built as the eager step builds it (attention metadata
        with a decode group only)."""
        key_positions = torch.arange(graph.width * self.block_size, device=self.device)
        rows = torch.arange(graph.batch, device=self.device)
        tables = graph.block_tables

        def step() -> torch.Tensor:
            bias = decode_bias(graph.context_lens, key_positions, self.dtype)
            group = DecodeGroup(rows, tables, tables.flatten(), graph.context_lens, bias)
            meta = AttentionMetadata(graph.slots, group, [])
            return self.model(graph.token_ids, graph.positions, self.kv_caches, meta)

        return step


def _record(step: Step, device: torch.device, pool: tuple[int, int] | None) -> Step:
    """`step` captured in a CUDA graph: a function that replays it and returns its (static) output. Elsewhere (the
    tests on CPU) `step` itself, which exercises the same static buffers and padding eagerly."""
    if device.type != "cuda":
        return step
    # One run outside the graph first, on a side stream as capture needs: cuBLAS picks its kernels and sets up its
    # workspace then, not inside the capture.
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # Only this thread's calls may break the capture: a KV transfer's copies run on NIXL's thread meanwhile.
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = step()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay
