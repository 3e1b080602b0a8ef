"""Recurrent-state slots for linear-attention layers: one fixed-size slot per running request.

Every tensor is allocated once, at start-up, and never reallocated (fixed addresses: a captured CUDA graph
or a transfer engine may hold them). A slot is zeroed when it is handed out, unless the caller overwrites it
at once (a prefix hit restoring a snapshot), so a request never sees another request's state.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridserve.models.cache_specs import LinearStateSpec

Allocator = Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor]


class StatePool:
    def __init__(
        self, specs: tuple[LinearStateSpec, ...], num_slots: int, device: torch.device, alloc: Allocator
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"a state pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        # Per linear-attention layer, in layer order: (conv tails, recurrent states).
        self.layers = [
            (alloc(s.conv_shape(num_slots), s.dtype, device), alloc(s.state_shape(num_slots), torch.float32, device))
            for s in specs
        ]
        self._addresses = [(c.data_ptr(), r.data_ptr()) for c, r in self.layers]
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.owner: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def slot(self, request_id: str) -> int:
        return self.owner[request_id]

    def allocate(self, request_id: str, zero: bool = True) -> int:
        """Hand out a slot; `zero=False` only for a caller that overwrites all of it before the next step."""
        if request_id in self.owner:
            raise RuntimeError(f"request {request_id} already holds state slot {self.owner[request_id]}")
        if not self._free:
            raise RuntimeError("no free state slot")
        slot = self._free.pop()
        if zero:
            for conv, state in self.layers:
                conv[slot].zero_()
                state[slot].zero_()
        self.owner[request_id] = slot
        return slot

    def free(self, request_id: str) -> None:
        slot = self.owner.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def check_integrity(self) -> None:
        """free + used == total, no slot both free and owned or owned twice, tensors never moved."""
        used = list(self.owner.values())
        if len(used) + len(self._free) != self.num_slots:
            raise AssertionError(f"state pool: {len(used)} used + {len(self._free)} free != {self.num_slots} total")
        if len(set(used) | set(self._free)) != self.num_slots:
            raise AssertionError("state pool: a slot is owned twice or both owned and free")
        if [(c.data_ptr(), r.data_ptr()) for c, r in self.layers] != self._addresses:
            raise AssertionError("state pool tensors were reallocated")
