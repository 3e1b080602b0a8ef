"""Fingerprints of a checkpoint, for the identity a worker reports (protocol.WorkerIdentity).

Fingerprints are content hashes, so two copies of one checkpoint agree and two checkpoints with the same file
names do not. Weight files are large: each is hashed by its size and a fixed sample of 1 MiB windows spread over
it, which tells different checkpoints apart at the cost of a few reads. Tokenizer files are hashed whole.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

_WINDOW = 1 << 20
_WINDOWS = 16
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
_TOKENIZER_NAMES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")


def weights_fingerprint(hf_dir: Path) -> str:
    """The weight files (by size and sampled windows) and the architecture config that reads them."""
    digest = hashlib.blake2b(digest_size=16)
    config = hf_dir / "config.json"
    if config.is_file():
        digest.update(config.read_bytes())
    for path in sorted(p for p in hf_dir.iterdir() if p.suffix in _WEIGHT_SUFFIXES):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            for k in range(_WINDOWS):
                f.seek(max(0, (size - _WINDOW) * k // (_WINDOWS - 1)))
                digest.update(f.read(_WINDOW))
    return digest.hexdigest()


def tokenizer_fingerprint(hf_dir: Path) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for path in sorted(p for p in hf_dir.iterdir() if p.name in _TOKENIZER_NAMES or p.suffix == ".jinja"):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()
