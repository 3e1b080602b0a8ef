"""One Response's generation: engine outputs → parsed pieces → output items, streamed as typed events or not.

Streamed: created → in_progress → each item's events (see output.py) → completed | incomplete; an engine
failure ends with error → failed, and so does a response whose end could not be stored (a full disk),
in place of its terminal event. `ResponseFormatter` is the synchronous part (it also runs in
post-processing workers, see serving/postprocess.py); `ResponseRun` drives it from a GenerationRun on
the event loop. The non-streamed path runs the same code without making events, so both build identical
objects.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from hybridserve.engine.outputs import CompletionOutput
from hybridserve.serving.openai.errors import APIError
from hybridserve.serving.openai.generation import GenerationRun, logprobs_content
from hybridserve.serving.openai.responses.lifecycle import Ending, ResponseLifecycle
from hybridserve.serving.openai.responses.output import EventWriter, OutputBuilder
from hybridserve.serving.openai.responses.protocol import (
    cancelled_response,
    failed_response,
    finished_response,
    usage,
)
from hybridserve.serving.parsers import Piece, StreamParser, Text, ToolCall


class ResponseFormatter:
    """Frames (when `stream`) and the terminal object of one Response, fed its choice's outputs in order.

    A `background` response's base object is `queued`: its stream says so before it goes in_progress."""

    def __init__(
        self,
        base: dict[str, Any],
        parser: StreamParser,
        stream: bool,
        background: bool = False,
        logprobs: bool = False,
    ) -> None:
        self.base = base
        self.logprobs = logprobs
        self._pending_logprobs: list[dict[str, Any]] = []  # of tokens whose text is held back
        self.parser = parser
        self.event = EventWriter() if stream else None
        self.background = background
        self.output = OutputBuilder(self.event)
        # Tokens inside the reasoning block, its markers included. Tokens whose text the parser holds back
        # (a marker's first characters) are counted once it is known whether they opened a block.
        self.reasoning_tokens = 0
        self._held = 0

    def start(self) -> list[bytes]:
        if self.event is None:
            return []
        frames = [self.event("response.created", response=self.base)]
        if self.background:
            frames.append(self.event("response.queued", response=self.base))
        frames.append(self.event("response.in_progress", response={**self.base, "status": "in_progress"}))
        return frames

    def feed(self, out: CompletionOutput) -> list[bytes]:
        parser = self.parser
        was_reasoning = parser.in_reasoning
        pieces = parser.feed(out.delta_text)
        if self.logprobs and not (was_reasoning or parser.in_reasoning):
            self._pending_logprobs.extend(logprobs_content(out.delta_logprobs or []))
        frames = [frame for piece in pieces for frame in self._add(piece)]
        if was_reasoning or parser.in_reasoning:
            self.reasoning_tokens += self._held + len(out.delta_token_ids)
            self._held = 0
        else:
            self._held = 0 if pieces else self._held + len(out.delta_token_ids)
        return frames

    def finish(self, finish_reason: str | None, chat_usage: dict[str, Any]) -> tuple[list[bytes], dict[str, Any]]:
        """The closing frames, the terminal event last, and the terminal object."""
        frames = [frame for piece in self.parser.finish() for frame in self._add(piece)]
        status = "incomplete" if finish_reason == "length" else "completed"
        frames.extend(self.output.finish(status))
        final = finished_response(self.base, self.output.items, status, usage(chat_usage, self.reasoning_tokens))
        if self.event is not None:
            frames.append(self.event(f"response.{status}", response=final))
        return frames, final

    def _add(self, piece: Piece) -> list[bytes]:
        """The piece's frames; a text piece carries the logprobs of the tokens behind it (a call's are dropped)."""
        logprobs = None
        if isinstance(piece, Text | ToolCall):
            logprobs, self._pending_logprobs = self._pending_logprobs, []
        return list(self.output.add(piece, logprobs if isinstance(piece, Text) else None))

    def fail(self, exc: APIError, chat_usage: dict[str, Any]) -> tuple[list[bytes], dict[str, Any]]:
        final = failed_response(self.base, exc, chat_usage)
        if self.event is None:
            return [], final
        frames = [
            self.event("error", code=exc.code or exc.type, message=exc.message, param=exc.param),
            self.event("response.failed", response=final),
        ]
        return frames, final

    def cancelled(self, chat_usage: dict[str, Any]) -> dict[str, Any]:
        """The response as it stands when cancelled: the output so far, the tokens spent."""
        return cancelled_response(self.base, self.output.cut(), usage(chat_usage, self.reasoning_tokens))


class ResponseRun(ResponseLifecycle):
    """A Response generated on the event loop, from a GenerationRun; a `background` one's stream says it was
    queued. Cancelled, it is stored with the output built so far."""

    def __init__(
        self,
        run: GenerationRun,
        base: dict[str, Any],
        parser: StreamParser,
        finish: Callable[[dict[str, Any], list[bytes]], dict[str, Any]],
        background: bool = False,
    ) -> None:
        super().__init__(base, finish)
        self.run = run
        self.parser = parser
        self.background = background
        self.formatter = ResponseFormatter(base, parser, stream=False)

    def usage(self) -> dict[str, Any]:
        return self.run.usage()

    def cancelled(self) -> dict[str, Any]:
        return self.formatter.cancelled(self.run.usage())

    async def body(self, stream: bool) -> AsyncIterator[bytes | Ending]:
        run = self.run
        logprobs = run.params[0].logprobs is not None
        fmt = self.formatter = ResponseFormatter(self.base, self.parser, stream, self.background, logprobs)
        for frame in fmt.start():
            yield frame
        finish_reason = None
        try:
            async for _, out, finished in run.outputs():
                for frame in fmt.feed(out):
                    yield frame
                if finished:
                    finish_reason = out.finish_reason
        except APIError as exc:
            frames, final = fmt.fail(exc, run.usage())
            yield Ending(final, frames, exc)
        else:
            frames, final = fmt.finish(finish_reason, run.usage())
            yield Ending(final, frames)
