"""A request's JSON body: read under a size limit (`--max-request-body-bytes`), parsed into its request model.

The body is read as it arrives and refused with a 413 the moment it passes the limit, or before any of it is
read when its Content-Length already says more, so a huge body neither fills memory nor is read to its end.
A large body is parsed on a worker thread, so the event loop goes on serving other requests meanwhile.
(/v1/files uploads are multipart, streamed to disk under their own limit: see files/upload.py.)
"""

from __future__ import annotations

import asyncio
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from hybridserve.serving.openai.errors import APIError, validation_error

# Room for any prompt a context window holds (a million tokens of text is a few MiB; as token ids, about 7 bytes
# each), far below what would strain the server's memory.
DEFAULT_MAX_BODY_BYTES = 16 * 1024**2
# Above this a parse takes milliseconds: a worker thread's hop (~0.1 ms) is then worth it.
OFF_LOOP_BYTES = 1024**2
M = TypeVar("M", bound=BaseModel)


def body_too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"The request body is larger than this server's limit of {limit} bytes (--max-request-body-bytes).",
        code="request_too_large",
    )


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or a 413 once it passes `limit` bytes (at once when its Content-Length says it will)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise body_too_large(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise body_too_large(limit)
    return bytes(body)


async def parse_body(request: Request, model: type[M], limit: int) -> M:
    """The body as `model`; a 413 past `limit` bytes, a 400 naming the field for what `model` refuses."""
    body = await read_body(request, limit)
    try:
        if len(body) > OFF_LOOP_BYTES:
            return await asyncio.to_thread(model.model_validate_json, body)
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error(list(exc.errors())) from None
