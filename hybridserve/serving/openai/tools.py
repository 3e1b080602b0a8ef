"""Function tools in a request: validation, tool_choice, rendering into the prompt, and forced calls.

Both endpoints normalise their own wire shapes (Chat nests `function`, Responses is flat) into one
ToolRequest. A function's `parameters` must be a valid JSON Schema (checked against its metaschema, a long one
on a worker thread), forced or not. The other tool types OpenAI defines for the endpoint (Chat: custom;
Responses: web_search, local_shell, mcp, ...) are accepted and ignored with a warning, as clients such as
Codex declare built-in tools a self-hosted model cannot run; a type OpenAI does not define there (a typo, a
missing type) is a 400.

Forced calls (tool_choice "required" or a named function) are a grammar (`forced_schema`, at most
MAX_FORCED_CALLS calls) read back by forced.py. How tools reach the prompt is the renderer's
(hybridserve/rendering/).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import re
from dataclasses import dataclass
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from jsonschema.validators import validator_for

from hybridserve.serving.openai.errors import APIError
from hybridserve.serving.openai.forced import NamedCallParser, RequiredCallsParser
from hybridserve.serving.parsers import Parsers, StreamParser

logger = logging.getLogger(__name__)

NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
CHOICES = ("auto", "none", "required")
CHAT_TOOL_TYPES = ("function", "custom")
RESPONSES_TOOL_TYPES = (
    "function",
    "file_search",
    "computer",
    "computer_use_preview",
    "web_search",
    "web_search_2025_08_26",
    "web_search_preview",
    "web_search_preview_2025_03_11",
    "mcp",
    "code_interpreter",
    "programmatic_tool_calling",
    "image_generation",
    "local_shell",
    "shell",
    "custom",
    "namespace",
    "tool_search",
    "apply_patch",
)
MAX_PROBLEM_CHARS = 300
# jsonschema is pure Python: checking a schema of this many characters takes ~10 ms, a megabyte seconds, so
# longer ones are checked on a worker thread. Checks of schemas up to MAX_CACHED_SCHEMA_CHARS are remembered
# (256 of them, at most 16 MiB): agents send the same tools with every turn.
OFF_LOOP_SCHEMA_CHARS = 2048
MAX_CACHED_SCHEMA_CHARS = 64 * 1024
# The most calls one forced turn ("required", parallel_tool_calls true) may make: the grammar's maxItems, after
# which it allows only the array's end. A small model forced to call often repeats its call until the token
# budget (all the context left, when max_tokens is not set) runs out, and an agent would run every repeat. A
# grammar cannot forbid a repeat (it is context-free: one item cannot be compared with another), so this cap is
# what ends such a turn. A turn that needs more calls makes the rest on the next one (agents loop until the
# model stops calling), so a low cap costs at most a turn where a loop costs every repeat's tokens and tool run.
MAX_FORCED_CALLS = 8


@dataclass(frozen=True)
class FunctionTool:
    name: str
    description: str | None
    parameters: dict[str, Any]

    def template_form(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": {**function, "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[FunctionTool, ...] = ()
    choice: str = "auto"  # auto, none, required, or the name of the one function to call
    parallel: bool = True
    # "required" and "none" are enforced by the prompt (the model's template states them), not by a grammar
    by_template: bool = False

    @property
    def parse_calls(self) -> bool:
        """Whether the model's free text is parsed for calls (forced calls are read as JSON instead)."""
        return bool(self.tools) and (self.choice == "auto" or (self.by_template and self.choice == "required"))

    @property
    def forced(self) -> bool:
        if self.by_template and self.choice == "required":
            return False
        return bool(self.tools) and self.choice not in ("auto", "none")

    def template_tools(self) -> list[dict[str, Any]] | None:
        if not self.tools or (self.choice == "none" and not self.by_template):
            return None
        return [tool.template_form() for tool in self.tools]

    def forced_schema(self) -> dict[str, Any]:
        """The JSON the output must be: the named function's arguments, or a list of calls for "required"."""
        if self.choice != "required":
            return self._tool(self.choice).parameters
        call = [
            {
                "type": "object",
                "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for tool in self.tools
        ]
        maximum = MAX_FORCED_CALLS if self.parallel else 1
        return {"type": "array", "minItems": 1, "maxItems": maximum, "items": {"anyOf": call}}

    def _tool(self, name: str) -> FunctionTool:
        return next(tool for tool in self.tools if tool.name == name)


def output_parser(parsers: Parsers, prompt_text: str, tools: ToolRequest) -> StreamParser:
    """The parser for one generation of a request with these tools."""
    if tools.forced:
        return RequiredCallsParser() if tools.choice == "required" else NamedCallParser(tools.choice)
    return parsers.for_request(prompt_text, tools.parse_calls)


def required_by(tools: ToolRequest, mode: str | None) -> ToolRequest:
    """`tools` as a model whose extension enforces tool_choice "required" in `mode` serves them."""
    return dataclasses.replace(tools, by_template=mode == "template")


async def tool_request(
    tools: list[dict[str, Any]] | None, tool_choice: Any, parallel: bool | None, *, nested: bool
) -> ToolRequest:
    """Validates `tools` and `tool_choice` as sent to Chat (`nested`: `{"function": {...}}`) or Responses."""
    functions: list[FunctionTool] = []
    for i, tool in enumerate(tools or []):
        param = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise APIError(400, f"'{param}' must be an object.", param=param)
        if _tool_type(tool, param, CHAT_TOOL_TYPES if nested else RESPONSES_TOOL_TYPES) != "function":
            logger.warning("ignoring tool %s of type %r: only function tools are served", param, tool["type"])
            continue
        spec = tool.get("function") if nested else tool
        if nested:
            param = f"{param}.function"
            if not isinstance(spec, dict):
                raise APIError(400, f"Missing required parameter: '{param}'.", param=param)
        functions.append(await _function(spec, param))
        if functions[-1].name in (f.name for f in functions[:-1]):
            raise APIError(400, f"Duplicate function name {functions[-1].name!r} in tools.", param=f"{param}.name")
    return ToolRequest(tuple(functions), _choice(tool_choice, functions, nested), parallel is not False)


def _tool_type(tool: dict[str, Any], param: str, known: tuple[str, ...]) -> str:
    kind = tool.get("type")
    if kind is None:
        raise APIError(
            400,
            f"Missing required parameter: '{param}.type'.",
            param=f"{param}.type",
            code="missing_required_parameter",
        )
    if kind not in known:
        raise APIError(
            400,
            f"Invalid value for '{param}.type': {kind!r}. Supported values are: {', '.join(map(repr, known))}.",
            param=f"{param}.type",
            code="invalid_value",
        )
    return kind


async def _function(spec: dict[str, Any], param: str) -> FunctionTool:
    name = spec.get("name")
    if not isinstance(name, str):
        raise APIError(400, f"Missing required parameter: '{param}.name'.", param=f"{param}.name")
    if not NAME.match(name):
        raise APIError(
            400,
            f"Invalid '{param}.name': {name!r}. Expected a string of 1 to 64 letters, digits, underscores or dashes.",
            param=f"{param}.name",
            code="invalid_value",
        )
    parameters = spec.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise APIError(400, f"'{param}.parameters' must be a JSON schema object.", param=f"{param}.parameters")
    problem = await _schema_problem(parameters)
    if problem is not None:
        raise APIError(
            400,
            f"Invalid schema for function {name!r}: {problem}",
            param=f"{param}.parameters",
            code="invalid_function_parameters",
        )
    description = spec.get("description")
    return FunctionTool(name, description if isinstance(description, str) else None, parameters)


async def _schema_problem(parameters: dict[str, Any]) -> str | None:
    """Why `parameters` is not a valid JSON Schema (against its `$schema`'s metaschema, else draft 2020-12's),
    or None."""
    text = json.dumps(parameters, sort_keys=True)
    check = _cached_problem if len(text) <= MAX_CACHED_SCHEMA_CHARS else _problem
    if len(text) <= OFF_LOOP_SCHEMA_CHARS:
        return check(text)
    return await asyncio.to_thread(check, text)


def _problem(schema_json: str) -> str | None:
    schema = json.loads(schema_json)
    declared = schema.get("$schema", "")
    validator = validator_for(schema) if isinstance(declared, str) else Draft202012Validator
    try:
        validator.check_schema(schema)
    except SchemaError as exc:
        where = f"In context={tuple(exc.path)}, " if exc.path else ""
        problem = f"{where}{exc.message}."
        return problem if len(problem) <= MAX_PROBLEM_CHARS else problem[: MAX_PROBLEM_CHARS - 3] + "..."
    return None


_cached_problem = functools.lru_cache(maxsize=256)(_problem)


def _choice(choice: Any, functions: list[FunctionTool], nested: bool) -> str:
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise APIError(
                400,
                f"Invalid value for 'tool_choice': {choice!r}. Expected one of {', '.join(CHOICES)}, "
                "or a function to call.",
                param="tool_choice",
                code="invalid_value",
            )
        name = choice
    else:
        spec = choice.get("function") if nested and isinstance(choice, dict) else choice
        name = spec.get("name") if isinstance(spec, dict) else None
        if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
            form = '{"type": "function", "function": {"name": ...}}' if nested else '{"type": "function", "name": ...}'
            raise APIError(400, f"'tool_choice' must be a string or {form}.", param="tool_choice")
    if name in ("auto", "none"):
        return name
    if not functions:
        raise APIError(
            400,
            "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are specified.",
            param="tool_choice",
        )
    if name != "required" and name not in (f.name for f in functions):
        raise APIError(400, f"tool_choice names function {name!r}, which is not in tools.", param="tool_choice")
    return name
