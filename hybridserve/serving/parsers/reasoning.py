"""Reasoning parsers: split generated text into reasoning and visible text.

A parser is made per generation. Its first state comes from the prompt: a chat template that opens the
reasoning block itself (the prompt ends inside `<think>`) makes the generation start in reasoning.
"""

from __future__ import annotations

from collections.abc import Callable

from hybridserve.serving.parsers.base import Piece, Reasoning, ReasoningSplitter, Text, held_back
from hybridserve.serving.parsers.kimi import KimiK3ReasoningParser


class ReasoningParser:
    """Text between `start` and `end` markers is reasoning; the markers themselves are dropped."""

    start = "<think>"
    end = "</think>"

    def __init__(self, prompt_text: str = "") -> None:
        self.in_reasoning = self.opened_by(prompt_text)
        self._buffer = ""

    @classmethod
    def opened_by(cls, prompt_text: str) -> bool:
        """Whether the prompt leaves a reasoning block open for the model to continue."""
        return prompt_text.rfind(cls.start) > prompt_text.rfind(cls.end)

    def feed(self, delta: str) -> list[Piece]:
        self._buffer += delta
        pieces: list[Piece] = []
        while True:
            marker = self.end if self.in_reasoning else self.start
            found = self._buffer.find(marker)
            if found < 0:
                break
            pieces.append(self._piece(self._buffer[:found]))
            self._buffer = self._buffer[found + len(marker) :]
            self.in_reasoning = not self.in_reasoning
        safe = held_back(self._buffer, (self.end if self.in_reasoning else self.start,))
        pieces.append(self._piece(self._buffer[:safe]))
        self._buffer = self._buffer[safe:]
        return pieces

    def finish(self) -> list[Piece]:
        rest, self._buffer = self._buffer, ""
        return [self._piece(rest)]

    def _piece(self, text: str) -> Piece:
        return Reasoning(text) if self.in_reasoning else Text(text)


REASONING_PARSERS: dict[str, Callable[[str], ReasoningSplitter]] = {
    # DeepSeek-R1, Qwen3, QwQ and most open reasoning models write <think>...</think>.
    "think": ReasoningParser,
    "deepseek_r1": ReasoningParser,
    "qwen3": ReasoningParser,
    "kimi_k2": ReasoningParser,
    "kimi_k3": KimiK3ReasoningParser,
}
