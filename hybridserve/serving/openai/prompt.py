"""A rendered prompt (hybridserve/rendering/) → its ids.

Tokenizing is the costly step of a large request (seconds for megabytes of text, where rendering takes
milliseconds), so long work runs on a worker thread (`off_loop`): Hugging Face's fast tokenizers release the
GIL while they encode, and the event loop goes on serving other requests meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

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


async def tokenized(tokenizer, text: str) -> Prompt:
    """The prompt `text` (rendered, special tokens spelled out) with its ids."""
    return Prompt(await off_loop(len(text), tokenizer.encode, text, add_special_tokens=False), text)
