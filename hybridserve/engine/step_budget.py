"""`StepBudget`: the tokens one engine step may still take, and how much of them batch work may.

Priorities from BACKGROUND_PRIORITY up are batch work (the Batch API's and run-batch's requests); those below are
online requests, whatever priority their clients set. While online work runs or waits, batch work shares at most
`background` tokens of the step, so the steps online requests wait for and run in stay short. Alone, batch work
takes the whole step. Among online requests priorities order admission and preemption only, never the budget."""

from __future__ import annotations

from dataclasses import dataclass

# The least priority value of batch work: every client-set online priority is below it (serving/openai/priority.py).
BACKGROUND_PRIORITY = 1_000_001


@dataclass
class StepBudget:
    tokens: int  # left in the step
    online: bool  # online work (a priority below BACKGROUND_PRIORITY) runs or waits
    background: int | None  # left to batch work while online work is there; None: it shares the whole step

    def _shares(self, priority: int) -> bool:
        """Whether a request of `priority` takes from the background share now."""
        return self.background is not None and self.online and priority >= BACKGROUND_PRIORITY

    def limit(self, priority: int) -> int:
        """What a request of `priority` may take now."""
        if self._shares(priority):
            assert self.background is not None
            return min(self.tokens, self.background)
        return self.tokens

    def spend(self, n: int, priority: int) -> None:
        """`n` tokens taken by a request of `priority`."""
        self.tokens -= n
        if self._shares(priority):
            assert self.background is not None
            self.background -= n

    def spend_background(self, n: int) -> None:
        """`n` tokens taken out of what batch work may take (as any of it may have been)."""
        self.tokens -= n
        if self.background is not None:
            self.background -= n

    @property
    def background_room(self) -> int:
        """What batch work may take now."""
        if self.background is None or not self.online:
            return self.tokens
        return min(self.tokens, self.background)
