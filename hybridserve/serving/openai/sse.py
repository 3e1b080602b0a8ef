"""Server-sent events and client-disconnect handling.

Both response paths watch the connection: when the client goes away, the task that drives the engine
is cancelled (plain asyncio cancellation, delivered once, so the engine iterator's cleanup can still
await) and the engine iterator is closed, which aborts the engine request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

SSE_DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.Encoder().encode


def sse_event(payload: Any) -> bytes:
    return b"data: " + _encode(payload) + b"\n\n"


async def aclose(iterator: AsyncIterator) -> None:
    close = getattr(iterator, "aclose", None)
    if close is not None:
        await close()


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _cancel(*tasks: asyncio.Future) -> None:
    """Cancels `tasks` at once, then waits for them to end; their outcomes stay on the tasks."""
    for task in tasks:
        task.cancel()
    await asyncio.wait(tasks)


class EventStreamResponse(Response):
    """Streams `chunks` (already-framed SSE bytes) until they end or the client disconnects."""

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self.status_code = 200
        self.background = None
        self.chunks = chunks
        self.init_headers({"cache-control": "no-cache"})  # no body attribute: no content-length

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self._stream(send))
        watch = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait((stream, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            await _cancel(watch, stream)
            await aclose(self.chunks)
        if not stream.cancelled() and stream.exception() is not None:
            raise stream.exception()

    async def _stream(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except OSError:  # ASGI spec 2.4 servers raise on send once the client is gone
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def cancel_on_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """Runs `work` unless the client disconnects first; then cancels it (aborting the engine request)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        await _cancel(watch, task)
    if task.cancelled():
        return Response(status_code=499)  # nginx's "client closed request"; never reaches the client
    return task.result()
