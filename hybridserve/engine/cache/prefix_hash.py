"""Chained, deterministic block hashes: a block's hash covers its tokens and every block before it.

Identical across processes and machines (no Python `hash()`, no random seed), so a router can compute
the same hashes a worker caches under.
"""

from __future__ import annotations

import hashlib

import numpy as np

BlockHash = bytes

ROOT_HASH: BlockHash = hashlib.blake2b(b"hybridserve-prefix-root", digest_size=16).digest()


def hash_block(parent: BlockHash, token_ids: list[int], salt: bytes = b"") -> BlockHash:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(np.asarray(token_ids, dtype="<i8").tobytes())
    if salt:
        h.update(salt)
    return h.digest()


def hash_blocks(
    token_ids: list[int], block_size: int, parent: BlockHash = ROOT_HASH, salt: bytes = b""
) -> list[BlockHash]:
    """Hashes of every full block of `token_ids`, chained from `parent`."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], salt)
        hashes.append(parent)
    return hashes
