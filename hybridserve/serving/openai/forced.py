"""Forced tool calls read back: the JSON a forced call's grammar makes the model write, as calls.

- tool_choice "required": the output is a JSON array of `{"name", "arguments"}` objects (at most
  MAX_FORCED_CALLS, see tools.py). Each call comes out as soon as its object closes, so a stream sends it
  while the model writes the next one.
- A named function: the output is that function's arguments, one call, read when the output ends.

Whatever is still open when the output ends was cut short (max_tokens, a stop string): it is dropped, never
given back as text. The finish reason says the output was cut ("length"; a Response is "incomplete").
"""

from __future__ import annotations

import json

from hybridserve.serving.parsers import Piece, ToolCall


class ArrayElements:
    """The elements of a top-level JSON array fed in pieces, each one's text as soon as it closes.

    The elements are objects or arrays (a forced call is an object); brackets inside strings, escaped quotes
    included, are not counted."""

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._open: list[str] | None = None  # the text of the element being read, while one is

    def feed(self, delta: str) -> list[str]:
        closed: list[str] = []
        start = 0
        for i, char in enumerate(delta):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "[{":
                self._depth += 1
                if self._depth == 2:
                    self._open, start = [], i
            elif char in "]}":
                self._depth -= 1
                if self._depth == 1 and self._open is not None:
                    closed.append("".join([*self._open, delta[start : i + 1]]))
                    self._open = None
        if self._open is not None:
            self._open.append(delta[start:])
        return closed


class RequiredCallsParser:
    """tool_choice "required": each call of the array as soon as it closes; a call cut short is dropped."""

    in_reasoning = False

    def __init__(self) -> None:
        self._elements = ArrayElements()

    def feed(self, delta: str) -> list[Piece]:
        calls = [json.loads(text) for text in self._elements.feed(delta)]
        return [ToolCall(call["name"], json.dumps(call["arguments"], ensure_ascii=False)) for call in calls]

    def finish(self) -> list[Piece]:
        return []  # an element still open was cut short


class NamedCallParser:
    """A named function: the whole output is its arguments; no call if the output was cut short."""

    in_reasoning = False

    def __init__(self, function: str) -> None:
        self.function = function
        self._text: list[str] = []

    def feed(self, delta: str) -> list[Piece]:
        self._text.append(delta)
        return []

    def finish(self) -> list[Piece]:
        text = "".join(self._text).strip()
        try:
            json.loads(text)
        except ValueError:
            return []
        return [ToolCall(self.function, text)]
