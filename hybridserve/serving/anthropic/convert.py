"""An Anthropic Messages request → the house's chat request (ChatCompletionRequest), in one place.

From there the request takes the chat endpoint's path: the model's extension rules, tools, sampling, the
renderer and the parsers. The mapping:
- `system` (a string or text blocks) and any `system`-role message become the leading system message, their
  texts joined in order by newlines.
- user blocks: text joins into user messages; each `tool_result` becomes a tool message (an `is_error` result's
  text starts with "Error: "), in the order the blocks come.
- assistant blocks: text → content, `thinking` → reasoning_content (its signature checked, see signature.py),
  `tool_use` → tool_calls; `redacted_thinking` is dropped (this server never sends one).
- tools → function tools (`input_schema` → parameters); server tools (versioned types) are kept as ignored
  "custom" tools, so the indices in error messages stay the request's.
- tool_choice auto / any / tool / none → "auto" / "required" / the named function / "none";
  `disable_parallel_tool_use` → parallel_tool_calls false.
- thinking enabled / adaptive / disabled → chat's `thinking` {"type": "enabled" | "disabled"}, and a reasoning
  effort: `output_config.effort`, else one from `budget_tokens` (BUDGET_EFFORTS), else none (the model's default).
- `output_config.format` (json_schema) → response_format; stop_sequences → stop; `max_tokens` is left to the
  service, which clamps it to the context.
"""

from __future__ import annotations

import json
from typing import Any

from hybridserve.serving.anthropic.protocol import ContentBlock, CountTokensRequest, MessagesRequest
from hybridserve.serving.anthropic.signature import ThinkingSigner
from hybridserve.serving.openai.errors import APIError
from hybridserve.serving.openai.protocol import ChatCompletionRequest

CLIENT_TOOL_TYPES = (None, "custom")
# budget_tokens below each bound → that effort; at or above the last bound → "high"
BUDGET_EFFORTS = ((4096, "low"), (16384, "medium"))


def chat_request(req: CountTokensRequest, signer: ThinkingSigner) -> ChatCompletionRequest:
    """`req` as the chat request the shared steps serve (sampling fields too when it is a MessagesRequest)."""
    fields: dict[str, Any] = {
        "model": req.model,
        "messages": chat_messages(req, signer),
        "tools": _tools(req),
        "tool_choice": _tool_choice(req),
        "parallel_tool_calls": _parallel(req),
        "thinking": _thinking(req),
        "reasoning_effort": _effort(req),
        "response_format": _response_format(req),
    }
    if isinstance(req, MessagesRequest):
        fields.update(
            stop=req.stop_sequences, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, stream=req.stream
        )
    return ChatCompletionRequest(**{k: v for k, v in fields.items() if v is not None})


def chat_messages(req: CountTokensRequest, signer: ThinkingSigner) -> list[dict[str, Any]]:
    if not req.messages:
        raise APIError(400, "messages: at least one message is required.", param="messages")
    system = [] if req.system is None else [_text(req.system, "system")]
    out: list[dict[str, Any]] = []
    for i, message in enumerate(req.messages):
        where = f"messages[{i}].content"
        content = message.content
        blocks = [ContentBlock(type="text", text=content)] if isinstance(content, str) else content
        if message.role == "system":
            system.append(_text(message.content, where))
        elif message.role == "user":
            out.extend(_user(blocks, where))
        else:
            out.append(_assistant(blocks, where, signer))
    return ([{"role": "system", "content": "\n".join(system)}] if system else []) + out


def _text(content: str | list, where: str) -> str:
    """A string, or text blocks joined by newlines; another block type is a 400 naming it."""
    if isinstance(content, str):
        return content
    texts = []
    for j, block in enumerate(content):
        if block.type != "text" or block.text is None:
            raise APIError(400, f"{where}[{j}]: only text blocks are supported here, got {block.type!r}.")
        texts.append(block.text)
    return "\n".join(texts)


def _required(value: Any, where: str) -> Any:
    if value is None:
        raise APIError(400, f"Missing required parameter: '{where}'.", param=where)
    return value


def _user(blocks: list[ContentBlock], where: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        if block.type == "text":
            texts.append(_required(block.text, f"{at}.text"))
            continue
        if block.type != "tool_result":
            raise APIError(400, f"{at}: content blocks of type {block.type!r} are not supported by this server.")
        if texts:
            out.append({"role": "user", "content": "\n".join(texts)})
            texts = []
        result = "" if block.content is None else _text(block.content, f"{at}.content")
        if block.is_error:
            result = f"Error: {result}"
        call_id = _required(block.tool_use_id, f"{at}.tool_use_id")
        out.append({"role": "tool", "tool_call_id": call_id, "content": result})
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant(blocks: list[ContentBlock], where: str, signer: ThinkingSigner) -> dict[str, Any]:
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        if block.type == "text":
            texts.append(_required(block.text, f"{at}.text"))
        elif block.type == "thinking":
            thinking = _required(block.thinking, f"{at}.thinking")
            if not signer.verify(thinking, _required(block.signature, f"{at}.signature")):
                raise APIError(
                    400,
                    f"{at}: invalid signature for this thinking block; thinking blocks must be sent back unchanged, "
                    "as this server sent them.",
                    param=f"{at}.signature",
                )
            reasoning.append(thinking)
        elif block.type == "tool_use":
            arguments = json.dumps(_required(block.input, f"{at}.input"), ensure_ascii=False)
            function = {"name": _required(block.name, f"{at}.name"), "arguments": arguments}
            calls.append({"id": _required(block.id, f"{at}.id"), "type": "function", "function": function})
        elif block.type != "redacted_thinking":
            raise APIError(400, f"{at}: content blocks of type {block.type!r} are not supported in assistant turns.")
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = "\n".join(reasoning)
    return message


def _tools(req: CountTokensRequest) -> list[dict[str, Any]] | None:
    if req.tools is None:
        return None
    out = []
    for i, tool in enumerate(req.tools):
        if tool.type not in CLIENT_TOOL_TYPES:  # a server tool: chat's tool check ignores "custom" with a warning
            out.append({"type": "custom", "custom": {"name": tool.name}})
            continue
        function = {"name": tool.name, "parameters": _required(tool.input_schema, f"tools[{i}].input_schema")}
        if tool.description is not None:
            function["description"] = tool.description
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(req: CountTokensRequest) -> str | dict[str, Any] | None:
    choice = req.tool_choice
    if choice is None:
        return None
    if choice.type == "tool":
        name = _required(choice.name, "tool_choice.name")
        return {"type": "function", "function": {"name": name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def _parallel(req: CountTokensRequest) -> bool | None:
    if req.tool_choice is None or req.tool_choice.disable_parallel_tool_use is None:
        return None
    return not req.tool_choice.disable_parallel_tool_use


def _thinking(req: CountTokensRequest) -> dict[str, str] | None:
    if req.thinking is None:
        return None
    return {"type": "disabled" if req.thinking.type == "disabled" else "enabled"}


def _effort(req: CountTokensRequest) -> str | None:
    if req.output_config is not None and req.output_config.effort is not None:
        return req.output_config.effort
    if req.thinking is None or req.thinking.type != "enabled":
        return None
    budget = _required(req.thinking.budget_tokens, "thinking.budget_tokens")
    return next((effort for bound, effort in BUDGET_EFFORTS if budget < bound), "high")


def _response_format(req: CountTokensRequest) -> dict[str, Any] | None:
    fmt = None if req.output_config is None else req.output_config.format
    if fmt is None or fmt.get("type") != "json_schema":
        return fmt
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.get("schema")}}
