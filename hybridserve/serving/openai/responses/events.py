"""One Response's generation: engine outputs → parsed pieces → output items, streamed as typed events or not.

Streamed: created → in_progress → each item's events (see output.py) → completed | incomplete; an engine
failure ends with error → failed. The non-streamed path runs the same loop without making events, so both
build identical objects.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from hybridserve.serving.openai.errors import APIError
from hybridserve.serving.openai.generation import GenerationRun
from hybridserve.serving.openai.responses.output import EventWriter, OutputBuilder
from hybridserve.serving.openai.responses.protocol import (
    cancelled_response,
    failed_response,
    finished_response,
    usage,
)
from hybridserve.serving.parsers import StreamParser


class ResponseRun:
    """`finish` receives the terminal object (to store it) before it is sent; `final` holds it afterwards."""

    def __init__(
        self, run: GenerationRun, base: dict[str, Any], parser: StreamParser, finish: Callable[[dict], None]
    ) -> None:
        self.run = run
        self.base = base
        self.parser = parser
        self.finish = finish
        self.final: dict[str, Any] | None = None
        self.output = OutputBuilder(None)

    def cancelled(self) -> dict[str, Any]:
        """The response as it stands when cancelled: the output so far, the tokens spent."""
        return cancelled_response(self.base, self.output.cut(), usage(self.run.usage()))

    async def events(self, stream: bool, background: bool = False) -> AsyncIterator[bytes]:
        """The event stream (`stream`), or nothing but `final` set; a non-streamed failure raises APIError.

        A `background` run's base object is `queued`: its stream says so before it goes in_progress."""
        run, parser = self.run, self.parser
        event = EventWriter() if stream else None
        out_items = self.output = OutputBuilder(event)
        if event is not None:
            yield event("response.created", response=self.base)
            if background:
                yield event("response.queued", response=self.base)
            yield event("response.in_progress", response={**self.base, "status": "in_progress"})
        # Tokens inside the reasoning block, its markers included. Tokens whose text the parser holds back
        # (a marker's first characters) are counted once it is known whether they opened a block.
        reasoning_tokens = held = 0
        finish_reason = None
        try:
            async for _, out, finished in run.outputs():
                was_reasoning = parser.in_reasoning
                pieces = parser.feed(out.delta_text)
                for piece in pieces:
                    for frame in out_items.add(piece):
                        yield frame
                if was_reasoning or parser.in_reasoning:
                    reasoning_tokens, held = reasoning_tokens + held + len(out.delta_token_ids), 0
                else:
                    held = 0 if pieces else held + len(out.delta_token_ids)
                if finished:
                    finish_reason = out.finish_reason
        except APIError as exc:
            if event is None:
                raise
            self.final = failed_response(self.base, exc, run.usage())
            self.finish(self.final)
            yield event("error", code=exc.code or exc.type, message=exc.message, param=exc.param)
            yield event("response.failed", response=self.final)
            return
        for piece in parser.finish():
            for frame in out_items.add(piece):
                yield frame
        status = "incomplete" if finish_reason == "length" else "completed"
        for frame in out_items.finish(status):
            yield frame
        self.final = finished_response(self.base, out_items.items, status, usage(run.usage(), reasoning_tokens))
        self.finish(self.final)
        if event is not None:
            yield event(f"response.{status}", response=self.final)
