"""Hugging Face chat templates: messages → prompt text, with tools where the template knows them.

Templates that take `tools` get them (and earlier calls' arguments as objects, which is what Hugging Face
templates index into). A template that knows no tools (SmolLM2's, for one) still serves agents: the tools, the
assistant's earlier calls and the tool results are written into the messages in the Hermes format, which the
hermes tool parser reads back. Templates that do not know the `developer` role (OpenAI's newer name for
system) get those messages as system.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import jinja2

from hybridserve.rendering.base import RenderError


def template_supports_tools(chat_template: str | None) -> bool:
    return chat_template is not None and "tools" in chat_template and "tool_calls" in chat_template


class ChatTemplateRenderer:
    """The checkpoint's Hugging Face chat template (jinja)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.native_tools = template_supports_tools(tokenizer.chat_template)
        self.knows_developer = "developer" in (tokenizer.chat_template or "")

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text for `messages`, ending with the assistant's turn; a template error is a RenderError."""
        kwargs = {"add_generation_prompt": True, **(template_kwargs or {}), "tokenize": False}
        if not self.knows_developer:
            messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
        if self.native_tools:
            messages = [_arguments_as_objects(m) for m in messages]
            if tools:
                kwargs["tools"] = tools
        else:
            messages = hermes_messages(messages, tools)
        try:
            return self.tokenizer.apply_chat_template(messages, **kwargs)
        except (jinja2.TemplateError, ValueError, TypeError) as exc:
            raise RenderError(f"The chat template could not render these messages: {exc}") from None


def _arguments_as_objects(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = []
    for call in calls:
        function = call.get("function") or {}
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                call = {**call, "function": {**function, "arguments": parsed}}
        out.append(call)
    return {**message, "tool_calls": out}


def hermes_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """`messages` with tools, calls and results written as Hermes text, for templates that know no tools."""
    out: list[dict[str, Any]] = []
    previous = None
    for message in messages:
        role = message["role"]
        content = message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            calls = [_hermes_call(call["function"]) for call in message["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(([content] if content else []) + calls)})
        elif role == "tool":
            result = f"<tool_response>\n{content}\n</tool_response>"
            if previous == "tool":  # consecutive results share one user turn
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result})
        else:
            out.append({"role": role, "content": content})
        previous = role
    if tools:
        declarations = "\n".join(json.dumps(tool["function"], ensure_ascii=False) for tool in tools)
        block = (
            "# Tools\n\nYou may call one or more of these functions to help with the user's request. "
            f"Their signatures, one per line:\n<tools>\n{declarations}\n</tools>\n\n"
            "To call a function, write one block per call:\n"
            '<tool_call>\n{"name": <function name>, "arguments": <arguments as a JSON object>}\n</tool_call>'
        )
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _hermes_call(function: dict[str, Any]) -> str:
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):
            arguments = json.loads(arguments)
    body = json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"
