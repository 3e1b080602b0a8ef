"""Output parsing: reasoning and tool calls out of generated text, chosen per model or by flag.

`Parsers` is the server-wide choice (`--reasoning-parser`, `--tool-parser`, or what the model's chat
template shows it writes); `Parsers.for_request` makes the per-generation OutputParser.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from hybridserve.serving.parsers.base import Piece, Reasoning, ReasoningSplitter, Text, ToolCall, ToolSplitter, merged
from hybridserve.serving.parsers.reasoning import REASONING_PARSERS
from hybridserve.serving.parsers.tools import TOOL_PARSERS

__all__ = ["OutputParser", "Parsers", "Piece", "Reasoning", "StreamParser", "Text", "ToolCall"]


class StreamParser(Protocol):
    """What the endpoints drive: feed each text delta, then finish once."""

    @property
    def in_reasoning(self) -> bool: ...

    def feed(self, delta: str) -> list[Piece]: ...

    def finish(self) -> list[Piece]: ...


@dataclass(frozen=True)
class Parsers:
    reasoning: str | None = None
    tool: str | None = None

    def __post_init__(self) -> None:
        if self.reasoning is not None and self.reasoning not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {self.reasoning!r}; known: {', '.join(REASONING_PARSERS)}")
        if self.tool is not None and self.tool not in TOOL_PARSERS:
            raise ValueError(f"unknown tool parser {self.tool!r}; known: {', '.join(TOOL_PARSERS)}")

    @classmethod
    def choose(
        cls, chat_template: str | None, native_tools: bool, reasoning: str | None = "auto", tool: str | None = "auto"
    ) -> Parsers:
        """The flags' choice; "auto" picks what the chat template shows the model writes, "none" turns off.

        A template without tools of its own (`native_tools` false) gets them in the Hermes form, so its
        calls are read back with the hermes parser."""
        template = chat_template or ""
        if reasoning == "auto":
            reasoning = "think" if "<think>" in template else None
        if tool == "auto":
            tool = "hermes" if "<tool_call>" in template or not native_tools else None
        return cls(None if reasoning == "none" else reasoning, None if tool == "none" else tool)

    def for_request(self, prompt_text: str, parse_tools: bool) -> OutputParser:
        reasoning = None if self.reasoning is None else REASONING_PARSERS[self.reasoning](prompt_text)
        tools = TOOL_PARSERS[self.tool]() if parse_tools and self.tool is not None else None
        return OutputParser(reasoning, tools)


class OutputParser:
    """Reasoning first, then tool calls in the visible text."""

    def __init__(self, reasoning: ReasoningSplitter | None, tools: ToolSplitter | None) -> None:
        self.reasoning = reasoning
        self.tools = tools

    @property
    def in_reasoning(self) -> bool:
        return self.reasoning is not None and self.reasoning.in_reasoning

    def feed(self, delta: str) -> list[Piece]:
        return self._route(self.reasoning.feed(delta) if self.reasoning else [Text(delta)], final=False)

    def finish(self) -> list[Piece]:
        return self._route(self.reasoning.finish() if self.reasoning else [], final=True)

    def _route(self, pieces: list[Piece], final: bool) -> list[Piece]:
        if self.tools is None:
            return merged(pieces)
        out: list[Piece] = []
        for piece in pieces:
            out.extend(self.tools.feed(piece.text) if isinstance(piece, Text) else [piece])
        if final:
            out.extend(self.tools.finish())
        return merged(out)
