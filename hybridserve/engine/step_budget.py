"""`StepBudget`: the tokens one engine step may still take, and how much of them less urgent work may.

While more urgent work runs or waits (online requests), less urgent work (batch requests, a higher priority value)
shares at most `background` tokens of the step, so the steps online requests wait for and run in stay short. Alone,
the less urgent work is the most urgent present and takes the whole step."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepBudget:
    tokens: int  # left in the step
    urgent: int  # the most urgent priority value present (running or waiting)
    background: int | None  # left to work less urgent than `urgent`; None: it shares the whole step

    def limit(self, priority: int) -> int:
        """What a request of `priority` may take now."""
        if self.background is None or priority == self.urgent:
            return self.tokens
        return min(self.tokens, self.background)

    def spend(self, n: int, priority: int) -> None:
        """`n` tokens taken by a request of `priority`."""
        self.tokens -= n
        if self.background is not None and priority > self.urgent:
            self.background -= n

    def spend_background(self, n: int) -> None:
        """`n` tokens taken out of what less urgent work may take (as any of it may have been)."""
        self.tokens -= n
        if self.background is not None:
            self.background -= n

    @property
    def background_room(self) -> int:
        """What less urgent work may take now."""
        return self.tokens if self.background is None else min(self.tokens, self.background)
