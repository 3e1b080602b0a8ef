"""Draft tokens for speculative decoding by prompt lookup (n-gram): no draft model, only the request's own tokens.

The last n tokens of a request (prompt and output) are looked for earlier in them, n from prompt_lookup_max down
to prompt_lookup_min; at the most recent earlier occurrence of the longest suffix found, the tokens that followed
it are the proposal. Text that repeats its context (edits, code, quotes, summaries) yields long accepted runs.

Searching is `bytes.rfind` over the ids packed as 32-bit integers, a scan in C; a hit not on a token boundary
is skipped by searching again to its left.
"""

from __future__ import annotations

from array import array

from hybridserve.config import SpeculativeConfig

_ITEM = 4  # bytes per packed token id


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """At most `max_tokens` tokens to follow `token_ids`; none when no suffix of them occurred before."""
        length = len(token_ids)
        if max_tokens < 1 or length < self.min_n + 1:
            return []
        packed = array("I", token_ids).tobytes()
        history = packed[: (length - 1) * _ITEM]  # an occurrence must be followed by at least one token
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = _rfind_aligned(history, packed[(length - n) * _ITEM :])
            if start >= 0:
                follow = start + n
                return token_ids[follow : follow + max_tokens]
        return []


def _rfind_aligned(haystack: bytes, needle: bytes) -> int:
    """The token index of the last occurrence of `needle` in `haystack` that starts on a token boundary, or -1."""
    end = len(haystack)
    while (at := haystack.rfind(needle, 0, end)) >= 0:
        if at % _ITEM == 0:
            return at // _ITEM
        end = at + len(needle) - 1
    return -1
