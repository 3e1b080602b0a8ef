"""The contract every Response run keeps, on the event loop (events.ResponseRun) or in a post-processing worker
(postprocess.PooledResponseRun): it ends in a terminal state (completed, incomplete, failed, cancelled),
stored through `finish` exactly once, on every way out.

A run supplies its body: the frames it streams, then one `Ending`. The lifecycle stores the ending before it
sends the ending's frames; a store that reports the response failed instead (a full disk) has its error end
the stream in place of the terminal event. A run that is cancelled or closed (a client disconnect, a
background cancel) is stored as `cancelled()` says; one that raises (a bug) is stored failed, loudly.
"""

from __future__ import annotations

import asyncio
import contextlib
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from hybridserve.serving.openai.errors import SERVER_ERROR, APIError
from hybridserve.serving.openai.responses.output import EventWriter
from hybridserve.serving.openai.responses.protocol import failed_response


@dataclass(frozen=True)
class Ending:
    """How a run's body ended: the terminal object, the frames still to send (the terminal event last, when
    streamed) and, for an engine failure, its error (a non-streamed request answers with it)."""

    final: dict[str, Any]
    frames: list[bytes]
    failure: APIError | None = None


def failure_events(sequence_number: int, response: dict[str, Any]) -> list[bytes]:
    """The events that end a stream, numbered from `sequence_number`, when the store reports `response`
    (failed: its end could not be stored) instead of the run's own terminal object: error, response.failed."""
    event = EventWriter(sequence_number)
    error = response["error"]
    return [
        event("error", code=error["code"], message=error["message"], param=None),
        event("response.failed", response=response),
    ]


class ResponseLifecycle(ABC):
    """`finish(final, pending)` receives the terminal object and the frames still to send (its terminal event
    last) to store them, and returns the state to report, which `final` holds after: the terminal object, or
    a failed one if it could not be stored."""

    def __init__(self, base: dict[str, Any], finish: Callable[[dict[str, Any], list[bytes]], dict[str, Any]]) -> None:
        self.base = base
        self.finish = finish
        self.final: dict[str, Any] | None = None

    @abstractmethod
    def body(self, stream: bool) -> AsyncIterator[bytes | Ending]:
        """The run: its frames (when `stream`; one SSE event each, or several joined), then its Ending."""

    @abstractmethod
    def usage(self) -> dict[str, Any]:
        """The chat-style usage of the tokens spent so far."""

    @abstractmethod
    def cancelled(self) -> dict[str, Any]:
        """The response as it is stored when cancelled or closed before its end."""

    def fail(self, error: APIError) -> None:
        """Ends the run failed with `error`, without events (it did not run, or is being left)."""
        self._end(failed_response(self.base, error, self.usage()), [])

    async def events(self, stream: bool) -> AsyncIterator[bytes]:
        """The event stream (`stream`), or nothing but `final` set; a non-streamed failure raises APIError."""
        sent = 0  # events sent so far: the terminal event's sequence number once all before it are out
        ending: Ending | None = None
        try:
            async with contextlib.aclosing(self.body(stream)) as body:
                async for item in body:
                    if isinstance(item, Ending):
                        ending = item
                        break
                    sent += item.count(b"\n\n")
                    yield item
            if ending is None:
                raise RuntimeError("the run ended without a terminal state")
        except (asyncio.CancelledError, GeneratorExit):
            if self.final is None:
                self._end(self.cancelled(), [])
            raise
        except Exception as exc:  # a bug: the response fails, loudly
            if self.final is None:
                self.fail(APIError(500, f"The response failed: {exc}", type=SERVER_ERROR))
            raise
        reported = self._end(ending.final, ending.frames)
        if ending.failure is not None and not stream:
            raise ending.failure
        frames = ending.frames
        if frames and reported is not ending.final and reported["status"] == "failed":
            before = sent + sum(frame.count(b"\n\n") for frame in frames[:-1])
            frames = [*frames[:-1], *failure_events(before, reported)]
        for frame in frames:
            yield frame

    def _end(self, final: dict[str, Any], pending: list[bytes]) -> dict[str, Any]:
        self.final = self.finish(final, pending)
        return self.final
