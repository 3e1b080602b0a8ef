"""Reasoning parsers: split generated text into reasoning and visible text.

A parser is made per generation. Its first state comes from the prompt: a chat template that opens the
reasoning block itself (the prompt ends inside `<think>`) makes the generation start in reasoning.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from hybridserve.serving.parsers.base import ChannelParser, ReasoningSplitter
from hybridserve.serving.parsers.kimi import KimiK3ReasoningParser


class ReasoningParser(ChannelParser):
    """Text between `<think>` and `</think>` is reasoning; the markers themselves are dropped."""

    start = "<think>"
    end = "</think>"
    switches: ClassVar[dict[str | None, dict[str, str | None]]] = {None: {start: "think"}, "think": {end: None}}

    def __init__(self, prompt_text: str = "") -> None:
        super().__init__("think" if self.opened_by(prompt_text) else None)

    @classmethod
    def opened_by(cls, prompt_text: str) -> bool:
        """Whether the prompt leaves a reasoning block open for the model to continue."""
        return prompt_text.rfind(cls.start) > prompt_text.rfind(cls.end)


REASONING_PARSERS: dict[str, Callable[[str], ReasoningSplitter]] = {
    # DeepSeek-R1, Qwen3, QwQ and most open reasoning models write <think>...</think>.
    "think": ReasoningParser,
    "deepseek_r1": ReasoningParser,
    "qwen3": ReasoningParser,
    "kimi_k2": ReasoningParser,
    "kimi_k3": KimiK3ReasoningParser,
}
