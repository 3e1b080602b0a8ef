"""The streamed form of one Response: typed server-sent events with contiguous sequence numbers.

created → in_progress → output_item.added → content_part.added → output_text.delta* → output_text.done →
content_part.done → output_item.done → completed | incomplete; an engine failure ends with error → failed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from hybridserve.serving.openai.errors import APIError
from hybridserve.serving.openai.generation import GenerationRun
from hybridserve.serving.openai.responses.protocol import (
    failed_response,
    finished_response,
    output_message,
    output_text_part,
)

_encode = msgspec.json.Encoder().encode


class EventWriter:
    """Frames events as `event: <type>` / `data: <json>`, numbering them from 0."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def __call__(self, type: str, **fields: Any) -> bytes:
        payload = {"type": type, **fields, "sequence_number": self.sequence_number}
        self.sequence_number += 1
        return b"event: " + type.encode() + b"\ndata: " + _encode(payload) + b"\n\n"


async def response_events(
    run: GenerationRun, base: dict[str, Any], item_id: str, finish: Callable[[dict[str, Any]], None]
) -> AsyncIterator[bytes]:
    """Streams `run` as Response events; `finish` receives the terminal object (to store it) before it is sent."""
    event = EventWriter()
    yield event("response.created", response=base)
    yield event("response.in_progress", response=base)
    where = {"item_id": item_id, "output_index": 0, "content_index": 0}
    yield event("response.output_item.added", output_index=0, item=output_message(item_id, "in_progress", None))
    yield event("response.content_part.added", **where, part=output_text_part(""))
    text: list[str] = []
    finish_reason = None
    try:
        async for _, out, finished in run.outputs():
            if out.delta_text:
                text.append(out.delta_text)
                yield event("response.output_text.delta", **where, delta=out.delta_text, logprobs=[])
            if finished:
                finish_reason = out.finish_reason
    except APIError as exc:
        failed = failed_response(base, exc, run.usage())
        finish(failed)
        yield event("error", code=exc.code or exc.type, message=exc.message, param=exc.param)
        yield event("response.failed", response=failed)
        return
    full = "".join(text)
    final = finished_response(base, item_id, full, finish_reason, run.usage())
    yield event("response.output_text.done", **where, text=full, logprobs=[])
    yield event("response.content_part.done", **where, part=output_text_part(full))
    yield event("response.output_item.done", output_index=0, item=final["output"][0])
    finish(final)
    yield event(f"response.{final['status']}", response=final)
