"""Tool-call parsers: find the calls a model writes into its text.

The Hermes format (Hermes, Qwen2.5/Qwen3 and many fine-tunes) writes each call as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. A block is held back until it closes, then
becomes one ToolCall; a block that does not parse as a call is given back as text, so nothing is lost.
Whitespace between calls (and after the last one) is dropped; any other text is kept in order.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from hybridserve.serving.parsers.base import Piece, Text, ToolCall, ToolSplitter, held_back
from hybridserve.serving.parsers.kimi import KimiK2ToolParser, KimiK3ToolParser


class HermesToolParser:
    start = "<tool_call>"
    end = "</tool_call>"

    def __init__(self) -> None:
        self._buffer = ""
        self._inside = False
        self._whitespace = ""  # trailing whitespace of the text so far: dropped if a call follows
        self.calls = 0

    def feed(self, delta: str) -> list[Piece]:
        self._buffer += delta
        pieces: list[Piece] = []
        while True:
            if self._inside:
                found = self._buffer.find(self.end)
                if found < 0:
                    return pieces
                pieces.append(self._call(self._buffer[:found], closed=True))
                self._buffer = self._buffer[found + len(self.end) :]
                self._inside = False
                continue
            found = self._buffer.find(self.start)
            if found < 0:
                safe = held_back(self._buffer, (self.start,))
                pieces.extend(self._text(self._buffer[:safe]))
                self._buffer = self._buffer[safe:]
                return pieces
            pieces.extend(self._text(self._buffer[:found]))
            self._buffer = self._buffer[found + len(self.start) :]
            self._inside = True

    def finish(self) -> list[Piece]:
        rest, self._buffer = self._buffer, ""
        if self._inside:  # cut off inside a block (max_tokens): a call if it is complete anyway
            return [self._call(rest, closed=False)]
        pieces = self._text(rest)
        if not self.calls and self._whitespace:
            pieces.append(Text(self._whitespace))
        return pieces

    def _text(self, text: str) -> list[Piece]:
        body = text.rstrip()
        if not body:
            self._whitespace += text
            return []
        out, self._whitespace = self._whitespace + text[: len(body)], text[len(body) :]
        return [Text(out)]

    def _call(self, body: str, closed: bool) -> Piece:
        call = parse_call(body)
        whitespace, self._whitespace = self._whitespace, ""
        if call is None:
            return Text(whitespace + self.start + body + (self.end if closed else ""))
        self.calls += 1
        return call


def parse_call(body: str) -> ToolCall | None:
    """`{"name": ..., "arguments": {...}}` (or "parameters") as a ToolCall; None if it is not one."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        return ToolCall(value["name"], arguments)
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


TOOL_PARSERS: dict[str, Callable[[], ToolSplitter]] = {
    "hermes": HermesToolParser,
    "qwen": HermesToolParser,
    "kimi_k2": KimiK2ToolParser,
    "kimi_k3": KimiK3ToolParser,
}
