"""A rendered prompt (hybridserve/rendering/) → its ids.

Tokenizing is the costly step of a large request (seconds for megabytes of text, where rendering takes
milliseconds), so long work runs on a worker thread (`off_loop`): Hugging Face's fast tokenizers release the
GIL while they encode, and the event loop goes on serving other requests meanwhile.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from hybridserve.serving.openai.errors import APIError

# Characters (or token ids) past which tokenizing takes over ~10 ms: a worker thread's hop (~0.1 ms) is then worth it.
OFF_LOOP_SIZE = 16 * 1024
T = TypeVar("T")


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    text: str


async def off_loop(size: int, work: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`work(*args, **kwargs)`, on a worker thread when `size` (the characters or token ids it goes through)
    passes OFF_LOOP_SIZE, else here."""
    if size > OFF_LOOP_SIZE:
        return await asyncio.to_thread(work, *args, **kwargs)
    return work(*args, **kwargs)


def check_vocabulary(ids: list[int], vocab_size: int, what: str, param: str) -> None:
    """A 400 naming the first of `ids` outside the vocabulary."""
    for token_id in ids:
        if not 0 <= token_id < vocab_size:
            raise APIError(
                400,
                f"{what} contains token id {token_id}, outside the vocabulary [0, {vocab_size}).",
                param=param,
                code="invalid_value",
            )


@functools.cache
def max_token_bytes(tokenizer: Any) -> int | None:
    """At least as many bytes of text as any one token of `tokenizer` stands for: the longest token's spelling in
    UTF-8 (a byte-level token's spelling takes one character, of up to two bytes, per byte it stands for; a
    SentencePiece byte token, six for one). None where a normalizer may shrink the text before it is split."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        return None
    spellings = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max(len(s.encode()) for s in spellings if s is not None)


def too_long(tokenizer: Any, text: str, limit: int) -> tuple[int, int, int] | None:
    """Whether `text`'s bytes alone prove it at least `limit` tokens (no token spans more than max_token_bytes):
    (that floor, the bytes, max_token_bytes) if so, else None (also where the tokenizer gives no bound)."""
    if 4 * len(text) < limit:  # at most 4 bytes a character, at least 1 a token: no need to encode it
        return None
    most = max_token_bytes(tokenizer)
    if most is None or 4 * len(text) < limit * most:
        return None
    size = len(text.encode())
    if -(-size // most) < limit:
        return None
    return -(-size // most), size, most


async def tokenized(tokenizer, text: str) -> Prompt:
    """The prompt `text` (rendered, special tokens spelled out) with its ids."""
    return Prompt(await off_loop(len(text), tokenizer.encode, text, add_special_tokens=False), text)
