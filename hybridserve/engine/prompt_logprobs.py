"""Prompt logprobs: each prompt token's logprob given the tokens before it, plus the top k (`prompt_logprobs`).

A prompt is prefilled over one or more steps (chunked prefill), so the runner takes them chunk by chunk from
each step's hidden states: the hidden state at position q predicts token q + 1, so prompt tokens 1..P-1 get one
(token 0 has nothing before it). They are kept until the request samples its first token, whose result carries
them. A preempted request recomputes its prompt, but what was already taken is not computed again. Logits are
made ROWS_PER_SLICE rows at a time, so a long chunk never holds its whole [chunk, vocab] logits at once.
Prefix-cache hits are off for such requests (the cache manager's rule): a cached token has no hidden state here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridserve.engine.protocol import TokenLogprobs
from hybridserve.engine.sampler import token_logprobs

ROWS_PER_SLICE = 256


class PromptLogprobs:
    """One request's prompt logprobs as they are computed, handed out once, complete."""

    def __init__(self, prompt_token_ids: list[int], k: int) -> None:
        self.prompt_token_ids = prompt_token_ids
        self.k = k
        self.logprobs: list[TokenLogprobs] = []  # for prompt tokens 1..len(self.logprobs)
        self.taken = False

    def rows(self, start: int, num_tokens: int) -> range:
        """The rows of a chunk of `num_tokens` at position `start` whose hidden states predict a prompt token
        not computed yet (offsets into the chunk)."""
        if self.taken:
            return range(0)
        first = max(start, len(self.logprobs))
        end = min(start + num_tokens, len(self.prompt_token_ids) - 1)
        return range(first - start, max(end, first) - start)

    def add(
        self, hidden: torch.Tensor, position: int, compute_logits: Callable[[torch.Tensor], torch.Tensor], vocab: int
    ) -> None:
        """Take in `hidden` [n, H], the hidden states at positions `position`.. (the rows `rows` picked)."""
        if position != len(self.logprobs):
            raise RuntimeError(f"prompt logprobs from position {position} after {len(self.logprobs)} computed")
        for i in range(0, hidden.shape[0], ROWS_PER_SLICE):
            rows = hidden[i : i + ROWS_PER_SLICE]
            logprobs = torch.log_softmax(compute_logits(rows)[:, :vocab].to(torch.float32), dim=-1)
            first = position + i + 1
            targets = torch.tensor(self.prompt_token_ids[first : first + rows.shape[0]], device=hidden.device)
            self.logprobs.extend(token_logprobs(logprobs, targets, [self.k] * rows.shape[0]))

    def take(self) -> list[TokenLogprobs] | None:
        """All of them once every prompt token has one, the first time asked; else None."""
        if self.taken or len(self.logprobs) < len(self.prompt_token_ids) - 1:
            return None
        self.taken = True
        logprobs, self.logprobs = self.logprobs, []
        return logprobs
