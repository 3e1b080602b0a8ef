"""A worker's registered cache tensors, and the byte regions that hold given blocks and state slots in them.

Every tensor the transfer reads is one of the runner's cache tensors, registered once at start-up: per paged
layer its KV cache ([2, kv_heads, blocks, block_size, head_dim] for attention, [blocks, block_size, latent] for
MLA), per linear-attention layer its conv-tail and recurrent-state slots ([slots, ...]). A block (or slot) is
`planes` regions of `row_bytes` each, one per index of the dimensions before the block dimension, `count`
rows apart; runs of consecutive blocks on both sides merge into one region per plane.
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


def _runs(src: Sequence[int], dst: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(first source index, first destination index, length) of each run consecutive on both sides."""
    s, d = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
    breaks = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
    starts = np.concatenate([[0], breaks])
    lengths = np.diff(np.concatenate([starts, [len(s)]]))
    return s[starts], d[starts], lengths


@dataclass(frozen=True)
class ReadPart:
    """The descriptors of one part of a request's read, KV blocks or recurrent state: Nx3 (address, length,
    device) arrays, local and remote row for row, and the bytes they cover."""

    local: np.ndarray
    remote: np.ndarray
    nbytes: int


def read_descriptors(
    local: Sequence[TensorLayout],
    remote: Sequence[TensorLayout],
    blocks: tuple[Sequence[int], Sequence[int]],
    slots: tuple[int, int] | None,
) -> dict[str, ReadPart]:
    """For reading remote `blocks[0]` into local `blocks[1]` and remote state slot `slots[0]` into local
    `slots[1]`: the "kv" part (every paged layer) and, for models with recurrent state, the "state" part."""
    block_runs = _runs(*blocks)
    slot_runs = _runs([slots[0]], [slots[1]]) if slots is not None else None
    rows: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] = {}
    nbytes: dict[str, int] = {}
    for ours, theirs in zip(local, remote, strict=True):
        part = "kv" if ours.kind == "kv" else "state"
        runs = block_runs if part == "kv" else slot_runs
        if runs is None:
            raise ValueError("the peers keep recurrent state but the request names no state slot")
        row = math.prod(ours.shape[ours.dim + 1 :]) * getattr(torch, ours.dtype).itemsize
        planes = math.prod(ours.shape[: ours.dim])
        src, dst, n = runs
        plane = np.arange(planes, dtype=np.int64)[:, None]
        local_rows, remote_rows = rows.setdefault(part, ([], []))
        for t, first, out in ((theirs, src, remote_rows), (ours, dst, local_rows)):
            addr = t.address + plane * t.count * row + first[None, :] * row
            length = np.broadcast_to(n[None, :] * row, addr.shape)
            out.append(np.stack([addr.ravel(), length.ravel(), np.full(addr.size, t.device)], axis=1))
        nbytes[part] = nbytes.get(part, 0) + int(planes * n.sum() * row)
    return {
        part: ReadPart(np.concatenate(loc).astype(np.uint64), np.concatenate(rem).astype(np.uint64), nbytes[part])
        for part, (loc, rem) in rows.items()
    }
