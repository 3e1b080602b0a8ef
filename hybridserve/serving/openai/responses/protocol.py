"""POST /v1/responses: the request model, input items → chat messages, and the response object's shape."""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import BaseModel

from hybridserve.serving.openai.errors import APIError

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text")
RESPONSE_ID_PREFIX = "resp_"


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def not_supported(what: str, param: str) -> APIError:
    return APIError(400, f"{what} is not supported yet.", param=param, code="unsupported_value")


def check_response_id(response_id: str, param: str) -> None:
    if not response_id.startswith(RESPONSE_ID_PREFIX):
        raise APIError(
            400,
            f"Invalid '{param}': '{response_id}'. Expected an ID that begins with '{RESPONSE_ID_PREFIX}'.",
            param=param,
            code="invalid_value",
        )


def response_not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", param=param, code="not_found")


class ResponsesRequest(BaseModel):
    """The fields this server reads; unknown fields are ignored, as OpenAI clients send extras."""

    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = True
    previous_response_id: str | None = None
    stream: bool | None = False
    user: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    include: list[str] | None = None
    truncation: str | None = None
    prompt_cache_key: str | None = None
    background: bool | None = None

    def check_supported(self) -> None:
        if self.background:
            raise not_supported("background: true", "background")
        fmt = (self.text or {}).get("format")
        if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
            kind = fmt.get("type") if isinstance(fmt, dict) else fmt
            raise not_supported(f"text.format of type {kind!r}", "text.format")
        if self.truncation not in (None, "auto", "disabled"):
            raise APIError(400, "truncation must be 'auto' or 'disabled'.", param="truncation", code="invalid_value")

    def input_items(self) -> list[dict[str, Any]]:
        """The input as stored items: messages with ids, content as typed text parts."""
        if isinstance(self.input, str):
            return [message_item("user", [{"type": "input_text", "text": self.input}])]
        return [_item(raw, f"input[{i}]") for i, raw in enumerate(self.input)]


def _item(raw: dict[str, Any], param: str) -> dict[str, Any]:
    kind = raw.get("type", "message")
    if kind != "message":
        raise not_supported(f"Input item type {kind!r}", f"{param}.type")
    role = raw.get("role")
    if role not in ROLES:
        raise APIError(
            400, f"Invalid value for '{param}.role': expected one of {', '.join(ROLES)}.", param=f"{param}.role"
        )
    content = raw.get("content")
    text_type = "output_text" if role == "assistant" else "input_text"
    if isinstance(content, str):
        parts = [{"type": text_type, "text": content}]
    elif isinstance(content, list):
        parts = [_part(part, f"{param}.content[{j}]") for j, part in enumerate(content)]
    else:
        raise APIError(400, f"'{param}.content' must be a string or a list of content parts.", param=f"{param}.content")
    item = message_item(role, parts)
    if isinstance(raw.get("id"), str):
        item["id"] = raw["id"]
    return item


def _part(part: Any, param: str) -> dict[str, Any]:
    if not isinstance(part, dict):
        raise APIError(400, f"'{param}' must be a content part object.", param=param)
    kind = part.get("type")
    if kind not in TEXT_PARTS:
        raise not_supported(f"Content part type {kind!r}", f"{param}.type")
    if not isinstance(part.get("text"), str):
        raise APIError(400, f"Missing required parameter: '{param}.text'.", param=f"{param}.text")
    if kind == "output_text":
        return {"type": kind, "text": part["text"], "annotations": part.get("annotations") or [], "logprobs": []}
    return {"type": kind, "text": part["text"]}


def message_item(role: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": new_id("msg"), "type": "message", "role": role, "status": "completed", "content": parts}


def item_message(item: dict[str, Any]) -> dict[str, str]:
    """A stored message item as the chat template expects it: content as one string."""
    return {"role": item["role"], "content": "\n".join(part["text"] for part in item["content"])}


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def output_message(item_id: str, status: str, text: str | None) -> dict[str, Any]:
    content = [] if text is None else [output_text_part(text)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def output_text(response: dict[str, Any]) -> str:
    return "".join(
        part["text"]
        for item in response["output"]
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    )


def usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    """Chat-style usage (GenerationRun.usage) in the Responses shape."""
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {
            "cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"],
            "cache_write_tokens": 0,
        },
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


def base_response(req: ResponsesRequest, response_id: str, model: str) -> dict[str, Any]:
    """The response object before any output: status in_progress, every field the schema wants present.

    `usage` is added once known (the schema does not allow it to be null)."""
    body: dict[str, Any] = {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "completed_at": None,
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": model,
        "output": [],
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "reasoning": req.reasoning,
        "store": bool(req.store),
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto" if req.tool_choice is None else req.tool_choice,
        "tools": req.tools or [],
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": req.truncation or "disabled",
        "metadata": req.metadata or {},
        "prompt_cache_key": req.prompt_cache_key,
    }
    if req.user is not None:
        body["user"] = req.user
    return body


def finished_response(
    base: dict[str, Any], item_id: str, text: str, finish_reason: str | None, chat_usage: dict[str, Any]
) -> dict[str, Any]:
    """The terminal object: completed, or incomplete when the output hit max_output_tokens."""
    cut = finish_reason == "length"
    status = "incomplete" if cut else "completed"
    return {
        **base,
        "status": status,
        "completed_at": None if cut else int(time.time()),
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "output": [output_message(item_id, status, text)],
        "usage": usage(chat_usage),
    }


def failed_response(base: dict[str, Any], error: APIError, chat_usage: dict[str, Any]) -> dict[str, Any]:
    code = "server_error" if error.status >= 500 else "invalid_prompt"
    return {**base, "status": "failed", "error": {"code": code, "message": error.message}, "usage": usage(chat_usage)}
