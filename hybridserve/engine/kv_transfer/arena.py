"""The staging arena: one registered byte region, carved into a contiguous span per request.

A request whose KV blocks lie scattered over the pool would be read as thousands of block-sized descriptors;
packed into a span here it is one. The prefill side packs a fragmented request at hold and frees the span when
the reader is done (or the lease ends); the decode side reads into a span when its own blocks are fragmented and
scatters it into them when the read lands. The arena is bounded: a request that finds no room is read straight
from (or into) its blocks, so the arena never holds a request back.
"""

from __future__ import annotations

import bisect

import torch

ALIGN = 64  # spans start on a cache line, so a typed view of any cache dtype fits


class StagingArena:
    def __init__(self, tensor: torch.Tensor) -> None:
        if tensor.dtype != torch.uint8 or tensor.dim() != 1:
            raise ValueError(f"a staging arena is a flat uint8 tensor, got {tensor.dtype} {tuple(tensor.shape)}")
        self.tensor = tensor
        self.nbytes = tensor.numel()
        self._free: list[tuple[int, int]] = [(0, self.nbytes)] if self.nbytes else []  # (start, size), by start
        self._spans: dict[str, tuple[int, int]] = {}  # owner → (start, size)

    @property
    def address(self) -> int:
        return self.tensor.data_ptr()

    @property
    def used(self) -> int:
        return sum(size for _, size in self._spans.values())

    def take(self, owner: str, nbytes: int) -> int | None:
        """The start of a span of `nbytes` for `owner` (first fit), or None when no free span is that large."""
        if owner in self._spans:
            raise ValueError(f"{owner} already holds a span of the staging arena")
        size = -(-nbytes // ALIGN) * ALIGN
        for i, (start, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (start + size, free - size)
                self._spans[owner] = (start, size)
                return start
        return None

    def give_back(self, owner: str) -> bool:
        """Frees `owner`'s span (False: it held none), merging it with its free neighbours."""
        span = self._spans.pop(owner, None)
        if span is None:
            return False
        start, size = span
        i = bisect.bisect(self._free, span)
        if i < len(self._free) and start + size == self._free[i][0]:
            size += self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == start:
            start, size = self._free[i - 1][0], self._free[i - 1][1] + size
            i -= 1
            del self._free[i]
        self._free.insert(i, (start, size))
        return True

    def view(self, owner: str) -> torch.Tensor:
        start, size = self._spans[owner]
        return self.tensor[start : start + size]

    @property
    def owners(self) -> list[str]:
        return list(self._spans)

    def check_integrity(self) -> None:
        """The spans and the free list tile the arena exactly, with no two free neighbours left unmerged."""
        pieces = sorted([*self._spans.values(), *self._free])
        at = 0
        for start, size in pieces:
            if start != at or size <= 0:
                raise AssertionError(f"staging arena: a span at {start} of {size} bytes where {at} was expected")
            at += size
        if at != self.nbytes:
            raise AssertionError(f"staging arena: spans and free space cover {at} of {self.nbytes} bytes")
        for (a, n), (b, _) in zip(self._free, self._free[1:], strict=False):
            if a + n == b:
                raise AssertionError(f"staging arena: free spans at {a} and {b} were not merged")
