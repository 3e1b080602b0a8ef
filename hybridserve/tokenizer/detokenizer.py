"""Incremental detokenization: token ids in, newly finalised text out, O(1) work per token.

The technique is the prefix-offset / read-offset one: keep a small window of ids, decode it with and without
the newest ids, and release the difference once it no longer ends in an incomplete character (U+FFFD).
Every window starts right after a released character, so for byte-level BPE the released pieces concatenate
to exactly `tokenizer.decode(output_ids)`. The first window holds the last few prompt ids, so decoders that
treat the start of a text specially (sentencepiece's leading "▁" is dropped there) render the first output
token as it reads after the prompt: the released text is `decode(context + output)` minus `decode(context)`.

tokenizers' own `DecodeStream` is not used: its initial ids are emitted rather than taken as context, it has
no way to flush a genuinely invalid sequence at the end, and it loses its state on non-monotonic output.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable

from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], skip_special_tokens: bool
    ) -> None:
        self._decode = _decoder(tokenizer, skip_special_tokens)
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        context_text = self._decode(context)
        if context_text.endswith(REPLACEMENT_CHAR):  # the prompt ends inside a character: no clean boundary
            context, context_text = [], ""
        self._window = context  # released ids kept as context, then the ids not released yet
        self._read = len(context)  # where the unreleased ids start
        self._context_text = context_text  # decode(window[:read])

    def add(self, token_ids: list[int]) -> str:
        """Take the next output ids; return the text they finalise ("" while a character is incomplete)."""
        self._window.extend(token_ids)
        text = self._decode(self._window)
        if len(text) <= len(self._context_text) or text.endswith(REPLACEMENT_CHAR):
            return ""
        return self._release(text)

    def flush(self) -> str:
        """Release whatever is held back, an invalid or incomplete sequence at the end included."""
        if self._read == len(self._window):
            return ""
        return self._release(self._decode(self._window))

    def _release(self, text: str) -> str:
        new_text = text[len(self._context_text) :]
        del self._window[: self._read]  # the ids just released are the next context
        self._read = len(self._window)
        self._context_text = self._decode(self._window)
        return new_text


def _decoder(tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """`tokenizer.decode` as a one-argument function. For a fast tokenizer that does no clean-up pass this
    is the Rust decoder itself: the same text without transformers' per-call Python wrapping, which
    dominated the frontend's time per streamed token."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return functools.partial(backend.decode, skip_special_tokens=skip_special_tokens)
    return functools.partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)


@functools.cache
def token_bytes(tokenizer: PreTrainedTokenizerBase, token_id: int) -> bytes:
    """The exact bytes one token contributes to the output (cached per tokenizer and id).

    Byte-level BPE tokens map back through GPT-2's byte table, sentencepiece byte-fallback tokens `<0xNN>` are
    that byte, and any other token is the UTF-8 of its text as `token_text` renders it.
    """
    if token_id not in tokenizer.added_tokens_decoder:
        token = tokenizer.convert_ids_to_tokens(token_id)
        if _is_byte_level(tokenizer):
            return bytes(_gpt2_byte_decoder()[char] for char in token)
        if match := _BYTE_FALLBACK.fullmatch(token):
            return bytes([int(match.group(1), 16)])
    return token_text(tokenizer, token_id).encode()


@functools.cache
def token_text(tokenizer: PreTrainedTokenizerBase, token_id: int) -> str:
    """One token's text as it reads after other text (cached); lossy for a token holding part of a character.

    Decoding the token twice and keeping the second copy keeps the leading space that sentencepiece-style
    decoders drop at the start of a text ("▁Hello" reads " Hello"); for byte-level BPE it equals decode([id]).
    """
    alone = tokenizer.decode([token_id])
    twice = tokenizer.decode([token_id, token_id])
    return twice[len(alone) :] if twice.startswith(alone) else alone


@functools.cache
def _is_byte_level(tokenizer: PreTrainedTokenizerBase) -> bool:
    decoder = tokenizer.backend_tokenizer.decoder if tokenizer.is_fast else None
    if decoder is None:
        return False
    spec = json.loads(decoder.__getstate__())
    return any(part["type"] == "ByteLevel" for part in spec.get("decoders", [spec]))


@functools.cache
def _gpt2_byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the printable character that stands for each byte."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    others = [b for b in range(256) if b not in printable]  # shifted past 255, in byte order
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    return {char: b for b, char in chars.items()}
