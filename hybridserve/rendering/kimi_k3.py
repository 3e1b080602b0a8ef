"""The Kimi-K3 prompt format ("XTML"): messages, control blocks and tool calls as tagged blocks.

A block is `<|open|>TAG ATTRS<|sep|>BODY<|close|>TAG<|sep|>`; a message block ends with `<|end_of_msg|>`.
System control blocks come first (declared tools, thinking effort, tool choice, response format), then
the conversation. An assistant turn renders its visible text in a `response` block and its calls in a
`tools` block (earlier reasoning is not rendered); a tool result binds to its call by the call's index in
the assistant turn that made it. The prompt ends by opening the assistant's `think` block, or its
`response` block when thinking is off.

Template kwargs read here: `thinking` (bool, default on), `thinking_effort` (low | high | max),
`tool_choice` (required | none), `response_format` ({"type": "json_object"} or
{"type": "json_schema", "schema": {...}}), `add_generation_prompt` (default on).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from hybridserve.rendering.base import RenderError

OPEN, SEP, CLOSE, END = "<|open|>", "<|sep|>", "<|close|>", "<|end_of_msg|>"
SPECIAL_TOKENS = (OPEN, SEP, CLOSE, END)
THINK_OPEN, THINK_CLOSE = f"{OPEN}think{SEP}", f"{CLOSE}think{SEP}"
RESPONSE_OPEN, RESPONSE_CLOSE = f"{OPEN}response{SEP}", f"{CLOSE}response{SEP}"
TOOLS_OPEN, TOOLS_CLOSE = f"{OPEN}tools{SEP}", f"{CLOSE}tools{SEP}"
CALL_CLOSE = f"{CLOSE}call{SEP}"
MESSAGE_CLOSE = f"{CLOSE}message{SEP}"
MESSAGE_END = MESSAGE_CLOSE + END
ASSISTANT_OPEN = f'{OPEN}message role="assistant"{SEP}'
EFFORTS = ("low", "high", "max")
_ATTRIBUTE = re.compile(r'([a-z_]+)="([^"]*)"')


def _block_pattern(tag: str, head: str) -> re.Pattern[str]:
    """A `tag` block whose head matches `head`; the body is the last group."""
    return re.compile(f"{re.escape(OPEN)}{tag}{head}{re.escape(SEP)}(.*?){re.escape(CLOSE)}{tag}{re.escape(SEP)}", re.S)


_ARGUMENT = _block_pattern("argument", " ([^<]*?)")
_JSON = _block_pattern("json", ' type="object"')


def escape(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")


def unescape(value: str) -> str:
    return value.replace("&quot;", '"').replace("&amp;", "&")


def attributes(text: str) -> dict[str, str]:
    return {key: unescape(value) for key, value in _ATTRIBUTE.findall(text)}


def block(tag: str, body: str, **attrs: str) -> str:
    head = "".join(f' {key}="{escape(value)}"' for key, value in attrs.items())
    return f"{OPEN}{tag}{head}{SEP}{body}{CLOSE}{tag}{SEP}"


def message(body: str, **attrs: str) -> str:
    return block("message", body, **attrs) + END


# --- tool calls ------------------------------------------------------------------------------------------


def _type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, dict) else "array"


def encode_arguments(arguments: str) -> str:
    """A call's arguments (JSON text): one typed `argument` block per key, or one `json` block when the
    text is not a JSON object."""
    try:
        value = json.loads(arguments)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        return block("json", arguments, type="object")
    out = []
    for key, item in value.items():
        kind = _type_of(item)
        text = item if kind == "string" else json.dumps(item, ensure_ascii=False, separators=(",", ":"))
        out.append(block("argument", text, key=key, type=kind))
    return "".join(out)


def decode_arguments(body: str) -> str:
    """The JSON text of a call's arguments as the model wrote them (typed blocks or one json block)."""
    raw = _JSON.search(body)
    if raw is not None and not _ARGUMENT.search(body):
        return raw.group(1).strip()
    arguments: dict[str, Any] = {}
    for attrs_text, value in _ARGUMENT.findall(body):
        attrs = attributes(attrs_text)
        kind = attrs.get("type", "string")
        if kind == "string":
            arguments[attrs.get("key", "")] = value
            continue
        try:
            arguments[attrs.get("key", "")] = json.loads(value)
        except ValueError:
            arguments[attrs.get("key", "")] = value
    return json.dumps(arguments, ensure_ascii=False)


