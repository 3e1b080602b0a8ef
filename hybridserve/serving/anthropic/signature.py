"""Thinking-block signatures: an HMAC of the thinking text under a secret this server made at start.

Anthropic's clients send thinking blocks back with their `signature` unchanged; checking it proves the
reasoning replayed into the prompt is what this server's model wrote, not text a client put in its mouth.
The secret lives in memory, so a restarted server refuses the blocks its predecessor signed.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets


class ThinkingSigner:
    def __init__(self, secret: bytes | None = None) -> None:
        self.secret = secrets.token_bytes(32) if secret is None else secret

    def sign(self, thinking: str) -> str:
        digest = hmac.new(self.secret, thinking.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).decode()

    def verify(self, thinking: str, signature: str) -> bool:
        return hmac.compare_digest(self.sign(thinking).encode(), signature.encode())
