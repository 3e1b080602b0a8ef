"""The model runner's recurrent-state memory: the state pool's slots and the snapshot copies of them.

Per linear-attention layer a conv-tail tensor and a float32 state tensor with a row per slot, and the same
shapes with a row per snapshot (and, with speculative decoding, a backup row per slot: its state before a draft
was verified, to go back to when the draft is rejected). Every tensor is allocated once, at start-up, and never
reallocated (fixed addresses: a captured CUDA graph or a transfer engine may hold them). The scheduler's books
(state_pool.py, state_snapshots.py) decide which rows; a step plan says what to do with them, and this module
does it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridserve.models.cache_specs import LinearStateSpec

Allocator = Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor]
Layers = list[tuple[torch.Tensor, torch.Tensor]]


def _copy(src: Layers, src_row: int, dst: Layers, dst_row: int) -> None:
    for (src_conv, src_state), (dst_conv, dst_state) in zip(src, dst, strict=True):
        dst_conv[dst_row].copy_(src_conv[src_row])
        dst_state[dst_row].copy_(src_state[src_row])


class StateTensors:
    def __init__(
        self,
        specs: tuple[LinearStateSpec, ...],
        num_slots: int,
        num_snapshots: int,
        device: torch.device,
        alloc: Allocator,
        backups: bool = False,
    ) -> None:
        def layers(rows: int) -> Layers:
            return [
                (alloc(s.conv_shape(rows), s.dtype, device), alloc(s.state_shape(rows), torch.float32, device))
                for s in specs
            ]

        # Per linear-attention layer, in layer order: (conv tails, recurrent states).
        self.slots = layers(num_slots)
        self.snapshots = layers(num_snapshots) if num_snapshots else []
        self.backups = layers(num_slots) if backups else []
        self._addresses = self._pointers()

    def _pointers(self) -> list[int]:
        return [t.data_ptr() for layer in (*self.slots, *self.snapshots, *self.backups) for t in layer]

    def zero(self, slot: int) -> None:
        for conv, state in self.slots:
            conv[slot].zero_()
            state[slot].zero_()

    def save(self, slot: int, snapshot: int) -> None:
        """Overwrite every element of `snapshot` with state slot `slot`."""
        _copy(self.slots, slot, self.snapshots, snapshot)

    def restore(self, snapshot: int, slot: int) -> None:
        """Overwrite every element of state slot `slot` with `snapshot`."""
        _copy(self.snapshots, snapshot, self.slots, slot)

    def back_up(self, slot: int) -> None:
        """Keep state slot `slot` as it is before a step that verifies a draft."""
        _copy(self.slots, slot, self.backups, slot)

    def roll_back(self, slot: int) -> None:
        """State slot `slot` as it was at its last `back_up`."""
        _copy(self.backups, slot, self.slots, slot)

    def check_integrity(self) -> None:
        if self._pointers() != self._addresses:
            raise AssertionError("recurrent-state tensors were reallocated")
