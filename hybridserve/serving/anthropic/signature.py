"""Thinking-block signatures: an HMAC of the thinking text under a secret this server made at start.

Anthropic's clients send thinking blocks back with their `signature` unchanged; checking it proves the
reasoning replayed into the prompt is what this server's model wrote, not text a client put in its mouth.
A server with a data directory keeps its secret there (`stored`), so conversations outlive a restart; one
without makes a new secret at start and refuses the blocks its predecessor signed.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
from pathlib import Path

SECRET_BYTES = 32


class ThinkingSigner:
    def __init__(self, secret: bytes | None = None) -> None:
        self.secret = secrets.token_bytes(SECRET_BYTES) if secret is None else secret

    @classmethod
    def stored(cls, path: Path) -> ThinkingSigner:
        """The signer whose secret is the file at `path`, made (readable by its owner only) if there is none."""
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            secret = path.read_bytes()
            if len(secret) != SECRET_BYTES:
                raise ValueError(f"{path} holds no thinking-signature secret ({len(secret)} bytes, not 32)") from None
            return cls(secret)
        secret = secrets.token_bytes(SECRET_BYTES)
        with os.fdopen(fd, "wb") as file:
            file.write(secret)
        return cls(secret)

    def sign(self, thinking: str) -> str:
        digest = hmac.new(self.secret, thinking.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).decode()

    def verify(self, thinking: str, signature: str) -> bool:
        return hmac.compare_digest(self.sign(thinking).encode(), signature.encode())
