"""Snapshots of recurrent state at block boundaries, so a prefix hit on a hybrid model resumes exactly: the books.

KV blocks alone cannot serve a prefix hit when some layers are linear attention: the request must also start
from the recurrent state after the hit's last token. A snapshot is a copy of one state slot (every
linear-attention layer's conv tail and recurrent state) taken right after a step that ended on a block
boundary, keyed by the chained hash of the block ending there, so it stands for exactly the tokens up to
that boundary and never for part of a block. Their number is fixed at start-up and the least recently used is
evicted first. The copies themselves are the model runner's (`state_tensors.py`): the scheduler books a save
into a snapshot for after a step (`reserve`), and the snapshot becomes findable once that step has run
(`commit`), so no request in the same step restores a copy not yet written.
"""

from __future__ import annotations

from collections import OrderedDict

from hybridserve.engine.cache.events import KVEventLog
from hybridserve.engine.cache.prefix_hash import BlockHash


class StateSnapshots:
    def __init__(self, num_snapshots: int, events: KVEventLog | None = None) -> None:
        """`events`, if given, hears of every snapshot made findable and every findable one evicted."""
        if num_snapshots < 1:
            raise ValueError(f"a snapshot pool needs at least one snapshot, got {num_snapshots}")
        self.num_snapshots = num_snapshots
        self._free = list(range(num_snapshots - 1, -1, -1))
        self._index: OrderedDict[BlockHash, int] = OrderedDict()  # least recently used first
        self._pending: set[BlockHash] = set()  # reserved for the step being planned, not yet written
        self.num_restored = 0
        self.events = events

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._index and block_hash not in self._pending

    def reserve(self, block_hash: BlockHash, replace: BlockHash | None = None) -> int | None:
        """The snapshot that the planned step's save of `block_hash` writes. With `replace`, the snapshot it
        supersedes (if still held) gives up its place. None, only marking it used, when a snapshot of
        `block_hash` exists (or is reserved) already."""
        if block_hash in self._index:
            self._index.move_to_end(block_hash)
            return None
        if replace is not None and replace in self._index:
            index = self._index.pop(replace)
            self._forget(replace)
        elif self._free:
            index = self._free.pop()
        else:
            evicted, index = self._index.popitem(last=False)
            self._forget(evicted)
        self._index[block_hash] = index
        self._pending.add(block_hash)
        return index

    def _forget(self, block_hash: BlockHash) -> None:
        """A snapshot gave up its place: one not yet written was never findable, so only others are news."""
        if block_hash in self._pending:
            self._pending.discard(block_hash)
        elif self.events is not None:
            self.events.snapshot_removed(block_hash)

    def commit(self) -> None:
        """The planned step ran: its saved snapshots hold their states and are findable."""
        if self.events is not None and self._pending:
            for block_hash in self._index:  # in LRU order, so the announcement order is deterministic
                if block_hash in self._pending:
                    self.events.snapshot_stored(block_hash)
        self._pending.clear()

    def findable(self) -> list[BlockHash]:
        return [h for h in self._index if h not in self._pending]

    def abandon(self) -> None:
        """The planned step failed: its reserved snapshots were never written and are given back."""
        for block_hash in self._pending:
            self._free.append(self._index.pop(block_hash))
        self._pending.clear()

    def restore(self, block_hash: BlockHash) -> int:
        """The snapshot to copy into a request's slot for a prefix hit ending at `block_hash`."""
        if block_hash not in self:
            raise RuntimeError(f"no state snapshot for block hash {block_hash.hex()}")
        self._index.move_to_end(block_hash)
        self.num_restored += 1
        return self._index[block_hash]

    def check_integrity(self) -> None:
        """free + held == total, no snapshot slot both free and held or held twice."""
        held = list(self._index.values())
        if len(held) + len(self._free) != self.num_snapshots:
            raise AssertionError(f"snapshots: {len(held)} held + {len(self._free)} free != {self.num_snapshots} total")
        if len(set(held) | set(self._free)) != self.num_snapshots:
            raise AssertionError("snapshots: a slot is held twice or both held and free")
        if not self._pending <= set(self._index):
            raise AssertionError("snapshots: a reserved snapshot is not held")
