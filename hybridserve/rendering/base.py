"""What every prompt renderer is: chat messages (and tools, and template kwargs) → the prompt text.

The frontend renders every prompt through one of these (and so does the offline `LLM`), so a model's ids do
not depend on which API asked; `registry.renderer_for` picks the model's.
"""

from __future__ import annotations

from typing import Any, Protocol


class RenderError(ValueError):
    """The messages cannot be rendered in the model's format; the message says why (the frontend's 400)."""


class Renderer(Protocol):
    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text, ending with the assistant's turn (the caller tokenizes it); raises RenderError."""
        ...
