"""A worker's registered cache tensors, and the byte regions that hold given blocks and state slots in them.

Every tensor the transfer reads is one of the runner's cache tensors, registered once at start-up: per paged
layer its KV cache ([2, kv_heads, blocks, block_size, head_dim] for attention, [blocks, block_size, latent] for
MLA), per linear-attention layer its conv-tail and recurrent-state slots ([slots, ...]). A block (or slot) is
`planes` regions of `row_bytes` each, one per index of the dimensions before the block dimension, `count`
rows apart. A request's part (its KV, or its state) is one byte stream: tensor by tensor, plane by plane, block
by block. Either side holds it as its blocks' regions (a run of consecutive blocks is one region per plane) or
packed in one staging-arena span (`pack` / `unpack`); a read's descriptors cut each side's regions where the
other side's end.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hybridserve.engine.kv_transfer.messages import TensorLayout, TransferEndpoint
from hybridserve.models.cache_specs import LayerSpec, LinearStateSpec, MLASpec


def tensor_layouts(specs: Sequence[LayerSpec], caches: Sequence[object]) -> list[TensorLayout]:
    """The runner's cache tensors in layer order (`caches[i]` is layer i's tensor, or its (conv, state) pair)."""
    layouts = []
    for spec, cache in zip(specs, caches, strict=True):
        if isinstance(spec, LinearStateSpec):
            conv, state = cache  # type: ignore[misc]
            layouts += [_layout("conv", conv, 0), _layout("state", state, 0)]
        else:
            assert isinstance(cache, torch.Tensor)
            layouts.append(_layout("kv", cache, 0 if isinstance(spec, MLASpec) else 2))
    return layouts


def _layout(kind: str, tensor: torch.Tensor, dim: int) -> TensorLayout:
    if not tensor.is_contiguous():
        raise ValueError(f"a {kind} cache tensor of shape {tuple(tensor.shape)} is not contiguous: it cannot be read")
    device = (tensor.device.index or 0) if tensor.device.type == "cuda" else 0
    dtype = str(tensor.dtype).removeprefix("torch.")
    return TensorLayout(kind, list(tensor.shape), dtype, dim, tensor.data_ptr(), device)


def mismatch(ours: TransferEndpoint, theirs: TransferEndpoint) -> str | None:
    """Why this worker cannot read from `theirs` (None: it can), naming the first difference."""
    checks = [
        ("weights fingerprint", theirs.weights, ours.weights),
        ("block_size", theirs.block_size, ours.block_size),
        ("memory", theirs.memory, ours.memory),
        ("tensor-parallel size", theirs.tp_size, ours.tp_size),
        ("tensor-parallel rank", theirs.tp_rank, ours.tp_rank),
        ("number of cache tensors", len(theirs.tensors), len(ours.tensors)),
    ]
    for name, value, expected in checks:
        if value != expected:
            return f"{name} {value!r} != {expected!r}"
    for i, (a, b) in enumerate(zip(theirs.tensors, ours.tensors, strict=True)):
        if a.geometry() != b.geometry():
            return f"cache tensor {i} ({b.kind}): {_describe(a)} != {_describe(b)}"
    return None


def _describe(t: TensorLayout) -> str:
    return f"{t.dtype} {t.shape} (blocks or slots on dimension {t.dim})"


def _runs(ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(first index, length) of each run of consecutive ids."""
    a = np.asarray(ids, dtype=np.int64)
    starts = np.concatenate([[0], np.flatnonzero(np.diff(a) != 1) + 1])
    return a[starts], np.diff(np.concatenate([starts, [len(a)]]))


def mean_run(ids: Sequence[int]) -> float:
    """The mean length of the runs of consecutive ids: what a read of them costs in descriptors per block."""
    return len(ids) / len(_runs(ids)[0]) if len(ids) else 0.0


def _segments(tensors: Sequence[TensorLayout], ids: Sequence[int]) -> np.ndarray:
    """Nx2 (address, length) of blocks or slots `ids` in every tensor, in stream order: tensor by tensor, plane
    by plane, run by run. The stream order is also the packed order of a staged request."""
    first, n = _runs(ids)
    out = []
    for t in tensors:
        row = math.prod(t.shape[t.dim + 1 :]) * getattr(torch, t.dtype).itemsize
        plane = np.arange(math.prod(t.shape[: t.dim]), dtype=np.int64)[:, None]
        addr = t.address + plane * t.count * row + first[None, :] * row
        out.append(np.stack([addr.ravel(), np.broadcast_to(n[None, :] * row, addr.shape).ravel()], axis=1))
    return np.concatenate(out)


