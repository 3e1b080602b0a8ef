"""Chat messages → prompt: the model's chat template, with tools where the template knows them.

Templates that take `tools` get them (and earlier calls' arguments as objects, which is what Hugging Face
templates index into); templates that do not get the Hermes text form instead (see tools.py). Templates
that do not know the `developer` role (OpenAI's newer name for system) get those messages as system.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import jinja2

from hybridserve.serving.openai.errors import APIError
from hybridserve.serving.openai.tools import hermes_messages


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    text: str


def template_supports_tools(chat_template: str | None) -> bool:
    return chat_template is not None and "tools" in chat_template and "tool_calls" in chat_template


class PromptRenderer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.native_tools = template_supports_tools(tokenizer.chat_template)
        self.knows_developer = "developer" in (tokenizer.chat_template or "")

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        param: str = "messages",
    ) -> Prompt:
        """The prompt for `messages`, ending with the assistant's turn; a template error is a 400 on `param`."""
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
            text = self.tokenizer.apply_chat_template(messages, **kwargs)
        except (jinja2.TemplateError, ValueError, TypeError) as exc:
            raise APIError(400, f"The chat template could not render these messages: {exc}", param=param) from None
        return Prompt(self.tokenizer.encode(text, add_special_tokens=False), text)


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
