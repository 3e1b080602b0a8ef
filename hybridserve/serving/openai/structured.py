"""Structured output requested through the API → the engine's grammar constraint (StructuredOutput).

Chat's `response_format`, Responses' `text.format` and forced tool calls (`tool_choice` "required" or a
named function) all become one StructuredOutput, checked here so a bad schema is a 400 naming the field
the client sent, before any engine work. A forced call wins over a response format: its output is the call.
"""

from __future__ import annotations

import json
from typing import Any

from hybridserve.engine.structured_output import check
from hybridserve.sampling_params import InvalidParameter, StructuredOutput
from hybridserve.serving.openai.errors import APIError
from hybridserve.serving.openai.tools import ToolRequest

FORMATS = ("text", "json_object", "json_schema")


def structured_output(fmt: Any, tools: ToolRequest, *, param: str, nested: bool) -> StructuredOutput | None:
    """`fmt` as sent at `param` (Chat nests the schema under "json_schema", Responses does not)."""
    if tools.forced:
        return _checked(StructuredOutput(json_schema=json.dumps(tools.forced_schema())), "tool_choice")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in FORMATS:
        raise APIError(
            400,
            f"Invalid value for '{param}.type': {kind!r}. Expected one of {', '.join(FORMATS)}.",
            param=f"{param}.type",
            code="invalid_value",
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return _checked(StructuredOutput(json_object=True), param)
    spec = fmt.get("json_schema") if nested else fmt
    where = f"{param}.json_schema" if nested else param
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise APIError(400, f"Missing required parameter: '{where}.name'.", param=f"{where}.name")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise APIError(400, f"'{where}.schema' must be a JSON schema object.", param=f"{where}.schema")
    return _checked(StructuredOutput(json_schema=json.dumps(schema)), f"{where}.schema")


def _checked(spec: StructuredOutput, param: str) -> StructuredOutput:
    try:
        check(spec)
    except InvalidParameter as exc:
        reason = str(exc).removeprefix(exc.param).strip()
        raise APIError(400, f"Invalid '{param}': the schema {reason}", param=param, code="invalid_value") from None
    return spec
