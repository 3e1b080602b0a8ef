"""Draft tokens for speculative decoding from a request's own tokens: no draft model.

A proposer keeps what it knows of each request it drafted for (appending the tokens added since its last
call, never rebuilding) until the scheduler says the request ended. Two methods:

- ngram (`NgramProposer`, prompt lookup): the last n tokens of a request (prompt and output) are looked for
  earlier in them, n from prompt_lookup_max down to prompt_lookup_min; at the most recent earlier occurrence of
  the longest suffix found, the tokens that followed it are the proposal. Searching is `bytearray.rfind` over
  the request's ids packed as 32-bit integers, a scan in C over a buffer that grows by the new tokens; a hit not
  on a token boundary is skipped by searching again to its left.
- suffix (`SuffixProposer`, suffix_drafting.py): suffix trees of the request's tokens and of recent requests'
  outputs, the most frequent continuation of the longest matched suffix.

Text that repeats its context (edits, code, quotes, summaries) yields long accepted runs.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Protocol

from hybridserve.speculative import SpeculativeConfig

_ITEM = 4  # bytes per packed token id


class Proposer(Protocol):
    num_speculative_tokens: int

    def propose(self, request_id: str, prompt: Sequence[int], output: Sequence[int], max_tokens: int) -> list[int]:
        """At most `max_tokens` tokens to follow the request's `prompt` and `output` so far (which only grow
        between calls)."""
        ...

    def finish(self, request_id: str, output: Sequence[int]) -> None:
        """The request ended: what was kept for it goes; `output` (empty: nothing worth keeping) is what it
        produced."""
        ...


def unseen(prompt: Sequence[int], output: Sequence[int], seen: int) -> Sequence[int]:
    """The tokens of prompt + output after the first `seen`, without concatenating the whole."""
    if seen < len(prompt):
        return [*prompt[seen:], *output]
    return output[seen - len(prompt) :]


# Draft tokens a request's verifications must have judged before its acceptance alone sizes its drafts.
EXPLORE = 4


def draft_lengths(
    judged: Sequence[tuple[int, int]], num_speculative_tokens: int, weight_read_tokens: float
) -> list[int]:
    """How many tokens each request decoding this step may draft, from its drafts' (accepted tokens, rejections)
    so far, sized so the step yields the most tokens for its cost. A step of N tokens costs about W + N tokens'
    compute (W = weight_read_tokens: the weights are read once, whatever N), and a request's k-th draft token is
    accepted with probability a^k, `a` its acceptance so far, (accepted + 1) / (judged + 2). Draft tokens are taken
    most probable first while each raises the step's expected tokens per cost, p > Y / (W + N) with Y the tokens
    expected so far: a lone request drafts deep, since its step costs about W anyway; a wide batch drafts only
    tokens nearly sure to be accepted; a request whose drafts keep failing stops drafting. Until its verifications
    have judged EXPLORE tokens, a request drafts at least one: its acceptance is learnt."""
    candidates: list[tuple[float, int]] = []  # (probability of acceptance, the request's index)
    for i, (accepted, rejections) in enumerate(judged):
        rate, p = (accepted + 1) / (accepted + rejections + 2), 1.0
        for _ in range(num_speculative_tokens):
            p *= rate
            candidates.append((p, i))
    candidates.sort(key=lambda c: -c[0])  # stable: equals keep the batch order
    counts = [0] * len(judged)
    expected = tokens = float(len(judged))
    for p, i in candidates:
        if p * (weight_read_tokens + tokens) <= expected:
            break
        counts[i] += 1
        expected += p
        tokens += 1
    for i, (accepted, rejections) in enumerate(judged):
        if accepted + rejections < EXPLORE:
            counts[i] = max(counts[i], 1)
    return counts


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self._packed: dict[str, bytearray] = {}  # per request: its tokens so far, as 32-bit ids

    def propose(self, request_id: str, prompt: Sequence[int], output: Sequence[int], max_tokens: int) -> list[int]:
        """None when no suffix of the tokens occurred before."""
        packed = self._packed.setdefault(request_id, bytearray())
        packed += array("I", unseen(prompt, output, len(packed) // _ITEM)).tobytes()
        length = len(packed) // _ITEM
        if max_tokens < 1 or length < self.min_n + 1:
            return []
        end = (length - 1) * _ITEM  # an occurrence must be followed by at least one token
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = _rfind_aligned(packed, bytes(packed[(length - n) * _ITEM :]), end)
            if start >= 0:
                follow = (start + n) * _ITEM
                return array("I", packed[follow : follow + max_tokens * _ITEM]).tolist()
        return []

    def finish(self, request_id: str, output: Sequence[int]) -> None:
        self._packed.pop(request_id, None)


def _rfind_aligned(haystack: bytearray, needle: bytes, end: int) -> int:
    """The token index of the last occurrence of `needle` in `haystack[:end]` that starts on a token boundary,
    or -1."""
    while (at := haystack.rfind(needle, 0, end)) >= 0:
        if at % _ITEM == 0:
            return at // _ITEM
        end = at + len(needle) - 1
    return -1
