"""The parsed output (reasoning, text, tool calls) as Anthropic content blocks and their stream events.

One writer serves both answers: it is fed the parser's pieces as they come, returns the events they make
(`content_block_start`, `content_block_delta`*, `content_block_stop`; indices contiguous from 0; none unless
`stream`) and keeps the finished blocks, which a non-streamed answer sends as its `content`. Consecutive
reasoning (text) pieces grow one thinking (text) block; a thinking block closes with a `signature_delta`
carrying its signature. A tool call arrives whole from the parsers, so its input is one `input_json_delta`.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from hybridserve.serving.anthropic.errors import sse
from hybridserve.serving.anthropic.signature import ThinkingSigner
from hybridserve.serving.parsers import Piece, Reasoning, Text, ToolCall

logger = logging.getLogger(__name__)
STARTS = {"thinking": {"type": "thinking", "thinking": "", "signature": ""}, "text": {"type": "text", "text": ""}}


def tool_input(call: ToolCall) -> dict[str, Any]:
    """A call's arguments as the object Anthropic's `input` must be; arguments that are not one are logged and
    sent as {} (the client's tool then reports the missing input, and the model may try again)."""
    try:
        value = json.loads(call.arguments)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        logger.warning("tool call %s: arguments are not a JSON object, sent as {}: %.200s", call.name, call.arguments)
        return {}
    return value


class BlockWriter:
    def __init__(self, signer: ThinkingSigner, stream: bool) -> None:
        self.signer = signer
        self.stream = stream
        self.blocks: list[dict[str, Any]] = []
        self.open: str | None = None  # the type of the last block while it may still grow
        self.calls = 0

    def add(self, pieces: list[Piece]) -> list[bytes]:
        events: list[bytes] = []
        for piece in pieces:
            if isinstance(piece, ToolCall):
                events += self._call(piece)
            elif piece.text:
                events += self._grow("thinking" if isinstance(piece, Reasoning) else "text", piece)
        return events

    def close(self) -> list[bytes]:
        """Ends the block still open (at the end of the output, or before a different one starts)."""
        if self.open is None:
            return []
        index, block = len(self.blocks) - 1, self.blocks[-1]
        events = []
        if self.open == "thinking":
            block["signature"] = self.signer.sign(block["thinking"])
            delta = {"type": "signature_delta", "signature": block["signature"]}
            events.append(self._event("content_block_delta", index=index, delta=delta))
        self.open = None
        return [*events, self._event("content_block_stop", index=index)]

    def _grow(self, kind: str, piece: Reasoning | Text) -> list[bytes]:
        events = []
        if self.open != kind:
            events += self.close()
            events.append(self._start(STARTS[kind]))
            self.open = kind
        self.blocks[-1][kind] += piece.text
        delta = {"type": f"{kind}_delta", kind: piece.text}
        return [*events, self._event("content_block_delta", index=len(self.blocks) - 1, delta=delta)]

    def _call(self, call: ToolCall) -> list[bytes]:
        events = self.close()
        arguments = tool_input(call)
        block = {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex}", "name": call.name, "input": {}}
        events.append(self._start(block))
        self.blocks[-1]["input"] = arguments
        self.calls += 1
        index = len(self.blocks) - 1
        delta = {"type": "input_json_delta", "partial_json": json.dumps(arguments, ensure_ascii=False)}
        return [
            *events,
            self._event("content_block_delta", index=index, delta=delta),
            self._event("content_block_stop", index=index),
        ]

    def _start(self, block: dict[str, Any]) -> bytes:
        self.blocks.append(dict(block))
        return self._event("content_block_start", index=len(self.blocks) - 1, content_block=block)

    def _event(self, kind: str, **fields: Any) -> bytes:
        return sse(kind, {"type": kind, **fields}) if self.stream else b""
