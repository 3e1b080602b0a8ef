"""What Chat Completions and Responses do before any engine work, in one order, so both answer a bad request
with the same checks and the same error bodies (each naming the field as its endpoint spells it):

tools and tool_choice (as the extension enforces "required") → sampling parameters (the extension may keep
special tokens) → the structured-output constraint (a forced call's, or the format's as the extension adjusts
it) → the prompt, rendered with the model's renderer (rendering/) and tokenized → a completion budget that fits.

The endpoint checks its model and its own fields and applies the extension's request rules first; Responses
gathers its input items and history between the tools and the sampling parameters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from hybridserve.rendering.base import RenderError
from hybridserve.rendering.registry import renderer_for
from hybridserve.sampling_params import SamplingParams
from hybridserve.serving.engine import ServingEngine
from hybridserve.serving.extensions.base import ServingExtension
from hybridserve.serving.openai.errors import APIError
from hybridserve.serving.openai.generation import check_size, fit_to_context
from hybridserve.serving.openai.prompt import Prompt, tokenized
from hybridserve.serving.openai.protocol import SamplingRequest
from hybridserve.serving.openai.structured import structured_output
from hybridserve.serving.openai.tools import ToolRequest, required_by, tool_request


@dataclass(frozen=True)
class Dialect:
    """How one endpoint spells what the preamble checks, for its errors."""

    prompt_param: str  # what the prompt came as: "messages", "input"
    max_tokens_param: str  # the field that set max_tokens
    renames: dict[str, str]  # SamplingParams field → the request's field
    format_param: str  # where the structured-output format came: "response_format", "text.format"
    nested: bool  # Chat's `{"function": {...}}` tools and nested json_schema, or Responses' flat ones


def chat_dialect(max_tokens_param: str) -> Dialect:
    """Chat Completions', whose budget is `max_tokens` or `max_completion_tokens` (whichever was sent)."""
    renames = {"max_tokens": max_tokens_param, "logprobs": "top_logprobs"}
    return Dialect("messages", max_tokens_param, renames, "response_format", nested=True)


RESPONSES = Dialect(
    "input", "max_output_tokens", {"max_tokens": "max_output_tokens", "logprobs": "top_logprobs"}, "text.format", False
)


@dataclass(frozen=True)
class Prepared:
    """A request ready for the engine: its tools, its (fitted) sampling parameters and its prompt."""

    tools: ToolRequest
    params: SamplingParams
    prompt: Prompt


class Preamble:
    """The shared steps, bound to the engine, the model's extension and the model's renderer."""

    def __init__(self, engine: ServingEngine, extension: ServingExtension) -> None:
        self.engine = engine
        self.extension = extension
        self.renderer = renderer_for(engine.model_type, engine.tokenizer)
        self.vocab_size = len(engine.tokenizer)

    async def tools(self, dialect: Dialect, tools: Any, tool_choice: Any, parallel: bool | None) -> ToolRequest:
        """The validated tools and tool_choice, "required" enforced as the extension says."""
        request = await tool_request(tools, tool_choice, parallel, nested=dialect.nested)
        return required_by(request, self.extension.required_tool_choice_mode())

    async def prepare(
        self,
        dialect: Dialect,
        tools: ToolRequest,
        sampling: SamplingRequest,
        num_logprobs: int | None,
        max_tokens: int | None,
        response_format: Any,
        template_kwargs: dict[str, Any],
        render: Callable[[SamplingParams], Awaitable[Prompt]],
    ) -> Prepared:
        """Sampling parameters from `sampling` (`num_logprobs`, `max_tokens` as asked), their constraint, the
        prompt `render` makes (given the parameters so far) and the budget fitted to what the prompt leaves."""
        params = sampling.sampling_params(
            num_logprobs,
            max_tokens,
            dialect.renames,
            self.vocab_size,
            self.engine.sampling_defaults,
            prompt_logprobs=sampling.prompt_logprobs,
        )
        if self.extension.keeps_special_tokens and sampling.skip_special_tokens is None:
            params = dataclasses.replace(params, skip_special_tokens=False)
        constraint = structured_output(response_format, tools, param=dialect.format_param, nested=dialect.nested)
        if not tools.forced:
            constraint = self.extension.structured_output(constraint, template_kwargs)
        params = dataclasses.replace(params, structured_output=constraint)
        prompt = await render(params)
        params = fit_to_context(
            params,
            len(prompt.ids),
            self.engine.max_model_len,
            what=dialect.prompt_param,
            max_tokens_param=dialect.max_tokens_param,
            renames=dialect.renames,
        )
        return Prepared(tools, params, prompt)

    async def render(
        self,
        dialect: Dialect,
        messages: list[dict[str, Any]],
        tools: ToolRequest,
        template_kwargs: dict[str, Any] | None,
    ) -> Prompt:
        """`messages` rendered by the model's renderer (what it cannot render is a 400 on the prompt), tokenized."""
        try:
            text = self.renderer.render(messages, tools.template_tools(), template_kwargs)
        except RenderError as exc:
            raise APIError(400, str(exc), param=dialect.prompt_param) from None
        check_size(self.engine.tokenizer, text, self.engine.max_model_len, dialect.prompt_param, rendered=True)
        return await tokenized(self.engine.tokenizer, text)
