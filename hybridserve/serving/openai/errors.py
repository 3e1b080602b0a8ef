"""OpenAI-style errors: one exception type, one body shape, and the FastAPI handlers that emit it."""

from __future__ import annotations

import json
import re

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from hybridserve.sampling_params import InvalidParameter
from hybridserve.serving.storage import disk_full, write_failure

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


class APIError(Exception):
    """An error the client sees as `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, headers: dict[str, str] | None = None) -> Response:
        return json_response(self.body(), self.status, headers)


def json_response(body: object, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(body), status, headers, media_type="application/json")


def invalid_parameter(exc: InvalidParameter, renames: dict[str, str] | None = None) -> APIError:
    param = exc.param
    message = str(exc)
    if renames and param in renames:
        param = renames[param]
        message = message.replace(exc.param, param, 1)
    return APIError(400, message, param=param, code="invalid_value")


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


# The deepest nesting of objects and arrays the JSON parser (pydantic's jiter) reads, the body's own object
# included; deeper is refused before any of it is validated.
MAX_JSON_DEPTH = 201


def malformed_json() -> APIError:
    return APIError(
        400,
        "We could not parse the JSON body of your request. The body must be a valid JSON object.",
    )


# pydantic marks which member of a union failed with the member's type ("str", "list[ContentPart]").
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|bytes|[a-z-]+\[.*\])$")


def _param_path(loc: tuple) -> str | None:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not _UNION_TAG.match(part):
            path += f".{part}" if path else part
    return path or None


def _shown(value: object, limit: int = 80) -> str:
    """A sent value as JSON (`"yes"`, `false`, `Infinity`), shortened past `limit` characters."""
    if isinstance(value, str):
        value = value[:limit]
    text = json.dumps(value, ensure_ascii=False, default=repr)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def validation_error(errors: list[dict]) -> APIError:
    """The first pydantic error, named by its field path (e.g. `messages[0].content`) and the value sent."""
    first = errors[0]
    if first["type"] == "json_invalid":
        if "recursion limit exceeded" in first["msg"]:
            return APIError(
                400,
                f"The JSON body is nested more than {MAX_JSON_DEPTH} levels deep (objects and arrays), deeper than "
                "this server parses.",
                code="json_too_deep",
            )
        return malformed_json()
    param = _param_path(tuple(first["loc"]))
    if param is None:
        return APIError(400, "The request body must be a JSON object.")
    if first["type"] == "missing":
        return APIError(400, f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    code = "invalid_type" if first["type"].endswith(("_type", "_parsing")) else "invalid_value"
    message = f"Invalid value for '{param}': {first['msg']}, got {_shown(first['input'])}."
    return APIError(400, message, param=param, code=code)


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, exc: APIError) -> Response:
        return exc.response()

    async def on_validation_error(request: Request, exc: RequestValidationError | ValidationError) -> Response:
        return validation_error(list(exc.errors())).response()

    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = INVALID_REQUEST if exc.status_code < 500 else SERVER_ERROR
        return APIError(exc.status_code, str(exc.detail), type=kind).response(exc.headers)

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        # Starlette re-raises after this response is sent, so the server logs the traceback.
        if disk_full(exc):  # any write path the routes do not answer themselves
            return APIError(
                507, f"The server could not store what the request writes: {write_failure(exc)}.", type=SERVER_ERROR
            ).response()
        return APIError(500, f"Internal server error: {exc}", type=SERVER_ERROR).response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(ValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)
