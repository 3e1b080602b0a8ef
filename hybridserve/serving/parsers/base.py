"""What parsers turn a model's generated text into: reasoning, visible text and tool calls, as they stream.

Parsers are incremental: `feed(delta)` returns the pieces that are certain so far and holds back any tail
that could still be the start of a marker, so a marker split across deltas never reaches the client as
text; `finish()` flushes what is left when the generation ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol


@dataclass(frozen=True)
class Reasoning:
    text: str


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON text, as the API sends it


Piece = Reasoning | Text | ToolCall


class ToolSplitter(Protocol):
    """A tool-call parser: visible text in, text and calls out."""

    def feed(self, delta: str) -> list[Piece]: ...

    def finish(self) -> list[Piece]: ...


class ReasoningSplitter(ToolSplitter, Protocol):
    """A reasoning parser: generated text in, reasoning and visible text out."""

    @property
    def in_reasoning(self) -> bool: ...


def held_back(buffer: str, markers: tuple[str, ...]) -> int:
    """Where the longest suffix of `buffer` that is a proper prefix of some marker starts (len if none)."""
    longest = max(map(len, markers)) - 1
    for start in range(max(0, len(buffer) - longest), len(buffer)):
        tail = buffer[start:]
        if any(marker.startswith(tail) for marker in markers):
            return start
    return len(buffer)


class ChannelParser:
    """Generated text as channels: text in channel "think" is reasoning, every other channel is visible text.

    `switches[channel]` maps each marker that may come next in `channel` to the channel it opens; markers
    are dropped, and a tail that may be the start of one is held back."""

    switches: ClassVar[dict[str | None, dict[str, str | None]]]

    def __init__(self, channel: str | None) -> None:
        self.channel = channel
        self._buffer = ""

    @property
    def in_reasoning(self) -> bool:
        return self.channel == "think"

    def feed(self, delta: str) -> list[Piece]:
        self._buffer += delta
        pieces: list[Piece] = []
        while True:
            switches = self.switches[self.channel]
            found = [(at, marker) for marker in switches if (at := self._buffer.find(marker)) >= 0]
            if not found:
                break
            at, marker = min(found)
            pieces.append(self._piece(self._buffer[:at]))
            self._buffer = self._buffer[at + len(marker) :]
            self.channel = switches[marker]
        safe = held_back(self._buffer, tuple(self.switches[self.channel]))
        pieces.append(self._piece(self._buffer[:safe]))
        self._buffer = self._buffer[safe:]
        return pieces

    def finish(self) -> list[Piece]:
        rest, self._buffer = self._buffer, ""
        return [self._piece(rest)]

    def _piece(self, text: str) -> Piece:
        return Reasoning(text) if self.in_reasoning else Text(text)


def merged(pieces: list[Piece]) -> list[Piece]:
    """Adjacent reasoning or text pieces joined; empty ones dropped."""
    out: list[Piece] = []
    for piece in pieces:
        if isinstance(piece, Reasoning | Text):
            if not piece.text:
                continue
            if out and type(out[-1]) is type(piece):
                out[-1] = type(piece)(out[-1].text + piece.text)  # type: ignore[union-attr]
                continue
        out.append(piece)
    return out
