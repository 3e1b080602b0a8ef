"""Chained block hashes: deterministic across processes, chained, full blocks only, salted."""

from __future__ import annotations

import os
import subprocess
import sys

from hybridserve.engine.cache.prefix_hash import ROOT_HASH, hash_block, hash_blocks

TOKENS = [5, 17, 0, 99_999, 3, 3, 3, 128_000, 42, 7, 1, 2]


def test_digests_are_identical_in_other_processes() -> None:
    code = (
        "from hybridserve.engine.cache.prefix_hash import ROOT_HASH, hash_blocks\n"
        f"print(ROOT_HASH.hex(), *(h.hex() for h in hash_blocks({TOKENS!r}, 4)))\n"
        f"print(*(h.hex() for h in hash_blocks({TOKENS!r}, 4, salt=b'lora-a')))\n"
    )
    here = [
        " ".join([ROOT_HASH.hex(), *(h.hex() for h in hash_blocks(TOKENS, 4))]),
        " ".join(h.hex() for h in hash_blocks(TOKENS, 4, salt=b"lora-a")),
    ]
    for seed in ("0", "12345"):  # Python's own hash() differs between these; ours must not
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.splitlines() == here


def test_known_shape_of_digests() -> None:
    hashes = hash_blocks(TOKENS, 4)
    assert len(hashes) == 3
    assert all(isinstance(h, bytes) and len(h) == 16 for h in [ROOT_HASH, *hashes])
    assert len(set(hashes)) == 3
    assert hash_blocks(TOKENS, 4) == hashes


def test_blocks_are_chained_from_the_root() -> None:
    hashes = hash_blocks(TOKENS, 4)
    assert hashes[0] == hash_block(ROOT_HASH, TOKENS[0:4])
    assert hashes[1] == hash_block(hashes[0], TOKENS[4:8])
    assert hashes[2] == hash_block(hashes[1], TOKENS[8:12])
    # Continuing from a parent gives the same chain as hashing the whole sequence.
    assert hash_blocks(TOKENS[4:], 4, parent=hashes[0]) == hashes[1:]


def test_changing_an_early_token_changes_every_later_hash() -> None:
    base = hash_blocks(TOKENS, 4)
    changed = hash_blocks([TOKENS[0] + 1, *TOKENS[1:]], 4)
    assert all(a != b for a, b in zip(base, changed, strict=True))
    # A change in the second block keeps the first block's hash.
    later = hash_blocks([*TOKENS[:5], TOKENS[5] + 1, *TOKENS[6:]], 4)
    assert later[0] == base[0]
    assert later[1] != base[1] and later[2] != base[2]


def test_same_block_under_different_parents_differs() -> None:
    block = [1, 2, 3, 4]
    assert hash_blocks(block * 2, 4)[1] != hash_blocks(block, 4)[0]


def test_only_full_blocks_are_hashed() -> None:
    assert hash_blocks([], 4) == []
    assert hash_blocks(TOKENS[:3], 4) == []
    assert hash_blocks(TOKENS[:4], 4) == hash_blocks(TOKENS, 4)[:1]
    assert hash_blocks(TOKENS[:7], 4) == hash_blocks(TOKENS, 4)[:1]
    assert hash_blocks(TOKENS[:8], 4) == hash_blocks(TOKENS, 4)[:2]
    assert len(hash_blocks(TOKENS, 5)) == 2
    assert len(hash_blocks(TOKENS, 12)) == 1
    assert len(hash_blocks(TOKENS, 13)) == 0


def test_block_size_changes_hashes() -> None:
    assert hash_blocks(TOKENS, 2)[1] != hash_blocks(TOKENS, 4)[0]


def test_token_values_are_not_confused_by_width() -> None:
    # 256 as one int64 differs from the tokens [0, 1] or [256] packed in a narrower type.
    assert hash_block(ROOT_HASH, [256]) != hash_block(ROOT_HASH, [0, 1])
    assert hash_block(ROOT_HASH, [1, 0]) != hash_block(ROOT_HASH, [0, 1])


def test_salt_changes_hashes() -> None:
    plain = hash_blocks(TOKENS, 4)
    salted = hash_blocks(TOKENS, 4, salt=b"lora-a")
    other = hash_blocks(TOKENS, 4, salt=b"lora-b")
    assert len(salted) == len(plain) == len(other)
    assert all(a != b for a, b in zip(plain, salted, strict=True))
    assert all(a != b for a, b in zip(salted, other, strict=True))
    assert hash_blocks(TOKENS, 4, salt=b"lora-a") == salted
    assert hash_blocks(TOKENS, 4, salt=b"") == plain  # an empty salt is no salt
