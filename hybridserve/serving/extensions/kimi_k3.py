"""Kimi-K3: its renderer and parsers, and its request options and history rules on both endpoints.

Request fields become the kwargs the K3 renderer reads (see rendering/kimi_k3.py): reasoning effort →
`thinking_effort` (the nearest K3 level at or above the one asked for; "none" turns thinking off; no
effort keeps the renderer's default), tool_choice "required" / "none" with tools declared →
`tool_choice`, a JSON response format → `response_format` (the schema goes into the prompt). Kwargs the
client sends in `chat_template_kwargs` win over derived ones. tool_choice "required" is enforced by the
prompt, so it needs no grammar. A response format's grammar applies to the response channel: with thinking
off the prompt opens it, so the grammar holds from the first token; with thinking on the think channel is
free text, and the grammar starts once the model closes it and opens the response channel.
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

from hybridserve.engine.structured_output import behind_free_text
from hybridserve.rendering.kimi_k3 import (
    MESSAGE_CLOSE,
    RESPONSE_CLOSE,
    RESPONSE_OPEN,
    THINK_CLOSE,
)
from hybridserve.sampling_params import StructuredOutput
from hybridserve.serving.extensions.base import RequiredMode, ServingExtension, register
from hybridserve.serving.extensions.policy import enforce_kimi_param_policy
from hybridserve.serving.extensions.tool_history import prepare_tool_history
from hybridserve.serving.openai.errors import APIError
from hybridserve.serving.openai.protocol import ChatCompletionRequest
from hybridserve.serving.openai.responses.protocol import ResponsesRequest

EFFORTS = {"minimal": "low", "low": "low", "medium": "high", "high": "high", "xhigh": "max", "max": "max"}
TOOL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_-]{0,255}$")


def thinking_kwargs(effort: Any, param: str) -> dict[str, Any]:
    if effort is None:
        return {}
    if effort == "none":
        return {"thinking": False}
    if effort not in EFFORTS:
        raise APIError(
            400,
            f"Invalid value for '{param}': {effort!r}. Expected one of none, {', '.join(EFFORTS)}.",
            param=param,
            code="invalid_value",
        )
    return {"thinking_effort": EFFORTS[effort]}


def tool_choice_kwargs(tool_choice: Any, tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    declared = any(isinstance(t, dict) and t.get("type") == "function" for t in tools or [])
    return {"tool_choice": tool_choice} if declared and tool_choice in ("required", "none") else {}


def response_format_kwargs(fmt: Any, nested: bool) -> dict[str, Any]:
    """Chat nests a json_schema format's schema under "json_schema"; Responses' text.format does not."""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if kind == "json_schema":
        spec = fmt.get("json_schema") if nested else fmt
        schema = spec.get("schema") if isinstance(spec, dict) else None
        return {"response_format": {"type": "json_schema", "schema": schema or {}}}
    return {}


def _chat_thinking(thinking: Any) -> dict[str, Any]:
    """Chat's `thinking`: a bool, or {"type": "enabled" | "disabled"}."""
    if isinstance(thinking, dict):
        thinking = thinking.get("type") != "disabled"
    return {} if thinking is None else {"thinking": bool(thinking)}


def check_system_tools(request: ChatCompletionRequest) -> None:
    """Tools declared on system messages: function tools with valid, unique names (request tools included)."""
    names = {(t.get("function") or {}).get("name") for t in request.tools or [] if isinstance(t, dict)}
    for i, message in enumerate(request.messages):
        tools = (message.model_extra or {}).get("tools")
        if message.role != "system" or tools is None:
            continue
        if not isinstance(tools, list):
            raise APIError(400, f"'messages[{i}].tools' must be a list of tools.", param=f"messages[{i}].tools")
        for j, tool in enumerate(tools):
            param = f"messages[{i}].tools[{j}]"
            if not isinstance(tool, dict) or tool.get("type") != "function":
                raise APIError(400, f"'{param}' must be a function tool.", param=f"{param}.type", code="invalid_value")
            name = (tool.get("function") or {}).get("name")
            if not isinstance(name, str) or not TOOL_NAME.match(name):
                raise APIError(
                    400,
                    f"Invalid '{param}.function.name': {name!r}. Expected a letter or underscore, then up to 255 "
                    "letters, digits, underscores or dashes.",
                    param=f"{param}.function.name",
                    code="invalid_value",
                )
            if name in names:
                raise APIError(400, f"Duplicate function name {name!r} in tools.", param=f"{param}.function.name")
            names.add(name)


R = TypeVar("R", ChatCompletionRequest, ResponsesRequest)


def _with_kwargs(request: R, derived: dict[str, Any], policy: bool) -> R:
    """`request` with the derived kwargs under the client's own, then the sampling policy (when on)."""
    kwargs = {**derived, **(request.chat_template_kwargs or {})}
    request = request.model_copy(update={"chat_template_kwargs": kwargs})
    return enforce_kimi_param_policy(request) if policy else request


@register("kimi_k3")
class KimiK3ServingExtension(ServingExtension):
    parsers = ("kimi_k3", "kimi_k3")
    keeps_special_tokens = True

    def apply_chat_extensions(self, request: ChatCompletionRequest) -> ChatCompletionRequest:
        check_system_tools(request)
        derived = {
            **thinking_kwargs(request.reasoning_effort, "reasoning_effort"),
            **_chat_thinking(request.thinking),
            **tool_choice_kwargs(request.tool_choice, request.tools),
            **response_format_kwargs(request.response_format, nested=True),
        }
        return _with_kwargs(request, derived, self.config.kimi_param_policy)

    def apply_responses_extensions(self, request: ResponsesRequest) -> ResponsesRequest:
        derived = {
            **thinking_kwargs((request.reasoning or {}).get("effort"), "reasoning.effort"),
            **tool_choice_kwargs(request.tool_choice, request.tools),
            **response_format_kwargs((request.text or {}).get("format"), nested=False),
        }
        return _with_kwargs(request, derived, self.config.kimi_param_policy)

    def prepare_responses_history(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return prepare_tool_history(messages)

    def required_tool_choice_mode(self) -> RequiredMode | None:
        return "template"

    def structured_output(
        self, constraint: StructuredOutput | None, template_kwargs: dict[str, Any]
    ) -> StructuredOutput | None:
        # With thinking off the prompt opens the response channel itself. With thinking on, a grammar from
        # the first token would forbid the think channel: the think text stays free (it may not close the
        # message, which would end the parser's channels), then the response channel must open, hold the
        # constrained content and close, and the message ends.
        if constraint is None or template_kwargs.get("thinking") is False:
            return constraint
        return behind_free_text(
            constraint,
            opening=THINK_CLOSE + RESPONSE_OPEN,
            closing=RESPONSE_CLOSE + MESSAGE_CLOSE,
            excludes=(THINK_CLOSE, MESSAGE_CLOSE),
        )
