"""Chat messages → prompt: the model's chat template, with tools where the template knows them; then its ids.

Templates that take `tools` get them (and earlier calls' arguments as objects, which is what Hugging Face
templates index into); templates that do not get the Hermes text form instead (see tools.py). Templates
that do not know the `developer` role (OpenAI's newer name for system) get those messages as system.

Tokenizing is the costly step of a large request (seconds for megabytes of text, where rendering takes
milliseconds), so long work runs on a worker thread (`off_loop`): Hugging Face's fast tokenizers release the
GIL while they encode, and the event loop goes on serving other requests meanwhile.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import jinja2

from hybridserve.serving.openai.errors import APIError
from hybridserve.serving.openai.tools import hermes_messages

# Characters (or token ids) past which tokenizing takes over ~10 ms: a worker thread's hop (~0.1 ms) is then worth it.
OFF_LOOP_SIZE = 16 * 1024
T = TypeVar("T")


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    text: str


async def off_loop(size: int, work: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`work(*args, **kwargs)`, on a worker thread when `size` (the characters or token ids it goes through)
    passes OFF_LOOP_SIZE, else here."""
    if size > OFF_LOOP_SIZE:
        return await asyncio.to_thread(work, *args, **kwargs)
    return work(*args, **kwargs)


async def tokenized(tokenizer, text: str) -> Prompt:
    """The prompt `text` (rendered, special tokens spelled out) with its ids."""
    return Prompt(await off_loop(len(text), tokenizer.encode, text, add_special_tokens=False), text)


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
    ) -> str:
        """The prompt text for `messages`, ending with the assistant's turn; a template error is a 400 on `param`."""
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
            raise APIError(400, f"The chat template could not render these messages: {exc}", param=param) from None


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
