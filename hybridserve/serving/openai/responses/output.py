"""A Response's output items, built from parsed pieces, with the stream events that announce them.

Items open when their first piece arrives and close when a piece of another kind (or the end) comes, so
`output_index` is the item's position in `output` and one item is closed before the next opens:

- reasoning: output_item.added → content_part.added → reasoning_text.delta* → reasoning_text.done →
  content_part.done → output_item.done
- message: the same with output_text
- function_call: output_item.added → function_call_arguments.delta → function_call_arguments.done →
  output_item.done (a call's arguments are parsed whole, so they arrive in one delta)

Without an EventWriter (a non-streamed Response) the same items are built and no events are made.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec

from hybridserve.serving.openai.responses.protocol import new_id, output_text_part
from hybridserve.serving.parsers import Piece, Reasoning, Text, ToolCall

_encode = msgspec.json.Encoder().encode


class EventWriter:
    """Frames events as `event: <type>` / `data: <json>`, numbering them from `sequence_number`."""

    def __init__(self, sequence_number: int = 0) -> None:
        self.sequence_number = sequence_number

    def __call__(self, type: str, **fields: Any) -> bytes:
        payload = {"type": type, **fields, "sequence_number": self.sequence_number}
        self.sequence_number += 1
        return b"event: " + type.encode() + b"\ndata: " + _encode(payload) + b"\n\n"


def reasoning_text_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


class OutputBuilder:
    def __init__(self, event: EventWriter | None) -> None:
        self.event = event
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._text: list[str] = []
        self._logprobs: list[dict[str, Any]] = []

    def add(self, piece: Piece, logprobs: list[dict[str, Any]] | None = None) -> Iterator[bytes]:
        """`logprobs` (LogProb objects) are those of the tokens behind a Text piece, when asked for."""
        kind = "reasoning" if isinstance(piece, Reasoning) else "message" if isinstance(piece, Text) else None
        if self._open is not None and (kind is None or self._open["type"] != kind):
            yield from self._close("completed")
        if isinstance(piece, ToolCall):
            yield from self._call(piece)
            return
        if self._open is None:
            yield from self._start(kind)
        self._text.append(piece.text)
        delta = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": logprobs or []}
        if logprobs:
            self._logprobs.extend(logprobs)
        yield from self._emit(delta, **self._where(), delta=piece.text, **extra)

    def finish(self, status: str) -> Iterator[bytes]:
        """Closes the last item with `status` (completed, or incomplete when cut by max_output_tokens).

        An output with nothing in it still gets its (empty) message, as clients read one."""
        if not self.items and self._open is None:
            yield from self._start("message")
        if self._open is not None:
            yield from self._close(status)

    def cut(self) -> list[dict[str, Any]]:
        """The items so far, an open one included as incomplete; no events (the output was cut short)."""
        if self._open is None:
            return list(self.items)
        return [*self.items, {**self._open, "status": "incomplete", "content": [self._part()]}]

    def _part(self) -> dict[str, Any]:
        assert self._open is not None
        text = "".join(self._text)
        if self._open["type"] == "reasoning":
            return reasoning_text_part(text)
        return {**output_text_part(text), "logprobs": self._logprobs}

    def _start(self, kind: str | None) -> Iterator[bytes]:
        if kind == "reasoning":
            item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
            part = reasoning_text_part("")
        else:
            item = {"id": new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress", "content": []}
            part = output_text_part("")
        self._open, self._text, self._logprobs = item, [], []
        yield from self._emit("response.output_item.added", output_index=len(self.items), item=dict(item))
        yield from self._emit("response.content_part.added", **self._where(), part=part)

    def _close(self, status: str) -> Iterator[bytes]:
        item, text, part = self._open, "".join(self._text), self._part()
        assert item is not None
        self._open = None
        if item["type"] == "reasoning":
            done, extra = "response.reasoning_text.done", {}
        else:
            done, extra = "response.output_text.done", {"logprobs": part["logprobs"]}
        where = {"item_id": item["id"], "output_index": len(self.items), "content_index": 0}
        item = {**item, "status": status, "content": [part]}
        self.items.append(item)
        yield from self._emit(done, **where, text=text, **extra)
        yield from self._emit("response.content_part.done", **where, part=part)
        yield from self._emit("response.output_item.done", output_index=where["output_index"], item=item)

    def _call(self, call: ToolCall) -> Iterator[bytes]:
        index = len(self.items)
        item = {
            "id": new_id("fc"),
            "type": "function_call",
            "call_id": new_id("call"),
            "name": call.name,
            "arguments": "",
            "status": "in_progress",
        }
        yield from self._emit("response.output_item.added", output_index=index, item=item)
        where = {"item_id": item["id"], "output_index": index}
        yield from self._emit("response.function_call_arguments.delta", **where, delta=call.arguments)
        yield from self._emit(
            "response.function_call_arguments.done", **where, name=call.name, arguments=call.arguments
        )
        item = {**item, "arguments": call.arguments, "status": "completed"}
        self.items.append(item)
        yield from self._emit("response.output_item.done", output_index=index, item=item)

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self.items), "content_index": 0}

    def _emit(self, type: str, **fields: Any) -> Iterator[bytes]:
        if self.event is not None:
            yield self.event(type, **fields)
