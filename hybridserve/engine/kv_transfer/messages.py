"""The control messages of a KV transfer; the bytes themselves move over NIXL, never through these."""

from __future__ import annotations

import msgspec


class TensorLayout(msgspec.Struct, frozen=True, array_like=True):
    """One registered tensor: `count` blocks (or state slots) along dimension `dim` of `shape`."""

    kind: str  # "kv" (a paged layer's cache), "conv" or "state" (a linear-attention layer's slots)
    shape: list[int]
    dtype: str
    dim: int  # the dimension that indexes blocks or slots
    address: int  # where it lives in the worker's memory (registered with NIXL)
    device: int  # the CUDA device, 0 for host memory

    @property
    def count(self) -> int:
        return self.shape[self.dim]

    def geometry(self) -> tuple[str, list[int], str, int]:
        """What must match between two peers: all but the address and the number of blocks or slots."""
        return self.kind, [n for i, n in enumerate(self.shape) if i != self.dim], self.dtype, self.dim


class TransferEndpoint(msgspec.Struct, frozen=True, array_like=True):
    """A worker's KV-transfer side, announced in its Welcome; the frontend hands a prefill worker's to the decode
    workers that will read from it."""

    agent: str  # the NIXL agent's name: unique per worker process
    metadata: bytes  # the agent's NIXL metadata (its registered memory, how to reach it)
    weights: str  # the model's weights fingerprint
    block_size: int
    memory: str  # "DRAM" or "VRAM"
    tensors: list[TensorLayout]
    lease_s: float  # how long a prefill worker holds a prefilled request without news from its reader
    tp_size: int = 1
    tp_rank: int = 0
    arena: int = 0  # where its staging arena lives (registered with NIXL); 0: it has none


class TransferSource(msgspec.Struct, frozen=True, array_like=True):
    """Where a prefilled request's KV blocks and recurrent state wait: sent by the prefill worker with the
    request's first token, forwarded by the frontend to the decode worker."""

    agent: str  # the prefill worker's NIXL agent
    handle: str  # the request's id there
    block_ids: list[int]  # the blocks covering the prompt, in order
    state_slot: int  # -1: the model keeps no recurrent state
    num_tokens: int  # prompt tokens in those blocks and that state
    num_cached_tokens: int  # of which the prefill worker's prefix cache served
    staged: int = -1  # the blocks' KV packed at this offset of the prefill worker's staging arena; -1: not packed


class RemoteDecode(msgspec.Struct, frozen=True, array_like=True, tag=True):
    """Prefill here, decode elsewhere: after the first token, hold the KV and state for a reader."""


class RemotePrefill(msgspec.Struct, frozen=True, array_like=True, tag=True):
    """Prefilled elsewhere: read the prompt's KV and state from `source`, then decode after `first_token`."""

    source: TransferSource
    first_token: int


KVTransfer = RemoteDecode | RemotePrefill


class AddTransferPeer(msgspec.Struct, frozen=True, array_like=True, tag=True):
    """Frontend → decode worker: a prefill worker it may be asked to read from (sent before the first such
    request). The decode worker checks it against its own layout and remembers the answer."""

    endpoint: TransferEndpoint


# ---- between the connector's two halves (connector_scheduler.py decides, connector_worker.py moves the bytes)


class PullOrder(msgspec.Struct, frozen=True, array_like=True):
    """Read a prefilled request's prompt KV (and state) from `source` into our blocks (and state slot)."""

    request_id: str
    source: TransferSource
    block_ids: list[int]  # ours, as many as the source's
    state_slot: int  # ours; -1: the model keeps no recurrent state


class TransferOrders(msgspec.Struct, array_like=True):
    """The scheduler half's decisions since the worker half last heard from it (one step's, in its plan)."""

    pulls: list[PullOrder] = []  # admitted: start their reads
    # (request, its source) given up by their clients: cancel a read in flight, tell the prefill worker
    drops: list[tuple[str, TransferSource]] = []
    keeps: list[TransferSource] = []  # still queued for room: ask their prefill workers to hold on
    releases: list[str] = []  # held requests let go (read, dropped, lease over, aborted): their staging spans go

    def __bool__(self) -> bool:
        return bool(self.pulls or self.drops or self.keeps or self.releases)


class TransferEvents(msgspec.Struct, array_like=True):
    """What the worker half saw happen since it last reported, for the scheduler half to act on."""

    landed: list[str] = []  # reads complete: the request runs from its first token on
    failed: list[tuple[str, str]] = []  # (request, why) reads over without landing, their blocks free again
    stuck: list[tuple[str, str]] = []  # (request, why) reads over without landing that NIXL still holds
    freed: list[str] = []  # stuck or dropped reads NIXL let go at last: their blocks may be reused
    heard: list[tuple[str, str]] = []  # (kind, request) from decode workers: "done", "drop" or "keep"

    def __bool__(self) -> bool:
        return bool(self.landed or self.failed or self.stuck or self.freed or self.heard)
