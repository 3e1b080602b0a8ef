"""POST /v1/responses: the request model, input items → chat messages, and the response object's shape."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

from hybridserve.sampling_params import MAX_TEMPERATURE, SamplingParams
from hybridserve.serving.openai.errors import APIError
from hybridserve.serving.openai.priority import PRIORITY_LIMIT
from hybridserve.serving.openai.protocol import LOGPROBS_RANGE, RequestModel, ranged

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text")
RESPONSE_ID_PREFIX = "resp_"
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# OpenAI's `include` values. Only the logprobs one adds anything here; the others are accepted and add nothing:
# they ask for the output of built-in tools this server does not run, image inputs it does not take, or
# encrypted reasoning (its reasoning items are plain text). Any other value is a 400 naming it.
Includable = Literal[
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
    "reasoning.encrypted_content",
    "message.output_text.logprobs",
]


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


class ResponsesRequest(RequestModel):
    """The fields this server reads, strict as Chat's (see openai/protocol.py); unknown fields are ignored, as
    OpenAI clients send extras."""

    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = ranged(minimum=1)
    temperature: float | None = ranged(minimum=0, maximum=MAX_TEMPERATURE)
    top_p: float | None = ranged(exclusiveMinimum=0, maximum=1)
    top_logprobs: int | None = ranged(**LOGPROBS_RANGE)
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
    include: list[Includable] | None = None
    truncation: str | None = None
    prompt_cache_key: str | None = None
    background: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_ids: bool | None = None  # the prompt ids the engine received and the output ids
    priority: int | None = ranged(minimum=-PRIORITY_LIMIT, maximum=PRIORITY_LIMIT)  # vLLM's; see openai/priority.py

    def check_supported(self) -> None:
        if self.background and self.store is False:
            raise APIError(400, "Background mode requires 'store' to be true.", param="background")
        if self.truncation not in (None, "auto", "disabled"):
            raise APIError(400, "truncation must be 'auto' or 'disabled'.", param="truncation", code="invalid_value")

    def num_logprobs(self) -> int | None:
        """Alternatives per token when logprobs are asked for (`include` or `top_logprobs`), else None."""
        if LOGPROBS_INCLUDE in (self.include or ()) or self.top_logprobs is not None:
            return self.top_logprobs or 0
        return None

    def input_items(self, lookup: Callable[[str], dict[str, Any] | None]) -> list[dict[str, Any]]:
        """The input as stored items, each with an id; `lookup` resolves item references to stored items."""
        if isinstance(self.input, str):
            return [message_item("user", [{"type": "input_text", "text": self.input}])]
        return [_item(raw, f"input[{i}]", lookup) for i, raw in enumerate(self.input)]


def _item(raw: Any, param: str, lookup: Callable[[str], dict[str, Any] | None]) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise APIError(400, f"'{param}' must be an input item object.", param=param)
    kind = raw.get("type", "message")
    if kind == "message":
        item = _message(raw, param)
    elif kind == "function_call":
        item = {
            "id": new_id("fc"),
            "type": kind,
            "call_id": _string(raw, "call_id", param),
            "name": _string(raw, "name", param),
            "arguments": _string(raw, "arguments", param),
            "status": "completed",
        }
    elif kind == "function_call_output":
        output = raw.get("output")
        if isinstance(output, list):
            output = "\n".join(_part(part, f"{param}.output[{j}]")["text"] for j, part in enumerate(output))
        elif not isinstance(output, str):
            raise APIError(400, f"Missing required parameter: '{param}.output'.", param=f"{param}.output")
        item = {"id": new_id("fco"), "type": kind, "call_id": _string(raw, "call_id", param), "output": output}
        item["status"] = "completed"
    elif kind == "reasoning":
        item = {"id": new_id("rs"), "type": kind, "summary": raw.get("summary") or []}
        for key in ("content", "encrypted_content"):
            if raw.get(key) is not None:
                item[key] = raw[key]
    elif kind == "item_reference":
        ref = _string(raw, "id", param)
        found = lookup(ref)
        if found is None:
            raise APIError(404, f"Item with id '{ref}' not found.", param=f"{param}.id", code="not_found")
        return found
    else:
        raise not_supported(f"Input item type {kind!r}", f"{param}.type")
    if isinstance(raw.get("id"), str):
        item["id"] = raw["id"]
    return item


def _string(raw: dict[str, Any], key: str, param: str) -> str:
    if not isinstance(raw.get(key), str):
        raise APIError(400, f"Missing required parameter: '{param}.{key}'.", param=f"{param}.{key}")
    return raw[key]


def _message(raw: dict[str, Any], param: str) -> dict[str, Any]:
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
    return message_item(role, parts)


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


def conversation_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Stored items as chat messages: consecutive function calls join the assistant turn before them,
    each output becomes a tool message, and reasoning is left out of the prompt."""
    out: list[dict[str, Any]] = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            content = item["content"]
            text = content if isinstance(content, str) else "\n".join(part["text"] for part in content)
            out.append({"role": item["role"], "content": text})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"]}}
            call["function"]["arguments"] = item["arguments"]
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return out


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def usage(chat_usage: dict[str, Any], reasoning_tokens: int = 0) -> dict[str, Any]:
    """Chat-style usage (GenerationRun.usage) in the Responses shape."""
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {
            "cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"],
            "cache_write_tokens": 0,
        },
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": chat_usage["total_tokens"],
    }


def base_response(req: ResponsesRequest, response_id: str, model: str, params: SamplingParams) -> dict[str, Any]:
    """The response object before any output: status in_progress, every field the schema wants present;
    temperature and top_p as sampled (`params`: the request's, else the model's defaults).

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
        "temperature": params.temperature,
        "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
        "tool_choice": "auto" if req.tool_choice is None else req.tool_choice,
        "tools": [_echo_tool(tool) for tool in req.tools or []],
        "top_p": params.top_p,
        "top_logprobs": req.top_logprobs or 0,
        "truncation": req.truncation or "disabled",
        "metadata": req.metadata or {},
        "prompt_cache_key": req.prompt_cache_key,
        "background": bool(req.background),
    }
    if req.user is not None:
        body["user"] = req.user
    return body


def _echo_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A function tool as the Response object lists it: every field present. `strict` defaults to false here
    (OpenAI's default is true): only forced calls are grammar-constrained, so unasked strictness isn't claimed."""
    if tool.get("type") != "function":
        return tool
    return {"description": None, "parameters": None, **tool, "strict": bool(tool.get("strict", False))}


def finished_response(
    base: dict[str, Any], output: list[dict[str, Any]], status: str, usage_body: dict[str, Any]
) -> dict[str, Any]:
    """The terminal object: completed, or incomplete when the output hit max_output_tokens."""
    cut = status == "incomplete"
    return {
        **base,
        "status": status,
        "completed_at": None if cut else int(time.time()),
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "output": output,
        "usage": usage_body,
    }


def cancelled_response(
    base: dict[str, Any], output: list[dict[str, Any]], usage_body: dict[str, Any]
) -> dict[str, Any]:
    return {**base, "status": "cancelled", "output": output, "usage": usage_body}


def failed_response(base: dict[str, Any], error: APIError, chat_usage: dict[str, Any]) -> dict[str, Any]:
    code = "server_error" if error.status >= 500 else "invalid_prompt"
    return {**base, "status": "failed", "error": {"code": code, "message": error.message}, "usage": usage(chat_usage)}