@dataclass(frozen=True)
class ParsedCall:
    name: str
    index: int
    arguments: str  # JSON text


def parse_call(head: str, body: str) -> ParsedCall | None:
    """One call block (`head`: what follows `<|open|>call`, `body`: its arguments); None if unnamed."""
    attrs = attributes(head)
    if "tool" not in attrs:
        return None
    index = attrs.get("index", "0")
    return ParsedCall(attrs["tool"], int(index) if index.isdigit() else 0, decode_arguments(body))


def render_calls(calls: list[dict[str, Any]]) -> str:
    out = []
    for i, call in enumerate(calls, start=1):
        function = call.get("function") or {}
        arguments = function.get("arguments")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)
        out.append(block("call", encode_arguments(arguments), tool=str(function.get("name", "")), index=str(i)))
    return block("tools", "".join(out))


# --- the prompt ------------------------------------------------------------------------------------------


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":"))


def tool_declaration(tools: list[dict[str, Any]]) -> str:
    ordered = sorted(tools, key=lambda t: (t.get("function") or t).get("name", ""))
    return message(f"```json\n{_json(ordered)}\n```", role="system", type="tool-declare")


def control_blocks(tools: list[dict[str, Any]] | None, kwargs: dict[str, Any]) -> list[str]:
    out = []
    if tools:
        out.append(tool_declaration(tools))
    effort = kwargs.get("thinking_effort")
    if kwargs.get("thinking", True) and effort is not None:
        if effort not in EFFORTS:
            raise ValueError(f"thinking_effort must be one of {', '.join(EFFORTS)}, got {effort!r}")
        out.append(message(f"thinking_effort={effort}", role="system", type="thinking-effort"))
    choice = kwargs.get("tool_choice")
    if tools and choice in ("required", "none"):
        out.append(message(f"tool_choice={choice}", role="system", type="tool-choice"))
    fmt = kwargs.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        out.append(message(f"```json\n{_json(fmt.get('schema') or {})}\n```", role="system", type="response-format"))
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        out.append(message("json_object", role="system", type="response-format"))
    return out


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part.get("text", "") for part in content if isinstance(part, dict))


def render_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, kwargs: dict[str, Any]) -> str:
    """The K3 prompt text; a tool result whose call is not in the assistant turn before it is a ValueError."""
    out = control_blocks(tools, kwargs)
    calls: dict[str, tuple[str, int]] = {}  # call id → (name, index) in the latest assistant turn with calls
    for m in messages:
        role = m["role"]
        text = _text(m.get("content"))
        if role == "assistant":
            turn = m.get("tool_calls") or []
            body = block("response", text) if text or not turn else ""
            if turn:
                body += render_calls(turn)
                calls = {c.get("id", ""): ((c.get("function") or {}).get("name", ""), i) for i, c in enumerate(turn, 1)}
            else:
                calls = {}
            out.append(message(body, role="assistant"))
        elif role == "tool":
            call_id = m.get("tool_call_id", "")
            if call_id not in calls:
                raise ValueError(f"tool result {call_id!r} answers no call of the assistant turn before it")
            name, index = calls[call_id]
            out.append(message(text, role="tool", name=name, index=str(index)))
        else:
            if role == "system" and m.get("tools"):
                out.append(tool_declaration(m["tools"]))
            out.append(message(text, role=role))
    if kwargs.get("add_generation_prompt", True):
        out.append(ASSISTANT_OPEN + (THINK_OPEN if kwargs.get("thinking", True) else RESPONSE_OPEN))
    return "".join(out)


class KimiK3Renderer:
    """The K3 format behind the Renderer interface."""

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        try:
            return render_messages(messages, tools, template_kwargs or {})
        except ValueError as exc:
            raise RenderError(f"The Kimi-K3 renderer could not render these messages: {exc}") from None
