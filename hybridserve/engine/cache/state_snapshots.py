"""Snapshots of recurrent state at block boundaries, so a prefix hit on a hybrid model resumes exactly.

KV blocks alone cannot serve a prefix hit when some layers are linear attention: the request must also start
from the recurrent state after the hit's last token. A snapshot is a copy of one state slot (every
linear-attention layer's conv tail and recurrent state) taken right after a step that ended on a block
boundary, keyed by the chained hash of the block ending there, so it stands for exactly the tokens up to
that boundary and never for part of a block. The number of snapshots is fixed at start-up; the tensors are
allocated once (fixed addresses, like the state pool's) and the least recently used snapshot is evicted
first. A snapshot overwrites every element of its slot, and a restore every element of the request's.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from hybridserve.engine.cache.prefix_hash import BlockHash
from hybridserve.engine.cache.state_pool import Allocator, StatePool

StateTensors = list[tuple[torch.Tensor, torch.Tensor]]


def _copy(src: StateTensors, src_slot: int, dst: StateTensors, dst_slot: int) -> None:
    for (src_conv, src_state), (dst_conv, dst_state) in zip(src, dst, strict=True):
        dst_conv[dst_slot].copy_(src_conv[src_slot])
        dst_state[dst_slot].copy_(src_state[src_slot])


class StateSnapshots:
    def __init__(self, states: StatePool, num_snapshots: int, device: torch.device, alloc: Allocator) -> None:
        if num_snapshots < 1:
            raise ValueError(f"a snapshot pool needs at least one snapshot, got {num_snapshots}")
        self.states = states
        self.num_snapshots = num_snapshots

        def like(t: torch.Tensor) -> torch.Tensor:
            return alloc((num_snapshots, *t.shape[1:]), t.dtype, device)

        self.layers = [(like(conv), like(state)) for conv, state in states.layers]
        self._addresses = [(c.data_ptr(), r.data_ptr()) for c, r in self.layers]
        self._free = list(range(num_snapshots - 1, -1, -1))
        self._index: OrderedDict[BlockHash, int] = OrderedDict()  # least recently used first
        self.num_restored = 0

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._index

    def save(self, block_hash: BlockHash, slot: int, replace: BlockHash | None = None) -> bool:
        """Copy state slot `slot` into a snapshot keyed by `block_hash`. With `replace`, the snapshot it
        supersedes (if still held) gives up its place. Returns False, only marking it used, when a snapshot
        of `block_hash` exists already."""
        if block_hash in self._index:
            self._index.move_to_end(block_hash)
            return False
        if replace is not None and replace in self._index:
            index = self._index.pop(replace)
        elif self._free:
            index = self._free.pop()
        else:
            _, index = self._index.popitem(last=False)
        _copy(self.states.layers, slot, self.layers, index)
        self._index[block_hash] = index
        return True

    def restore(self, block_hash: BlockHash, slot: int) -> None:
        """Overwrite state slot `slot` with the snapshot of `block_hash`."""
        index = self._index.get(block_hash)
        if index is None:
            raise RuntimeError(f"no state snapshot for block hash {block_hash.hex()}")
        self._index.move_to_end(block_hash)
        _copy(self.layers, index, self.states.layers, slot)
        self.num_restored += 1

    def check_integrity(self) -> None:
        """free + held == total, no snapshot slot both free and held or held twice, tensors never moved."""
        held = list(self._index.values())
        if len(held) + len(self._free) != self.num_snapshots:
            raise AssertionError(f"snapshots: {len(held)} held + {len(self._free)} free != {self.num_snapshots} total")
        if len(set(held) | set(self._free)) != self.num_snapshots:
            raise AssertionError("snapshots: a slot is held twice or both held and free")
        if [(c.data_ptr(), r.data_ptr()) for c, r in self.layers] != self._addresses:
            raise AssertionError("snapshot tensors were reallocated")