@dataclass(frozen=True)
class ReadPart:
    """The descriptors of one part of a request's read, KV blocks or recurrent state: Nx3 (address, length,
    device) arrays, local and remote row for row, and the bytes they cover."""

    local: np.ndarray
    remote: np.ndarray
    nbytes: int


def _pair(local: np.ndarray, remote: np.ndarray, local_device: int, remote_device: int) -> ReadPart:
    """Descriptors reading the remote byte stream into the local one: each side's segments cut where the other's
    end, so a descriptor covers bytes consecutive on both sides."""
    ends = [np.concatenate([[0], np.cumsum(side[:, 1])]) for side in (local, remote)]
    if ends[0][-1] != ends[1][-1]:
        raise ValueError(f"a read of {ends[1][-1]} bytes into {ends[0][-1]}")
    cuts = np.union1d(*ends)
    starts, lengths = cuts[:-1], np.diff(cuts)
    rows = []
    for side, bounds, device in ((local, ends[0], local_device), (remote, ends[1], remote_device)):
        i = np.searchsorted(bounds, starts, side="right") - 1
        addr = side[i, 0] + (starts - bounds[i])
        rows.append(np.stack([addr, lengths, np.full(len(starts), device)], axis=1).astype(np.uint64))
    return ReadPart(rows[0], rows[1], int(ends[0][-1]))


def read_descriptors(
    local: Sequence[TensorLayout],
    remote: Sequence[TensorLayout],
    blocks: tuple[Sequence[int], Sequence[int]],
    slots: tuple[int, int] | None,
    staged: tuple[int | None, int | None] = (None, None),
) -> dict[str, ReadPart]:
    """For reading remote `blocks[0]` into local `blocks[1]` and remote state slot `slots[0]` into local
    `slots[1]`: the "kv" part (every paged layer) and, for models with recurrent state, the "state" part.
    `staged` (remote, local): the address of a staging-arena span holding (or to hold) the KV part packed, in
    place of that side's blocks."""
    parts = {}
    kv = [t for t in local if t.kind == "kv"], [t for t in remote if t.kind == "kv"]
    if kv[0]:
        nbytes = len(blocks[1]) * kv_bytes_per_block(kv[0])
        sides = [
            np.array([[at, nbytes]]) if at is not None else _segments(tensors, ids)
            for tensors, ids, at in ((kv[0], blocks[1], staged[1]), (kv[1], blocks[0], staged[0]))
        ]
        parts["kv"] = _pair(*sides, kv[0][0].device, kv[1][0].device)
    state = [t for t in local if t.kind != "kv"], [t for t in remote if t.kind != "kv"]
    if state[0]:
        if slots is None:
            raise ValueError("the peers keep recurrent state but the request names no state slot")
        local_rows, remote_rows = _segments(state[0], [slots[1]]), _segments(state[1], [slots[0]])
        parts["state"] = _pair(local_rows, remote_rows, state[0][0].device, state[1][0].device)
    return parts


def kv_bytes_per_block(tensors: Sequence[TensorLayout]) -> int:
    return sum(
        math.prod(t.shape[: t.dim]) * math.prod(t.shape[t.dim + 1 :]) * getattr(torch, t.dtype).itemsize
        for t in tensors
        if t.kind == "kv"
    )


def _planes(cache: torch.Tensor, dim: int) -> torch.Tensor:
    """A KV cache tensor as [planes, blocks, row]."""
    return cache.view(math.prod(cache.shape[:dim]), cache.shape[dim], -1)


def pack(caches: Sequence[tuple[torch.Tensor, int]], blocks: Sequence[int], span: torch.Tensor) -> None:
    """Gathers `blocks` of every (KV cache, block dimension) into the uint8 `span`, in stream order."""
    ids = torch.tensor(blocks, dtype=torch.int64, device=span.device)
    at = 0
    for cache, dim in caches:
        src = _planes(cache, dim)
        out = span[at : at + src.shape[0] * len(blocks) * src.shape[2] * cache.element_size()]
        torch.index_select(src, 1, ids, out=out.view(cache.dtype).view(src.shape[0], len(blocks), src.shape[2]))
        at += out.numel()


def unpack(caches: Sequence[tuple[torch.Tensor, int]], blocks: Sequence[int], span: torch.Tensor) -> None:
    """Scatters a packed `span` into `blocks` of every (KV cache, block dimension): the inverse of `pack`."""
    ids = torch.tensor(blocks, dtype=torch.int64, device=span.device)
    at = 0
    for cache, dim in caches:
        dst = _planes(cache, dim)
        n = dst.shape[0] * len(blocks) * dst.shape[2] * cache.element_size()
        dst.index_copy_(1, ids, span[at : at + n].view(cache.dtype).view(dst.shape[0], len(blocks), dst.shape[2]))
        at += n
