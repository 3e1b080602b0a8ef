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
