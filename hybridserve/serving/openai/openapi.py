"""The served OpenAPI document (/openapi.json): the request bodies and error responses the routes really have.

The JSON endpoints read their bodies themselves (under a size limit, large ones parsed off the event loop:
body.py), so FastAPI sees no body parameter and would publish none. Each route names its body model with
`json_body(Model)` (or `multipart_body` for uploads) and its error statuses with `errors(...)`; `publish`
then puts the body models into the document's components. Every error has OpenAI's shape (`ErrorResponse`).
A request FastAPI itself rejects (a query parameter of the wrong type) is answered 400 like any other bad
request (errors.py), so the document lists 400 where FastAPI would list its 422; every /v1 route may also
answer 401 (a server with an API key; KEYED_PATHS) and 500.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

REF = "#/components/schemas/{model}"
# The paths a server started with --api-key guards (so they may answer 401): the API's, and vLLM's tokenizer routes.
KEYED_PATHS = ("/v1", "/tokenize", "/detokenize")

ERROR_DESCRIPTIONS = {
    400: "The request is invalid (a missing or malformed field, a value out of range, a prompt too long).",
    401: "The API key is missing or wrong (a server started with --api-key).",
    404: "The model, or the object the path names, does not exist.",
    409: "The object is in a state that does not allow this.",
    413: "The request body is larger than the server's limit.",
    429: "Too many batches already wait for a runner slot (--max-queued-batches).",
    500: "The engine or the server failed.",
    503: "No engine worker can serve the request now; retrying later may succeed.",
    507: "What the request writes could not be stored: the disk is full.",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """What every error status carries."""

    error: ErrorDetail


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """A route's `responses=`: these error statuses, each with OpenAI's error body."""
    return {status: {"model": ErrorResponse, "description": ERROR_DESCRIPTIONS[status]} for status in statuses}


def json_body(model: type[BaseModel], streams: bool = False) -> dict[str, Any]:
    """A route's `openapi_extra`: its JSON body is `model`; with `streams`, its answer may be an event stream."""
    extra: dict[str, Any] = {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}},
        }
    }
    if streams:
        content = {
            "application/json": {"schema": {"type": "object"}},
            "text/event-stream": {"schema": {"type": "string", "description": "Server-sent events; `stream: true`"}},
        }
        extra["responses"] = {"200": {"description": "The result, or its event stream", "content": content}}
    return extra


def multipart_body(properties: dict[str, dict[str, Any]], required: list[str]) -> dict[str, Any]:
    """A route's `openapi_extra` for a multipart/form-data body of these fields."""
    schema = {"type": "object", "properties": properties, "required": required}
    return {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": schema}}}}


def publish(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Serve a document that holds `models` (the bodies named by `json_body`) among its component schemas,
    with FastAPI's 422 replaced by the 400 this server answers, and 401 and 500 on every keyed route."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = document.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                schema = model.model_json_schema(ref_template=REF)
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
            schemas.pop("HTTPValidationError", None)
            schemas.pop("ValidationError", None)
            schemas.update(_error_schemas())
            for path, operations in document.get("paths", {}).items():
                for operation in operations.values():
                    _set_errors(operation, path.startswith(KEYED_PATHS))
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _error_schemas() -> dict[str, Any]:
    schema = ErrorResponse.model_json_schema(ref_template=REF)
    return {**schema.pop("$defs"), "ErrorResponse": schema}


def _set_errors(operation: dict[str, Any], api: bool) -> None:
    responses = operation.setdefault("responses", {})
    validation = responses.pop("422", None)
    statuses = [400] if validation is not None else []
    if api:
        statuses += [401, 500]
    error = {"application/json": {"schema": {"$ref": REF.format(model="ErrorResponse")}}}
    for status in statuses:
        responses.setdefault(str(status), {"description": ERROR_DESCRIPTIONS[status], "content": error})
