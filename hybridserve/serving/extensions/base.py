"""Model-specific request handling behind one interface, chosen by the checkpoint's `model_type`.

The Chat and Responses paths call these hooks and keep no model-name branch. Every default reproduces the
generic behaviour, so a model without an extension is served exactly as before.
"""

from __future__ import annotations

from typing import Any, Literal

from hybridserve.config import ExtensionConfig
from hybridserve.sampling_params import StructuredOutput
from hybridserve.serving.openai.protocol import ChatCompletionRequest
from hybridserve.serving.openai.responses.protocol import ResponsesRequest

RequiredMode = Literal["template", "grammar"]


class ServingExtension:
    """The generic behaviour; a model's extension overrides the hooks it needs."""

    #: default output parsers (reasoning, tool) when the server's flags say "auto"; None: from the template
    parsers: tuple[str | None, str | None] | None = None
    #: whether the model's markup is special tokens the parsers must see in the text
    keeps_special_tokens = False

    def __init__(self, config: ExtensionConfig | None = None) -> None:
        #: the deployment's switches (`hybridserve serve` flags); an extension reads its own
        self.config = ExtensionConfig() if config is None else config

    def apply_chat_extensions(self, request: ChatCompletionRequest) -> ChatCompletionRequest:
        """The chat request as this model serves it (derived template kwargs, sampling policy); may raise a
        400 APIError before any engine work. Generic: `reasoning_effort` reaches the chat template as the
        kwarg of that name (templates that know it, such as gpt-oss's, read it; others ignore it)."""
        kwargs = _with_effort(request.chat_template_kwargs, request.reasoning_effort)
        return request if kwargs is None else request.model_copy(update={"chat_template_kwargs": kwargs})

    def apply_responses_extensions(self, request: ResponsesRequest) -> ResponsesRequest:
        """The Responses request as this model serves it; runs before sampling parameters and the prompt.
        Generic: `reasoning.effort` reaches the chat template as the `reasoning_effort` kwarg."""
        effort = (request.reasoning or {}).get("effort")
        kwargs = _with_effort(request.chat_template_kwargs, effort if isinstance(effort, str) else None)
        return request if kwargs is None else request.model_copy(update={"chat_template_kwargs": kwargs})

    def replay_stored_turn(self, item: dict[str, Any]) -> dict[str, Any]:
        """One stored item of an earlier turn, as it is replayed (previous_response_id)."""
        return item

    def prepare_responses_history(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The conversation's chat messages adapted to what this model's renderer binds; never mutates them."""
        return messages

    def required_tool_choice_mode(self) -> RequiredMode | None:
        """How tool_choice "required" is enforced: by this model's template, by a grammar, or (None) the
        server's generic grammar."""
        return None

    def structured_output(
        self, constraint: StructuredOutput | None, template_kwargs: dict[str, Any]
    ) -> StructuredOutput | None:
        """The grammar constraint actually attached, given the kwargs the prompt is rendered with."""
        return constraint


def _with_effort(kwargs: dict[str, Any] | None, effort: str | None) -> dict[str, Any] | None:
    """`kwargs` with `reasoning_effort` added (an explicit one wins); None when there is nothing to add."""
    if effort is None or (kwargs and "reasoning_effort" in kwargs):
        return None
    return {"reasoning_effort": effort, **(kwargs or {})}


EXTENSIONS: dict[str, type[ServingExtension]] = {}


def register(model_type: str):
    def add(cls: type[ServingExtension]) -> type[ServingExtension]:
        EXTENSIONS[model_type] = cls
        return cls

    return add


def extension_for(model_type: str | None, config: ExtensionConfig | None = None) -> ServingExtension:
    """The extension registered for `model_type` (the generic one if none is), with the deployment's `config`."""
    return EXTENSIONS.get(model_type or "", ServingExtension)(config)
