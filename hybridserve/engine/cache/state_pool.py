"""Recurrent-state slots for linear-attention layers: the books of one fixed-size slot per running request.

The slots' tensors belong to the model runner (`state_tensors.py`); this side only decides which request owns
which slot. A slot handed out is zeroed by the step that first uses it, unless that step overwrites it with a
snapshot (a prefix hit), so a request never sees another request's state.
"""

from __future__ import annotations


class StatePool:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a state pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.owner: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def slot(self, request_id: str) -> int:
        return self.owner[request_id]

    def allocate(self, request_id: str) -> int:
        if request_id in self.owner:
            raise RuntimeError(f"request {request_id} already holds state slot {self.owner[request_id]}")
        if not self._free:
            raise RuntimeError("no free state slot")
        slot = self._free.pop()
        self.owner[request_id] = slot
        return slot

    def free(self, request_id: str) -> None:
        slot = self.owner.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def check_integrity(self) -> None:
        """free + used == total, no slot both free and owned or owned twice."""
        used = list(self.owner.values())
        if len(used) + len(self._free) != self.num_slots:
            raise AssertionError(f"state pool: {len(used)} used + {len(self._free)} free != {self.num_slots} total")
        if len(set(used) | set(self._free)) != self.num_slots:
            raise AssertionError("state pool: a slot is owned twice or both owned and free")
