"""Kimi output parsers: K3's think / response channels and tools blocks, and K2's tool-call sections.

K3 (see rendering/kimi_k3.py): the assistant writes `<|open|>think<|sep|>…<|close|>think<|sep|>`, then
`<|open|>response<|sep|>…<|close|>response<|sep|>`, then optionally a `tools` block of `call` blocks. The
reasoning parser starts in the channel the prompt opened and drops the channel and end-of-message markers;
what lies outside both channels (the tools block) passes on as text for the tool parser.

K2: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}
<|tool_call_end|>…<|tool_calls_section_end|>`.

Every marker split across deltas is held back until it is known, so markup never reaches the client as text.
"""

from __future__ import annotations

from hybridserve.rendering.kimi_k3 import (
    CALL_CLOSE,
    END,
    MESSAGE_CLOSE,
    OPEN,
    RESPONSE_CLOSE,
    RESPONSE_OPEN,
    SEP,
    THINK_CLOSE,
    THINK_OPEN,
    TOOLS_CLOSE,
    TOOLS_OPEN,
    parse_call,
)
from hybridserve.serving.parsers.base import ChannelParser, Piece, Text, ToolCall, held_back

_ENDINGS = {MESSAGE_CLOSE: None, END: None}
_SWITCHES: dict[str | None, dict[str, str | None]] = {
    None: {THINK_OPEN: "think", RESPONSE_OPEN: "response", **_ENDINGS},
    "think": {THINK_CLOSE: None, **_ENDINGS},
    "response": {RESPONSE_CLOSE: None, **_ENDINGS},
}


def opened_channel(prompt_text: str) -> str | None:
    """The channel the prompt leaves open for the model: "think", "response" or None."""
    if prompt_text.endswith(THINK_OPEN):
        return "think"
    return "response" if prompt_text.endswith(RESPONSE_OPEN) else None


class KimiK3ReasoningParser(ChannelParser):
    switches = _SWITCHES

    def __init__(self, prompt_text: str = "") -> None:
        super().__init__(opened_channel(prompt_text))


class SectionToolParser:
    """Calls inside a section (`section_open` … `section_close`), each ended by `item_close`.

    Text outside sections is passed through; whitespace between a section's calls is dropped; a call that
    does not parse is given back as its text."""

    section_open = ""
    section_close = ""
    item_close = ""

    def __init__(self) -> None:
        self._buffer = ""
        self._inside = False

    def feed(self, delta: str) -> list[Piece]:
        self._buffer += delta
        pieces: list[Piece] = []
        while True:
            if not self._inside:
                at = self._buffer.find(self.section_open)
                if at < 0:
                    safe = held_back(self._buffer, (self.section_open,))
                    pieces.append(Text(self._buffer[:safe]))
                    self._buffer = self._buffer[safe:]
                    return pieces
                pieces.append(Text(self._buffer[:at]))
                self._buffer = self._buffer[at + len(self.section_open) :]
                self._inside = True
                continue
            item, section = self._buffer.find(self.item_close), self._buffer.find(self.section_close)
            if section >= 0 and (item < 0 or section < item):
                pieces.append(Text(self._buffer[:section].strip()))
                self._buffer = self._buffer[section + len(self.section_close) :]
                self._inside = False
                continue
            if item < 0:
                return pieces
            pieces.append(self._call(self._buffer[:item].strip()))
            self._buffer = self._buffer[item + len(self.item_close) :]

    def finish(self) -> list[Piece]:
        rest, self._buffer = self._buffer, ""
        if not self._inside:
            return [Text(rest)]
        rest = rest.strip()
        return [self._call(rest)] if rest else []  # cut off inside a section (max_tokens)

    def _call(self, chunk: str) -> Piece:
        call = self.parse(chunk)
        return Text(chunk) if call is None else call

    def parse(self, chunk: str) -> ToolCall | None:
        raise NotImplementedError


class KimiK3ToolParser(SectionToolParser):
    section_open = TOOLS_OPEN
    section_close = TOOLS_CLOSE
    item_close = CALL_CLOSE

    def parse(self, chunk: str) -> ToolCall | None:
        head_start = f"{OPEN}call"
        if not chunk.startswith(head_start) or SEP not in chunk:
            return None
        head, body = chunk[len(head_start) :].split(SEP, 1)
        call = parse_call(head, body)
        return None if call is None else ToolCall(call.name, call.arguments)


K2_SECTION_BEGIN, K2_SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
K2_CALL_BEGIN, K2_ARGUMENT_BEGIN, K2_CALL_END = (
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
)


class KimiK2ToolParser(SectionToolParser):
    section_open = K2_SECTION_BEGIN
    section_close = K2_SECTION_END
    item_close = K2_CALL_END

    def parse(self, chunk: str) -> ToolCall | None:
        if not chunk.startswith(K2_CALL_BEGIN) or K2_ARGUMENT_BEGIN not in chunk:
            return None
        call_id, arguments = chunk[len(K2_CALL_BEGIN) :].split(K2_ARGUMENT_BEGIN, 1)
        name = call_id.strip().removeprefix("functions.").rsplit(":", 1)[0]
        return ToolCall(name, arguments.strip()) if name else None
