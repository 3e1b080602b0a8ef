"""Anthropic's error shape: `{"type": "error", "error": {"type", "message"}}` with Anthropic's statuses.

The shared steps raise the house APIError (its message names the field); this module only re-dresses it,
so both APIs refuse the same request for the same reason. An unavailable engine (the house 503) is
Anthropic's 529 overloaded_error, which the anthropic SDK retries.
"""

from __future__ import annotations

import msgspec
from starlette.responses import Response

from hybridserve.serving.openai.errors import APIError

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}
OVERLOADED = 529
_encode = msgspec.json.Encoder().encode


def status_of(exc: APIError) -> int:
    return OVERLOADED if exc.status == 503 else exc.status


def error_body(status: int, message: str) -> dict:
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(exc: APIError, headers: dict[str, str] | None = None) -> Response:
    status = status_of(exc)
    return Response(_encode(error_body(status, exc.message)), status, headers, media_type="application/json")


def sse(kind: str, payload: dict) -> bytes:
    """One Anthropic server-sent event: its type on the `event:` line, the payload (which repeats it) as data."""
    return b"event: " + kind.encode() + b"\ndata: " + _encode(payload) + b"\n\n"


def error_event(exc: APIError) -> bytes:
    """A failure after the stream began: Anthropic's `error` event (and nothing after it)."""
    return sse("error", error_body(status_of(exc), exc.message))
