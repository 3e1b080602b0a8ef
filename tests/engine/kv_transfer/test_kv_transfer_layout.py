"""The byte plan of a KV transfer, checked by carrying it out with memmove in one process: reading a request's
scattered blocks (and state slot) into another pool lands exactly the remote bytes, whether either side reads
its blocks directly or through a packed staging span; and the staging arena's spans tile it exactly."""

from __future__ import annotations

import ctypes

import pytest
import torch

from hybridserve.engine.kv_transfer.arena import ALIGN, StagingArena
from hybridserve.engine.kv_transfer.layout import _layout, kv_bytes_per_block, mean_run, pack, read_descriptors, unpack


def _pool(seed: int) -> list[tuple[str, torch.Tensor, int]]:
    """An attention layer ([2, kv_heads, blocks, block, head_dim], bf16), an MLA layer ([blocks, block, latent],
    float32), and a linear-attention layer's conv and state slots."""
    g = torch.Generator().manual_seed(seed)
    return [
        ("kv", torch.randn(2, 3, 20, 4, 8, generator=g).to(torch.bfloat16), 2),
        ("kv", torch.randn(20, 4, 12, generator=g), 0),
        ("conv", torch.randn(5, 6, 3, generator=g), 0),
        ("state", torch.randn(5, 2, 4, 4, generator=g), 0),
    ]


def _carry_out(parts: dict) -> None:
    for part in parts.values():
        for (dst, n, _), (src, m, _) in zip(part.local.tolist(), part.remote.tolist(), strict=True):
            assert n == m
            ctypes.memmove(dst, src, n)


def _block(t: torch.Tensor, dim: int, i: int) -> torch.Tensor:
    return t.select(dim, i)


@pytest.mark.parametrize("staged", [(False, False), (True, False), (False, True), (True, True)])
def test_a_read_lands_the_remote_bytes_with_or_without_staging(staged: tuple[bool, bool]) -> None:
    remote, local = _pool(1), _pool(2)
    layouts = [[_layout(kind, t, dim) for kind, t, dim in pool] for pool in (local, remote)]
    src_blocks, dst_blocks = [7, 3, 4, 5, 19, 0], [1, 2, 3, 9, 11, 10]  # runs on neither side line up
    kv = [[(t, dim) for kind, t, dim in pool if kind == "kv"] for pool in (local, remote)]
    nbytes = len(src_blocks) * kv_bytes_per_block(layouts[0])
    spans = [torch.zeros(nbytes + ALIGN, dtype=torch.uint8) for _ in range(2)]
    if staged[0]:
        pack(kv[1], src_blocks, spans[1][:nbytes])
    at = (spans[1].data_ptr() if staged[0] else None, spans[0].data_ptr() if staged[1] else None)
    parts = read_descriptors(layouts[0], layouts[1], (src_blocks, dst_blocks), (4, 1), at)
    _carry_out(parts)
    if staged[1]:
        unpack(kv[0], dst_blocks, spans[0][:nbytes])
    assert parts["kv"].nbytes == nbytes
    for (kind, ours, dim), (_, theirs, _) in zip(local, remote, strict=True):
        if kind == "kv":
            for s, d in zip(src_blocks, dst_blocks, strict=True):
                assert torch.equal(_block(ours, dim, d), _block(theirs, dim, s)), (kind, s, d)
        else:
            assert torch.equal(ours[1], theirs[4])
    untouched = _pool(2)[0][1]
    assert torch.equal(local[0][1][:, :, 0], untouched[:, :, 0])  # block 0 was nobody's destination


def test_descriptors_merge_runs_consecutive_on_both_sides() -> None:
    pool = _pool(0)
    layouts = [_layout(kind, t, dim) for kind, t, dim in pool if kind == "kv"]
    parts = read_descriptors(layouts, layouts, ([2, 3, 4, 9], [5, 6, 7, 8]), None)
    # attention: 6 planes x 2 pieces ([2,3,4] -> [5,6,7] and [9] -> [8]); MLA: 1 plane x 2 pieces
    assert len(parts["kv"].local) == 6 * 2 + 2
    staged = read_descriptors(layouts, layouts, ([2, 3, 4, 9], [5, 6, 7, 8]), None, (1 << 20, None))
    assert len(staged["kv"].local) == 6 + 1  # the local side's runs only: one per plane, the last block follows
    assert mean_run([2, 3, 4, 9]) == 2.0 and mean_run([5, 6, 7, 8]) == 4.0


def test_the_staging_arena_gives_first_fit_spans_and_merges_what_comes_back() -> None:
    arena = StagingArena(torch.zeros(10 * ALIGN, dtype=torch.uint8))
    assert [arena.take(name, n) for name, n in (("a", 1), ("b", 2 * ALIGN), ("c", ALIGN + 1))] == [
        0,
        ALIGN,
        3 * ALIGN,
    ]
    assert arena.take("too-big", 6 * ALIGN) is None  # 5 of 10 left
    assert arena.give_back("b") and not arena.give_back("b")
    assert arena.take("d", 3 * ALIGN) == 5 * ALIGN  # the hole of b holds only 2
    arena.give_back("a")
    assert arena.take("e", 3 * ALIGN) == 0  # a's and b's holes merged: 3 wide
    arena.check_integrity()
    arena.give_back("c")
    arena.give_back("e")
    assert arena.take("f", 5 * ALIGN) == 0  # a, b, c and e merged into one span
    assert sorted(arena.owners) == ["d", "f"] and arena.used == 8 * ALIGN
    arena.check_integrity()
    with pytest.raises(ValueError, match="d already holds a span"):
        arena.take("d", 1)
