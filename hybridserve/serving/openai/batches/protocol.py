"""The Batch API's request and line formats, and what a batch may run.

Input line: `{"custom_id", "method": "POST", "url": <the batch's endpoint>, "body": {...}}`.
Output / error line: `{"id": "batch_req_…", "custom_id", "response": {"status_code", "request_id", "body"} | null,
"error": {"code", "message"} | null}`; a request the endpoint answered with an error status is in the error
file with that response, a request never run (the batch expired) has `response: null` and an `error`.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import Response

from hybridserve.serving.openai.errors import APIError
from hybridserve.serving.openai.files.expiry import ExpiresAfter

COMPLETION_WINDOWS = {"24h": 24 * 60 * 60}
TERMINAL = ("completed", "failed", "expired", "cancelled")
STATUSES = ("validating", "in_progress", "finalizing", "cancelling", *TERMINAL)
MAX_METADATA_KEYS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
_encode = msgspec.json.Encoder().encode


@dataclass(frozen=True)
class BatchEndpoint:
    """What runs a batch line: the endpoint's request model and its service's `create`, the very code
    behind the HTTP route."""

    model: type[BaseModel]
    create: Callable[[Any, Request], Awaitable[Response]]


class CreateBatchRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: ExpiresAfter | None = None  # anchored at the output / error files' creation

    def check(self, endpoints: dict[str, BatchEndpoint]) -> None:
        if self.endpoint not in endpoints:
            raise APIError(
                400,
                f"Invalid value for 'endpoint': '{self.endpoint}'. This server batches {', '.join(endpoints)}.",
                param="endpoint",
                code="invalid_value",
            )
        if self.completion_window not in COMPLETION_WINDOWS:
            raise APIError(
                400,
                f"Invalid value for 'completion_window': '{self.completion_window}'. Supported: "
                f"{', '.join(COMPLETION_WINDOWS)}.",
                param="completion_window",
                code="invalid_value",
            )
        metadata = self.metadata or {}
        if len(metadata) > MAX_METADATA_KEYS:
            raise APIError(
                400,
                f"metadata has {len(metadata)} keys; at most {MAX_METADATA_KEYS} are allowed.",
                param="metadata",
                code="invalid_value",
            )
        for key, value in metadata.items():
            if len(key) > MAX_METADATA_KEY:
                raise APIError(
                    400,
                    f"metadata key '{key}' has {len(key)} characters; at most {MAX_METADATA_KEY} are allowed.",
                    param="metadata",
                    code="invalid_value",
                )
            if len(value) > MAX_METADATA_VALUE:
                raise APIError(
                    400,
                    f"metadata['{key}'] has {len(value)} characters; at most {MAX_METADATA_VALUE} are allowed.",
                    param=f"metadata.{key}",
                    code="invalid_value",
                )


class InputLine(BaseModel):
    """One line of a batch input file (the body is checked against the endpoint's own model). Only keys are
    cached by the JSON parser: custom_ids are unique, so caching values would only hold memory."""

    model_config = ConfigDict(extra="forbid", cache_strings="keys")

    custom_id: str
    method: str
    url: str
    body: dict[str, Any]


def result_line(custom_id: str, status: int, body: bytes) -> bytes:
    """The output or error line of a request the endpoint answered `status` with `body` (kept byte for byte)."""
    request_id = msgspec.json.decode(body).get("id") if status < 400 else None
    head = {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request_id or f"req_{uuid.uuid4().hex}", "body": None},
    }
    # The body goes in as the endpoint's own bytes, not re-encoded: `head` ends `"body":null}}`.
    return _encode(head)[: -len(b"null}}")] + body + b'},"error":null}\n'


def not_run_line(custom_id: str, code: str, message: str) -> bytes:
    """The error line of a request that never ran."""
    line = {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
    return _encode(line) + b"\n"
