"""Request models for Anthropic's Messages API (POST /v1/messages and /v1/messages/count_tokens).

Known fields take JSON's own types (strict, as the OpenAI models do) and a wrong one is a 400 naming the field;
unknown fields are ignored, as Claude Code sends many (`cache_control`, `metadata`, `context_management`,
`service_tier`, betas). Content blocks are one permissive model checked per type in convert.py, so a block of
a type this server does not serve gets an error naming the block rather than a union's list of mismatches.
Block lists come first in their unions, so a bad block is named (`messages[0].content[1].text`) rather than
the content called no string.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from hybridserve.serving.openai.protocol import RequestModel


class ResultBlock(RequestModel):
    """A block inside a tool_result's content (only text is served)."""

    type: str
    text: str | None = None


class ContentBlock(RequestModel):
    """A message's content block: text, tool_use, tool_result, thinking, redacted_thinking (each its fields)."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: list[ResultBlock] | str | None = None
    is_error: bool | None = None
    thinking: str | None = None
    signature: str | None = None


class Message(RequestModel):
    role: Literal["user", "assistant", "system"]
    content: list[ContentBlock] | str


class SystemBlock(RequestModel):
    type: Literal["text"]
    text: str


class Tool(RequestModel):
    """A client tool (no type, or "custom") with its input_schema; a server tool (a versioned type such as
    "web_search_20250305") is accepted and not served."""

    type: str | None = None
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class ToolChoice(RequestModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(RequestModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1)


class OutputConfig(RequestModel):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: dict[str, Any] | None = None


class CountTokensRequest(RequestModel):
    """What decides the prompt: the fields count_tokens takes, and create's too."""

    model: str
    messages: list[Message]
    system: list[SystemBlock] | str | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    context_management: dict[str, Any] | None = None  # accepted; this server edits no context


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = False
    metadata: dict[str, Any] | None = None
    priority: int | None = None  # an extension (vLLM's field): scheduling priority, see openai/priority.py
